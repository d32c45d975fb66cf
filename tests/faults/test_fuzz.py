"""Fuzzing a live broker (issue 15): generated and mutated frames on many connections,
then malformed admin requests; and regressions for what the fuzzer found.

The CI run is :mod:`anabranch.testing.fuzz` with 30,000 frames and 1,500 HTTP requests
against a real ``anabranch standalone`` subprocess (a few seconds);
``benchmarks/fuzz_frames.py`` runs a million. Asserted: the process survives, its RSS
stays bounded, every burst of well-formed frames is answered, the probe connection's
longest PING→PONG stays under a generous bound for a shared 2-core box (the benchmark
reports the figure against the 100 ms target), no admin request gets a 500 or a body
with a traceback or the data directory, and the broker logged no traceback (a handler
exception it did not expect).

Bugs the fuzzer found, each with a regression test below:

- a bit flip inside a ``string`` field: proto2 parsing does not check UTF-8, and the
  Python runtime hands such a field out as ``bytes``; WATCH_SCALABLE_TOPICS then raised
  TypeError in the handler (logged with a traceback, answered UnknownError). The decoder
  now refuses the frame (MalformedFrame: ERROR and close, like any unparsable command).
- a topic load that failed (namespace missing) while every caller had gone (their
  connection closed) logged "Task exception was never retrieved".
"""

from __future__ import annotations

import asyncio
import gc
import logging
import random
from pathlib import Path
from typing import Any

import pytest

from anabranch.admin.models import decode_json
from anabranch.broker.consumer import Consumer
from anabranch.broker.dispatcher_entries import sticky_key
from anabranch.errors import ConsumerBusy, InvalidArgument, MalformedFrame, ProtocolError
from anabranch.protocol import commands
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.protocol.frames import (
    FrameDecoder,
    decode_frame,
    encode_command,
    encode_entry,
    encode_entry_frame,
)
from anabranch.storage.api import EARLIEST, Position
from anabranch.storage.memory import MemoryManagedLedgerFactory
from anabranch.testing.broker import BrokerProcess, InProcessBroker
from anabranch.testing.clock import ManualClock
from anabranch.testing.fuzz import (
    ALL_TYPES,
    FrameGenerator,
    Mutator,
    fuzz_frames,
    fuzz_http,
)
from tests.broker import test_hostile_counts as hostile
from tests.broker import test_subscriptions as subs_test
from tests.broker.test_core_protocol import RawClient

pytestmark = pytest.mark.timeout(300)

FRAMES = 30_000
HTTP_REQUESTS = 1_500
RSS_GROWTH_MAX_MB = 64.0
"""Over the run (the benchmark's million frames show the plateau)."""
STALL_BOUND_MS = 1_000.0
"""Generous for CI on a shared box; the benchmark reports the figure (target 100 ms)."""


def test_the_generator_makes_well_formed_frames_of_every_type() -> None:
    gen = FrameGenerator(random.Random(7))
    for command_type in ALL_TYPES:
        for _ in range(20):
            (frame,) = FrameDecoder(max_frame_size=1 << 24).feed(gen.frame(command_type))
            assert frame.type == command_type


def test_the_mutator_breaks_most_frames_and_the_decoder_only_raises_protocol_errors() -> None:
    rng = random.Random(8)
    gen, mut = FrameGenerator(rng), Mutator(rng)
    refused = 0
    for _ in range(3_000):
        data = mut.mutate(gen.frame(), gen.frame())
        try:
            FrameDecoder(max_frame_size=1 << 24).feed(data)
        except ProtocolError:
            refused += 1
    assert refused > 1_000  # the mutations do break frames (else the fuzz tests little)


def _watch(namespace: bytes) -> bytes:
    """WATCH_SCALABLE_TOPICS whose namespace bytes are given raw (maybe invalid UTF-8)."""
    body = pb.CommandWatchScalableTopics(watch_id=1, namespace="x" * len(namespace))
    frame = encode_command(
        pb.BaseCommand(type=pb.BaseCommand.WATCH_SCALABLE_TOPICS, watchScalableTopics=body)
    )
    return frame.replace(b"x" * len(namespace), namespace)


def test_a_string_field_with_invalid_utf8_is_a_malformed_frame() -> None:
    assert decode_frame(_watch(b"public/default")[4:]).body.namespace == "public/default"
    with pytest.raises(MalformedFrame, match="namespace is not valid UTF-8"):
        decode_frame(_watch(b"public/defa\xfflt")[4:])
    # A SEND's metadata (a string in a nested message) is checked too.
    md = pb.MessageMetadata(producer_name="prod\u00e9", sequence_id=1, publish_time=1)
    send = encode_entry_frame(commands.send(1, 1), encode_entry(md, b"x", checksum=False))
    assert decode_frame(send[4:]).metadata is not None
    bad = send.replace("prod\u00e9".encode(), b"prod\xff\xfe")
    with pytest.raises(MalformedFrame, match="producer_name"):
        decode_frame(bad[4:])


async def _exchange(port: int, data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(encode_command(commands.connect("test")))
    await reader.read(65536)
    writer.write(data)
    received = b""
    while chunk := await reader.read(65536):
        received += chunk
    writer.close()
    return received


async def test_the_broker_refuses_invalid_utf8_without_a_handler_exception(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with InProcessBroker(tmp_path) as broker:
        with caplog.at_level(logging.INFO):
            answer = await _exchange(broker.port, _watch(b"public/defa\xfflt"))
        (error,) = FrameDecoder().feed(answer)
        assert error.type_name == "ERROR"
        assert "not valid UTF-8" in error.command.error.message
        assert not [r for r in caplog.records if r.exc_info], "a handler raised"


async def test_a_failed_topic_load_whose_callers_left_loses_no_exception(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lost: list[dict[str, Any]] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, context: lost.append(context))
    try:
        async with InProcessBroker(tmp_path) as broker:
            service = broker.service
            gate = asyncio.Event()
            policies = service.policies.namespace_policies

            async def slow_policies(*args: Any, **kwargs: Any) -> Any:
                await gate.wait()  # the load fails only after its caller has gone
                return await policies(*args, **kwargs)

            monkeypatch.setattr(service.policies, "namespace_policies", slow_policies)
            caller = asyncio.ensure_future(
                service.get_topic("persistent://nope/none/t", create=True)
            )
            await asyncio.sleep(0.05)  # the load task is waiting at the gate
            loading = list(service._loading.values())
            assert loading
            caller.cancel()  # its connection closed
            await asyncio.wait([caller])
            gate.set()
            await asyncio.wait(loading)  # (retrieves no exception)
            assert not service.loaded_topics()  # the load failed (namespace missing)
            del loading, caller  # (the cancelled caller's traceback holds the load task)
            gc.collect()
            await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(None)
    assert not [c for c in lost if "never retrieved" in str(c.get("message"))], lost


async def test_a_live_broker_survives_the_fuzzer(tmp_path: Path) -> None:
    broker = BrokerProcess(tmp_path / "data")
    await broker.start()
    try:
        assert broker.pid is not None
        report = await fuzz_frames(
            broker.host,
            broker.port,
            frames=FRAMES,
            seed=11,
            broker_pid=broker.pid,
            leak_markers=(str(tmp_path),),
        )
        http = await fuzz_http(
            f"http://{broker.host}:{broker.http_port}",
            requests=HTTP_REQUESTS,
            seed=11,
            leak_markers=(str(tmp_path),),
        )
        assert broker.running
    finally:
        await broker.stop()
    summary = report.to_json()
    assert report.crashes == 0, summary
    assert report.frames >= FRAMES, summary
    assert report.unanswered_pings == 0, report.examples
    assert report.frame_leaks == 0, report.examples
    assert report.frames_answered > FRAMES // 10, summary  # the fuzz reached the handlers
    assert report.probe_pings > 0 and report.probe_failures == 0, summary
    assert report.max_stall_ms < STALL_BOUND_MS, summary
    assert report.rss_peak_mb - report.rss_start_mb < RSS_GROWTH_MAX_MB, summary
    assert http.http_requests >= HTTP_REQUESTS * 0.9, http.to_json()
    assert http.http_500 == 0 and http.http_leaks == 0, http.examples
    log = broker.log_path.read_text(errors="replace")
    assert "Traceback" not in log, log[-5000:]


def test_a_bad_base64_partition_key_does_not_poison_dispatch() -> None:
    md = pb.MessageMetadata(producer_name="p", sequence_id=1, publish_time=1)
    md.partition_key = "\u00e9t\u00e9!"  # neither base64 nor ASCII
    md.partition_key_b64_encoded = True
    assert sticky_key(md) == "\u00e9t\u00e9!".encode()
    md.partition_key = "abc"  # bad padding
    assert sticky_key(md) == b"abc"
    md.partition_key = "YWJj"
    assert sticky_key(md) == b"abc"


async def test_an_ack_past_what_the_topic_stored_is_refused(tmp_path: Path) -> None:
    async with InProcessBroker(tmp_path, metadata="memory") as broker:
        client = await RawClient.open(broker.port)
        try:
            await client.handshake()
            await hostile.produce_batch(client, 1)
            await client.send(
                commands.subscribe(
                    hostile.TOPIC, "sub", pb.CommandSubscribe.Exclusive, 1, 201,
                    initial_position=hostile.EARLIEST_POS,
                )
            )  # fmt: skip
            await hostile.expect(client, pb.BaseCommand.SUCCESS)
            await client.send(commands.flow(1, 1000))
            first = (await hostile.expect(client, pb.BaseCommand.MESSAGE)).command.message
            ledger, entry = first.message_id.ledgerId, first.message_id.entryId
            for bogus in (
                pb.MessageIdData(ledgerId=ledger + 1000, entryId=0),  # a later ledger
                pb.MessageIdData(ledgerId=ledger, entryId=entry + 1),  # not written yet
                pb.MessageIdData(ledgerId=ledger, entryId=2**63, ack_set=[1]),  # negative
                pb.MessageIdData(ledgerId=2**64 - 1, entryId=2**64 - 1),
            ):
                await client.send(commands.ack(1, [bogus], cumulative=True, request_id=7))
                answer = await hostile.expect(client, pb.BaseCommand.ACK_RESPONSE)
                assert answer.command.ackResponse.HasField("error"), bogus
            # Nothing was skipped: the next message is delivered.
            md = pb.MessageMetadata(producer_name="p1", sequence_id=2, publish_time=1)
            await client.send(commands.send(1, 2), md, b"second")
            await hostile.expect(client, pb.BaseCommand.SEND_RECEIPT)
            message = await hostile.expect(client, pb.BaseCommand.MESSAGE)
            assert message.command.message.message_id.entryId == entry + 1
            await hostile.assert_responsive(client)
        finally:
            await client.close()


async def test_a_subscribe_racing_an_unload_is_refused_not_left_dispatching(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fuzzer's "Task was destroyed but it is pending" (Dispatcher._run): a SUBSCRIBE
    whose cursor opened while the topic was being unloaded added its subscription to the
    closed topic, and its dispatcher read a closed ledger forever."""
    topic_name = "persistent://public/default/unload-race"
    async with InProcessBroker(tmp_path, metadata="memory") as broker:
        topic = await broker.service.get_topic(topic_name, create=True)
        gate = asyncio.Event()
        open_cursor = topic.ledger.open_cursor

        async def slow_open_cursor(*args: Any, **kwargs: Any) -> Any:
            cursor = await open_cursor(*args, **kwargs)
            await gate.wait()
            return cursor

        monkeypatch.setattr(topic.ledger, "open_cursor", slow_open_cursor)
        client = await RawClient.open(broker.port)
        try:
            await client.handshake()
            await client.send(
                commands.subscribe(
                    topic_name, "sub", pb.CommandSubscribe.Exclusive, 1, 7,
                    initial_position=hostile.EARLIEST_POS,
                )
            )  # fmt: skip
            await asyncio.sleep(0.1)  # the SUBSCRIBE waits in open_cursor
            assert await broker.service.unload_topic(topic_name)
            gate.set()
            answer = await client.recv()
            assert answer is not None and answer.type == pb.BaseCommand.ERROR
            assert answer.command.error.error == pb.ServiceNotReady  # retriable
            assert not topic.subscriptions
            await hostile.assert_responsive(client)
        finally:
            await client.close()


async def test_concurrent_subscribes_of_two_types_leave_no_orphan_dispatcher() -> None:
    """The fuzzer's other "Task was destroyed but it is pending" (Dispatcher._run): two
    consumers of different types attaching at once to a subscription whose last consumer
    had left both replaced its dispatcher; the first one's consumer was left on a dropped
    dispatcher that nobody closed (and that never delivered to it)."""
    factory = MemoryManagedLedgerFactory()
    ledger = await factory.open("public/default/persistent/race")
    topic = subs_test.FakeTopic("persistent://public/default/race", ledger, ManualClock())
    try:
        sub = await subs_test.subscribe(topic, pb.CommandSubscribe.Shared)
        session = subs_test.FakeSession()
        first = await subs_test.add(sub, session, 1)
        await sub.remove_consumer(first)  # the Shared dispatcher idles, its loop running
        kinds = (pb.CommandSubscribe.Exclusive, pb.CommandSubscribe.Failover)
        consumers = [Consumer(session, 2 + i, f"c{i}", kind) for i, kind in enumerate(kinds)]
        results = await asyncio.gather(
            *(sub.add_consumer(c) for c in consumers), return_exceptions=True
        )
        attached = [c for c, r in zip(consumers, results, strict=True) if r is None]
        refused = [r for r in results if r is not None]
        assert len(attached) == 1 and isinstance(refused[0], ConsumerBusy), results
        assert sub.dispatcher.consumers == attached  # on the live dispatcher
        await topic.append(b"m")
        await subs_test.settle()
        attached[0].add_permits(10)
        sub.dispatcher.kick()
        await subs_test.settle()
        assert session.entries(attached[0].consumer_id) == [0]
        await sub.close()
    finally:
        await factory.close()


async def test_a_seek_to_an_extreme_or_unwritten_position_is_clamped() -> None:
    """A SEEK to entry 2^63 (negative once signed) left a mark-delete of -2^63-1, which
    the cursor could not persist (struct.error on every flush, so no ack was saved again)."""
    factory = MemoryManagedLedgerFactory()
    ledger = await factory.open("public/default/persistent/seek")
    topic = subs_test.FakeTopic("persistent://public/default/seek", ledger, ManualClock())
    try:
        first = await topic.append(b"a")
        sub = await subs_test.subscribe(topic, pb.CommandSubscribe.Exclusive)
        for bogus, expected in (
            (Position(first[0], -(2**63)), EARLIEST),
            (Position(-5, 3), EARLIEST),
            (Position(first[0] + 1000, 0), first),
            (Position(first[0], first[1] + 1), first),
        ):
            await sub.seek(bogus)
            assert sub.cursor.mark_delete_position == expected, bogus
            await sub.cursor.flush()  # persistable (raised struct.error)
        session = subs_test.FakeSession()
        await subs_test.add(sub, session, 1, permits=10)
        await topic.append(b"b")
        await subs_test.settle()
        assert session.entries(1) == [first[1] + 1]  # past the end: only what comes next
        await sub.close()
    finally:
        await factory.close()


def test_an_admin_body_with_invalid_utf8_is_a_bad_request() -> None:
    """The HTTP fuzz's one 500: a JSON string with invalid UTF-8 made msgspec raise
    UnicodeDecodeError, which reached the error middleware as an internal error."""
    with pytest.raises(InvalidArgument, match="bad actions body"):
        decode_json(b'["produce\xd7"]', list[str], "actions")
    assert decode_json(b'["produce"]', list[str], "actions") == ["produce"]


async def test_a_schema_for_a_namespace_that_does_not_exist_writes_nothing(
    tmp_path: Path,
) -> None:
    """The fuzz left /schemas/nope/none/... records: GET_OR_CREATE_SCHEMA stored a schema
    for any valid name, its namespace missing or not."""
    async with InProcessBroker(tmp_path, metadata="memory") as broker:
        client = await RawClient.open(broker.port)
        try:
            await client.handshake()
            schema = pb.Schema(name="s", type=pb.Schema.String, schema_data=b"")
            for topic, ok in (("persistent://nope/none/t", False), (hostile.TOPIC, True)):
                body = pb.CommandGetOrCreateSchema(request_id=1, topic=topic, schema=schema)
                await client.send(
                    pb.BaseCommand(type=pb.BaseCommand.GET_OR_CREATE_SCHEMA, getOrCreateSchema=body)
                )
                frame = await hostile.expect(client, pb.BaseCommand.GET_OR_CREATE_SCHEMA_RESPONSE)
                answer = frame.command.getOrCreateSchemaResponse
                assert answer.HasField("error_code") != ok, answer
        finally:
            await client.close()
        page = await broker.service.store.list_prefix("/schemas/persistent/nope/")
        assert not page.records
        assert (await broker.service.store.list_prefix("/schemas/persistent/public/")).records
