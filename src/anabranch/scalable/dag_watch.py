"""Fan out a scalable topic's layout changes to listeners (the broker's DAG-watch sessions).

Any broker can serve a DAG watch (PIP-468): it reads the layout record and watches it.
:class:`DagWatcher` keeps one store watch per topic however many listeners there are:

* *list-then-watch*: read the record with the store revision of the read, deliver it,
  then watch from that revision + 1, so no change between the read and the watch is lost;
* on :class:`~anabranch.errors.Compacted` (the history is gone) re-list and go on;
* a listener gets full layouts, in epoch order, each epoch at most once (a re-list after
  compaction may read a layout already delivered); ``None`` means the topic was deleted;
* the watch ends when the last listener of the topic leaves.

Example:
    >>> from anabranch.metadata.memory import MemoryMetadataStore
    >>> async def demo(store: MetadataStore, topic: TopicName) -> None:
    ...     watcher = DagWatcher(store)
    ...     layouts: asyncio.Queue[SegmentLayout | None] = asyncio.Queue()
    ...     handle = await watcher.add_listener(topic, layouts.put_nowait)
    ...     print(await layouts.get())                  # no such topic yet
    ...     layout = SegmentLayout.initial(2, now_ms=0)
    ...     await store.put(TopicPaths(topic).layout, layout.to_json())   # created
    ...     print((await layouts.get()) == layout)
    ...     await handle.remove()
    ...     await watcher.close()
    ...     await store.close()
    >>> topic = TopicName.parse("topic://public/default/orders")
    >>> asyncio.run(demo(MemoryMetadataStore(), topic))
    None
    True
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from anabranch import limits
from anabranch.clock import Clock, SystemClock
from anabranch.core.names import TopicName
from anabranch.core.segment_layout import SegmentLayout
from anabranch.errors import Closed, Compacted
from anabranch.metadata.api import EventKind, MetadataStore
from anabranch.scalable.paths import TopicPaths

log = logging.getLogger(__name__)

LayoutListener = Callable[[SegmentLayout | None], None]
"""Called with each new layout, or None when the topic is deleted."""


@dataclass(eq=False)
class ListenerHandle:
    """A registered listener; :meth:`remove` unregisters it."""

    watcher: DagWatcher
    topic: TopicName
    listener: LayoutListener
    last_epoch: int = -1

    async def remove(self) -> None:
        """Stop delivering to this listener (idempotent)."""
        await self.watcher._remove(self)


@dataclass(eq=False)
class _TopicWatch:
    listeners: list[ListenerHandle] = field(default_factory=list)
    task: asyncio.Task[None] | None = None
    layout: SegmentLayout | None = None
    listed: asyncio.Event = field(default_factory=asyncio.Event)


class DagWatcher:
    """One metadata watch per topic, fanned out to any number of listeners."""

    def __init__(self, store: MetadataStore, clock: Clock | None = None) -> None:
        self._store = store
        self._clock: Clock = clock or SystemClock()
        self._topics: dict[TopicName, _TopicWatch] = {}
        self._closed = False

    async def add_listener(self, topic: TopicName, listener: LayoutListener) -> ListenerHandle:
        """Register ``listener``; it is called at once with the current layout (or None if
        the topic does not exist yet), then with every change."""
        if self._closed:
            raise Closed("DAG watcher is closed")
        paths = TopicPaths(topic)
        handle = ListenerHandle(self, topic, listener)
        while True:
            entry = self._topics.get(topic)
            if entry is None:
                entry = self._topics[topic] = _TopicWatch()
                try:
                    revision = await self._list(topic, paths, entry)
                except BaseException:
                    if self._topics.get(topic) is entry:
                        del self._topics[topic]
                    raise
                finally:
                    entry.listed.set()
                entry.task = asyncio.create_task(self._run(topic, paths, entry, revision + 1))
                break
            # Another listener's first read may still be running: until it finishes,
            # entry.layout is not the stored layout (None would read as "deleted").
            await entry.listed.wait()
            if self._topics.get(topic) is entry:
                break
        entry.listeners.append(handle)
        self._deliver(handle, entry.layout)
        return handle

    async def _list(self, topic: TopicName, paths: TopicPaths, entry: _TopicWatch) -> int:
        page = await self._store.list_range(paths.layout, paths.layout + "\x00")
        entry.layout = SegmentLayout.from_json(page.records[0].value) if page.records else None
        return page.revision

    async def _run(
        self, topic: TopicName, paths: TopicPaths, entry: _TopicWatch, start: int
    ) -> None:
        while True:
            try:
                watch = self._store.watch(paths.layout, start_revision=start)
                try:
                    async for event in watch:
                        start = event.revision + 1
                        if event.kind is EventKind.DELETE:
                            entry.layout = None
                        else:
                            entry.layout = SegmentLayout.from_json(event.value)
                        self._fan_out(entry)
                finally:
                    await watch.close()
                return  # the store ended the watch: it is closing
            except Compacted:
                start = await self._list(topic, paths, entry) + 1
                self._fan_out(entry)
            except Closed:
                return
            except Exception:
                log.exception("%s: layout watch failed; re-listing", topic)
                await self._clock.sleep(limits.SCALABLE_WATCH_RETRY_S)
                with contextlib.suppress(Exception):
                    start = await self._list(topic, paths, entry) + 1
                    self._fan_out(entry)

    def _fan_out(self, entry: _TopicWatch) -> None:
        for handle in list(entry.listeners):
            self._deliver(handle, entry.layout)

    @staticmethod
    def _deliver(handle: ListenerHandle, layout: SegmentLayout | None) -> None:
        if layout is not None and layout.epoch <= handle.last_epoch:
            return  # already delivered (a re-list reads what the watch had shown)
        if layout is None and handle.last_epoch == -2:
            return
        handle.last_epoch = layout.epoch if layout is not None else -2
        try:
            handle.listener(layout)
        except Exception:
            log.exception("%s: a layout listener failed", handle.topic)

    async def _remove(self, handle: ListenerHandle) -> None:
        entry = self._topics.get(handle.topic)
        if entry is None or handle not in entry.listeners:
            return
        entry.listeners.remove(handle)
        if not entry.listeners:
            del self._topics[handle.topic]
            await _cancel(entry.task)

    async def close(self) -> None:
        """End every watch; listeners get nothing more. Idempotent."""
        self._closed = True
        entries, self._topics = list(self._topics.values()), {}
        for entry in entries:
            await _cancel(entry.task)


async def _cancel(task: asyncio.Task[None] | None) -> None:
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
