"""Rate-limited logging: a flood (of rejected messages, preemptions, re-sends) must not fill a log."""

from __future__ import annotations

import logging
import time
from typing import Any


class RateLimitedLog:
    """At most one line per key every `every_s` seconds (the first at once); the next line says how many it hid."""

    def __init__(self, logger: logging.Logger, every_s: float) -> None:
        self.logger = logger
        self.every_s = every_s
        self.last: dict[str, float] = {}
        self.suppressed: dict[str, int] = {}

    def __call__(self, key: str, level: int, message: str, *args: Any) -> None:
        now = time.monotonic()
        last = self.last.get(key)
        if last is not None and now - last < self.every_s:
            self.suppressed[key] = self.suppressed.get(key, 0) + 1
            return
        self.last[key] = now
        hidden = self.suppressed.pop(key, 0)
        if hidden:
            message, args = message + " (and %d more %r since the last such line)", (*args, hidden, key)
        self.logger.log(level, message, *args)
