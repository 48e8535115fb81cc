"""The webhook's HTTP/1.1 client: response framing (pure), and exchanges with real local servers (plain and TLS)."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import trustme
from hypothesis import given
from hypothesis import strategies as st

from kafold.connectors.effects import webhook_client
from kafold.connectors.effects.drivers import Webhook
from kafold.connectors.effects.policy import PermanentEffectError, RetriableEffectError
from kafold.connectors.effects.settings import WebhookConfig
from kafold.connectors.effects.webhook_client import MAX_BODY, MAX_HEAD, HttpError, WebhookClient, parse
from kafold.envelope import Event

# ---- framing ----------------------------------------------------------------------------------------------------


def test_a_content_length_body_is_read_to_its_end_and_nothing_past_it() -> None:
    head = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nRetry-After: 3\r\n\r\n"
    assert parse(head + b"hel", eof=False) is None
    response, used, keep = parse(head + b"hello" + b"HTTP/1.1", eof=False)
    assert (response.status, response.headers["retry-after"], used, keep) == (200, "3", len(head) + 5, True)
    with pytest.raises(HttpError, match="inside the response body"):
        parse(head + b"hel", eof=True)


def test_chunked_bodies_with_extensions_and_trailers() -> None:
    raw = (b"HTTP/1.1 202 Accepted\r\nTransfer-Encoding: chunked\r\n\r\n"
           b"5;ext=1\r\nhello\r\n10\r\n0123456789abcdef\r\n0\r\nX-Trailer: 1\r\n\r\n")
    response, used, keep = parse(raw, eof=False)
    assert (response.status, used, keep) == (202, len(raw), True)
    plain = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"
    assert parse(plain, eof=False)[1:] == (len(plain), True)
    with pytest.raises(HttpError, match="chunk size"):
        parse(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", eof=False)


@given(st.sampled_from([
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;a=b\r\nhello\r\n0\r\nT: 1\r\n\r\n",
    b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 429 Too Many\r\nRetry-After: 7\r\nContent-Length: 2\r\n\r\nno",
    b"HTTP/1.0 204 No Content\r\nConnection: keep-alive\r\n\r\n",
]), st.data())
def test_a_response_arriving_in_pieces_is_complete_only_at_its_last_byte(raw: bytes, data: st.DataObject) -> None:
    cut = data.draw(st.integers(0, len(raw) - 1))
    assert parse(raw[:cut], eof=False) is None
    whole = parse(raw, eof=False)
    assert whole is not None and whole[1] == len(raw) and whole[2] is True


def test_interim_answers_are_skipped_and_bodiless_statuses_have_no_body() -> None:
    raw = b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n"
    response, used, keep = parse(raw, eof=False)
    assert (response.status, used, keep) == (204, len(raw), True)
    with pytest.raises(HttpError, match="switched protocols"):
        parse(b"HTTP/1.1 101 Switching\r\nUpgrade: x\r\n\r\n", eof=False)


def test_which_answers_leave_the_connection_reusable() -> None:
    def keep(raw: bytes) -> bool:
        found = parse(raw, eof=False)
        assert found is not None
        return found[2]

    assert keep(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
    assert not keep(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")
    assert not keep(b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n")
    assert keep(b"HTTP/1.0 200 OK\r\nConnection: Keep-Alive\r\nContent-Length: 0\r\n\r\n")
    # no length: the body runs to the connection's end; the status is known at once, the connection is not reused
    assert not keep(b"HTTP/1.1 200 OK\r\n\r\npartial body")
    # a body too large to be worth reading: the status is taken, the connection closed
    assert not keep(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (MAX_BODY + 1))


def test_malformed_answers_are_refused_with_what_is_wrong() -> None:
    for raw, problem in ((b"SMTP ready\r\n\r\n", "status line"),
                         (b"HTTP/1.1 2000 OK\r\n\r\n", "status line"),
                         (b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", "Content-Length"),
                         (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", "Content-Length"),
                         (b"HTTP/1.1 200 OK\r\nA: 1\r\n folded\r\n\r\n", "header line"),
                         (b"HTTP/1.1 200 OK\r\nName : v\r\n\r\n", "header line")):
        with pytest.raises(HttpError, match=problem):
            parse(raw, eof=False)
    with pytest.raises(HttpError, match="head larger"):
        parse(b"HTTP/1.1 200 OK\r\nX: " + b"a" * MAX_HEAD, eof=False)
    with pytest.raises(HttpError, match="before a complete response head"):
        parse(b"HTTP/1.1 200", eof=True)


# ---- exchanges with real servers -------------------------------------------------------------------------------

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


class Server:
    """A raw HTTP server on 127.0.0.1 whose answers a test writes byte for byte; counts connections and requests."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []

    @classmethod
    def answering(cls, raw: bytes) -> Server:
        """A server that answers every request with `raw`, on connections kept open."""
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
            while await server.read_request(reader) is not None:
                writer.write(raw)

        server = cls(handler)
        return server

    async def __aenter__(self) -> Server:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *_: object) -> None:
        self.server.close()

    async def read_request(self, reader: asyncio.StreamReader) -> bytes | None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        request = head + await reader.readexactly(length)
        self.requests.append(request)
        return request

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer, self.connections)
        finally:
            writer.close()


def client(port: int, path: str = "/hook?token=t", **kw: float) -> WebhookClient:
    return WebhookClient(f"http://127.0.0.1:{port}{path}", timeout_s=kw.get("timeout_s", 5.0),
                         connect_timeout_s=1.0, headers=[("x-static", "s")])


def test_connections_are_kept_alive_and_requests_carry_every_header() -> None:
    async def main() -> None:
        chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n"
        async with Server.answering(chunked) as server:
            c = client(server.port)
            statuses = [(await c.post(b'{"n": %d}' % i, [("webhook-id", f"id-{i}")])).status for i in range(30)]
            await c.close()
        assert statuses == [200] * 30 and server.connections == 1
        first = server.requests[0]
        assert first.startswith(b"POST /hook?token=t HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n" % server.port)
        assert b"\r\nx-static: s\r\n" in first and b"\r\nwebhook-id: id-0\r\n" in first
        assert first.endswith(b'Content-Length: 8\r\n\r\n{"n": 0}')

    asyncio.run(main())


def test_a_request_lost_to_a_closing_kept_alive_connection_is_sent_again_on_a_new_one() -> None:
    async def main() -> None:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
            await server.read_request(reader)
            writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
            if n == 1:  # the keep-alive race: the next request arrives as the server closes, unanswered
                await server.read_request(reader)
                return
            while await server.read_request(reader) is not None:
                writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")

        async with Server(handler) as server:
            c = client(server.port)
            assert (await c.post(b"{}", [("webhook-id", "a")])).status == 204
            assert (await c.post(b"{}", [("webhook-id", "b")])).status == 204
            await c.close()
        assert server.connections == 2
        ids = [r.split(b"webhook-id: ")[1][:1] for r in server.requests]
        assert ids == [b"a", b"b", b"b"]  # at least once: the receiver deduplicates on webhook-id

    asyncio.run(main())


def test_a_new_connection_closed_without_an_answer_fails_once_a_hung_one_times_out() -> None:
    async def main() -> None:
        async def closes(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
            await server.read_request(reader)

        async with Server(closes) as server:
            with pytest.raises(HttpError, match="closed before an answer"):
                await client(server.port).post(b"{}", [])
            assert server.connections == 1

        async def hangs(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
            await server.read_request(reader)
            assert await reader.read() == b""  # the client gave up and closed: end of stream

        async with Server(hangs) as server:
            c = client(server.port, timeout_s=0.3)
            with pytest.raises(TimeoutError):
                await c.post(b"{}", [])
            assert c._idle == []  # the timed-out connection is not reused
            await asyncio.sleep(0.1)

    asyncio.run(main())


def test_a_refused_connection_is_an_os_error() -> None:
    async def main() -> None:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        with pytest.raises(OSError):
            await client(port).post(b"{}", [])

    asyncio.run(main())


def test_tls_verifies_the_certificate_against_the_system_trust_store(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(server_ctx)
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))

    async def main(trusted: bool) -> int:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                await reader.readuntil(b"\r\n\r\n")
                writer.write(b"HTTP/1.1 201 Created\r\nContent-Length: 0\r\n\r\n")
                await writer.drain()
            except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
                pass
            finally:
                writer.close()

        server = await asyncio.start_server(handler, "127.0.0.1", 0, ssl=server_ctx)
        port = server.sockets[0].getsockname()[1]
        if trusted:
            monkeypatch.setenv("SSL_CERT_FILE", str(ca_file))
        c = WebhookClient(f"https://127.0.0.1:{port}/hook", timeout_s=5, connect_timeout_s=5)
        try:
            return (await c.post(b"{}", [])).status
        finally:
            await c.close()
            server.close()

    with pytest.raises(ssl.SSLCertVerificationError):  # an OSError: retried as any connection failure
        asyncio.run(main(trusted=False))
    assert asyncio.run(main(trusted=True)) == 201


# ---- the webhook effect on it -----------------------------------------------------------------------------------


def test_an_event_id_that_cannot_be_a_header_is_permanent_and_statuses_are_classified() -> None:
    async def main() -> None:
        async with Server.answering(b"HTTP/1.1 503 Busy\r\nRetry-After: 4\r\nContent-Length: 4\r\n\r\nbusy") as server:
            effect = Webhook(WebhookConfig(url=f"http://127.0.0.1:{server.port}/hook", allow_http=True))
            await effect.start()
            try:
                with pytest.raises(PermanentEffectError, match="event_id"):
                    await effect.run(Event.new("T", "A", "a1", 1, {}, event_id="x\r\nInjected: 1"))
                with pytest.raises(RetriableEffectError, match="HTTP 503") as raised:
                    await effect.run(Event.new("T", "A", "a1", 1, {}))
                assert raised.value.retry_after_s == 4.0
            finally:
                await effect.close()
        assert len(server.requests) == 1 and b"Injected" not in server.requests[0]

    asyncio.run(main())


def test_static_headers_that_would_break_a_request_are_refused_in_the_config() -> None:
    for headers, problem in (({"X-A": "1\r\nX-B: 2"}, "line break"), ({"X A": "1"}, "not a valid HTTP header name"),
                             ({"Host": "elsewhere"}, "set by kafold")):
        with pytest.raises(ValueError, match=problem):
            WebhookConfig(url="https://example.com/hook", headers=headers)


def test_idle_connections_past_the_keep_alive_time_are_not_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    async def main() -> None:
        async with Server.answering(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n") as server:
            c = client(server.port)
            await c.post(b"{}", [])
            monkeypatch.setattr(webhook_client, "IDLE_S", 0.0)
            await asyncio.sleep(0.01)
            await c.post(b"{}", [])
            await c.close()
        assert server.connections == 2

    asyncio.run(main())


def test_a_connection_with_bytes_beyond_the_answer_is_not_reused() -> None:
    async def main() -> None:
        stray = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\nHTTP/1.1 500 Stray\r\n\r\n"
        async with Server.answering(stray) as server:
            c = client(server.port)
            statuses = [(await c.post(b"{}", [])).status for _ in range(3)]
            await c.close()
        assert statuses == [200, 200, 200] and server.connections == 3

    asyncio.run(main())


def test_the_url_path_is_percent_encoded_once() -> None:
    async def main() -> None:
        async with Server.answering(b"HTTP/1.1 204 No Content\r\n\r\n") as server:
            c = client(server.port, path="/hooks/caf\u00e9 bar%2F1?x=a b")
            await c.post(b"{}", [])
            await c.close()
        assert server.requests[0].startswith(b"POST /hooks/caf%C3%A9%20bar%2F1?x=a%20b HTTP/1.1\r\n")

    asyncio.run(main())
