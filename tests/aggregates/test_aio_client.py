"""kafold.aio's command client and event producer against a real broker, with this test answering as the aggregate
runtime would (a result record carrying the command id): results are matched by command id, a cancelled send or
a send whose result never comes leaves nothing behind, and closing the client stops its thread and fails whoever
still waits with ClientClosed. Its DaemonClient follows the shared redirect rule (the token to its own origin
only) and shares one request among waits begun together, against local HTTP servers."""

from __future__ import annotations

import asyncio
import threading
import urllib.parse
from typing import Any

import anyio
import pytest

from kafold import kafka_clients, tokens
from kafold.aio import ClientClosed, CommandClient, DaemonClient, EventProducer
from kafold.client import ResultTimeout
from kafold.config import AggregateConfig, KafkaConfig
from kafold.envelope import Event
from kafold.errors import KafoldError
from kafold.messages import Command, Result
from tests.aggregates.agg_support import bank_config, create_topics, read_all
from tests.aggregates.test_instance_trust import TOKEN, recording_server


def _answer(kafka: KafkaConfig, agg: AggregateConfig, commands: list[Command], version: int = 1) -> None:
    """Write a result for each command to the results topic, as the runtime would."""
    producer = kafka_clients.producer(kafka)
    for c in commands:
        key, value, headers = Result(c.command_id, c.aggregate_id, "accepted", version).encode()
        producer.produce(agg.topic("results"), value=value, key=key, headers=headers)
    assert producer.flush(30) == 0
    producer.close()


def _threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("kafold-aio")}


def test_results_are_matched_by_command_id_and_a_timeout_or_cancel_leaves_no_waiter(kafka_config: KafkaConfig,
                                                                                    unique: str) -> None:
    agg = bank_config(unique, partitions=2)
    create_topics(kafka_config, agg)

    async def main() -> None:
        async with CommandClient(kafka_config, agg) as client:
            pump = client._pump
            assert pump is not None and _threads() == {f"kafold-aio-commands.{agg.name}"}
            first = client.command("acc-1", "OpenAccount", {"owner": "a"})
            again = client.command("acc-1", "OpenAccount", {"owner": "a"}, command_id=first.command_id)
            other = client.command("acc-2", "OpenAccount", {"owner": "b"})
            waiting = [asyncio.create_task(client.send(c, timeout=30)) for c in (first, again, other)]
            while len(pump.waiters) < 2:  # both ids registered (the same id twice under one key)
                await asyncio.sleep(0.01)
            await asyncio.to_thread(_answer, kafka_config, agg, [other, first])
            got = await asyncio.gather(*waiting)
            assert [r.command_id if r else None for r in got] == [first.command_id, first.command_id,
                                                                  other.command_id]
            assert pump.waiters == {}

            # nobody answers: a timeout, then a cancellation, each takes its waiter out
            with pytest.raises(ResultTimeout, match=r"1 of 1 results not received within 0\.5s"):
                await client.send(client.command("acc-3", "OpenAccount", {"owner": "c"}), timeout=0.5)
            assert pump.waiters == {}
            task = asyncio.create_task(client.send(client.command("acc-4", "OpenAccount", {"owner": "d"})))
            while not pump.waiters:
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert pump.waiters == {}

            # fire and forget: delivered, nothing to wait for
            assert await client.send(client.command("acc-5", "OpenAccount", {"owner": "e"}), wait=False) is None
            assert pump.waiters == {}
        assert _threads() == set()

    asyncio.run(main())
    sent = {r.key().decode() for r in read_all(kafka_config, agg.topic("commands"))}
    assert sent == {"acc-1", "acc-2", "acc-3", "acc-4", "acc-5"}


def test_closing_fails_pending_sends_with_client_closed_and_stops_the_thread(kafka_config: KafkaConfig,
                                                                           unique: str) -> None:
    agg = bank_config(unique)
    create_topics(kafka_config, agg)

    async def main() -> None:
        client = CommandClient(kafka_config, agg)
        await client.start()
        pending = [asyncio.create_task(client.send(client.command(f"acc-{i}", "OpenAccount", {"owner": "x"})))
                   for i in range(20)]
        assert client._pump is not None
        while len(client._pump.waiters) < 20:
            await asyncio.sleep(0.01)
        await client.aclose()
        outcomes = await asyncio.gather(*pending, return_exceptions=True)
        assert all(isinstance(o, ClientClosed) for o in outcomes), outcomes
        assert _threads() == set()
        with pytest.raises(ClientClosed):
            await client.send(client.command("acc-x", "OpenAccount", {"owner": "x"}))

    asyncio.run(main())


def test_an_event_is_produced_under_anyio_and_its_token_names_where_it_landed(kafka_config: KafkaConfig,
                                                                              unique: str) -> None:
    agg = bank_config(unique)
    create_topics(kafka_config, agg)

    async def main() -> list[str]:
        async with EventProducer(kafka_config) as producer:
            return list(await asyncio.gather(*(
                producer.produce(agg.topic("events"), Event.new("AccountOpened", agg.name, f"acc-{i}", 1,
                                                                {"owner": "o"})) for i in range(10))))

    landed: Any = anyio.run(main)  # an anyio application (its asyncio backend, the default)
    positions = tokens.parse(tokens.merge(*landed) or "")
    assert positions == {(agg.topic("events"), 0): 9}
    assert len(read_all(kafka_config, agg.topic("events"))) == 10


def test_the_async_daemon_client_sends_its_token_to_its_own_origin_only_and_asks_again_on_503() -> None:
    with recording_server() as (elsewhere, far):
        hops = {"/aggregates/account/a1": (307, {"Location": "/aggregates/account/moved"}, b""),
                "/aggregates/account/moved": (302, {"Location": f"http://localhost:{elsewhere}/state"}, b""),
                "/aggregates/account/file": (307, {"Location": "file:///etc/passwd"}, b""),
                "/aggregates/account/busy": (503, {"Retry-After": "0.1"}, b'{"message": "the partition moves"}')}
        with recording_server(hops) as (port, near):
            async def main() -> None:
                async with DaemonClient(f"http://127.0.0.1:{port}", TOKEN) as daemon:
                    assert await daemon.state("account", "a1") == {"state": "forged"}
                    with pytest.raises(KafoldError, match="not an http"):
                        await daemon.state("account", "file")
                    with pytest.raises(KafoldError, match="503 the partition moves"):
                        await daemon.state("account", "busy", timeout=0.5)

            asyncio.run(main())
            assert near[:2] == [("/aggregates/account/a1", f"Bearer {TOKEN}"),
                                ("/aggregates/account/moved", f"Bearer {TOKEN}")]  # same origin: kept
            assert far == [("/state", None)]  # another host: no token
            assert sum(1 for path, _ in near if path == "/aggregates/account/busy") >= 3  # asked again meanwhile


def test_waits_begun_together_share_one_request_and_a_failed_shared_wait_is_asked_again_alone() -> None:
    toks = [tokens.encode({("t.events", p): 10 * p + i}) for i, p in enumerate([0, 1, 1, 2])]
    refused = {"/connectors/other/wait": (400, {}, b'{"message": "token: t.events is not a topic of other"}')}
    with recording_server(refused) as (port, seen):
        async def main() -> None:
            async with DaemonClient(f"http://127.0.0.1:{port}", TOKEN) as daemon:
                await asyncio.gather(*(daemon.wait("accounts", t, timeout=5) for t in toks))
                assert len(seen) == 1  # one request for the four, for their merged token
                await daemon.wait("accounts", toks[0], timeout=5)  # a later wait: a request of its own
                assert len(seen) == 2
                got = await asyncio.gather(*(daemon.wait("other", t, timeout=5) for t in toks[:2]),
                                           return_exceptions=True)
                assert [type(e).__name__ for e in got] == ["BadToken", "BadToken"]  # each its own answer

        asyncio.run(main())
    asked = [urllib.parse.parse_qs(urllib.parse.urlsplit(path).query)["token"][0] for path, _ in seen]
    assert asked[:2] == [tokens.merge(*toks), toks[0]]
    assert asked[2] == tokens.merge(*toks[:2]) and sorted(asked[3:]) == sorted(toks[:2])  # shared, then alone
