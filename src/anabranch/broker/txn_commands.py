"""The session's handlers for the transaction-coordinator commands (PIP-31 wire, PIP-473
coordinator).

Every broker serves every coordinator partition: the header CAS in the metadata store is
the only linearization point, so no broker needs to lead a partition to answer
TC_CLIENT_CONNECT, NEW_TXN, ADD_PARTITION_TO_TXN, ADD_SUBSCRIPTION_TO_TXN or END_TXN.
Each answer is the command's own response type; a failure travels in its ``error`` and
``message`` fields (upstream's clients read them there, not from a generic ERROR), and
the connection stays open.

ADD_PARTITION_TO_TXN and ADD_SUBSCRIPTION_TO_TXN only check that the transaction is
open: participants register themselves by writing op records when the write or ack
arrives (PIP-473), so the coordinator never has to enumerate them.

Example (a client's NEW_TXN reaches :func:`handle_new_txn` through its session, which
answers NEW_TXN_RESPONSE on the wire; its commit is END_TXN):
    >>> import asyncio, tempfile
    >>> from pathlib import Path
    >>> from anabranch.aio import Client
    >>> from anabranch.testing.broker import InProcessBroker
    >>> async def demo(client: Client) -> None:
    ...     txn = await client.new_transaction(timeout=30)
    ...     print(txn.id, txn.state.name)
    ...     await txn.commit()
    ...     print(txn.id, txn.state.name)
    >>> async def main() -> None:
    ...     with tempfile.TemporaryDirectory() as tmp:
    ...         async with InProcessBroker(Path(tmp)) as broker:
    ...             async with Client(broker.service_url) as client:
    ...                 await demo(client)
    >>> asyncio.run(main())
    0_0 OPEN
    0_0 COMMITTED
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

from anabranch import limits
from anabranch.broker.error_codes import client_message, server_error
from anabranch.core.names import parse_name
from anabranch.core.txn_keys import NEW_CLIENT_EPOCH
from anabranch.core.txn_state import clamp_timeout
from anabranch.errors import (
    AnabranchError,
    InvalidArgument,
    NonPersistentUnsupported,
    ResourceLimitReached,
    TransactionCoordinatorNotFound,
    TransactionTooLarge,
)
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.transactions.ids import TxnId
from anabranch.transactions.keys import BINDING_ATTR, TransactionKeys
from anabranch.transactions.op_records import check_owner
from anabranch.transactions.records import TxnState

log = logging.getLogger(__name__)
T = pb.BaseCommand

Session = Any
"""``anabranch.broker.session.Session`` (kept loose: the session imports this module)."""


def _coordinator(session: Session) -> Any:
    coordinator = getattr(session.service, "txn_coordinator", None)
    if coordinator is None:
        raise TransactionCoordinatorNotFound("transactions are disabled on this broker")
    return coordinator


async def _check_owner(session: Session, txn: TxnId) -> None:
    """Pulsar's ownership rule (``op_records.check_owner``); an unknown transaction is
    left to the command itself."""
    role = session.service.authorizer.txn_role(getattr(session, "role", None))
    if role is None:
        return
    coordinator = _coordinator(session)
    header = coordinator.open_header(txn) or await coordinator.get(txn)
    if header is not None:
        check_owner(txn, header.owner, role)


@contextlib.contextmanager
def _keyed(session: Session) -> Iterator[tuple[TransactionKeys | None, Any]]:
    """``(keys, binding)`` of a connection holding a transaction key, else ``(None,
    None)``; wraps a command up to its answer, so that a connection fenced meanwhile is
    closed only after that answer went out."""
    keys = getattr(session.service, "txn_keys", None)
    if keys is None or getattr(session, BINDING_ATTR, None) is None:
        yield None, None
        return
    with keys.command(session) as binding:
        yield keys, binding


def on_session_closed(session: Session) -> None:
    """A closed connection no longer holds its transaction key (if any)."""
    keys = getattr(session.service, "txn_keys", None)
    if keys is not None:
        keys.release(session)


def _fail(body: Any, err: BaseException) -> None:
    body.error = server_error(err)
    body.message = client_message(err)  # names no internals
    if not isinstance(err, AnabranchError):
        log.error("transaction command failed unexpectedly", exc_info=err)


async def handle_tc_client_connect_request(
    session: Session, cmd: pb.CommandTcClientConnectRequest
) -> None:
    """TC_CLIENT_CONNECT → its response; an error when transactions are off or the
    partition does not exist.

    With a ``transaction_key`` (the key-fencing PIP) the connection claims the key of its
    role ("" without auth): ``epoch`` -1 or absent bumps the key's epoch (fencing the
    older holder and aborting its transaction), the stored epoch resumes it, an older
    one is NotAllowed ("fenced"); the answer carries the epoch in field 4."""
    body = pb.CommandTcClientConnectResponse(request_id=cmd.request_id)
    try:
        coordinator = _coordinator(session)
        if cmd.tc_id >= coordinator.partitions:
            raise TransactionCoordinatorNotFound(
                f"no transaction coordinator {cmd.tc_id} (there are {coordinator.partitions})"
            )
        keys = getattr(session.service, "txn_keys", None)
        if cmd.HasField("transaction_key") and keys is not None:
            binding = await keys.connect(
                session,
                getattr(session, "role", None) or "",
                cmd.transaction_key,
                cmd.epoch if cmd.HasField("epoch") else NEW_CLIENT_EPOCH,
            )
            body.epoch = binding.epoch
    except Exception as err:
        _fail(body, err)
    session.write(T(type=T.TC_CLIENT_CONNECT_RESPONSE, tcClientConnectResponse=body))


class OpenTxns:
    """The OPEN transactions one connection created (its NEW_TXN cap): forgotten when the
    connection ends them or their deadline passes (the sweep aborts them then).

    Example:
        >>> tally = OpenTxns(cap=1)
        >>> tally.admit(now_ms=0)
        >>> tally.add(TxnId(0, 1), deadline_ms=100)
        >>> try:
        ...     tally.admit(now_ms=50)
        ... except ResourceLimitReached as err:
        ...     print(err)
        too many open transactions on this connection (at most 1)
        >>> tally.admit(now_ms=101)  # past its deadline: no longer counted
    """

    def __init__(self, cap: int | None = None) -> None:
        self._cap = limits.TXN_OPEN_PER_CONNECTION_MAX if cap is None else cap
        self._deadlines: dict[TxnId, int] = {}

    def admit(self, now_ms: int) -> None:
        """ResourceLimitReached when the connection already holds ``cap`` open ones."""
        if len(self._deadlines) >= self._cap:
            self._deadlines = {t: d for t, d in self._deadlines.items() if d >= now_ms}
        if len(self._deadlines) >= self._cap:
            raise ResourceLimitReached("open transactions on this connection", self._cap)

    def add(self, txn: TxnId, deadline_ms: int) -> None:
        self._deadlines[txn] = deadline_ms

    def discard(self, txn: TxnId) -> None:
        self._deadlines.pop(txn, None)


_OPEN_TXNS: weakref.WeakKeyDictionary[Session, OpenTxns] = weakref.WeakKeyDictionary()


def _open_txns(session: Session) -> OpenTxns:
    tally = _OPEN_TXNS.get(session)
    if tally is None:
        tally = _OPEN_TXNS[session] = OpenTxns()
    return tally


async def handle_new_txn(session: Session, cmd: pb.CommandNewTxn) -> None:
    """NEW_TXN → NEW_TXN_RESPONSE with the new TxnID (``txn_ttl_millis`` is the timeout)."""
    body = pb.CommandNewTxnResponse(request_id=cmd.request_id)
    with _keyed(session) as (keys, binding):
        try:
            coordinator = _coordinator(session)
            tally = _open_txns(session)
            now_ms = session.service.clock.wall_ms()
            tally.admit(now_ms)
            timeout = cmd.txn_ttl_millis or limits.TXN_TIMEOUT_DEFAULT_MS
            tc_id = cmd.tc_id if cmd.HasField("tc_id") else None
            owner = getattr(session, "role", None)
            if keys is not None:  # a keyed connection: checked and recorded in its key
                txn = await keys.new_txn(binding, timeout, tc_id=tc_id, owner=owner)
            else:
                txn = await coordinator.new_txn(timeout, tc_id=tc_id, owner=owner)
            tally.add(txn, now_ms + clamp_timeout(timeout))
            body.txnid_most_bits = txn.most_bits
            body.txnid_least_bits = txn.least_bits
        except Exception as err:
            _fail(body, err)
        session.write(T(type=T.NEW_TXN_RESPONSE, newTxnResponse=body))


async def _answer_open_check(session: Session, cmd: Any, body: Any) -> None:
    """Fill ``body`` (an ADD_*_RESPONSE) with the txn id and the open check's outcome."""
    body.request_id = cmd.request_id
    body.txnid_most_bits = cmd.txnid_most_bits
    body.txnid_least_bits = cmd.txnid_least_bits
    try:
        # A keyed connection's cached state only: a fence marks it at once (here, or on
        # another broker through the key watch).
        TransactionKeys.check(getattr(session, BINDING_ATTR, None))
        txn = TxnId(cmd.txnid_most_bits, cmd.txnid_least_bits)
        await _check_owner(session, txn)
        await _coordinator(session).check_open(txn)
    except Exception as err:
        _fail(body, err)


async def handle_add_partition_to_txn(session: Session, cmd: pb.CommandAddPartitionToTxn) -> None:
    """ADD_PARTITION_TO_TXN: a check that the transaction is open (participants register
    themselves). A topic this connection has a producer on joins the transaction now (its
    op record), so that the join overlaps the client's batching of its first sends
    instead of delaying their append; the other topics join at their first write."""
    body = pb.CommandAddPartitionToTxnResponse()
    refused = _too_many(len(cmd.partitions), "partitions") or _non_persistent(cmd.partitions)
    buffers = None if refused is not None else _produced_buffers(session, cmd.partitions)
    if refused is not None:
        body.request_id = cmd.request_id
        body.txnid_most_bits = cmd.txnid_most_bits
        body.txnid_least_bits = cmd.txnid_least_bits
        _fail(body, refused)
    elif buffers is not None:
        body.request_id = cmd.request_id
        body.txnid_most_bits = cmd.txnid_most_bits
        body.txnid_least_bits = cmd.txnid_least_bits
        try:
            TransactionKeys.check(getattr(session, BINDING_ATTR, None))
            txn = TxnId(cmd.txnid_most_bits, cmd.txnid_least_bits)
            await _check_owner(session, txn)
            for buffer in buffers:
                await buffer.prepare(txn)  # judges the header like the open check does
        except Exception as err:
            _fail(body, err)
    else:
        await _answer_open_check(session, cmd, body)
    session.write(T(type=T.ADD_PARTITION_TO_TXN_RESPONSE, addPartitionToTxnResponse=body))


def _produced_buffers(session: Session, topics: Iterable[str]) -> list[Any] | None:
    """The transaction buffers (able to ``prepare``) of ``topics``, when this connection
    has a producer on every one of them (its proof of the produce permission: joining
    pins the topic's readers until the transaction ends); else None."""
    producing = {p.topic.name: p.topic for p in session.producers.values()}
    found = {}
    for name in topics:
        # Clients name a topic as the broker does: parsing (for short forms) only if not.
        topic = producing.get(name)
        if topic is None:
            try:
                topic = producing.get(str(parse_name(name)))
            except AnabranchError:
                return None  # a bad name: the open check answers
        buffer = None if topic is None else topic.transaction_buffer
        if buffer is None or not hasattr(buffer, "prepare"):
            return None
        found[id(buffer)] = buffer  # a name repeated joins once
    return list(found.values()) or None


def _too_many(count: int, what: str) -> TransactionTooLarge | None:
    """A request naming more participants than a transaction may have op records can
    never succeed: refused before any per-name work.

    Example:
        >>> _too_many(limits.TXN_OP_RECORDS_MAX + 1, "partitions") is not None
        True
    """
    if count <= limits.TXN_OP_RECORDS_MAX:
        return None
    return TransactionTooLarge(
        f"{count} {what} in one request (a transaction has at most "
        f"{limits.TXN_OP_RECORDS_MAX} participants)"
    )


def _non_persistent(topics: Iterable[str]) -> NonPersistentUnsupported | None:
    """Refuses a ``non-persistent://`` name in ``topics``: those never join a transaction.

    Example:
        >>> str(_non_persistent(["persistent://a/b/c", "non-persistent://a/b/d"]))
        'transactions (non-persistent://a/b/d): not supported on a non-persistent topic'
    """
    for topic in topics:
        if topic.startswith("non-persistent://"):
            return NonPersistentUnsupported(f"transactions ({topic})")
    return None


async def handle_add_subscription_to_txn(
    session: Session, cmd: pb.CommandAddSubscriptionToTxn
) -> None:
    """ADD_SUBSCRIPTION_TO_TXN: as ADD_PARTITION_TO_TXN."""
    body = pb.CommandAddSubscriptionToTxnResponse()
    refused = _too_many(len(cmd.subscription), "subscriptions") or _non_persistent(
        sub.topic for sub in cmd.subscription
    )
    if refused is not None:
        body.request_id = cmd.request_id
        body.txnid_most_bits = cmd.txnid_most_bits
        body.txnid_least_bits = cmd.txnid_least_bits
        _fail(body, refused)
    else:
        await _answer_open_check(session, cmd, body)
    session.write(T(type=T.ADD_SUBSCRIPTION_TO_TXN_RESPONSE, addSubscriptionToTxnResponse=body))


async def handle_end_txn(session: Session, cmd: pb.CommandEndTxn) -> None:
    """END_TXN → END_TXN_RESPONSE once the header CAS landed (idempotent for the same
    action; InvalidTxnStatus for the other; TransactionNotFound for an unknown id)."""
    body = pb.CommandEndTxnResponse(
        request_id=cmd.request_id,
        txnid_most_bits=cmd.txnid_most_bits,
        txnid_least_bits=cmd.txnid_least_bits,
    )
    with _keyed(session) as (keys, binding):
        try:
            coordinator = _coordinator(session)
            if not cmd.HasField("txn_action") or cmd.txn_action not in (pb.COMMIT, pb.ABORT):
                raise InvalidArgument("END_TXN needs txn_action COMMIT or ABORT")
            wanted = TxnState.COMMITTED if cmd.txn_action == pb.COMMIT else TxnState.ABORTED
            txn = TxnId(cmd.txnid_most_bits, cmd.txnid_least_bits)
            await _check_owner(session, txn)
            if keys is not None:  # the header CAS is guarded by the key record
                await keys.end_txn(binding, txn, wanted)
            else:
                await coordinator.end_txn(txn, wanted)
            _open_txns(session).discard(txn)
        except Exception as err:
            _fail(body, err)
        session.write(T(type=T.END_TXN_RESPONSE, endTxnResponse=body))
