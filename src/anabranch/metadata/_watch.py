"""Watch fan-out shared by the embedded backends (memory, SQLite).

A watch registered while the store's published revision is ``R`` gets every later
change live (pushed by :meth:`WatchHub.publish` in revision order) and replays
``[start_revision, R]`` from the backend's history first, page by page. The two never
overlap, so there are no gaps or duplicates. A watcher that falls more than
``limits.METADATA_WATCH_QUEUE_EVENTS_MAX`` live events behind is ended with
``Compacted``: the caller re-lists and watches again.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Sequence

from anabranch import limits
from anabranch.errors import AnabranchError, Closed, Compacted
from anabranch.metadata.api import WatchEvent, prefix_end

Replay = Callable[[str, bool, int, int], Awaitable[list[WatchEvent]]]
"""``replay(path, prefix, from_rev, to_rev)``: the matching history events with
``from_rev <= revision <= to_rev`` in order, or Compacted when that history is gone."""

REPLAY_PAGE_REVISIONS = 1_000
"""Revisions fetched per replay page, so replaying a long history uses bounded memory."""


class QueueWatch:
    """One watcher: replayed history first, then its bounded live queue.

    Example:
        >>> import asyncio
        >>> from anabranch.metadata.memory import MemoryMetadataStore
        >>> async def demo(store: MetadataStore) -> None:
        ...     await store.put("/a/1", b"x")                # history, replayed
        ...     watch = store.watch("/a/", prefix=True, start_revision=1)
        ...     await store.delete("/a/1")                   # live
        ...     async for event in watch:
        ...         print(event.revision, event.kind.value, event.path)
        ...         if event.revision == 2:
        ...             break
        ...     await watch.close()
        ...     await store.close()
        >>> asyncio.run(demo(MemoryMetadataStore()))
        1 put /a/1
        2 delete /a/1
    """

    def __init__(
        self,
        hub: WatchHub,
        path: str,
        *,
        prefix: bool,
        start_revision: int,
        registered_revision: int,
        replay: Replay,
    ) -> None:
        self._hub = hub
        self._path = path
        self._prefix = prefix
        self._end = prefix_end(path) if prefix else path
        self._replay_from = start_revision
        self._replay_to = registered_revision
        self._live_from = max(start_revision, registered_revision + 1)
        self._replay = replay
        self._buffer: deque[WatchEvent] = deque()
        self._live: deque[WatchEvent] = deque()
        self._wake = asyncio.Event()
        self._error: AnabranchError | None = None
        self._closed = False

    def matches(self, path: str) -> bool:
        if self._prefix:
            return self._path <= path < self._end
        return path == self._path

    def offer(self, event: WatchEvent) -> None:
        """Queue one live event (called by the hub in revision order)."""
        if self._closed or event.revision < self._live_from or not self.matches(event.path):
            return
        if len(self._live) >= limits.METADATA_WATCH_QUEUE_EVENTS_MAX:
            self.fail(Compacted(self._live[0].revision, event.revision + 1))
            return
        self._live.append(event)
        self._wake.set()

    def fail(self, error: AnabranchError) -> None:
        """End the watch: the next read raises ``error``."""
        if self._closed:
            return
        self._error = error
        self._buffer.clear()
        self._live.clear()
        self._detach()

    def __aiter__(self) -> QueueWatch:
        return self

    async def __anext__(self) -> WatchEvent:
        while True:
            if self._buffer:
                return self._buffer.popleft()
            if self._error is not None:
                error, self._error = self._error, None
                raise error
            if self._closed:
                raise StopAsyncIteration
            if self._replay_from <= self._replay_to:
                await self._replay_page()
                continue
            if self._live:
                return self._live.popleft()
            self._wake.clear()
            await self._wake.wait()

    async def close(self) -> None:
        self._detach()

    async def _replay_page(self) -> None:
        page_to = min(self._replay_to, self._replay_from + REPLAY_PAGE_REVISIONS - 1)
        try:
            events = await self._replay(self._path, self._prefix, self._replay_from, page_to)
        except AnabranchError as error:
            self.fail(error)
            return
        self._replay_from = page_to + 1
        self._buffer.extend(e for e in events if self.matches(e.path))

    def _detach(self) -> None:
        self._closed = True
        self._hub.remove(self)
        self._wake.set()


class WatchHub:
    """Every open watch of one store."""

    def __init__(self) -> None:
        self._watches: set[QueueWatch] = set()

    def open(
        self,
        path: str,
        *,
        prefix: bool,
        start_revision: int | None,
        published_revision: int,
        replay: Replay,
    ) -> QueueWatch:
        start = published_revision + 1 if start_revision is None else start_revision
        watch = QueueWatch(
            self,
            path,
            prefix=prefix,
            start_revision=start,
            registered_revision=published_revision,
            replay=replay,
        )
        self._watches.add(watch)
        return watch

    def publish(self, events: Sequence[WatchEvent]) -> None:
        """Fan out the events of newly committed revisions, oldest first."""
        for watch in list(self._watches):
            for event in events:
                watch.offer(event)

    def remove(self, watch: QueueWatch) -> None:
        self._watches.discard(watch)

    def close_all(self) -> None:
        for watch in list(self._watches):
            watch.fail(Closed("metadata store closed"))
