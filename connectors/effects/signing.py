"""Standard Webhooks signatures: `v1,<base64 HMAC-SHA256(key, "{id}.{timestamp}.{body}")>`, several for rotation.

A secret written `whsec_<base64>` (the Standard Webhooks form) is base64-decoded to get the HMAC key; any other
secret is used as its UTF-8 bytes. Receivers verify one signature of the space-separated list and reject
timestamps too far from their clock (replay protection). `verify_request` is the receiver's side in one call: it
takes the request's headers as received and never raises on hostile ones.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from collections.abc import Iterable, Mapping

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
    if abs((now if now is not None else int(time.time())) - timestamp) > tolerance_s:
        return False
    expected = sign(msg_id, timestamp, body, [secret]).partition(",")[2]
    for item in header.split():
        version, _, sig = item.partition(",")
        if version == "v1" and hmac.compare_digest(sig, expected):
            return True
    return False


def verify_request(headers: Mapping[str, str], body: bytes, secrets: Iterable[str], *, now: int | None = None,
                   tolerance_s: int = 300) -> bool:
    """For receivers: True when `webhook-id`, `webhook-timestamp` and `webhook-signature` (any header case) are
    present, the timestamp is within `tolerance_s` and a signature matches one of `secrets` (several during a
    rotation). Missing, malformed or oversized headers give False, never an exception."""
    lower = {k.lower(): v for k, v in headers.items()}
    msg_id, stamp, header = lower.get("webhook-id"), lower.get("webhook-timestamp"), lower.get("webhook-signature")
    if not msg_id or not stamp or not header or len(stamp) > 20 or not stamp.isascii() or not stamp.isdigit():
        return False
    if len(header) > 10_000:  # a legitimate header carries a few 44-character signatures
        return False
    return any(verify(msg_id, int(stamp), body, header, s, now=now, tolerance_s=tolerance_s) for s in secrets)
