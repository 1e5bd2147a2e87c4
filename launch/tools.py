"""The commands that write files and exit, without a config: `keys DIR` (a cluster's CURVE keys,
async_rl/security.py), `model import` and `export` (Hugging Face model directories, async_rl/hf_io.py). What they
wrote goes to stdout, progress to stderr, a failure in one line."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys

from async_rl.errors import AsyncRLError


def run_tool(args: argparse.Namespace) -> int:
    return run_keys(args) if args.role == "keys" else run_hf_io(args)


def run_keys(args: argparse.Namespace) -> int:
    """`keys DIR --workers N`: a CURVE key pair for the replay, the learner and each worker; the files written on
    stdout."""
    from async_rl.security import create_keys

    try:
        written = create_keys(args.dir, args.workers)
    except (AsyncRLError, OSError) as exc:
        print(f"async-rl keys: {exc}", file=sys.stderr)
        return 2
    print("\n".join(str(path) for path in written))
    return 0


def run_hf_io(args: argparse.Namespace) -> int:
    """`model import` and `export`: the directory written on stdout, progress on stderr, a failure in one line."""
    from async_rl import hf_io

    command = "model import" if args.role == "model" else "export"
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s [{command}] %(name)s: %(message)s",
                        stream=sys.stderr, force=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # transformers is imported (and quietened) only once the cheap checks of SOURCE and OUT_DIR passed; what
    # libraries print (DeepSpeed's accelerator notice, imported by save_pretrained) goes to stderr: stdout is OUT_DIR
    try:
        with contextlib.redirect_stdout(sys.stderr):
            if args.role == "model":
                out = hf_io.import_model(args.source, args.out_dir, dtype=args.dtype, force=args.force)
            else:
                out, _ = hf_io.export_run(args.run_dir, args.out_dir, version=args.version, dtype=args.dtype,
                                          force=args.force)
    except (AsyncRLError, OSError) as exc:  # e.g. the disk filled while writing
        print(f"async-rl {command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    print(out)
    return 0
