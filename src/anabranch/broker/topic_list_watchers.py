"""Topic-list watchers (PIP-145): WATCH_TOPIC_LIST, WATCH_TOPIC_UPDATE, WATCH_TOPIC_LIST_CLOSE.

The broker advertises ``FeatureFlags.supports_topic_watchers`` in CONNECTED. A pattern
consumer then sends ``WATCH_TOPIC_LIST{request_id, watcher_id, namespace, topics_pattern,
topics_hash?}`` and gets:

* ``WATCH_TOPIC_LIST_SUCCESS{request_id, watcher_id, topic[], topics_hash}``: the
  namespace's ``persistent://`` topics (partitions included) matching the pattern (the
  :mod:`~anabranch.broker.topic_patterns` rules) and their hash;
* then ``WATCH_TOPIC_UPDATE{watcher_id, new_topics, deleted_topics, topics_hash}`` each
  time a matching topic is registered or unregistered, ``topics_hash`` being the hash of
  the whole matching list after the change. Updates follow the topic registry in the
  metadata store, so a topic created through another broker of the cluster is seen too.
* ERROR(request_id): NotAllowedError for a pattern the broker will not evaluate (over
  ``limits.TOPICS_PATTERN_LENGTH_MAX``, nested quantifiers, a match that may backtrack
  past ``limits.TOPICS_PATTERN_MATCH_STEPS_MAX``: see
  :func:`~anabranch.core.topic_patterns.compile_safely`; upstream refuses over-long ones
  so too), over ``limits.TOPIC_LIST_WATCHERS_PER_CONNECTION_MAX`` watchers, or a
  ``watcher_id`` already open on the connection; TopicNotFound for a missing namespace.

``WATCH_TOPIC_LIST_CLOSE{request_id, watcher_id}`` ends a watcher and is answered with
SUCCESS (also for an unknown id). A closed connection ends all its watchers.

Example:
    >>> # command_table: WATCH_TOPIC_LIST -> handle_watch_topic_list(session, body)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from anabranch import limits
from anabranch.broker.policies import TOPICS
from anabranch.broker.scalable_commands import topics_hash
from anabranch.core import topic_patterns
from anabranch.core.names import NamespaceName, TopicDomain
from anabranch.errors import Closed, Compacted, NotAllowed
from anabranch.metadata.api import EventKind
from anabranch.protocol._generated import pulsar_api_pb2 as pb

if TYPE_CHECKING:
    from anabranch.broker.session import Session

log = logging.getLogger(__name__)
T = pb.BaseCommand


@dataclass(eq=False)
class TopicListWatcher:
    """One watcher of a connection."""

    watcher_id: int
    namespace: NamespaceName
    pattern: re.Pattern[str]
    topics: set[str] = field(default_factory=set)
    task: asyncio.Task[None] | None = None
    closed: bool = False


def _watchers(session: Session) -> dict[int, TopicListWatcher]:
    watchers: dict[int, TopicListWatcher] = session.topic_list_watchers
    return watchers


async def handle_watch_topic_list(session: Session, cmd: pb.CommandWatchTopicList) -> None:
    """WATCH_TOPIC_LIST → WATCH_TOPIC_LIST_SUCCESS, then WATCH_TOPIC_UPDATEs."""
    watchers = _watchers(session)
    watcher_id = int(cmd.watcher_id)
    if watcher_id in watchers:
        raise NotAllowed(f"topic list watcher {watcher_id} is already present on the connection")
    if len(watchers) >= limits.TOPIC_LIST_WATCHERS_PER_CONNECTION_MAX:
        limit = limits.TOPIC_LIST_WATCHERS_PER_CONNECTION_MAX
        raise NotAllowed(f"over {limit} topic list watchers on this connection")
    pattern = topic_patterns.compile_safely(cmd.topics_pattern)
    if pattern is None:
        raise NotAllowed(
            "unable to create topic list watcher: the pattern is longer than "
            f"{limits.TOPICS_PATTERN_LENGTH_MAX} characters, invalid, or too costly to evaluate"
        )
    namespace = NamespaceName.parse(cmd.namespace)
    watcher = TopicListWatcher(watcher_id, namespace, pattern)
    # Reserved before the first await: a second WATCH_TOPIC_LIST with this id, running
    # concurrently (both are spawned), sees it taken.
    watchers[watcher_id] = watcher
    store = session.service.store
    try:
        await session.service.policies.namespace_policies(namespace)
        revision = await store.current_revision()
        watcher.topics = set(await _matching(session, watcher))
    except BaseException:
        if watchers.get(watcher_id) is watcher:
            del watchers[watcher_id]
        raise
    if session.closed or watcher.closed:
        return
    body = pb.CommandWatchTopicListSuccess(
        request_id=cmd.request_id,
        watcher_id=watcher_id,
        topic=sorted(watcher.topics),
        topics_hash=topics_hash(watcher.topics),
    )
    session.write(T(type=T.WATCH_TOPIC_LIST_SUCCESS, watchTopicListSuccess=body))
    watcher.task = asyncio.ensure_future(_follow(session, watcher, revision))


async def _matching(session: Session, watcher: TopicListWatcher) -> list[str]:
    listed = await session.service.policies.list_topics(watcher.namespace, include_deleting=True)
    return topic_patterns.filter_topics(listed, watcher.pattern)


def _update(watcher: TopicListWatcher, added: set[str], removed: set[str]) -> pb.BaseCommand:
    body = pb.CommandWatchTopicUpdate(
        watcher_id=watcher.watcher_id,
        new_topics=sorted(added),
        deleted_topics=sorted(removed),
        topics_hash=topics_hash(watcher.topics),
    )
    return T(type=T.WATCH_TOPIC_UPDATE, watchTopicUpdate=body)


async def _follow(session: Session, watcher: TopicListWatcher, revision: int) -> None:
    """Push an update for every registry change of a matching topic, from ``revision``."""
    store = session.service.store
    domain = TopicDomain.PERSISTENT.value
    prefix = f"{TOPICS}/{watcher.namespace}/{domain}/"
    scheme = f"{domain}://{watcher.namespace}/"
    while not watcher.closed and not session.closed:
        try:
            events = store.watch(prefix, prefix=True, start_revision=revision + 1)
            try:
                async for event in events:
                    local = event.path[len(prefix) :]
                    if not local or "/" in local:
                        continue
                    topic = scheme + local
                    # On the event loop, for every new topic: compile_safely admitted only
                    # patterns whose match_cost bounds this to a few milliseconds.
                    if not topic_patterns.matches(topic, watcher.pattern):
                        continue
                    if event.kind is EventKind.PUT and topic not in watcher.topics:
                        watcher.topics.add(topic)
                        session.write(_update(watcher, {topic}, set()))
                    elif event.kind is EventKind.DELETE and topic in watcher.topics:
                        watcher.topics.discard(topic)
                        session.write(_update(watcher, set(), {topic}))
            finally:
                await events.close()
            return  # the store ended the watch: it is closing
        except Compacted:
            # History gone: re-list and send the difference.
            revision = await store.current_revision()
            now = set(await _matching(session, watcher))
            added, removed = now - watcher.topics, watcher.topics - now
            watcher.topics = now
            if added or removed:
                session.write(_update(watcher, added, removed))
        except (Closed, asyncio.CancelledError):
            return
        except Exception:
            log.exception("%s: topic list watcher failed; retrying", session.remote_address)
            await session.service.clock.sleep(limits.SCALABLE_WATCH_RETRY_S)


async def _end(watcher: TopicListWatcher) -> None:
    watcher.closed = True
    task = watcher.task
    if task is not None and task is not asyncio.current_task():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def handle_watch_topic_list_close(
    session: Session, cmd: pb.CommandWatchTopicListClose
) -> None:
    """WATCH_TOPIC_LIST_CLOSE → SUCCESS (an unknown watcher too, as upstream)."""
    watcher = _watchers(session).pop(int(cmd.watcher_id), None)
    if watcher is not None:
        await _end(watcher)
    session.reply_success(cmd.request_id)


async def on_session_closed(session: Session) -> None:
    """End every watcher of a closed connection."""
    watchers = _watchers(session)
    ended = list(watchers.values())
    watchers.clear()
    for watcher in ended:
        await _end(watcher)


def watcher_count(session: Session) -> int:
    """Open topic-list watchers of ``session``.

    Example:
        >>> # watcher_count(session) -> 0 on a fresh connection
    """
    return len(_watchers(session))
