"""Transaction keys with epoch fencing (pip-transaction-key-fencing), over the metadata store.

A client created with ``transaction_key="etl-7"`` sends the key and its last epoch in
TC_CLIENT_CONNECT. The record of a key lives at ``/txn/key/<percent-encoded owner&key>``
(DESIGN.md §3.4) as JSON ``{owner, key, epoch, txn, createdAt, updatedAt}`` (``txn`` is
``"<most>_<least>"`` or null). The rules are :mod:`anabranch.core.txn_keys`; this module
reads, judges and writes, every change a CAS:

* **connect** — a new client (epoch -1) CASes the epoch up (creating the record at 0),
  then aborts the transaction the record named and closes the older connections holding
  the key: this broker's at once (its registry of keyed connections), other brokers' when
  their prefix watch on ``/txn/key/`` sees the newer record. A reconnect with the stored
  epoch keeps it and its transaction (END_TXN retries after a dropped connection work);
  an older epoch is fenced (NotAllowed, "fenced").
* **NEW_TXN** of a keyed connection creates the transaction, then records it in the key
  record by a CAS on the version it read after checking the epoch; a lost CAS re-reads,
  and a connection fenced meanwhile aborts the transaction it just created. The key's
  previous transaction, if still open, is aborted: a key has one open transaction.
* **END_TXN** reads the record, checks the epoch and hands the coordinator
  ``Check(record, version, create revision)`` to put in the header's CAS commit
  (``end_txn(also=...)``), so "the old owner commits while a new owner fences" has exactly
  one winner: the commit lands before the fence's CAS (the fence's abort then finds it
  committed), or the guard fails and the old owner is answered "fenced" (the fence aborts
  the transaction).
* **ADD_PARTITION / ADD_SUBSCRIPTION** check only the connection's cached state (a fenced
  connection is marked at once locally and by the watch elsewhere).

An admin delete leaves the key's last epoch at ``/txn/key-deleted/<owner&key>``; a
re-created key starts above it (and removes it), so a holder fenced by the delete can
never resume a later incarnation of the key with its old epoch.

A fenced connection is closed once its in-flight transaction commands have answered, so
an END_TXN that won its race still gets its reply. Owners are roles ("" while auth is
off); keys must not hold ``&``.

Example:
    >>> import asyncio
    >>> from anabranch.clock import SystemClock
    >>> from anabranch.metadata.memory import MemoryMetadataStore
    >>> from anabranch.transactions.coordinator import TransactionCoordinator
    >>> async def demo() -> list[int]:
    ...     store, clock = MemoryMetadataStore(), SystemClock()
    ...     tc = TransactionCoordinator(store, clock, partitions=1, sweep_interval_s=0)
    ...     keys = TransactionKeys(store, clock, tc)
    ...     first = await keys.connect(object(), "", "etl-7", -1)
    ...     second = await keys.connect(object(), "", "etl-7", -1)   # fences the first
    ...     again = await keys.connect(object(), "", "etl-7", second.epoch)  # a reconnect
    ...     return [first.epoch, second.epoch, again.epoch]
    >>> asyncio.run(demo())
    [0, 1, 1]
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, unquote

from anabranch import limits
from anabranch.clock import Clock
from anabranch.core.txn_keys import (
    NEW_CLIENT_EPOCH,
    ConnectVerdict,
    Holding,
    fenced_message,
    is_current,
    judge_connect,
    key_id,
    split_key_id,
    validate_key,
    validate_owner,
)
from anabranch.errors import (
    BadVersion,
    Closed,
    Compacted,
    InvalidArgument,
    InvalidTxnStatus,
    NotFound,
    TransactionConflict,
    TransactionKeyFenced,
    TransactionNotFound,
)
from anabranch.metadata.api import (
    MUST_NOT_EXIST,
    Check,
    Delete,
    EventKind,
    MetadataStore,
    Op,
    Put,
    Record,
)
from anabranch.transactions import records
from anabranch.transactions.ids import TxnId
from anabranch.transactions.records import TxnState

if TYPE_CHECKING:
    from anabranch.transactions.coordinator import TransactionCoordinator

log = logging.getLogger(__name__)

KEYS = "/txn/key/"
"""Prefix of the transaction-key records."""

DELETED = "/txn/key-deleted/"
"""Prefix of the last epochs of deleted keys (``{"epoch": n}``): a re-created key starts
at n + 1, so no epoch is handed out twice (outside ``KEYS``: not listed, not watched)."""

BINDING_ATTR = "txn_key_binding"
"""The attribute of a broker session holding its :class:`Binding` (None: no key)."""

CAS_ATTEMPTS_MAX = limits.POLICIES_CAS_RETRIES_MAX
"""Read-judge-CAS rounds of one key operation; each lost round means another writer moved
the record on, so a handful always settles (else BadVersion)."""


def key_path(owner: str, key: str) -> str:
    """The record path of ``(owner, key)``.

    Example:
        >>> key_path("", "etl-7"), key_path("alice", "a/b")
        ('/txn/key/%26etl-7', '/txn/key/alice%26a%2Fb')
    """
    return KEYS + quote(key_id(owner, key), safe="")


def deleted_path(owner: str, key: str) -> str:
    """Where a deleted key's last epoch stays."""
    return DELETED + quote(key_id(owner, key), safe="")


def parse_key_path(path: str) -> tuple[str, str]:
    """``(owner, key)`` of a record path (InvalidArgument for anything else)."""
    if not path.startswith(KEYS):
        raise InvalidArgument(f"not a transaction key path: {path!r}")
    return split_key_id(unquote(path[len(KEYS) :]))


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """One transaction key's record."""

    owner: str
    key: str
    epoch: int
    txn: TxnId | None
    created_at: int
    updated_at: int


def encode_key_record(rec: KeyRecord) -> bytes:
    """JSON of a record.

    Example:
        >>> rec = KeyRecord("", "k", 2, TxnId(1, 9), 10, 20)
        >>> encode_key_record(rec)
        b'{"owner":"","key":"k","epoch":2,"txn":"1_9","createdAt":10,"updatedAt":20}'
        >>> decode_key_record(encode_key_record(rec)) == rec
        True
    """
    return json.dumps(
        {
            "owner": rec.owner,
            "key": rec.key,
            "epoch": rec.epoch,
            "txn": None if rec.txn is None else records.txn_key(rec.txn),
            "createdAt": rec.created_at,
            "updatedAt": rec.updated_at,
        },
        separators=(",", ":"),
    ).encode()


def decode_key_record(value: bytes) -> KeyRecord:
    """A record from its JSON (InvalidArgument when it is not one)."""
    try:
        data = json.loads(value)
        txn = data.get("txn")
        rec = KeyRecord(
            owner=str(data["owner"]),
            key=str(data["key"]),
            epoch=int(data["epoch"]),
            txn=None if txn is None else records.parse_txn_key(str(txn)),
            created_at=int(data["createdAt"]),
            updated_at=int(data["updatedAt"]),
        )
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise InvalidArgument(f"not a transaction key record: {err}") from None
    return rec


@dataclass(eq=False)
class Binding:
    """A connection's claim on a key: the epoch it holds (and the record's create
    revision), the store revision of the claim (older watch events are ignored), whether
    it was fenced, and how many of its transaction commands are in flight."""

    owner: str
    key: str
    path: str
    holding: Holding
    revision: int
    session: Any
    fenced: bool = False
    fenced_by: int | None = None
    """The epoch that fenced it (None: the key was deleted)."""
    inflight: int = 0

    @property
    def epoch(self) -> int:
        return self.holding.epoch

    def fenced_error(self, extra: str = "") -> TransactionKeyFenced:
        return TransactionKeyFenced(fenced_message(self.key, self.epoch, self.fenced_by) + extra)


@dataclass
class KeyMetrics:
    """Counters for ``/metrics`` (the gauges are read from :meth:`TransactionKeys.known`)."""

    bumps: int = 0
    fenced_connections: int = 0
    aborted_by_fence: int = 0
    watch_relists: int = 0


@dataclass
class _Known:
    """A record as the watch last saw it (``create_revision`` None: not seen created)."""

    record: KeyRecord
    create_revision: int | None


class TransactionKeys:
    """The transaction keys of one broker's coordinator (see the module docstring)."""

    def __init__(
        self, store: MetadataStore, clock: Clock, coordinator: TransactionCoordinator
    ) -> None:
        self._store = store
        self._clock = clock
        self._coordinator = coordinator
        self._bindings: dict[str, set[Binding]] = {}
        self._known: dict[str, _Known] = {}
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.metrics = KeyMetrics()

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Read every key record, then watch ``/txn/key/`` from that revision."""
        if self._task is not None:
            return
        revision = await self._relist()
        self._task = asyncio.create_task(self._watch_loop(revision + 1), name="txn-keys-watch")

    async def close(self) -> None:
        """Stop watching. Idempotent."""
        self._closed = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # --- connections -------------------------------------------------------------------------

    async def connect(self, session: Any, owner: str, key: str, request_epoch: int) -> Binding:
        """TC_CLIENT_CONNECT with a key: the session's new :class:`Binding` (its ``epoch``
        is the answer), or TransactionKeyFenced / InvalidArgument (nothing written)."""
        validate_key(key)
        validate_owner(owner)
        # A connection claiming again gives up its old claim first: the watch event of
        # its own new epoch must not find (and fence) it under the old one.
        self.release(session)
        path = key_path(owner, key)
        for _ in range(CAS_ATTEMPTS_MAX):
            record = await self._store.get(path)
            stored = None if record is None else decode_key_record(record.value)
            tombstone = None
            if record is None and request_epoch == NEW_CLIENT_EPOCH:
                tombstone = await self._store.get(deleted_path(owner, key))
            floor = 0 if tombstone is None else _decode_floor(tombstone.value) + 1
            verdict, epoch = judge_connect(
                None if stored is None else stored.epoch, request_epoch, floor=floor
            )
            if verdict is ConnectVerdict.FENCED:
                raise TransactionKeyFenced(
                    fenced_message(key, request_epoch, None if stored is None else stored.epoch)
                )
            if verdict is ConnectVerdict.RESUME:
                assert record is not None
                holding = Holding(epoch, record.stat.create_revision)
                revision = record.stat.mod_revision
            else:
                now = self._clock.wall_ms()
                new = KeyRecord(
                    owner, key, epoch, None, now if stored is None else stored.created_at, now
                )
                expected = MUST_NOT_EXIST if record is None else record.stat.version
                try:
                    # A commit, not a put: its revision orders this claim against the
                    # watch events other brokers see.
                    ops: list[Op] = [Put(path, encode_key_record(new), expected)]
                    if tombstone is not None:
                        # The re-created key took over the deleted one's last epoch.
                        ops.append(Delete(tombstone.path, tombstone.stat.version))
                    result = await self._store.commit(ops)
                except BadVersion:
                    continue  # another client took the next epoch first: judge again
                stat = result.results[0]
                assert stat is not None and not isinstance(stat, bool)
                holding = Holding(epoch, stat.create_revision)
                revision = result.revision
                self.metrics.bumps += 1
            binding = self._bind(session, owner, key, path=path, holding=holding, revision=revision)
            self._fence_local(key_id(owner, key), holding, revision)
            if verdict is ConnectVerdict.BUMP and stored is not None and stored.txn is not None:
                await self._abort(stored.txn)
            return binding
        raise BadVersion(path, None, -1)

    def _bind(
        self, session: Any, owner: str, key: str, *, path: str, holding: Holding, revision: int
    ) -> Binding:
        self.release(session)
        binding = Binding(owner, key, path, holding, revision, session)
        with contextlib.suppress(AttributeError):
            setattr(session, BINDING_ATTR, binding)
        self._bindings.setdefault(key_id(owner, key), set()).add(binding)
        return binding

    def release(self, session: Any) -> None:
        """Forget ``session``'s claim (it closed, or claims another key)."""
        binding = getattr(session, BINDING_ATTR, None)
        if binding is None:
            return
        kid = key_id(binding.owner, binding.key)
        held = self._bindings.get(kid)
        if held is not None:
            held.discard(binding)
            if not held:
                del self._bindings[kid]
        with contextlib.suppress(AttributeError):
            setattr(session, BINDING_ATTR, None)

    def connections(self, owner: str, key: str) -> int:
        """This broker's live connections holding ``(owner, key)`` (tests, admin)."""
        return sum(1 for b in self._bindings.get(key_id(owner, key), ()) if not b.fenced)

    @contextlib.contextmanager
    def command(self, session: Any) -> Iterator[Binding | None]:
        """Around one transaction command of ``session`` (its answer written inside):
        yields its binding (None: no key) and closes a connection fenced meanwhile once
        its last command answered."""
        binding: Binding | None = getattr(session, BINDING_ATTR, None)
        if binding is None:
            yield None
            return
        binding.inflight += 1
        try:
            yield binding
        finally:
            binding.inflight -= 1
            if binding.fenced and binding.inflight == 0:
                _close(binding.session)

    @staticmethod
    def check(binding: Binding | None) -> None:
        """The cheap check of ADD_*: TransactionKeyFenced once the connection is fenced."""
        if binding is not None and binding.fenced:
            raise binding.fenced_error()

    def _fence(self, binding: Binding, by_epoch: int | None) -> None:
        if binding.fenced:
            return
        binding.fenced = True
        binding.fenced_by = by_epoch
        self.metrics.fenced_connections += 1
        log.info(
            "transaction key %r: connection at epoch %d fenced (%s)",
            binding.key,
            binding.epoch,
            "key deleted" if by_epoch is None else f"epoch {by_epoch}",
        )
        if binding.inflight == 0:
            _close(binding.session)

    def _fence_local(self, kid: str, current: Holding | None, revision: int) -> None:
        """Fence this broker's connections of ``kid`` claimed before ``revision`` that do
        not hold ``current`` (None: the key is gone)."""
        for binding in list(self._bindings.get(kid, ())):
            if binding.revision < revision and not is_current(current, binding.holding):
                self._fence(binding, None if current is None else current.epoch)

    async def _read_current(self, binding: Binding) -> tuple[Record, KeyRecord]:
        """The key's record if ``binding`` still holds it, else fence it and raise."""
        if binding.fenced:
            raise binding.fenced_error()
        record = await self._store.get(binding.path)
        stored = None if record is None else decode_key_record(record.value)
        holding = (
            None
            if record is None or stored is None
            else Holding(stored.epoch, record.stat.create_revision)
        )
        if record is None or stored is None or not is_current(holding, binding.holding):
            self._fence(binding, None if stored is None else stored.epoch)
            raise binding.fenced_error()
        return record, stored

    # --- transaction commands ----------------------------------------------------------------

    async def new_txn(
        self, binding: Binding, timeout_ms: int, *, tc_id: int | None, owner: str | None
    ) -> TxnId:
        """NEW_TXN of a keyed connection: create the transaction and record it in the key
        record (CAS); the key's previous open transaction is aborted."""
        record, stored = await self._read_current(binding)
        txn = await self._coordinator.new_txn(timeout_ms, tc_id=tc_id, owner=owner)
        try:
            for _ in range(CAS_ATTEMPTS_MAX):
                new = replace(stored, txn=txn, updated_at=self._clock.wall_ms())
                try:
                    await self._store.put(binding.path, encode_key_record(new), record.stat.version)
                except BadVersion:
                    record, stored = await self._read_current(binding)
                    continue
                if stored.txn is not None and stored.txn != txn:
                    # One open transaction per key: the one this NEW_TXN replaces ends.
                    await self._abort(stored.txn, count=False)
                return txn
            raise BadVersion(binding.path, record.stat.version, -1)
        except BaseException:
            # Fenced (or the store failed) before the key named it: nobody would fence
            # this transaction, so it must not stay open.
            await self._abort(txn, count=False)
            raise

    async def end_txn(self, binding: Binding, txn: TxnId, state: TxnState) -> TxnState:
        """END_TXN of a keyed connection: the header CAS commits only while the key
        record is the one read here (see the module docstring)."""
        for _ in range(CAS_ATTEMPTS_MAX):
            try:
                record, _ = await self._read_current(binding)
            except TransactionKeyFenced:
                return await self._end_fenced(binding, txn, state)
            guard = [
                Check(
                    binding.path,
                    expected_version=record.stat.version,
                    expected_create_revision=record.stat.create_revision,
                )
            ]
            try:
                ended = await self._coordinator.end_txn(txn, state, also=guard)
            except BadVersion as err:
                if err.path != binding.path:
                    raise
                continue  # the key record moved: a fence (judged next round) or our NEW_TXN
            except (InvalidTxnStatus, TransactionConflict):
                # Another outcome won: if a fence did it, say so (ExpiredTransactionError).
                await self._read_current(binding)
                raise
            return ended
        raise BadVersion(binding.path, None, -1)

    async def _end_fenced(self, binding: Binding, txn: TxnId, state: TxnState) -> TxnState:
        """A fenced connection's END_TXN: success only when the header already has the
        outcome it asks for (a retry of an END_TXN that won before the fence)."""
        header = await self._coordinator.get(txn)
        if header is not None and header.state is state:
            return state
        if header is not None and header.state is TxnState.ABORTED:
            extra = f"; transaction {txn} was aborted because its transaction key was fenced"
        else:
            extra = f"; transaction {txn} cannot be {state.value} by it"
        raise binding.fenced_error(extra)

    async def _abort(self, txn: TxnId, *, count: bool = True) -> None:
        """Abort ``txn`` if still open (a final or collected one is fine)."""
        try:
            await self._coordinator.end_txn(txn, TxnState.ABORTED)
        except (InvalidTxnStatus, TransactionNotFound):
            return
        except Exception:
            # The fence stands without it: the old owner can no longer commit (its
            # guard fails), and the timeout sweep aborts the transaction in the end.
            log.exception("aborting transaction %s of a fenced key failed", txn)
            return
        if count:
            self.metrics.aborted_by_fence += 1

    # --- admin -------------------------------------------------------------------------------

    async def list_keys(self, limit: int = limits.TXN_KEYS_LIST_MAX) -> list[dict[str, Any]]:
        """Every key record (up to ``limit``), in key order, as :meth:`describe` without
        the transaction's status."""
        out: list[dict[str, Any]] = []
        after: str | None = None
        while len(out) < limit:
            page = await self._store.list_prefix(
                KEYS, limit=min(limits.TXN_SWEEP_BATCH, limit - len(out)), start_after=after
            )
            for record in page.records:
                with contextlib.suppress(InvalidArgument):
                    out.append(self._fields(decode_key_record(record.value)))
            if not page.more or not page.records:
                break
            after = page.records[-1].path
        return out

    async def describe(self, owner: str, key: str) -> dict[str, Any]:
        """A key's epoch, current transaction (and its status), owner and age; NotFound."""
        record = await self._store.get(key_path(owner, validate_key(key)))
        if record is None:
            raise NotFound(f"transaction key {key!r} of owner {owner!r}")
        rec = decode_key_record(record.value)
        fields = self._fields(rec)
        status = None
        if rec.txn is not None:
            header = await self._coordinator.get(rec.txn)
            status = None if header is None else header.state.value
        fields["txnStatus"] = status
        fields["connections"] = self.connections(owner, key)
        return fields

    async def delete(self, owner: str, key: str) -> dict[str, Any]:
        """Delete a key record and abort its open transaction; connections holding it are
        fenced (this broker's at once, others' by their watch). NotFound when absent.
        Returns the record as it was."""
        path = key_path(owner, validate_key(key))
        for _ in range(CAS_ATTEMPTS_MAX):
            record = await self._store.get(path)
            if record is None:
                raise NotFound(f"transaction key {key!r} of owner {owner!r}")
            rec = decode_key_record(record.value)
            try:
                result = await self._store.commit(
                    [
                        Delete(path, record.stat.version),
                        Put(deleted_path(owner, key), _encode_floor(rec.epoch)),
                    ]
                )
            except BadVersion:
                continue
            self._fence_local(key_id(owner, key), None, result.revision)
            if rec.txn is not None:
                await self._abort(rec.txn)
            return self._fields(rec)
        raise BadVersion(path, None, -1)

    def _fields(self, rec: KeyRecord) -> dict[str, Any]:
        return {
            "owner": rec.owner,
            "transactionKey": rec.key,
            "epoch": rec.epoch,
            "txnId": None if rec.txn is None else str(rec.txn),
            "createdAt": rec.created_at,
            "updatedAt": rec.updated_at,
            "ageMs": max(0, self._clock.wall_ms() - rec.created_at),
        }

    # --- the watch (other brokers' fences, the metrics' view) --------------------------------

    def known(self) -> list[KeyRecord]:
        """Every key record as this broker's watch last saw it (for ``/metrics``)."""
        return [k.record for k in self._known.values()]

    async def _relist(self) -> int:
        """Read every record; returns the revision taken before reading."""
        revision = await self._store.current_revision()
        seen: dict[str, _Known] = {}
        after: str | None = None
        while True:
            page = await self._store.list_prefix(
                KEYS, limit=limits.TXN_SWEEP_BATCH, start_after=after
            )
            for record in page.records:
                self._apply_put(
                    record.path,
                    record.value,
                    version=record.stat.version,
                    revision=record.stat.mod_revision,
                    create_revision=record.stat.create_revision,
                    into=seen,
                )
            if not page.more or not page.records:
                break
            after = page.records[-1].path
        for path in set(self._known) - set(seen):
            self._apply_delete(path, revision)
        self._known = seen
        return revision

    async def _watch_loop(self, start: int) -> None:
        while not self._closed:
            try:
                watch = self._store.watch(KEYS, prefix=True, start_revision=start)
                try:
                    async for event in watch:
                        start = event.revision + 1
                        if event.kind is EventKind.PUT:
                            create = event.revision if event.version == 1 else None
                            self._apply_put(
                                event.path,
                                event.value,
                                version=event.version,
                                revision=event.revision,
                                create_revision=create,
                                into=self._known,
                            )
                        else:
                            self._apply_delete(event.path, event.revision)
                finally:
                    await watch.close()
                return  # the store ended the watch: it is closing
            except (Closed, asyncio.CancelledError):
                return
            except Compacted:
                pass
            except Exception:
                log.exception("transaction key watch failed; re-listing")
                await self._clock.sleep(limits.TXN_PARTICIPANT_RETRY_MIN_S)
            try:
                start = await self._relist() + 1
                self.metrics.watch_relists += 1
            except Closed:
                return
            except Exception:
                log.exception("re-reading transaction keys failed; retrying")
                await self._clock.sleep(limits.TXN_PARTICIPANT_RETRY_MAX_S)

    def _apply_put(
        self,
        path: str,
        value: bytes,
        *,
        version: int,
        revision: int,
        create_revision: int | None,
        into: dict[str, _Known],
    ) -> None:
        try:
            rec = decode_key_record(value)
        except InvalidArgument:
            return
        previous = self._known.get(path)
        if create_revision is None and previous is not None and version > 1:
            create_revision = previous.create_revision
        into[path] = _Known(rec, create_revision)
        kid = key_id(rec.owner, rec.key)
        for binding in list(self._bindings.get(kid, ())):
            if binding.revision >= revision:
                continue  # an event from before this connection's claim
            if create_revision is None:
                stale = binding.epoch < rec.epoch
            else:
                stale = not is_current(Holding(rec.epoch, create_revision), binding.holding)
            if stale:
                self._fence(binding, rec.epoch)

    def _apply_delete(self, path: str, revision: int) -> None:
        self._known.pop(path, None)
        with contextlib.suppress(InvalidArgument):
            owner, key = parse_key_path(path)
            self._fence_local(key_id(owner, key), None, revision)


def _encode_floor(epoch: int) -> bytes:
    return json.dumps({"epoch": epoch}, separators=(",", ":")).encode()


def _decode_floor(value: bytes) -> int:
    try:
        return int(json.loads(value)["epoch"])
    except (ValueError, KeyError, TypeError) as err:
        raise InvalidArgument(f"not a deleted transaction key record: {err}") from None


def _close(session: Any) -> None:
    close = getattr(session, "close", None)
    if callable(close):
        try:
            close()
        except Exception:
            log.exception("closing a fenced connection failed")


__all__ = [
    "BINDING_ATTR",
    "KEYS",
    "Binding",
    "KeyRecord",
    "TransactionKeys",
    "decode_key_record",
    "encode_key_record",
    "key_path",
    "parse_key_path",
]
