"""A producer's ADD_PARTITION_TO_TXN at its first send in a transaction, not awaited.

Why: the broker writes a topic's op record (durable) before the topic's first entry of a
transaction. Sent at the first ``send_async`` of a transaction, ADD_PARTITION_TO_TXN lets
the broker write it while the application is still queueing the round's messages and the
producer batching them, instead of when their batch arrives. Nothing waits for the
answer: the sends of the transaction carry any refusal themselves (the broker joins at
the first write when the announcement did not), so correctness never depends on it.

Bounded: one announcement per transaction per producer, at most ``IN_FLIGHT_MAX``
unanswered (beyond it the producer just skips announcing).

Example:
    >>> ahead = JoinAhead()
    >>> ahead.wants(TxnId(0, 1))
    True
    >>> ahead.announce(None, "persistent://public/default/t", TxnId(0, 1))  # no connection
    >>> ahead.wants(TxnId(0, 1)), ahead.wants(TxnId(0, 2))
    (False, True)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable

from anabranch.client.connection import ClientConnection
from anabranch.core.txn_id import TxnId
from anabranch.errors import AnabranchError
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.protocol.frames import Frame

log = logging.getLogger(__name__)

IN_FLIGHT_MAX = 4
"""Unanswered announcements of one producer (a new transaction per send would otherwise
pile them up)."""


class JoinAhead:
    """Which transaction a producer last announced, and the announcements in flight."""

    def __init__(self) -> None:
        self._last: TxnId | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def wants(self, txn_id: TxnId) -> bool:
        """Is ``txn_id`` not yet announced (and is there room to)?"""
        return txn_id != self._last and len(self._tasks) < IN_FLIGHT_MAX

    def announce(self, conn: ClientConnection | None, topic: str, txn_id: TxnId) -> None:
        """Send ADD_PARTITION_TO_TXN for ``topic`` on ``conn`` (the producer's)."""
        self._last = txn_id
        if conn is None or not conn.is_open:
            return
        request_id = conn.new_request_id()
        body = pb.CommandAddPartitionToTxn(
            request_id=request_id,
            txnid_most_bits=txn_id.most_bits,
            txnid_least_bits=txn_id.least_bits,
            partitions=[topic],
        )
        command = pb.BaseCommand(type=pb.BaseCommand.ADD_PARTITION_TO_TXN, addPartitionToTxn=body)
        try:
            # On the wire now: the caller may queue a whole round before it yields.
            answer = conn.request_now(command, request_id)
        except AnabranchError as err:
            log.debug("ADD_PARTITION_TO_TXN not sent: %s", err)
            return
        task = asyncio.get_running_loop().create_task(_answered(answer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


async def _answered(answer: Awaitable[Frame]) -> None:
    try:
        await answer
    except AnabranchError as err:
        log.debug("ADD_PARTITION_TO_TXN not answered: %s", err)


__all__ = ["IN_FLIGHT_MAX", "JoinAhead"]
