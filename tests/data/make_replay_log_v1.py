"""Writes tests/data/replay_log_v1/: a run directory whose replay log (snapshot format 1) was written by the
replay before its split by job (run at commit cceb674 with `PYTHONPATH=. python tests/data/make_replay_log_v1.py`).
tests/test_replay_wal.py checks that a later replay refuses it with a message naming both formats. Kept for the
record: it imports the old replay's API and does not run against the new one."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from test_replay import WORKER, Worker, make_config, only_reply, outcome_messages, stage_records  # noqa: E402

from async_rl.config_load import config_to_dict  # noqa: E402
from async_rl.protocol import encode  # noqa: E402
from replay.service import ReplayService, apply_entry, handle_safely  # noqa: E402
from replay.wal import Received, ReplayLog  # noqa: E402

OUT = Path(__file__).resolve().parent / "replay_log_v1"


def logged(service: ReplayService, wal: ReplayLog, message, now: float):
    wal.append(Received(WORKER, now, encode(message)))
    return only_reply(handle_safely(service, WORKER, message, now))


def main() -> None:
    shutil.rmtree(OUT, ignore_errors=True)
    config = make_config(run={"dir": str(OUT.parent), "name": OUT.name})
    (OUT / "replay").mkdir(parents=True)
    raw = config_to_dict(config)
    raw["run"]["dir"] = "runs"  # --resume points the config at wherever the directory is
    (OUT / "config.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    service, wal = ReplayService(config), ReplayLog(OUT / "replay", fsync=False)
    wal.recover(service, apply_entry)
    service.start_epoch(1, 0.0)
    wal.compact(service, 0.0)  # snapshot-00000001 (format 1), holding one open group after the next lines
    worker = Worker()
    grant = logged(service, wal, worker.lease(), 0.0)
    for message in stage_records(worker, grant) + outcome_messages(worker, grant):
        wal.append(Received(WORKER, 1.0, encode(message)))
        handle_safely(service, WORKER, message, 1.0)
    wal.commit()
    wal.compact(service, 1.0)  # snapshot-00000002: the group's state, then a segment of a few more records
    other = logged(service, wal, worker.lease(), 2.0)
    for message in stage_records(worker, other)[:3]:
        wal.append(Received(WORKER, 2.0, encode(message)))
        handle_safely(service, WORKER, message, 2.0)
    wal.commit()
    wal.close()
    (OUT / "replay" / "lock").unlink()


if __name__ == "__main__":
    main()
