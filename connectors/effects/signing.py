"""Standard Webhooks signatures: `v1,<base64 HMAC-SHA256(key, "{id}.{timestamp}.{body}")>`, several for rotation.

A secret written `whsec_<base64>` (the Standard Webhooks form) is base64-decoded to get the HMAC key; any other
secret is used as its UTF-8 bytes. Receivers verify one signature of the space-separated list and reject
timestamps too far from their clock (replay protection).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Iterable

PREFIX = "whsec_"


def key_bytes(secret: str) -> bytes:
    if secret.startswith(PREFIX):
        return base64.b64decode(secret[len(PREFIX):])
    return secret.encode("utf-8")


def sign(msg_id: str, timestamp: int, body: bytes, secrets: Iterable[str]) -> str:
    """The `webhook-signature` header value: one `v1,<sig>` per secret, space-separated."""
    content = f"{msg_id}.{timestamp}.".encode() + body
    return " ".join(
        "v1," + base64.b64encode(hmac.new(key_bytes(s), content, hashlib.sha256).digest()).decode("ascii")
        for s in secrets)


def verify(msg_id: str, timestamp: int, body: bytes, header: str, secret: str, *, now: int | None = None,
           tolerance_s: int = 300) -> bool:
    """True when one signature in `header` matches `secret` and the timestamp is within `tolerance_s` of now."""
    import time

    if abs((now if now is not None else int(time.time())) - timestamp) > tolerance_s:
        return False
    expected = sign(msg_id, timestamp, body, [secret]).partition(",")[2]
    for item in header.split():
        version, _, sig = item.partition(",")
        if version == "v1" and hmac.compare_digest(sig, expected):
            return True
    return False
