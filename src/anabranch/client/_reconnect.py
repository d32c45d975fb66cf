"""Shared connect/reconnect machinery of producers and consumers.

A handler connects once when created (retrying retriable errors until the operation
timeout, so a broker that is still starting is waited for), and after any later loss of its
connection reconnects in the background with :class:`Backoff` until it succeeds, is
closed, or meets a terminal error (topic gone, terminated, fenced), which ends it.

An attempt that failed because the broker it was sent to does not answer
(``BrokerUnresponsive``: a paused owner whose session has not expired yet, so lookups
still name it) already waited the probe timeout; the next one follows after the minimum
delay instead of a growing one, so the handler moves within about a probe timeout of the
topic's new owner taking over.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from anabranch.client.backoff import Backoff
from anabranch.client.connection import ClientConnection, ConnectionPool
from anabranch.client.errors import BrokerUnresponsive
from anabranch.errors import AnabranchError, Closed, NotFound, ProducerFenced, TopicTerminated

log = logging.getLogger(__name__)

TERMINAL_ERRORS: tuple[type[AnabranchError], ...] = (
    Closed,
    NotFound,
    TopicTerminated,
    ProducerFenced,
)
"""Errors after which reconnecting cannot help (upstream fails the producer/consumer)."""


class ReconnectingHandler:
    """Base of Producer and Consumer: owns ``_conn`` and the reconnect task."""

    def __init__(self, pool: ConnectionPool, topic: str) -> None:
        self._pool = pool
        self.topic = topic
        self._conn: ClientConnection | None = None
        self._closing = False
        self._reconnect_task: asyncio.Task[None] | None = None
        self._backoff = Backoff(random=pool.random)

    async def _connect_once(self) -> None:
        """Look the topic up, attach to the connection and register; set ``_conn``."""
        raise NotImplementedError

    def _on_terminal_error(self, error: AnabranchError) -> None:
        """Reconnecting failed for good: fail whatever waits on this handler."""
        raise NotImplementedError

    async def _start(self) -> None:
        """First connection; retriable errors are retried until the operation timeout."""
        deadline = asyncio.get_running_loop().time() + self._pool.operation_timeout_s
        while True:
            try:
                await self._connect_once()
                self._backoff.reset()
                return
            except AnabranchError as err:
                if isinstance(err, BrokerUnresponsive):
                    self._backoff.reset()  # the attempt itself waited (module docstring)
                delay = self._backoff.next()
                if not err.retriable or asyncio.get_running_loop().time() + delay > deadline:
                    raise
                log.info("%s: retrying connect in %.2fs: %s", self.topic, delay, err)
                await asyncio.sleep(delay)

    def on_connection_closed(self, conn: ClientConnection) -> None:
        """Connection lost or broker closed us: reconnect in the background."""
        if conn is not self._conn:
            return
        self._conn = None
        self._on_disconnected()
        if self._closing or self._pool.closed:
            return
        if self._reconnect_task is None or self._reconnect_task.done():
            self._reconnect_task = asyncio.get_running_loop().create_task(self._reconnect())

    def _on_disconnected(self) -> None:
        """Hook: the connection is gone (before reconnecting starts)."""

    async def _reconnect(self) -> None:
        while not self._closing and not self._pool.closed:
            delay = self._backoff.next()
            await asyncio.sleep(delay)
            if self._closing or self._pool.closed:
                return
            try:
                await self._connect_once()
            except TERMINAL_ERRORS as err:
                log.warning("%s: giving up reconnecting: %s", self.topic, err)
                self._on_terminal_error(err)
                return
            except BrokerUnresponsive as err:
                log.info("%s: reconnect failed (retrying at once): %s", self.topic, err)
                self._backoff.reset()
                continue
            except (AnabranchError, OSError) as err:
                log.info("%s: reconnect failed, next in ~%.2fs: %s", self.topic, delay, err)
                continue
            self._backoff.reset()
            return

    async def _stop_reconnecting(self) -> None:
        task, self._reconnect_task = self._reconnect_task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
