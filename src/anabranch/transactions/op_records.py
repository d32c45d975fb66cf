"""What both kinds of participant do with op records (PIP-473): join, write, clean up.

A participant (a topic's transaction buffer, a subscription's pending-ack store) joins a
transaction by writing an op record, always in one commit guarded by
``Check(header, expected_version=1)``: version 1 is OPEN, and the coordinator's one
finalizing CAS makes it 2, so a write can never slip in after the decision. Before that
it reads the header once (:func:`join`) to refuse early: absent → TransactionNotFound,
final → TransactionConflict, OPEN past its deadline → TransactionConflict ("timed out").

Sequence numbers of a transaction's op records are shared by all its participants: a
writer takes the one after the highest it listed, and a collision with another writer
(``BadVersion`` on the op path) re-lists and tries the next one.

In a cluster every participant write also carries the broker's ownership fence
(:mod:`anabranch.metadata.ownership_fence`): a broker that was paused past its session and
resumes cannot write anything for a topic another broker now owns (NotOwner, which the
client retries).

:class:`OutcomeWork` runs the durable part of applying an outcome (delete op records,
write an aborted record, move a cursor) in one background task per participant,
retrying each transaction with backoff until its work succeeds.

Example:
    >>> import asyncio
    >>> from anabranch.metadata.memory import MemoryMetadataStore
    >>> from anabranch.storage.api import Position
    >>> async def demo() -> int:
    ...     store = MemoryMetadataStore()
    ...     txn = TxnId(0, 1)
    ...     header = records.TxnHeader(TxnState.OPEN, created_at=0, timeout_ms=10**12)
    ...     await store.put(records.header_path(txn), records.encode_header(header))
    ...     await join(store, txn, now_ms=5)
    ...     op = records.TxnOp(records.OpKind.WRITE, "t", first_after=Position(-1, -1))
    ...     return await write_op(store, txn, op, lambda seq: f"/idx/{seq}", next_seq=0)
    >>> asyncio.run(demo())
    0
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence

from anabranch import limits
from anabranch.clock import Clock
from anabranch.errors import (
    BadVersion,
    MetadataUnavailable,
    NotOwner,
    TransactionConflict,
    TransactionNotFound,
    TransactionTooLarge,
)
from anabranch.metadata.api import MUST_NOT_EXIST, Check, Delete, MetadataStore, Op, Put
from anabranch.metadata.ownership_fence import OwnershipFence, commit_fenced
from anabranch.transactions import records
from anabranch.transactions.ids import TxnId
from anabranch.transactions.records import TxnState

log = logging.getLogger(__name__)

OPEN_VERSION = 1
"""The header's version while OPEN (created at 1; the finalizing CAS makes it 2)."""


async def join(store: MetadataStore, txn: TxnId, now_ms: int) -> records.TxnHeader:
    """Refuse to join ``txn`` unless its header is OPEN and within its deadline; returns
    the header."""
    record = await store.get(records.header_path(txn))
    if record is None:
        raise TransactionNotFound(f"transaction {txn} not found")
    header = records.decode_header(record.value)
    check_joinable(txn, header, now_ms)
    return header


def check_joinable(txn: TxnId, header: records.TxnHeader, now_ms: int) -> None:
    """:func:`join`'s verdict on a header already at hand (e.g. the one this broker's
    coordinator created: the guarded write still checks the stored one)."""
    if header.state.final:
        raise TransactionConflict(f"transaction {txn} is already {header.state.value}")
    if now_ms > header.deadline:
        raise TransactionConflict(f"transaction {txn} timed out")


def check_owner(txn: TxnId, owner: str | None, role: str | None) -> None:
    """Pulsar's ownership rule: with authentication on, only the role that opened a
    transaction (``owner``), or a superuser (``role`` None, as with authentication off),
    may add to it or end it. Anyone else gets TransactionNotFound, as upstream answers:
    transaction ids are sequential, so they are easy to guess.

    Example:
        >>> check_owner(TxnId(0, 1), "app", None)
        >>> check_owner(TxnId(0, 1), "app", "intruder")
        Traceback (most recent call last):
        ...
        anabranch.errors.TransactionNotFound: role intruder is neither the owner of transaction 0_1 nor a superuser
    """  # noqa: E501 (a doctest's output is one line)
    if role is not None and owner is not None and owner != role:
        raise TransactionNotFound(
            f"role {role} is neither the owner of transaction {txn} nor a superuser"
        )


async def join_and_count(
    store: MetadataStore, txn: TxnId, now_ms: int
) -> tuple[records.TxnHeader, int, int]:
    """:func:`join` and :func:`op_count` as one round trip (both reads run together; a
    refusal to join wins over the count): the header, its op records, the next free
    sequence."""
    joined, counted = await asyncio.gather(
        join(store, txn, now_ms), op_count(store, txn), return_exceptions=True
    )
    if isinstance(joined, BaseException):
        raise joined
    if isinstance(counted, BaseException):
        raise counted
    return joined, *counted


async def op_count(store: MetadataStore, txn: TxnId) -> tuple[int, int]:
    """``(op records of txn, next free sequence)``; TransactionTooLarge at the limit."""
    page = await store.list_prefix(records.op_prefix(txn), limit=limits.TXN_OP_RECORDS_MAX)
    if len(page.records) >= limits.TXN_OP_RECORDS_MAX:
        raise TransactionTooLarge(
            f"transaction {txn} has {limits.TXN_OP_RECORDS_MAX} op records (the limit)"
        )
    if not page.records:
        return 0, 0
    _, last = records.parse_op_name(page.records[-1].path.rsplit("/", 1)[-1])
    return len(page.records), last + 1


async def write_op(
    store: MetadataStore,
    txn: TxnId,
    op: records.TxnOp,
    index_path: Callable[[int], str],
    *,
    next_seq: int,
    fence: OwnershipFence | None = None,
) -> int:
    """Write ``op`` (and its index key) as ``txn``'s op record, guarded by the header
    being OPEN (and by ``fence``); returns the sequence number used."""
    header = records.header_path(txn)
    value = records.encode_op(op)
    for _ in range(limits.TXN_OP_WRITE_ATTEMPTS_MAX):
        seq = next_seq
        ops: list[Op] = [
            Put(records.op_path(txn, seq), value, expected_version=MUST_NOT_EXIST),
            Put(index_path(seq), b"", expected_version=MUST_NOT_EXIST),
            Check(header, expected_version=OPEN_VERSION),
        ]
        try:
            await commit_fenced(store, ops, fence)
            return seq
        except BadVersion as err:
            if err.path == header:
                if await store.get(header) is None:
                    raise TransactionNotFound(f"transaction {txn} not found") from err
                raise TransactionConflict(f"transaction {txn} is no longer open") from err
        # Another participant took this sequence number: list again, take the next one.
        _, next_seq = await op_count(store, txn)
        next_seq = max(next_seq, seq + 1)
    raise MetadataUnavailable(f"transaction {txn}: no free op record sequence number")


async def delete_ops(
    store: MetadataStore,
    txn: TxnId,
    paths: Sequence[str],
    first: Sequence[Op] = (),
    fence: OwnershipFence | None = None,
) -> None:
    """Delete op records and index keys (absent ones are fine), ``first`` ops going in
    the first commit (an aborted record is written with the first deletions), each commit
    guarded by ``fence``."""
    ops: list[Op] = list(first)
    pending = list(paths)
    while True:
        room = limits.METADATA_TXN_OPS_MAX - len(ops) - (fence is not None)
        ops += [Delete(p) for p in pending[:room]]
        pending = pending[room:]
        if ops:
            await commit_fenced(store, ops, fence)
        if not pending:
            return
        ops = []


Work = Callable[[TxnId, TxnState], Awaitable[bool]]
"""Apply ``txn``'s outcome durably; False = not yet (wait for the next ``wake``)."""


class OutcomeWork:
    """One background task running each transaction's outcome work until it succeeds.

    A failing pass is retried after a delay that doubles from
    ``TXN_PARTICIPANT_RETRY_MIN_S`` to ``TXN_PARTICIPANT_RETRY_MAX_S``; work that says
    "not yet" (an append or ack of the transaction still in flight) waits for
    :meth:`wake`. At most one entry per transaction is held, and only for transactions
    the participant registered, so the queue is bounded by its op records.
    """

    def __init__(self, clock: Clock, work: Work, name: str) -> None:
        self._clock = clock
        self._work = work
        self._name = name
        self._pending: dict[TxnId, TxnState] = {}
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.failures = 0
        """Passes of work that raised (metrics)."""

    @property
    def pending(self) -> int:
        return len(self._pending)

    def submit(self, txn: TxnId, state: TxnState) -> None:
        """Run ``txn``'s outcome work (again, if it already ran: work is idempotent)."""
        if self._closed:
            return
        self._pending[txn] = state
        self.wake()

    def wake(self) -> None:
        """Something a waiting work item needed has happened: try again now."""
        if self._closed or not self._pending:
            return
        self._idle.clear()
        self._wakeup.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name=f"txn-outcomes {self._name}")

    async def wait_idle(self) -> None:
        """Return once nothing is left to do (tests and graceful close)."""
        await self._idle.wait()

    async def close(self) -> None:
        """Stop the task, then try what is left once; leftovers stay for recovery."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._pass()
        if not self._pending:
            self._idle.set()

    async def _run(self) -> None:
        delay = limits.TXN_PARTICIPANT_RETRY_MIN_S
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            if await self._pass():
                await self._clock.sleep(delay)
                delay = min(delay * 2, limits.TXN_PARTICIPANT_RETRY_MAX_S)
                self._wakeup.set()
            else:
                delay = limits.TXN_PARTICIPANT_RETRY_MIN_S
            if not self._pending:
                self._idle.set()

    async def _pass(self) -> bool:
        """Try every pending item once; True if one failed (so back off)."""
        failed = False
        for txn, state in list(self._pending.items()):
            try:
                done = await self._work(txn, state)
            except (NotOwner, MetadataUnavailable) as err:
                # The topic moved (its new owner's recovery finishes the work) or etcd is
                # out of reach for a moment (retried): expected under faults, one line.
                self.failures += 1
                failed = True
                log.warning("%s: outcome of %s not applied yet: %s", self._name, txn, err)
                continue
            except Exception:
                self.failures += 1
                failed = True
                log.warning("%s: outcome of %s not applied yet", self._name, txn, exc_info=True)
                continue
            if done and self._pending.get(txn) is state:
                del self._pending[txn]
        return failed
