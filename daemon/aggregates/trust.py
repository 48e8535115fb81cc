"""Trust between instances: the deployment's instance secret, the signed address each instance advertises, the
signed reads it sends on, and the only URLs a state read is ever sent to (docs/security.md#trust-between-instances).

Why: an instance learns where a key's owner serves from the owner's `client.id` in its aggregate group's
description, and anyone who may join that group writes a client id. So the address is believed only when it
carries an HMAC of (group, address) under the instance secret, which only this deployment's instances hold. A
member that copies a genuine member's client id word for word gains nothing: the signature names the genuine
member's address, so the reads go there (and it answers "not the owner"). Reads sent on carry an HMAC over
(method, path and query, time) instead of the caller's API token: the token also allows `subjects forget`, and an
owner needs only to know that a fellow instance checked it. A redirect carries the same kind of credential in its
Location (valid MAX_SKEW_S), so a client need not send its token to another host to follow it.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import quote, unquote, urlencode, urlsplit

from kafold.config import DaemonConfig, advertised_url_problem
from kafold.errors import ConfigError

ADVERT_PREFIX = "k1."       # the signature's part of a client id: `<client_id>@<url, percent-encoded>@k1.<mac>`
AUTH_HEADER = "Kafold-Instance-Auth"  # on a read sent on: `t=<unix seconds>,mac=<mac>`
TIME_PARAM = "kafold_t"     # in a redirect's Location: when it was signed
MAC_PARAM = "kafold_mac"    # and the signature, always last: it covers everything before it
MAX_SKEW_S = 30             # a signed read is accepted this long (either way: clocks differ a little)
MIN_SECRET_CHARS = 32       # `openssl rand -base64 32` gives 44
MAX_CREDENTIAL_CHARS = 200  # an honest one is about 60: anything longer is refused before it is looked at


class InstanceKey:
    """The instance secret (and, while it is rotated, the previous one): signs with the first, accepts either."""

    def __init__(self, secrets: Sequence[str]) -> None:
        # one key per use, derived from the secret: a MAC made for one purpose never verifies for another
        self._keys = [{use: hmac.new(s.encode(), f"kafold instance {use}".encode(), hashlib.sha256).digest()
                       for use in ("advert", "read", "redirect")} for s in secrets]

    def __repr__(self) -> str:
        return f"InstanceKey({len(self._keys)} secret(s))"  # never the secret

    @classmethod
    def of(cls, daemon: DaemonConfig) -> InstanceKey | None:
        """From `[daemon] instance_secret` (+ `_previous`), None when unset; ConfigError for a short secret."""
        if daemon.instance_secret is None:
            return None
        secrets = [daemon.instance_secret.reveal()]
        if daemon.instance_secret_previous is not None:
            secrets.append(daemon.instance_secret_previous.reveal())
        for key, value in zip(("daemon.instance_secret", "daemon.instance_secret_previous"), secrets, strict=False):
            if len(value.strip()) < MIN_SECRET_CHARS:
                raise ConfigError([f"{key}: the instance secret is shorter than {MIN_SECRET_CHARS} characters "
                                   "(e.g. `openssl rand -base64 32`)"])
        return cls(secrets)

    def sign(self, use: str, *parts: str) -> str:
        return _mac(self._keys[0][use], parts)

    def verify(self, mac: str, use: str, *parts: str) -> bool:
        given = mac.encode("ascii", "replace")
        return any(hmac.compare_digest(_mac(k[use], parts).encode(), given) for k in self._keys)


def _mac(key: bytes, parts: Sequence[str]) -> str:
    # each part length-prefixed, so parts never run into each other; surrogatepass: a request's path may carry
    # undecodable bytes (as lone surrogates), and checking it must not raise
    encoded = [p.encode("utf-8", "surrogatepass") for p in parts]
    message = b"".join(len(e).to_bytes(4, "big") + e for e in encoded)
    digest = hmac.new(key, message, hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


# ---- the advertisement in the group --------------------------------------------------------------------------
def advertisement(client_id: str, url: str | None, group: str, key: InstanceKey | None) -> str:
    """The aggregate consumer's client.id: `client_id@<url percent-encoded>[@k1.<mac of (group, url)>]` (no '@'
    left in the encoded part); unsigned without a key (no other instance then sends it anything)."""
    if url is None:
        return client_id
    signed = f"@{ADVERT_PREFIX}{key.sign('advert', group, url)}" if key is not None else ""
    return f"{client_id}@{quote(url, safe='')}{signed}"


def advertised(client_id: str) -> tuple[str | None, str | None]:
    """(the http(s) URL a member's client id claims, its signature): (None, None) without a URL (HTTP off, an
    older kafold, anything else); the signature None when there is none."""
    head, at, last = client_id.rpartition("@")
    mac = None
    if at and last.startswith(ADVERT_PREFIX) and "@" in head:
        mac = last.removeprefix(ADVERT_PREFIX)
        head, at, last = head.rpartition("@")
    if not at:
        return None, None
    url = unquote(last)
    return (url, mac) if urlsplit(url).scheme in ("http", "https") else (None, None)


# ---- where a read goes -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Peer:
    """A verified instance's address, taken apart: a read to it is built from these, never by appending to the
    advertised text (whose '#', '?' or '@' would otherwise choose where the request really goes)."""

    scheme: str
    host: str    # lower case; an IPv6 address without brackets
    port: int
    prefix: str  # '' or '/a/b'

    @classmethod
    def parse(cls, url: str) -> Peer:
        """ValueError unless `url` is http(s)://host[:port][/prefix] (kafold.config.advertised_url_problem)."""
        problem = advertised_url_problem(url)
        if problem is not None:
            raise ValueError(problem)
        parts = urlsplit(url)
        assert parts.hostname is not None  # checked above
        return cls(parts.scheme, parts.hostname, parts.port or (443 if parts.scheme == "https" else 80),
                   parts.path.rstrip("/"))

    @property
    def origin(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"

    def state_path(self, aggregate: str, aggregate_id: str, query: Sequence[tuple[str, str]] = ()) -> str:
        """The path (and query) of `GET /aggregates/{aggregate}/{id}` at this peer, each part percent-encoded."""
        path = f"{self.prefix}/aggregates/{quote(aggregate, safe='')}/{quote(aggregate_id, safe='')}"
        return f"{path}?{urlencode(query)}" if query else path


# ---- signed reads ----------------------------------------------------------------------------------------------
def read_credential(key: InstanceKey, path: str, now: float | None = None) -> str:
    """The AUTH_HEADER value for a read of `path` (with its query) sent on now."""
    t = str(int(time.time() if now is None else now))
    return f"t={t},mac={key.sign('read', 'GET', path, t)}"


def signed_redirect(key: InstanceKey, path: str, now: float | None = None) -> str:
    """`path` (which has a query) with TIME_PARAM and, last, MAC_PARAM appended: a redirect's Location path."""
    assert "?" in path, path  # the redirect's own parameter is always there
    t = str(int(time.time() if now is None else now))
    signed = f"{path}&{TIME_PARAM}={t}"
    return f"{signed}&{MAC_PARAM}={key.sign('redirect', 'GET', signed, t)}"


def instance_read(key: InstanceKey | None, method: str, raw_path: str, headers: Mapping[str, str],
                  now: float | None = None) -> bool:
    """True when a request carries a fellow instance's valid credential for exactly this read: AUTH_HEADER over
    its method, path and query, or a redirect's MAC_PARAM over everything before it; either within MAX_SKEW_S.
    The caller accepts it for state reads only. Never raises."""
    if key is None or method != "GET":
        return False
    now = time.time() if now is None else now
    header = headers.get(AUTH_HEADER)
    if header is not None:
        if len(header) > MAX_CREDENTIAL_CHARS:
            return False
        fields = dict(p.partition("=")[::2] for p in header.split(","))
        t, mac = fields.get("t", ""), fields.get("mac", "")
        return _fresh(t, now) and key.verify(mac, "read", "GET", raw_path, t)
    signed, sep, mac = raw_path.rpartition(f"&{MAC_PARAM}=")
    if not sep or len(mac) > MAX_CREDENTIAL_CHARS:
        return False
    _, tsep, t = signed.rpartition(f"&{TIME_PARAM}=")
    return bool(tsep) and _fresh(t, now) and key.verify(mac, "redirect", "GET", signed, t)


def _fresh(t: str, now: float) -> bool:
    return t.isascii() and t.isdigit() and len(t) <= 12 and abs(now - int(t)) <= MAX_SKEW_S
