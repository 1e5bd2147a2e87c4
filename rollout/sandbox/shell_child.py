"""The shell sandbox's process: isolate itself, say what is in force, then become `bash -c COMMAND`.

Run by rollout/sandbox/shell.py as `python -I -S -B <this file>` (standard library only). It reads its spec from
stdin (the command, its environment, the working directory and the directories bound into its mount namespace, the
limits), applies rollout/sandbox/isolation.py's mechanisms (rlimits, network/mount/pid namespaces, a uid of its own,
no_new_privs), writes one JSON line on the report pipe (the mechanisms in force, and those that could not be set),
and execs bash. With `require_namespaces` and no namespaces it never execs: the command does not run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys


def main() -> None:
    spec = json.loads(sys.stdin.buffer.read())
    os.close(0)
    os.open(os.devnull, os.O_RDONLY)
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "isolation.py")
    loader = importlib.util.spec_from_file_location("_sandbox_isolation", path)
    isolation = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(isolation)
    report = isolation.Report()
    allowed = isolation.isolate(spec, report)
    line = json.dumps({"isolation": report.isolation, "notes": report.notes}) + "\n"
    os.write(spec["report_fd"], line.encode())
    os.close(spec["report_fd"])
    if not allowed:
        os._exit(111)
    os.execve("/bin/bash", ["bash", "-c", spec["command"]], spec["env"])


if __name__ == "__main__":
    main()
