"""Client-side transactions (PIP-31 commands, served by the PIP-473 coordinator).

Theory of operation
-------------------
Every broker serves every coordinator partition (PIP-473), so the
:class:`TransactionCoordinatorClient` talks to the service URL's broker: on first use of a
connection it sends TC_CLIENT_CONNECT_REQUEST (``scalable=true``); the answer
``TransactionCoordinatorNotFound`` means transactions are disabled on that broker.
NEW_TXN (``txn_ttl_millis``, ``tc_id`` round-robin over the coordinator partitions)
returns the :class:`~anabranch.core.txn_id.TxnId`; END_TXN (COMMIT or ABORT) ends it.
A request whose connection dropped, or that got a retriable answer, is sent again on a
new connection (END_TXN is idempotent on the broker for the same action), at most
``TXN_REQUEST_ATTEMPTS_MAX`` times, within the operation timeout. ADD_PARTITION_TO_TXN and
ADD_SUBSCRIPTION_TO_TXN are never sent: the v5 coordinator learns the participants from
the participants.

A :class:`Transaction` counts the sends and acks made in it (``_begin_op`` when one is
accepted, ``_end_op`` with its outcome). ``commit`` stops accepting new ones, waits for the
pending ones (until the transaction's deadline), and aborts instead of committing when any
of them failed. The client knows the timeout: from the moment NEW_TXN was sent plus the
timeout, the transaction is TIMED_OUT, using it raises ``ExpiredTransactionError`` without
any wire traffic, and ``commit`` raises it too (after a best-effort abort).

States and transitions (anything absent is illegal; see ``TRANSITIONS``)::

    OPEN ──commit──▶ COMMITTING ──▶ COMMITTED
      │                 │ an op failed
      │ abort           ▼
      └────────────▶ ABORTING ──▶ ABORTED
    OPEN/COMMITTING/ABORTING ──deadline──▶ TIMED_OUT
    COMMITTING/ABORTING ──unknown outcome or broker refusal──▶ ERROR ──abort──▶ ABORTING

Example (with an async client)::

    async with client.transaction(timeout=30) as txn:      # commit on exit
        await producer.send(b"out", key="k", txn=txn)
        await stream.acknowledge_cumulative(msg, txn=txn)

    txn = await client.new_transaction(timeout=60)
    await producer.send(b"x", txn=txn)
    await txn.abort()
    assert txn.state is TransactionState.ABORTED
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import itertools
import logging
from collections.abc import Awaitable, Callable, Coroutine
from types import TracebackType
from typing import Any, Final, Protocol, TypeVar

from anabranch.client.backoff import Backoff
from anabranch.client.connection import ClientConnection, ConnectionPool
from anabranch.client.errors import (
    ExpiredTransactionError,
    TooManyRequests,
    TransactionOperationFailed,
    from_server_error,
)
from anabranch.client.txn_spares import SPARE_MAX_AGE_S, SPARES_MAX, Spare, SparePool
from anabranch.core.txn_id import TxnId
from anabranch.core.txn_keys import NEW_CLIENT_EPOCH, validate_key
from anabranch.errors import (
    AnabranchError,
    InvalidArgument,
    InvalidTxnStatus,
    TransactionCoordinatorNotFound,
)
from anabranch.limits import (
    TXN_COORDINATOR_PARTITIONS,
    TXN_TIMEOUT_DEFAULT_MS,
    TXN_TIMEOUT_MAX_MS,
)
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.protocol.frames import Frame

log = logging.getLogger(__name__)
T = pb.BaseCommand
R = TypeVar("R")

TXN_REQUEST_ATTEMPTS_MAX = 64
"""Sends of one coordinator request (NEW_TXN, END_TXN) across dropped connections or
retriable answers. The client's operation timeout is what ends them in practice (the
pause between sends grows to ``TXN_RETRY_BACKOFF_MAX_S``): a broker restart or a metadata
store outage of a few seconds is ridden out — five quick tries (0.75 s) turned those into
failed commits — and a broker that is really gone fails at the operation timeout, as any
other request does."""

TXN_RETRY_BACKOFF_MIN_S = 0.05
TXN_RETRY_BACKOFF_MAX_S = 1.0
"""Pause between those sends (doubling): short, since any broker can answer."""

SENDS_COMPACT_MIN = 256
"""A transaction's list of sends is first pruned of answered ones at this length (then
whenever it doubles)."""

DEFAULT_TIMEOUT_S: Final[float] = TXN_TIMEOUT_DEFAULT_MS / 1000
"""A transaction's timeout when none is given (the broker's default for NEW_TXN)."""


class TransactionState(enum.Enum):
    """Where a transaction is (upstream ``Transaction.State``)."""

    OPEN = "open"
    COMMITTING = "committing"
    ABORTING = "aborting"
    COMMITTED = "committed"
    ABORTED = "aborted"
    ERROR = "error"
    TIMED_OUT = "timed_out"


S = TransactionState
TRANSITIONS: Final[dict[TransactionState, frozenset[TransactionState]]] = {
    S.OPEN: frozenset({S.COMMITTING, S.ABORTING, S.TIMED_OUT}),
    S.COMMITTING: frozenset({S.COMMITTED, S.ABORTING, S.TIMED_OUT, S.ERROR}),
    S.ABORTING: frozenset({S.ABORTED, S.TIMED_OUT, S.ERROR}),
    S.ERROR: frozenset({S.ABORTING}),
    S.COMMITTED: frozenset(),
    S.ABORTED: frozenset(),
    S.TIMED_OUT: frozenset(),
}
"""Legal state changes; a change not listed raises ``InvalidTxnStatus``."""


def timeout_ms(timeout_s: float) -> int:
    """The wire ``txn_ttl_millis`` of a timeout in seconds (clamped like the broker does).

    Example:
        >>> timeout_ms(30), timeout_ms(0.25), timeout_ms(10**6)
        (30000, 250, 3600000)
    """
    if not timeout_s > 0:
        raise InvalidArgument(f"transaction timeout must be > 0 s, not {timeout_s!r}")
    return max(1, min(round(timeout_s * 1000), TXN_TIMEOUT_MAX_MS))


def _check_answer(body: Any) -> None:
    """Raise the typed error a *_RESPONSE carries in its ``error`` field, if any."""
    if body.HasField("error"):
        raise from_server_error(int(body.error), body.message)


class TransactionCoordinatorClient:
    """Sends the coordinator requests of one client (see the module docstring).

    ``partitions``: the coordinator partitions NEW_TXN round-robins over (the broker
    default, 16); a partition the broker refuses with ``TransactionCoordinatorNotFound``
    shrinks the range to the partitions below it.
    """

    def __init__(
        self,
        pool: ConnectionPool,
        *,
        partitions: int = TXN_COORDINATOR_PARTITIONS,
        attempts_max: int = TXN_REQUEST_ATTEMPTS_MAX,
        transaction_key: str | None = None,
        spares: int = SPARES_MAX,
        spare_max_age_s: float = SPARE_MAX_AGE_S,
    ) -> None:
        self._pool = pool
        # The key-fencing PIP: the key and the last epoch the broker gave us travel in
        # every TC_CLIENT_CONNECT (-1 before the first), so a reconnect resumes the epoch
        # and only a new client bumps it. Once fenced, the client stays fenced.
        self.transaction_key = None if transaction_key is None else validate_key(transaction_key)
        self.epoch = NEW_CLIENT_EPOCH
        self._fenced: ExpiredTransactionError | None = None
        self._partitions = max(1, partitions)
        self._next_tc = itertools.count()
        self._attempts_max = attempts_max
        self._handshaken: ClientConnection | None = None
        self._handshake_lock = asyncio.Lock()
        # A keyed connection holds one open transaction at a time (a NEW_TXN aborts the
        # key's previous one), so a keyed client keeps no spares.
        self._spares = SparePool(0 if self.transaction_key is not None else spares, spare_max_age_s)
        self._spare_margin_ms = round(self._spares.max_age_s * 1000)
        self._expiry: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._arriving: dict[int, int] = {}  # timeout (ms) → spares being opened for it
        self._arrival_waiters: list[asyncio.Future[None]] = []
        self.spares_used = 0
        """Transactions handed out from spares (no NEW_TXN round trip waited for)."""
        self.spares_aborted = 0
        """Spares aborted unused (too old, or at close)."""

    async def new_transaction(self, timeout: float = DEFAULT_TIMEOUT_S) -> Transaction:  # noqa: ASYNC109 (the txn's TTL)
        """An OPEN transaction that times out ``timeout`` seconds from now: a spare
        (``txn_spares``) when a fresh one is at hand (its replacement is opened when it
        ends) or on its way, else one NEW_TXN now (and one spare opened in the
        background, while below the bound)."""
        ttl_ms = timeout_ms(timeout)
        loop = asyncio.get_running_loop()
        spares_on = self._spares.max_spares > 0 and ttl_ms + self._spare_margin_ms <= (
            TXN_TIMEOUT_MAX_MS
        )
        while spares_on:
            now = loop.time()
            spare, stale = self._spares.take(ttl_ms, now)
            self._abort_spares(stale)
            if spare is not None:
                self.spares_used += 1
                txn = Transaction(self, spare.txn_id, ttl_ms / 1000, deadline=now + ttl_ms / 1000)
                # Its replacement is opened when it ends: that NEW_TXN then shares the
                # broker's group commit with the END_TXN instead of delaying this
                # transaction's first write.
                txn._before_end = functools.partial(self._refill, ttl_ms)
                return txn
            if not self._arriving.get(ttl_ms):
                break
            # A spare for this timeout is on its way: sooner than a NEW_TXN of our own.
            waiter = loop.create_future()
            self._arrival_waiters.append(waiter)
            await waiter
        try:
            txn_id, started = await self._open(ttl_ms)
        except TooManyRequests:
            # Our spares (of another timeout) may hold the open-transaction slots the
            # broker counts: give them back and ask once more.
            spares = self._spares.clear()
            if not spares:
                raise
            self.spares_aborted += len(spares)
            await asyncio.gather(*(_quietly(self._end_spare(s)) for s in spares))
            txn_id, started = await self._open(ttl_ms)
            return Transaction(self, txn_id, ttl_ms / 1000, deadline=started + ttl_ms / 1000)
        if spares_on:
            self._refill(ttl_ms)
        return Transaction(self, txn_id, ttl_ms / 1000, deadline=started + ttl_ms / 1000)

    async def _open(self, ttl_ms: int) -> tuple[TxnId, float]:
        """NEW_TXN for ``ttl_ms``: ``(its id, when it was sent)``."""
        loop = asyncio.get_running_loop()
        while True:
            tc_id = next(self._next_tc) % self._partitions
            started = loop.time()
            try:
                frame = await self._request(functools.partial(_new_txn, ttl_ms=ttl_ms, tc_id=tc_id))
            except TransactionCoordinatorNotFound:
                if tc_id == 0:
                    raise
                log.info("coordinator partition %d refused: using partitions < %d", tc_id, tc_id)
                self._partitions = tc_id
                continue
            body = frame.command.newTxnResponse
            return TxnId(int(body.txnid_most_bits), int(body.txnid_least_bits)), started

    # --- spares (see txn_spares) -----------------------------------------------------------

    def _refill(self, ttl_ms: int) -> None:
        """Open one more spare for ``ttl_ms`` in the background, if the pool wants one."""
        if not self._spares.want_refill():
            return
        self._spares.refill_started()
        self._arriving[ttl_ms] = self._arriving.get(ttl_ms, 0) + 1
        self._background(self._open_spare(ttl_ms), "txn-spare")

    async def _open_spare(self, ttl_ms: int) -> None:
        spare: Spare | None = None
        try:
            txn_id, started = await self._open(ttl_ms + self._spare_margin_ms)
            spare = Spare(txn_id, ttl_ms, started)
        except AnabranchError as err:
            log.debug("opening a spare transaction failed: %s", err)
        finally:
            now = asyncio.get_running_loop().time()
            left = self._arriving[ttl_ms] - 1
            if left:
                self._arriving[ttl_ms] = left
            else:
                del self._arriving[ttl_ms]
            self._abort_spares(self._spares.refilled(spare, now))
            self._arm_expiry()
            waiters, self._arrival_waiters = self._arrival_waiters, []
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)

    def _arm_expiry(self) -> None:
        """Abort spares once they are too old to hand out (an idle client keeps none)."""
        when = self._spares.next_expiry()
        if when is None or self._expiry is not None:
            return
        loop = asyncio.get_running_loop()
        self._expiry = loop.call_at(max(when, loop.time()), self._on_expiry)

    def _on_expiry(self) -> None:
        self._expiry = None
        self._abort_spares(self._spares.expire(asyncio.get_running_loop().time()))
        self._arm_expiry()

    def _abort_spares(self, spares: list[Spare]) -> None:
        for spare in spares:
            self.spares_aborted += 1
            self._background(self._end_spare(spare), "txn-spare-abort")

    async def _end_spare(self, spare: Spare) -> None:
        await self.end_transaction(spare.txn_id, commit=False)

    def _background(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        # Bounded: one task per spare (opening or aborting), at most SPARES_MAX of each.
        task = asyncio.get_running_loop().create_task(_quietly(coro), name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Abort the spares (waiting for the NEW_TXNs in flight for them first)."""
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        self._spares.closed = True
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
            self._abort_spares(self._spares.drain())
        self._abort_spares(self._spares.drain())
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def end_transaction(self, txn_id: TxnId, commit: bool) -> None:
        """END_TXN COMMIT or ABORT, sent again after a dropped connection."""
        action = pb.COMMIT if commit else pb.ABORT
        await self._request(lambda rid: _end_txn(rid, txn_id, action))

    async def _request(self, build: Callable[[int], pb.BaseCommand]) -> Frame:
        """Send a coordinator request, again on a new connection when it may succeed there."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._pool.operation_timeout_s
        backoff = Backoff(TXN_RETRY_BACKOFF_MIN_S, TXN_RETRY_BACKOFF_MAX_S, self._pool.random)
        attempt = 0
        while True:
            attempt += 1
            try:
                conn = await self._connection()
                request_id = conn.new_request_id()
                frame = await conn.request(build(request_id), request_id)
                _check_answer(_body(frame))
                return frame
            except ExpiredTransactionError as err:
                self._note_fenced(err)
                raise
            except AnabranchError as err:
                pause = backoff.next()
                if (
                    not err.retriable
                    or attempt >= self._attempts_max
                    or loop.time() + pause >= deadline
                ):
                    raise
                log.info("transaction request failed (%s); again in %.2fs", err, pause)
                await asyncio.sleep(pause)

    @property
    def fenced(self) -> ExpiredTransactionError | None:
        """The broker's answer that fenced this client's transaction key (None: not)."""
        return self._fenced

    def _note_fenced(self, err: ExpiredTransactionError) -> None:
        """Remember a fence of our transaction key (not a mere timeout of one txn)."""
        if self.transaction_key is not None and self._fenced is None and "fenced" in str(err):
            self._fenced = err

    async def claim_transaction_key(self) -> int:
        """TC_CLIENT_CONNECT now (not at the first transaction): returns the key's epoch."""
        await self._connection()
        return self.epoch

    async def _connection(self) -> ClientConnection:
        """A service-URL connection on which TC_CLIENT_CONNECT was answered."""
        if self._fenced is not None:
            raise ExpiredTransactionError(str(self._fenced))
        conn = await self._pool.get()
        if conn is self._handshaken:
            return conn
        async with self._handshake_lock:
            if conn is self._handshaken and conn.is_open:
                return conn
            request_id = conn.new_request_id()
            try:
                frame = await conn.request(
                    _tc_connect(request_id, self.transaction_key, self.epoch), request_id
                )
                answer = frame.command.tcClientConnectResponse
                _check_answer(answer)
                if self.transaction_key is not None and answer.HasField("epoch"):
                    self.epoch = int(answer.epoch)
            except ExpiredTransactionError as err:
                self._note_fenced(err)
                raise
            except TransactionCoordinatorNotFound as err:
                raise TransactionCoordinatorNotFound(
                    f"transactions are disabled on this broker ({conn.address[0]}:"
                    f"{conn.address[1]}): {err}"
                ) from err
            self._handshaken = conn
        return conn


async def _quietly(coro: Coroutine[Any, Any, None]) -> None:
    """Run a background spare request; its failure is only logged (the broker's sweep
    ends a spare that could not be aborted)."""
    try:
        await coro
    except AnabranchError as err:
        log.debug("spare transaction request failed: %s", err)


def _body(frame: Frame) -> Any:
    if frame.type == T.TC_CLIENT_CONNECT_RESPONSE:
        return frame.command.tcClientConnectResponse
    if frame.type == T.NEW_TXN_RESPONSE:
        return frame.command.newTxnResponse
    return frame.command.endTxnResponse


def _tc_connect(request_id: int, key: str | None = None, epoch: int = -1) -> pb.BaseCommand:
    body = pb.CommandTcClientConnectRequest(request_id=request_id, tc_id=0, scalable=True)
    if key is not None:
        body.transaction_key = key
        body.epoch = epoch
    return pb.BaseCommand(type=T.TC_CLIENT_CONNECT_REQUEST, tcClientConnectRequest=body)


def _new_txn(request_id: int, *, ttl_ms: int, tc_id: int) -> pb.BaseCommand:
    body = pb.CommandNewTxn(
        request_id=request_id, txn_ttl_millis=ttl_ms, tc_id=tc_id, scalable=True
    )
    return pb.BaseCommand(type=T.NEW_TXN, newTxn=body)


def _end_txn(request_id: int, txn_id: TxnId, action: int) -> pb.BaseCommand:
    body = pb.CommandEndTxn(
        request_id=request_id,
        txnid_most_bits=txn_id.most_bits,
        txnid_least_bits=txn_id.least_bits,
        txn_action=action,  # type: ignore[arg-type]
        scalable=True,
    )
    return pb.BaseCommand(type=T.END_TXN, endTxn=body)


class _Sender(Protocol):
    """A producer holding sends of a transaction in its open batches."""

    def _flush_soon(self) -> None: ...


class Transaction:
    """An async transaction (see the module docstring); made by ``Client.new_transaction``.

    ``id`` is the :class:`TxnId` ``(most_bits, least_bits)``; ``state`` a
    :class:`TransactionState`; ``timeout`` the timeout in seconds. ``async with txn:``
    commits on a normal exit and aborts on an exception.
    """

    def __init__(
        self,
        coordinator: TransactionCoordinatorClient,
        txn_id: TxnId,
        timeout: float,
        *,
        deadline: float,
    ) -> None:
        self._coordinator = coordinator
        self._loop = asyncio.get_running_loop()
        self.id = txn_id
        self.timeout = timeout
        self._deadline = deadline
        self._state = TransactionState.OPEN
        # Only a keyed client's transactions can be fenced (tests pass stand-ins).
        self._unkeyed = getattr(coordinator, "transaction_key", None) is None
        self._inflight = 0
        self._sends: list[asyncio.Future[Any]] = []
        self._senders: set[_Sender] = set()
        """Producers that took sends of this transaction: an ending one sends their open
        batches at once instead of waiting out the batch delay."""
        self._compact_at = SENDS_COMPACT_MIN
        self._idle = asyncio.Event()
        self._idle.set()
        self._failure: BaseException | None = None
        self._on_abort: list[Callable[[], None]] = []
        self._ending: asyncio.Task[None] | None = None
        self._before_end: Callable[[], None] | None = None

    def __repr__(self) -> str:
        return f"Transaction({self.id}, {self.state.name})"

    @property
    def state(self) -> TransactionState:
        """The current state (an OPEN transaction past its deadline reads TIMED_OUT)."""
        if self._state is TransactionState.OPEN and self._expired():
            self._state = TransactionState.TIMED_OUT
        return self._state

    def peek_state(self) -> TransactionState:
        """``state`` without recording the timeout: safe from another thread (sync API)."""
        state = self._state
        if state is TransactionState.OPEN and self._expired():
            return TransactionState.TIMED_OUT
        return state

    def _expired(self) -> bool:
        return self._loop.time() >= self._deadline

    def _move(self, new: TransactionState) -> None:
        if new not in TRANSITIONS[self._state]:
            raise InvalidTxnStatus(f"{self}: cannot go from {self._state.name} to {new.name}")
        self._state = new

    # --- operations in the transaction (used by producers and consumers) ---------------------

    def _check_usable(self) -> None:
        """Raise at once (nothing sent) unless sends and acks may join this transaction."""
        # Once per message: the common case (open, in time, no key that could be fenced)
        # answers from three plain fields.
        if (
            self._state is TransactionState.OPEN
            and self._loop.time() < self._deadline
            and self._unkeyed
        ):
            return
        self._raise_if_unusable()

    def _raise_if_unusable(self) -> None:
        state = self.state
        if state is TransactionState.TIMED_OUT:
            raise ExpiredTransactionError(f"transaction {self.id} timed out after {self.timeout}s")
        fenced = getattr(self._coordinator, "fenced", None)  # tests pass stand-ins
        if state is TransactionState.OPEN and fenced is not None:
            # The key was fenced: the broker aborted this transaction already.
            raise ExpiredTransactionError(
                f"transaction {self.id} was aborted because its transaction key was fenced: "
                f"{fenced}"
            )
        if state is not TransactionState.OPEN:
            raise InvalidTxnStatus(f"transaction {self.id} is {state.name}, not OPEN")

    def _begin_op(self) -> None:
        """A send or ack joins the transaction (raises like ``_check_usable``)."""
        self._check_usable()
        self._inflight += 1
        self._idle.clear()

    def _end_op(self, error: BaseException | None) -> None:
        """That send or ack has its outcome (``error`` None: it succeeded)."""
        if error is not None and self._failure is None:
            self._failure = error
        self._inflight -= 1
        if self._inflight == 0:
            self._idle.set()

    def _track(self, fut: asyncio.Future[Any]) -> None:
        """``_begin_op`` was called for ``fut``'s operation: from now on the transaction
        waits for ``fut`` itself (at commit or abort). Kept in a list rather than with a
        done callback each, which cost a loop callback per message; done ones are
        dropped (noting a failure) whenever the list doubles, so it holds about the
        unanswered ones."""
        self._add_send(fut)
        self._end_op(None)

    def _add_send(self, fut: asyncio.Future[Any]) -> None:
        """From now on the transaction waits for ``fut`` (a send queued without waiting,
        after ``_check_usable``: no ``_begin_op`` is needed when nothing awaited)."""
        self._sends.append(fut)
        if len(self._sends) >= self._compact_at:
            self._compact_sends()

    def _compact_sends(self) -> list[asyncio.Future[Any]]:
        """Drop the answered sends (noting the first failure); returns the others."""
        pending = []
        for fut in self._sends:
            if not fut.done():
                pending.append(fut)
            elif self._failure is None:
                if fut.cancelled():
                    self._failure = asyncio.CancelledError(
                        "an operation in the transaction was cancelled"
                    )
                else:
                    self._failure = fut.exception()
            elif not fut.cancelled():
                fut.exception()  # retrieved: one failure is reported, not each
        self._sends = pending
        self._compact_at = max(SENDS_COMPACT_MIN, 2 * len(pending))
        return pending

    @property
    def unanswered(self) -> int:
        """Sends and acks of the transaction still waiting for the broker's answer."""
        return self._inflight + sum(1 for fut in self._sends if not fut.done())

    async def _wait_sends(self, timeout: float) -> bool:  # noqa: ASYNC109 (a deadline's rest)
        """Wait for the tracked sends (at most ``timeout`` s); False if some are left.

        Waits for the newest unanswered send, then looks again: a producer answers its
        sends in order, so that answer usually finds the others answered too - one
        wake-up per commit instead of a done callback on every send (``asyncio.wait``
        over all of them cost more than the commit's round trip when a commit starts
        with its sends still in flight, as a pipelining producer's does).
        """
        until = self._loop.time() + timeout
        pending = self._compact_sends()
        while pending:
            rest = until - self._loop.time()
            if rest <= 0:
                return False
            _, left = await asyncio.wait((pending[-1],), timeout=rest)
            if left:
                return False
            pending = self._compact_sends()
        return True

    async def _run(self, op: Callable[[], Awaitable[R]]) -> R:
        """Run one operation (an ack awaiting its answer) as part of this transaction."""
        self._begin_op()
        try:
            result = await op()
        except BaseException as err:
            self._end_op(err)
            raise
        self._end_op(None)
        return result

    def _add_abort_hook(self, hook: Callable[[], None]) -> None:
        """``hook`` runs once the transaction aborted (consumers redeliver what it acked)."""
        self._on_abort.append(hook)

    # --- ending ----------------------------------------------------------------------------

    async def commit(self) -> None:
        """Wait for every send and ack of the transaction, then commit it.

        Raises ``TransactionOperationFailed`` (after aborting) when one of them failed,
        ``ExpiredTransactionError`` (after a best-effort abort) when the timeout passed,
        ``InvalidTxnStatus`` when the transaction was already aborted, or the broker's
        typed answer (the state is then ERROR). Committing twice is a no-op.
        """
        state = self.state
        if state is TransactionState.COMMITTED:
            return
        if state is TransactionState.COMMITTING and self._ending is not None:
            await asyncio.shield(self._ending)
            return
        if state is TransactionState.TIMED_OUT:
            await self._abort_expired()
            raise ExpiredTransactionError(f"transaction {self.id} timed out after {self.timeout}s")
        self._move(TransactionState.COMMITTING)
        self._ending = _ending_task(self._commit())
        await asyncio.shield(self._ending)

    def _flush_senders(self) -> None:
        for sender in self._senders:
            sender._flush_soon()

    async def _commit(self) -> None:
        self._flush_senders()
        if not await self._settle_ops():
            self._state = TransactionState.TIMED_OUT
            await self._abort_expired()
            raise ExpiredTransactionError(
                f"transaction {self.id} timed out after {self.timeout}s with "
                f"{self.unanswered} sends/acks unanswered"
            )
        if isinstance(self._failure, ExpiredTransactionError):
            self._state = TransactionState.TIMED_OUT  # the broker said so
            await self._abort_expired()
            raise ExpiredTransactionError(str(self._failure)) from self._failure
        if self._failure is not None:
            cause = self._failure
            self._move(TransactionState.ABORTING)
            await self._end(commit=False)
            raise TransactionOperationFailed(self.id, cause) from cause
        await self._end(commit=True)

    async def abort(self) -> None:
        """Abort: nothing sent in the transaction becomes visible, its acks are undone.

        Waits (up to the operation timeout) for the sends and acks still in flight first.
        Aborting twice, or a timed-out transaction, is a no-op; aborting a committed one
        raises ``InvalidTxnStatus``.
        """
        state = self.state
        if state in (TransactionState.ABORTED, TransactionState.TIMED_OUT):
            if state is TransactionState.TIMED_OUT:
                await self._abort_expired()
            return
        if state in (TransactionState.ABORTING, TransactionState.COMMITTING) and self._ending:
            with contextlib.suppress(AnabranchError):
                await asyncio.shield(self._ending)
            if self._state in (TransactionState.ABORTED, TransactionState.TIMED_OUT):
                return
            state = self._state
        if state is TransactionState.COMMITTED:
            raise InvalidTxnStatus(f"transaction {self.id} is already committed")
        self._move(TransactionState.ABORTING)
        self._ending = _ending_task(self._abort())
        await asyncio.shield(self._ending)

    async def _abort(self) -> None:
        self._flush_senders()
        until = self._loop.time() + self._coordinator._pool.operation_timeout_s
        if not self._idle.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), until - self._loop.time())
        await self._wait_sends(until - self._loop.time())
        await self._end(commit=False)

    async def _settle_ops(self) -> bool:
        """Wait for the pending operations until the deadline; False if it passed first."""
        remaining = self._deadline - self._loop.time()
        if remaining <= 0:
            return self._inflight == 0 and not self._compact_sends() and not self._expired()
        # The usual case (sends awaited before the commit) takes no task and no timer.
        if not self._idle.is_set():
            try:
                await asyncio.wait_for(self._idle.wait(), remaining)
            except TimeoutError:
                return False
        if not await self._wait_sends(self._deadline - self._loop.time()):
            return False
        return not self._expired()

    def _end_hook(self) -> None:
        """An END_TXN is about to go out: run the one-shot hook (a spare's refill)."""
        hook, self._before_end = self._before_end, None
        if hook is not None:
            hook()

    async def _end(self, commit: bool) -> None:
        """END_TXN; the state follows the broker's answer."""
        self._end_hook()
        try:
            await self._coordinator.end_transaction(self.id, commit)
        except ExpiredTransactionError:
            self._state = TransactionState.TIMED_OUT
            self._aborted()
            raise
        except BaseException:
            self._state = TransactionState.ERROR
            raise
        if commit:
            self._move(TransactionState.COMMITTED)
        else:
            self._move(TransactionState.ABORTED)
            self._aborted()

    async def _abort_expired(self) -> None:
        """A timed-out transaction: ask the broker to abort it now (its sweep would too)."""
        self._aborted()
        self._end_hook()
        try:
            await self._coordinator.end_transaction(self.id, commit=False)
        except AnabranchError as err:
            log.debug("abort of timed-out transaction %s: %s", self.id, err)

    def _aborted(self) -> None:
        hooks, self._on_abort = self._on_abort, []
        for hook in hooks:
            try:
                hook()
            except Exception:
                log.exception("%s: an abort hook failed", self)

    # --- context manager -------------------------------------------------------------------

    async def __aenter__(self) -> Transaction:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await finish(self, exc)


def _ending_task(coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
    """Run a commit or abort to its end even when its caller is cancelled (shielded); its
    error then stays with the transaction's state, not in an unretrieved task."""
    task = asyncio.get_running_loop().create_task(coro)
    task.add_done_callback(lambda t: None if t.cancelled() else t.exception())
    return task


async def finish(txn: Transaction, exc: BaseException | None) -> None:
    """End ``txn`` as a ``with`` block does: commit after a normal exit, abort after ``exc``
    (an abort failure is logged, so that ``exc`` is what propagates). A transaction the
    block already ended is left as it is."""
    if exc is None:
        if txn.state is not TransactionState.ABORTED:
            await txn.commit()
        return
    if txn.state in (TransactionState.COMMITTED, TransactionState.ABORTED):
        return
    try:
        await txn.abort()
    except AnabranchError as err:
        log.warning("abort of %s after %r failed: %s", txn, exc, err)


class TransactionScope:
    """``async with client.transaction(timeout=30) as txn:`` (NEW_TXN on entry)."""

    def __init__(
        self, coordinator: Callable[[], TransactionCoordinatorClient], timeout: float
    ) -> None:
        self._coordinator = coordinator
        self._timeout = timeout
        self._txn: Transaction | None = None

    async def __aenter__(self) -> Transaction:
        self._txn = await self._coordinator().new_transaction(self._timeout)
        return self._txn

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._txn is not None
        await finish(self._txn, exc)


__all__ = [
    "Transaction",
    "TransactionCoordinatorClient",
    "TransactionScope",
    "TransactionState",
    "TxnId",
    "timeout_ms",
]
