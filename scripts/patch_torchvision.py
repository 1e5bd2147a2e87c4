"""Make torchvision import beside CPU torch: PyPI's torchvision is a CUDA build whose C extension cannot load.

    python scripts/patch_torchvision.py SITE_PACKAGES/torchvision/_meta_registrations.py

After the extension fails to load, torchvision/_meta_registrations.py fails at import with "operator
torchvision::nms does not exist". This makes those fake-op registrations conditional on the extension having
loaded. Idempotent (a patched file is left as it is). Used by build_sglang_env.sh and build_vllm_env.sh.
"""

import re
import sys

TAG = "# async-rl patch"


def main(path: str) -> int:
    with open(path) as f:
        src = f.read()
    if TAG in src:
        return 0
    new, n = re.subn(
        r'^@torch\.library\.register_fake\(("torchvision::\w+")\)[ \t]*$',
        r"@(torch.library.register_fake(\1) if torchvision.extension._has_ops() else (lambda f: f))  " + TAG,
        src,
        flags=re.M,
    )
    if n == 0:
        print("no torchvision register_fake decorators found to patch", file=sys.stderr)
        return 1
    with open(path, "w") as f:
        f.write(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
