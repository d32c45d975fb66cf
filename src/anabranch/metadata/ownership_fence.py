"""A broker's claim on a topic, carried by the metadata writes it makes for that topic.

In a cluster a broker may write a topic's metadata (transaction op records, aborted
records, dedup snapshots) only while it owns the topic. Leadership is never proof of the
right to write (DESIGN.md §2): a broker paused past its session wakes believing it still
owns what another broker took over. So each such write is committed together with the
``check`` of the broker's ownership record (``ClusterOwnership.fence``: its create
revision, which a new owner's claim changes); once the claim is gone the write fails,
writes nothing, and :func:`commit_fenced` raises NotOwner (the client looks the topic up
again). Standalone brokers have no fence (None).

Example:
    >>> import asyncio
    >>> from anabranch.metadata.api import Put
    >>> from anabranch.metadata.memory import MemoryMetadataStore
    >>> async def demo() -> None:
    ...     store = MemoryMetadataStore()
    ...     record = "/ownership/persistent/t/ns/x"
    ...     stat = await store.put(record, b"this broker")
    ...     check = Check(record, expected_create_revision=stat.create_revision)
    ...     fence = OwnershipFence(check, "persistent://t/ns/x")
    ...     await commit_fenced(store, [Put("/state", b"1")], fence)  # owned: written
    ...     await store.delete(record)  # our session expired...
    ...     await store.put(record, b"another broker")  # ...and another broker claimed it
    ...     try:
    ...         await commit_fenced(store, [Put("/state", b"2")], fence)
    ...     except NotOwner as err:
    ...         print(err)
    ...     print((await store.get("/state")).value)
    ...     await store.close()
    >>> asyncio.run(demo())
    this broker does not own persistent://t/ns/x: it is moving
    b'1'
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from anabranch.errors import BadVersion, NotOwner
from anabranch.metadata.api import Check, MetadataStore, Op


class OwnershipFence(NamedTuple):
    """This broker's claim on ``topic``: ``check`` holds while the claim does."""

    check: Check
    topic: str


async def commit_fenced(
    store: MetadataStore, ops: Sequence[Op], fence: OwnershipFence | None
) -> None:
    """Commit ``ops`` and ``fence`` (None: no fence) atomically; NotOwner when the fence
    no longer holds (nothing is written then)."""
    if fence is None:
        await store.commit(ops)
        return
    try:
        await store.commit([*ops, fence.check])
    except BadVersion as err:
        if err.path == fence.check.path:
            raise NotOwner(fence.topic, None) from err
        raise
