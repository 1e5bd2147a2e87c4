"""The weight-sync group's rendezvous store, keyed: every value a rank writes carries an HMAC-SHA256 of its key and
value under the group's secret, and every value a rank reads is checked before torch.distributed uses it.

torch's TCPStore has no authentication: anyone who reaches its port may list, read and write its keys, and a rank
joins the group with whatever addresses it reads there. With this store a process without the secret cannot join
(the ranks refuse its values, naming the key) nor point a rank at itself (a forged or altered address is refused).
The values stay readable (they are the ranks' addresses, signed, not encrypted), and the broadcast itself runs over
gloo's or NCCL's own connections, which have neither authentication nor encryption (docs/architecture.md,
"Security"). The learner draws a fresh secret for each group (`new_secret`) and hands it to each receiver in its
join call; scripts/vllm_plugin/ holds the receivers' copy of this class (it imports nothing of async-rl).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import secrets
from typing import cast

import torch.distributed as dist

TAG_BYTES = 32  # HMAC-SHA256


def new_secret() -> bytes:
    """A group's secret: 32 random bytes (sent to each receiver as 64 hex digits)."""
    return secrets.token_bytes(32)


class KeyedStore(dist.Store):
    """`inner` (the group's PrefixStore over the TCPStore) with every value signed on `set` and checked on `get`. A
    counter (`add`) cannot carry a tag: a forged one can only stall a join until its timeout."""

    def __init__(self, inner: dist.Store, secret: bytes) -> None:
        super().__init__()
        if len(secret) < 16:
            raise ValueError("a weight-sync store secret has at least 16 bytes")
        self.inner, self.secret = inner, secret

    def _tag(self, key: str, value: bytes) -> bytes:
        return hmac.new(self.secret, key.encode() + b"\0" + value, hashlib.sha256).digest()

    def set(self, key: str, value: bytes | str) -> None:
        value = value.encode() if isinstance(value, str) else bytes(value)
        # torch's stub says str; the binding takes bytes as they are (a str would be UTF-8 encoded)
        self.inner.set(key, cast(str, value + self._tag(key, value)))

    def get(self, key: str) -> bytes:
        signed = self.inner.get(key)
        value, tag = signed[:-TAG_BYTES], signed[-TAG_BYTES:]
        if len(signed) < TAG_BYTES or not hmac.compare_digest(tag, self._tag(key, value)):
            raise PermissionError(f"weight-sync store: the value of {key!r} is not signed with this group's secret "
                                  "(a process without it wrote there): refusing to join")
        return value

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(key, amount)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.inner.set_timeout(timeout)
