"""The webhook's HTTP/1.1 client: POSTs to one origin over kept-alive connections, at about a third of aiohttp's CPU.

Why not aiohttp's client: a webhook effect is one small POST and a status; aiohttp spent ~240 µs of CPU on each
(request and response objects, multidict headers, timers, tracing hooks) against ~80 µs here, and the effects
executor is one interpreter, so that CPU decided the effects rate (docs/benchmarks.md, "effects"). What is kept:
HTTP/1.1 framing by the RFC 9112 rules (Content-Length, chunked, close-delimited, 1xx skipped, 204/304 bodiless),
TLS with certificate and host verification (the system's trust store), a connect timeout and a whole-request
timeout, no redirects followed, no proxy from the environment (aiohttp's default too).

What is not needed and left out: methods other than POST, cookies, compression, HTTP/2, reading the response body
(it is read and dropped so the connection can be reused; only the status and Retry-After matter).

A request that fails on a reused connection before any byte of an answer arrived is sent once more on a new
connection: the server may have closed the idle connection as the request left (a keep-alive race). The receiver
deduplicates on `webhook-id`, so a second copy of a request that did arrive is harmless (at least once).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import quote, urlsplit

MAX_HEAD = 64 * 1024  # a response head (status line and headers) larger than this is refused
MAX_BODY = 1024 * 1024  # a larger response body is not read to its end: the connection is closed instead
IDLE_S = 15.0  # a connection idle longer than this is closed rather than reused (aiohttp's keep-alive time)


class HttpError(Exception):
    """The exchange failed below HTTP's statuses: a malformed answer, or the connection closed before one."""


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    headers: dict[str, str]  # names in lower case; a repeated header keeps its last value


def header_safe(text: str, what: str) -> str:
    """`text` unchanged, or ValueError when it would break the request's framing (a line break or a NUL)."""
    if "\r" in text or "\n" in text or "\0" in text:
        raise ValueError(f"{what} holds a line break or NUL, which cannot go into an HTTP header")
    return text


def parse(buf: bytes | bytearray, eof: bool) -> tuple[Response, int, bool] | None:
    """One response from the start of `buf`: (response, bytes it took, whether the connection can be reused), or
    None while it is incomplete. `eof`: the server closed its side (ends a close-delimited body)."""
    start = 0
    while True:
        end = buf.find(b"\r\n\r\n", start)
        if end < 0:
            if len(buf) - start > MAX_HEAD:
                raise HttpError(f"response head larger than {MAX_HEAD} bytes")
            if eof:
                raise HttpError("connection closed before an answer" if len(buf) == start
                                else "connection closed before a complete response head")
            return None
        lines = bytes(buf[start:end]).split(b"\r\n")
        status_line = lines[0].split(b" ", 2)
        if len(status_line) < 2 or not status_line[0].startswith(b"HTTP/1.") or not status_line[1].isdigit() \
                or len(status_line[1]) != 3:
            raise HttpError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
        status = int(status_line[1])
        headers: dict[str, str] = {}
        lengths: set[bytes] = set()
        for line in lines[1:]:
            name, colon, value = line.partition(b":")
            if not colon or not name or name != name.strip() or line[:1] in (b" ", b"\t"):
                raise HttpError(f"malformed response header line: {line[:80]!r}")
            key = name.decode("latin-1").lower()
            text = value.strip()
            if key == "content-length":
                lengths.add(text)
            headers[key] = text.decode("latin-1")
        body_at = end + 4
        if 100 <= status < 200:  # an interim answer (100 Continue, 103 Early Hints): the final one follows
            if status == 101:
                raise HttpError("the server switched protocols (101) on a POST")
            start = body_at
            continue
        break
    connection = headers.get("connection", "").lower()
    keep = "close" not in connection if status_line[0] == b"HTTP/1.1" else "keep-alive" in connection
    response = Response(status, headers)
    if status in (204, 304):
        return response, body_at, keep
    coding = headers.get("transfer-encoding", "").lower()
    if coding:
        if not coding.rstrip().endswith("chunked"):  # not chunked last: the body ends when the connection does
            return (response, len(buf), False) if eof else None
        return _chunked(buf, body_at, response, keep, eof)
    if lengths:
        if len(lengths) > 1 or not next(iter(lengths)).isdigit():
            raise HttpError(f"invalid Content-Length: {headers['content-length']!r}")
        length = int(headers["content-length"])
        if length > MAX_BODY:
            return response, len(buf), False  # the status is all that matters: close rather than read it all
        if len(buf) - body_at < length:
            if eof:
                raise HttpError("connection closed inside the response body")
            return None
        return response, body_at + length, keep
    # Neither: the body runs to the end of the connection (RFC 9112 6.3, item 8); the status is known already.
    return response, len(buf), False


def _chunked(buf: bytes | bytearray, at: int, response: Response, keep: bool,
             eof: bool) -> tuple[Response, int, bool] | None:
    start = at
    while True:
        line_end = buf.find(b"\r\n", at)
        if line_end < 0:
            if len(buf) - at > MAX_HEAD:
                raise HttpError("chunk size line too long")
            break
        size_text = bytes(buf[at:line_end]).split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise HttpError(f"invalid chunk size {size_text[:20]!r}") from None
        if size == 0:  # the last chunk; trailer lines (rarely any) follow up to an empty line
            trailers_end = buf.find(b"\r\n\r\n", line_end)
            if trailers_end < 0:
                break
            return response, trailers_end + 4, keep
        at = line_end + 2 + size + 2
        if at - start > MAX_BODY:  # the status is all that matters: close rather than read it all
            return response, len(buf), False
        if at > len(buf):
            break
        if buf[at - 2:at] != b"\r\n":
            raise HttpError("chunk not followed by CRLF")
    if eof:
        raise HttpError("connection closed inside a chunked response body")
    return None


class _Connection(asyncio.Protocol):
    """One connection, one exchange at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiter: asyncio.Future[tuple[Response, bool]] | None = None
        self.closed = False
        self.idle_since = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.waiter is None:  # nothing asked: a server talking out of turn is not to be trusted with more
            self.close()
            return
        self._answer(False)

    def eof_received(self) -> bool | None:
        if self.waiter is not None:
            self._answer(True)
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            if self.buf:
                self._answer(True)
            if not self.waiter.done():
                self.waiter.set_exception(HttpError(f"connection closed before an answer"
                                                    f"{f' ({exc})' if exc else ''}"))

    def _answer(self, eof: bool) -> None:
        waiter = self.waiter
        if waiter is None or waiter.done():
            return
        try:
            found = parse(self.buf, eof)
        except HttpError as e:
            waiter.set_exception(e)
            self.close()
            return
        if found is None:
            return
        response, used, keep = found
        del self.buf[:used]
        waiter.set_result((response, keep and not self.buf and not eof))

    async def exchange(self, request: bytes) -> Response:
        assert self.transport is not None
        waiter = self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        try:
            response, keep = await waiter
        finally:
            self.waiter = None
        if not keep:
            self.close()
        return response

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class WebhookClient:
    """POSTs to one URL; connections are kept for reuse (as many as run at once), newest first."""

    def __init__(self, url: str, *, timeout_s: float, connect_timeout_s: float,
                 headers: Iterable[tuple[str, str]] = ()) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"expected an http(s) URL, got {parts.scheme}://{parts.hostname or ''}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        host = f"[{self.host}]" if ":" in self.host else self.host
        if parts.port is not None and parts.port != (443 if self.ssl else 80):
            host = f"{host}:{parts.port}"
        # Percent-encoded as a browser would (a space, non-ASCII); what is encoded already stays as it is.
        target = quote((parts.path or "/") + (f"?{parts.query}" if parts.query else ""), safe="/?:@!$&'()*+,;=%~")
        lines = [f"POST {header_safe(target, 'the URL')} HTTP/1.1", f"Host: {host}"]
        lines += [f"{header_safe(k, 'a header name')}: {header_safe(v, f'header {k}')}" for k, v in headers]
        self._head = ("\r\n".join(lines) + "\r\n").encode()
        self._idle: list[_Connection] = []

    async def post(self, body: bytes, headers: Iterable[tuple[str, str]]) -> Response:
        """Send `body` with `headers` besides the static ones; TimeoutError past timeout_s, OSError when the
        connection cannot be made, HttpError when the answer is broken or missing."""
        extra = "".join(f"{k}: {header_safe(v, f'header {k}')}\r\n" for k, v in headers)
        request = b"%s%sContent-Length: %d\r\n\r\n%s" % (self._head, extra.encode(), len(body), body)
        async with asyncio.timeout(self.timeout_s):
            conn = self._reuse()
            if conn is not None:
                try:
                    return await self._exchange(conn, request)
                except HttpError:
                    if conn.buf:  # part of an answer came: the request was read; it is not sent again here
                        raise
            return await self._exchange(await self._connect(), request)

    async def _exchange(self, conn: _Connection, request: bytes) -> Response:
        try:
            response = await conn.exchange(request)
        except BaseException:  # a timeout or a cancel included: the connection's state is unknown
            conn.abort()
            raise
        if conn.buf:  # bytes beyond the answer: a server out of step with the framing is not asked again
            conn.close()
        elif not conn.closed:
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
        return response

    def _reuse(self) -> _Connection | None:
        oldest = time.monotonic() - IDLE_S
        while self._idle and self._idle[0].idle_since < oldest:  # the least used ones, at the bottom
            self._idle.pop(0).close()
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed and conn.idle_since >= oldest and conn.transport is not None \
                    and not conn.transport.is_closing():
                return conn
            conn.close()
        return None

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(_Connection, self.host, self.port, ssl=self.ssl,
                                                       server_hostname=self.host if self.ssl else None)
        except TimeoutError:  # the connect's own timeout (the whole request's arrives as a cancel here)
            raise ConnectionError(f"connecting to {self.host}:{self.port} timed out after "
                                  f"{self.connect_timeout_s:g}s") from None
        return conn

    async def close(self) -> None:
        while self._idle:
            self._idle.pop().close()
