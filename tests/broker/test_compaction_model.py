"""The compactor and the compacted read path against a model, over real (memory) managed
ledgers: any interleaving of appends (plain entries and batches; keyed, keyless and
tombstone messages) and compactions, read from the start through the view and on into the
tail, gives the latest value of each key up to the last horizon followed by every message
after it."""

from __future__ import annotations

import asyncio

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from anabranch.broker.compaction import TopicCompaction
from anabranch.broker.compaction_messages import entry_messages
from anabranch.broker.topic import PersistentTopic
from anabranch.clock import SystemClock
from anabranch.core.compaction import Message, compact_model
from anabranch.metadata.memory import MemoryMetadataStore
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.protocol.batch import encode_batch
from anabranch.protocol.frames import encode_entry
from anabranch.storage.api import EARLIEST, ManagedLedgerConfig, Position
from anabranch.storage.memory import MemoryManagedLedgerFactory

KEYS = st.sampled_from(["a", "b", "c", "d", None])
MESSAGE = st.tuples(KEYS, st.sampled_from([b"", b"x", b"yy", b"zzz"]))
APPEND = st.lists(MESSAGE, min_size=1, max_size=4).map(lambda batch: ("append", batch))
STEPS = st.lists(st.one_of(APPEND, st.just(("compact", []))), max_size=12)


def entry(messages: list[tuple[str | None, bytes]], seq: int) -> bytes:
    md = pb.MessageMetadata(producer_name="p", sequence_id=seq, publish_time=0)
    if len(messages) == 1:
        key, value = messages[0]
        if key is not None:
            md.partition_key = key
        return encode_entry(md, value)
    singles = []
    for key, value in messages:
        single = pb.SingleMessageMetadata()
        if key is not None:
            single.partition_key = key
        singles.append((single, value))
    md.num_messages_in_batch = len(messages)
    return encode_entry(md, encode_batch(singles))


async def scenario(steps: list[tuple[str, list[tuple[str | None, bytes]]]]) -> None:
    factory = MemoryManagedLedgerFactory()
    ledger = await factory.open("t/ns/persistent/x", ManagedLedgerConfig(ledger_entries_max=3))
    topic = PersistentTopic(
        "persistent://t/ns/x", ledger, store=MemoryMetadataStore(), clock=SystemClock()
    )
    compaction = TopicCompaction(topic, factory, ManagedLedgerConfig())
    appended: list[Message] = []
    for seq, (kind, messages) in enumerate(steps):
        if kind == "append":
            position = await ledger.append(entry(messages, seq))
            batched = len(messages) > 1
            for index, (key, value) in enumerate(messages):
                appended.append(
                    Message(position, index if batched else -1,
                            None if key is None else key.encode(), not value)
                )  # fmt: skip
        else:
            await compaction.compact()
    horizon = await compaction.horizon()
    # read the way dispatch does: the view (then the tail) from the start, in small reads
    seen: list[Message] = []
    start = Position(EARLIEST[0], EARLIEST[1] + 1)
    while True:
        got = await compaction.read(start, 2)
        if got is None:
            got = [(e, b"") for e in await ledger.read(start, 2)]
        if not got:
            break
        for stored, removed in got:
            seen.extend(entry_messages(stored, removed))
        start = got[-1][0].position.next()
    if horizon is None:
        expected = appended
    else:
        head = [m for m in appended if m.position <= horizon]
        expected = compact_model(head) + [m for m in appended if m.position > horizon]
    assert seen == expected
    await compaction.close()
    await ledger.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(STEPS)
def test_view_then_tail_matches_the_model(
    steps: list[tuple[str, list[tuple[str | None, bytes]]]],
) -> None:
    asyncio.run(scenario(steps))
