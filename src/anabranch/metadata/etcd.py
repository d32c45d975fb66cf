"""The etcd metadata backend (cluster mode): :class:`EtcdMetadataStore` over aetcd's gRPC stubs.

Theory of operation. Every key is stored as ``namespace + path`` (UTF-8), so several stores
can share one etcd. The :class:`~anabranch.metadata.api.Stat` of a key is etcd's own
``KeyValue`` facts (version, create/mod revision, lease), and store revisions are etcd
revisions. aetcd's high-level API lacks range limits, header revisions, lease keepalive and
watch resume (ecosystem.md §2.1), so this module talks to the raw stubs
(``kvstub.Range/Txn/Compact``, ``leasestub``, ``WatchStub``) and aetcd only owns the channel.

* Writes: ``put``, ``delete`` and ``commit`` are one etcd ``Txn`` each, or share one with
  other callers' concurrent commits on other keys (``etcd_coalesce.py``). Conditions become
  compares (``version == n``; ``version == 0`` for must-not-exist; ``create_revision == r``
  for a fencing Check). The failure branch reads every compared key in the same Txn, so a
  failed condition is reported as ``BadVersion(path, expected, actual)`` with the actual
  facts at that revision. Puts ask for ``prev_kv`` to compute the new Stat exactly.
* Listings: ``kvstub.Range`` with ``limit`` gives ``more``; children skip over whole
  subtrees by seeking past ``name + "0"`` ("0" is the byte after "/").
* Sequential keys: a hidden per-prefix counter (``namespace + "\\x00seq" + prefix``, below
  every user key) is advanced by CAS in the same Txn that creates the key, retried on
  conflict, so names strictly increase.
* Sessions are leases. A background task refreshes every TTL/3 and declares the session
  lost when etcd reports TTL <= 0 or when it could not refresh for a whole TTL.
* Watches are one gRPC stream each. They remember the revision after the last event
  received and, when the connection drops (client side or an etcd restart), re-open from
  there with backoff, so no event is lost or repeated. A compacted start raises
  ``Compacted``.
* Errors: gRPC failures become :class:`MetadataUnavailable` (retriable), "lease not
  found" becomes :class:`SessionExpired`, and nothing from grpc/aetcd escapes raw.

Example (against a running etcd, e.g. ``endpoint="127.0.0.1:2379"``)::

    async def demo(endpoint: str) -> None:
        store = await EtcdMetadataStore.open(endpoint, namespace="/cluster-a")
        stat = await store.put("/topics/t", b"{}", expected_version=0)
        await store.put("/topics/t", b"{...}", expected_version=stat.version)
        await store.close()
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import weakref
from collections.abc import AsyncIterator, Sequence
from typing import Any

import aetcd
import grpc
from aetcd import rpc

from anabranch import limits
from anabranch.errors import (
    AnabranchError,
    BadVersion,
    Closed,
    Compacted,
    InvalidArgument,
    MetadataError,
    MetadataUnavailable,
    SessionExpired,
    ValueTooLarge,
)
from anabranch.metadata.api import (
    Check,
    CommitResult,
    Delete,
    EventKind,
    Op,
    Page,
    Put,
    Record,
    Session,
    Stat,
    WatchEvent,
    prefix_end,
    sequential_name,
    validate_expected_version,
    validate_limit,
    validate_ops,
    validate_path,
    validate_prefix,
    validate_ttl,
    validate_value,
)
from anabranch.metadata.etcd_channel import EtcdChannel, EtcdOptions
from anabranch.metadata.etcd_coalesce import PendingCommit, holds, take_batch
from anabranch.supervisor import report_death

_SEQUENCE_MARK = b"\x00seq"
"""Counter keys live at ``namespace + _SEQUENCE_MARK + prefix``: "\\x00" sorts below "/",
so no listing or watch of user paths ever sees them."""

_SEQUENCE_FIRST = 0
"""The first number create_sequential hands out under a prefix (ZooKeeper starts at 0)."""

_CHANNEL_OPTIONS: dict[str, Any] = {
    "grpc.max_receive_message_length": limits.ETCD_RESPONSE_BYTES_MAX,
    "grpc.initial_reconnect_backoff_ms": int(limits.ETCD_RECONNECT_BACKOFF_MIN_S * 1000),
    "grpc.min_reconnect_backoff_ms": int(limits.ETCD_RECONNECT_BACKOFF_MIN_S * 1000),
    "grpc.max_reconnect_backoff_ms": int(limits.ETCD_RECONNECT_BACKOFF_MAX_S * 1000),
}

_RPC_ERRORS = (grpc.RpcError, grpc.aio.BaseError, aetcd.ClientError)
"""What grpc and aetcd raise; always translated by ``_translate`` before leaving us."""


_AUTH_CODES = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
_AUTH_MESSAGES = ("user name is empty", "authentication failed", "invalid auth token")


class EtcdMetadataStore:
    """:class:`~anabranch.metadata.api.MetadataStore` over a real etcd (3.4+).

    Example::

        async def demo() -> None:
            store = await EtcdMetadataStore.open("127.0.0.1:2379", namespace="/t1")
            session = await store.open_session(5.0)
            await store.put("/brokers/b1", b"", session=session)  # gone when it expires
            await store.close()
    """

    def __init__(
        self, client: EtcdChannel, endpoint: str, namespace: str, *, coalesce: bool = True
    ) -> None:
        self._client = client
        self._coalesce = coalesce
        self._queue: collections.deque[PendingCommit] = collections.deque()
        self._out: dict[int, float] = {}
        """Txns outstanding: serial -> loop time sent."""
        self._out_serial = 0
        self._wake: asyncio.TimerHandle | None = None
        self._room = asyncio.Semaphore(limits.METADATA_WRITE_QUEUE_MAX)
        self._senders: set[asyncio.Task[None]] = set()
        self.commits_sent = 0
        """Commits sent to etcd (metrics; with ``txns_sent``: how much coalescing saves)."""
        self.txns_sent = 0
        """Txn requests those commits took."""
        self._endpoint = endpoint
        self._ns = namespace.encode("utf-8")
        self._watch_stub = client.watchstub
        self._closed = False
        self._revision_seen = 0
        self._sessions: dict[int, EtcdSession] = {}
        self._revocations: set[asyncio.Task[None]] = set()
        self._watches: weakref.WeakSet[EtcdWatch] = weakref.WeakSet()

    @classmethod
    async def open(
        cls,
        endpoints: str,
        *,
        namespace: str = "",
        options: EtcdOptions | None = None,
        coalesce: bool = True,
    ) -> EtcdMetadataStore:
        """Connect to comma-separated ``host:port`` endpoints (``http://`` prefixes are
        accepted) and check that etcd answers; MetadataUnavailable when it does not.

        ``options`` add TLS and user/password (:class:`EtcdOptions`); with several
        endpoints a call fails over to the next member when one goes away. ``coalesce``
        off sends every commit in a Txn of its own (the benchmark's baseline).
        """
        if namespace:
            validate_path(namespace)
        options = options or EtcdOptions()
        endpoint = endpoints.split(",", maxsplit=1)[0].strip().removeprefix("http://")
        try:
            client = await EtcdChannel.open(endpoints, options, _CHANNEL_OPTIONS)
        except _RPC_ERRORS as err:
            raise MetadataUnavailable(f"etcd at {endpoint}: {err}") from err
        try:
            store = cls(client, endpoint, namespace, coalesce=coalesce)
            await store.current_revision()
        except BaseException as err:
            await client.close()
            if isinstance(err, _RPC_ERRORS):
                raise MetadataUnavailable(f"etcd at {endpoint}: {err}") from err
            raise
        return store

    # --- plumbing ------------------------------------------------------------------------

    def _key(self, path: str) -> bytes:
        return self._ns + path.encode("utf-8")

    def _path(self, key: bytes) -> str:
        return key[len(self._ns) :].decode("utf-8")

    def _check_open(self) -> None:
        if self._closed:
            raise Closed("etcd metadata store is closed")

    def _observe(self, response: Any) -> None:
        self._revision_seen = max(self._revision_seen, response.header.revision)

    def _translate(self, err: BaseException, lease_ids: Sequence[int] = ()) -> AnabranchError:
        """The anabranch error for a grpc/aetcd failure (never the raw type)."""
        if self._closed:
            return Closed("etcd metadata store is closed")
        code = err.code() if isinstance(err, grpc.aio.AioRpcError) else None
        details = (err.details() if isinstance(err, grpc.aio.AioRpcError) else None) or str(err)
        if "lease not found" in details and lease_ids:
            return SessionExpired(lease_ids[0])
        if code in _AUTH_CODES or any(m in details for m in _AUTH_MESSAGES):
            # etcd reports some credential problems as INVALID_ARGUMENT: not the caller's
            # request, but the broker's settings.
            return MetadataUnavailable(
                f"etcd at {self._endpoint} refused our credentials: {details}"
            )
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return InvalidArgument(f"etcd rejected the request: {details}")
        return MetadataUnavailable(f"etcd at {self._endpoint}: {details}")

    async def _rpc(
        self, stub: str, method: str, request: Any, lease_ids: Sequence[int] = ()
    ) -> Any:
        """One unary call with a deadline; errors translated, header revision observed."""
        self._check_open()
        call = getattr(getattr(self._client, stub), method)
        try:
            try:
                response = await call(
                    request, timeout=limits.ETCD_REQUEST_TIMEOUT_S, metadata=self._client.metadata
                )
            except grpc.aio.AioRpcError as err:
                # etcd's simple auth tokens expire when idle: log in again, retry once.
                if (
                    err.code() != grpc.StatusCode.UNAUTHENTICATED
                    or not self._client.options.username
                ):
                    raise
                await self._client.reauthenticate()
                response = await call(
                    request, timeout=limits.ETCD_REQUEST_TIMEOUT_S, metadata=self._client.metadata
                )
        except _RPC_ERRORS as err:
            raise self._translate(err, lease_ids) from err
        if hasattr(response, "header"):
            self._observe(response)
        return response

    def _record(self, kv: Any) -> Record:
        return Record(self._path(kv.key), bytes(kv.value), _stat(kv))

    async def _range(self, key: bytes, range_end: bytes = b"", **fields: Any) -> Any:
        request = rpc.RangeRequest(key=key, range_end=range_end, **fields)
        return await self._rpc("kvstub", "Range", request)

    async def _txn(self, compare: list[Any], success: list[Any], failure: list[Any]) -> Any:
        request, _ = _txn_request(compare, success, failure)
        return await self._send_txn(request, success)

    async def _send_txn(self, request: Any, success: list[Any]) -> Any:
        lease_ids = [op.request_put.lease for op in success if op.request_put.lease]
        return await self._rpc("kvstub", "Txn", request, lease_ids)

    # --- reads ---------------------------------------------------------------------------

    async def get(self, path: str) -> Record | None:
        """The key's value and stat, or None when absent."""
        validate_path(path)
        response = await self._range(self._key(path))
        return self._record(response.kvs[0]) if response.kvs else None

    async def current_revision(self) -> int:
        """The latest committed etcd revision (shared by every namespace on that etcd)."""
        response = await self._range(self._ns + b"/", count_only=True)
        revision: int = response.header.revision
        return revision

    async def list_range(self, start: str, end: str, *, limit: int | None = None) -> Page:
        """Keys in ``[start, end)`` in byte order; page on with ``last key + "\\x00"``."""
        if not isinstance(start, str) or not isinstance(end, str):
            raise InvalidArgument(f"range bounds must be strings: {start!r}, {end!r}")
        # Every user path starts with "/", so clipping to ["/", "0") loses nothing and keeps
        # the range inside this namespace (away from the sequence counters).
        start, end = max(start, "/"), min(end, prefix_end("/"))
        return await self._page(start, end, validate_limit(limit))

    async def list_prefix(
        self, prefix: str, *, limit: int | None = None, start_after: str | None = None
    ) -> Page:
        """Keys starting with ``prefix`` in byte order, after ``start_after`` if given."""
        validate_prefix(prefix)
        start = prefix
        if start_after is not None:
            if not isinstance(start_after, str):
                raise InvalidArgument(f"start_after must be a string: {start_after!r}")
            start = max(prefix, start_after + "\x00")
        return await self._page(start, prefix_end(prefix), validate_limit(limit))

    async def _page(self, start: str, end: str, limit: int) -> Page:
        if start >= end:
            # etcd reads an empty range_end as "this one key"; never send one.
            return Page([], more=False, revision=await self.current_revision())
        response = await self._range(self._key(start), self._key(end), limit=limit)
        records = [self._record(kv) for kv in response.kvs]
        return Page(records, more=bool(response.more), revision=response.header.revision)

    async def list_children(self, path: str) -> list[str]:
        """Sorted names of the direct children of ``path``."""
        validate_path(path)
        base = "/" if path == "/" else path + "/"
        end = self._key(prefix_end(base))
        cursor = self._key(base)
        # A set: "b!" sorts between "b" and "b/...", so a child's name can recur after a
        # sibling's.
        names: set[str] = set()
        while cursor < end:
            response = await self._range(
                cursor, end, limit=limits.METADATA_LIST_LIMIT_MAX, keys_only=True
            )
            for kv in response.kvs:
                name, slash, _ = self._path(kv.key)[len(base) :].partition("/")
                names.add(name)
                if slash:
                    # A deeper key: skip the rest of this child's subtree in one seek.
                    cursor = self._key(base + name + "0")
                    break
            else:
                if not response.more:
                    break
                cursor = response.kvs[-1].key + b"\x00"
        return sorted(names)

    # --- writes --------------------------------------------------------------------------

    async def put(
        self,
        path: str,
        value: bytes,
        expected_version: int | None = None,
        *,
        session: Session | None = None,
    ) -> Stat:
        """Write ``value`` (ephemeral with ``session``); BadVersion on a version mismatch."""
        session_id = self._live_session_id(session)
        result = await self.commit([Put(path, value, expected_version, session_id)])
        stat = result.results[0]
        assert isinstance(stat, Stat)
        return stat

    async def delete(self, path: str, expected_version: int | None = None) -> bool:
        """Delete the key; False when it was absent and no version was expected."""
        result = await self.commit([Delete(path, expected_version)])
        return bool(result.results[0])

    async def commit(self, ops: Sequence[Op]) -> CommitResult:
        """Apply every op in one etcd Txn, or none (BadVersion names the failed path)."""
        ops = validate_ops(ops)
        self._check_open()
        pending = self._pending(ops)
        if not self._coalesce:
            return await self._commit_alone(pending)
        if not self._queue and self._may_send():
            # Nothing waits and there is room: go now, from this task (no hand-off).
            serial = self._sending()
            try:
                return await self._commit_alone(pending)
            finally:
                del self._out[serial]
                if not self._closed:
                    self._pump()
        async with self._room:  # callers past METADATA_WRITE_QUEUE_MAX wait here
            future: asyncio.Future[CommitResult] = asyncio.get_running_loop().create_future()
            pending.future = future
            self._queue.append(pending)
            self._pump()
            return await future

    def _pending(self, ops: list[Op]) -> PendingCommit:
        compare: list[Any] = []
        compared: dict[str, bytes] = {}
        success: list[Any] = []
        keys: set[bytes] = set()
        for op in ops:
            key = self._key(op.path)
            keys.add(key)
            compare.extend(_compares(op, key))
            if op.expected_version is not None or getattr(op, "expected_create_revision", None):
                compared[op.path] = key
            if isinstance(op, Put):
                success.append(_put_op(key, op.value, op.session_id or 0))
            elif isinstance(op, Delete):
                success.append(rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key)))
        if len(compare) > limits.METADATA_TXN_OPS_MAX:
            raise InvalidArgument(
                f"{len(compare)} conditions in one commit, over {limits.METADATA_TXN_OPS_MAX}"
            )
        failure = [_range_op(key) for key in compared.values()]
        request, size = _txn_request(compare, success, failure)
        return PendingCommit(ops, compare, success, failure, frozenset(keys), size, request)

    async def _commit_alone(self, pending: PendingCommit) -> CommitResult:
        self.commits_sent += 1
        self.txns_sent += 1
        response = await self._send_txn(pending.request, pending.success)
        if not response.succeeded:
            raise self._bad_version(pending.ops, response)
        revision = response.header.revision
        return CommitResult(revision, self._results(pending.ops, response.responses, revision))

    def _may_send(self) -> bool:
        """Fewer than ETCD_COMMITS_IN_FLIGHT_MAX Txns out, not counting those out for
        longer than ETCD_COMMIT_SLOW_S: a Txn stuck on a cut link (answered only at its
        deadline) must not hold back commits a healed link would carry at once."""
        if len(self._out) < limits.ETCD_COMMITS_IN_FLIGHT_MAX:
            return True
        young = asyncio.get_running_loop().time() - limits.ETCD_COMMIT_SLOW_S
        return sum(sent > young for sent in self._out.values()) < (
            limits.ETCD_COMMITS_IN_FLIGHT_MAX
        )

    def _sending(self) -> int:
        self._out_serial += 1
        self._out[self._out_serial] = asyncio.get_running_loop().time()
        return self._out_serial

    def _pump(self) -> None:
        """Send what waits while :meth:`_may_send`; if some still waits, look again once
        the Txns out may have turned slow."""
        while self._queue and self._may_send():
            batch = take_batch(
                self._queue,
                ops_max=limits.METADATA_TXN_OPS_MAX,
                bytes_max=limits.ETCD_REQUEST_BYTES_MAX,
            )
            if not batch:
                return
            task = asyncio.create_task(self._send(batch, self._sending()), name="etcd-commit")
            self._senders.add(task)
            task.add_done_callback(self._senders.discard)
        if self._queue and self._wake is None:
            self._wake = asyncio.get_running_loop().call_later(
                limits.ETCD_COMMIT_SLOW_S, self._woken
            )

    def _woken(self) -> None:
        self._wake = None
        if not self._closed:
            self._pump()

    async def _send(self, batch: list[PendingCommit], serial: int) -> None:
        try:
            await self._send_batch(batch)
        except BaseException as err:
            failure = err if isinstance(err, Exception) else Closed("etcd commit cancelled")
            for pending in batch:
                _settle(pending, error=failure)
            if not isinstance(err, Exception):
                raise
        finally:
            del self._out[serial]
            if self._closed:
                self._fail_queue()
            else:
                self._pump()

    async def _send_batch(self, batch: list[PendingCommit]) -> None:
        if len(batch) == 1:
            try:
                _settle(batch[0], result=await self._commit_alone(batch[0]))
            except AnabranchError as err:
                _settle(batch[0], error=err)
            return
        self.commits_sent += len(batch)
        self.txns_sent += 1
        try:
            response = await self._txn(
                [c for pending in batch for c in pending.compare],
                [op for pending in batch for op in pending.success],
                [op for pending in batch for op in pending.failure],
            )
        except (SessionExpired, InvalidArgument, ValueTooLarge):
            # etcd refused the request, so nothing of it was applied; one commit is at
            # fault (an expired session's lease, say): each goes alone for its own answer.
            await asyncio.gather(*(self._send_batch([p]) for p in batch if p.waiting))
            return
        except AnabranchError as err:
            for pending in batch:
                _settle(pending, error=err)
            return
        revision = response.header.revision
        if response.succeeded:
            replies = list(response.responses)
            at = 0
            for pending in batch:
                mine = replies[at : at + len(pending.success)]
                at += len(pending.success)
                results = self._results(pending.ops, mine, revision)
                _settle(pending, result=CommitResult(revision, results))
            return
        # Nothing applied. Judge each commit on the facts the failure branch read; those
        # whose conditions hold go again, first in line.
        facts = self._facts(response)
        again: list[PendingCommit] = []
        for pending in batch:
            broken = holds(pending.ops, facts)
            if broken is None:
                again.append(pending)
            else:
                _settle(pending, error=BadVersion(*broken))
        self._queue.extendleft(reversed(again))

    def _fail_queue(self) -> None:
        while self._queue:
            _settle(self._queue.popleft(), error=Closed("etcd metadata store is closed"))

    def _facts(self, response: Any) -> dict[str, tuple[int, int]]:
        """(version, create revision) of every key a failed Txn's failure branch read."""
        facts: dict[str, tuple[int, int]] = {}
        for reply in response.responses:
            for kv in reply.response_range.kvs:
                facts[self._path(kv.key)] = (kv.version, kv.create_revision)
        return facts

    def _bad_version(self, ops: Sequence[Op], response: Any) -> BadVersion:
        """The first op whose condition failed, with the facts the Txn read."""
        broken = holds(ops, self._facts(response))
        if broken is None:
            # Unreachable: the failure branch read every compared key in the same revision.
            raise MetadataError(f"etcd Txn failed but every condition holds: {ops!r}")
        return BadVersion(*broken)

    def _results(
        self, ops: Sequence[Op], replies: Sequence[Any], revision: int
    ) -> list[Stat | bool | None]:
        answers = iter(replies)
        results: list[Stat | bool | None] = []
        for op in ops:
            if isinstance(op, Put):
                prev = next(answers).response_put.prev_kv
                existed = bool(prev.key)
                results.append(
                    Stat(
                        version=prev.version + 1 if existed else 1,
                        create_revision=prev.create_revision if existed else revision,
                        mod_revision=revision,
                        session_id=op.session_id or None,
                    )
                )
            elif isinstance(op, Delete):
                results.append(next(answers).response_delete_range.deleted > 0)
            else:
                results.append(None)
        return results

    async def create_sequential(
        self, prefix: str, value: bytes, *, session: Session | None = None
    ) -> str:
        """Create ``prefix`` + a zero-padded number, strictly increasing under ``prefix``."""
        validate_path(sequential_name(prefix, _SEQUENCE_FIRST))
        value = validate_value(value)
        lease = self._live_session_id(session) or 0
        counter_key = self._ns + _SEQUENCE_MARK + prefix.encode("utf-8")
        response = await self._range(counter_key)
        counter_kv = response.kvs[0] if response.kvs else None
        number = _SEQUENCE_FIRST
        for _ in range(limits.ETCD_SEQUENTIAL_ATTEMPTS_MAX):
            counter_version = counter_kv.version if counter_kv is not None else 0
            if counter_kv is not None:
                number = max(number, int(counter_kv.value))
            name = sequential_name(prefix, number)
            key = self._key(name)
            response = await self._txn(
                [_compare_version(counter_key, counter_version), _compare_version(key, 0)],
                [_put_op(counter_key, str(number + 1).encode(), 0), _put_op(key, value, lease)],
                [_range_op(counter_key, keys_only=False), _range_op(key)],
            )
            if response.succeeded:
                return name
            counter_kvs = response.responses[0].response_range.kvs
            counter_kv = counter_kvs[0] if counter_kvs else None
            if response.responses[1].response_range.kvs:
                number += 1  # someone wrote this name directly; never overwrite it
        raise MetadataUnavailable(
            f"create_sequential({prefix!r}) lost {limits.ETCD_SEQUENTIAL_ATTEMPTS_MAX} CAS races"
        )

    async def compact(self, revision: int) -> None:
        """Drop history before ``revision``; watches from older revisions get Compacted.

        Compacting to a revision at or below an earlier compaction is a no-op.
        """
        self._check_open()
        if not isinstance(revision, int) or revision < 0:
            raise InvalidArgument(f"compact revision must be >= 0: {revision!r}")
        if revision == 0:
            return  # nothing precedes revision 0 (and etcd rejects it)
        request = rpc.CompactionRequest(revision=revision, physical=True)
        try:
            await self._client.kvstub.Compact(
                request, timeout=limits.ETCD_REQUEST_TIMEOUT_S, metadata=self._client.metadata
            )
        except _RPC_ERRORS as err:
            details = err.details() if isinstance(err, grpc.aio.AioRpcError) else str(err)
            if "compacted" in (details or ""):
                return
            if "future revision" in (details or ""):
                raise InvalidArgument(f"compact({revision}) is past the current revision") from err
            raise self._translate(err) from err

    # --- sessions ------------------------------------------------------------------------

    def _live_session_id(self, session: Session | None) -> int | None:
        if session is None:
            return None
        if not isinstance(session, EtcdSession) or session._store is not self:
            raise InvalidArgument("session belongs to another metadata store")
        if session.expired:
            raise SessionExpired(session.id)
        return session.id

    async def open_session(self, ttl_s: float, *, auto_keepalive: bool = True) -> EtcdSession:
        """A new lease of ``ceil(ttl_s)`` seconds (etcd leases are whole seconds and at
        least its minimum TTL); its ephemeral keys go when it expires or closes."""
        ttl_s = validate_ttl(ttl_s)
        request = rpc.LeaseGrantRequest(TTL=max(1, math.ceil(ttl_s)), ID=0)
        # The lease's clock starts somewhere during the call: count from before it.
        sent = asyncio.get_running_loop().time()
        response = await self._rpc("leasestub", "LeaseGrant", request)
        if response.error:
            raise MetadataUnavailable(f"etcd refused a lease: {response.error}")
        session = EtcdSession(self, response.ID, ttl_s, float(response.TTL), auto_keepalive)
        session._deadline = sent + session.granted_ttl_s
        self._sessions[response.ID] = session
        return session

    async def _lease_keepalive(self, lease_id: int) -> int:
        """Refresh a lease once; its remaining TTL in seconds (<= 0: gone)."""
        self._check_open()
        request = rpc.LeaseKeepAliveRequest(ID=lease_id)
        call = self._client.leasestub.LeaseKeepAlive(
            iter([request]), timeout=limits.ETCD_REQUEST_TIMEOUT_S, metadata=self._client.metadata
        )
        try:
            reply = await call.read()
        except _RPC_ERRORS as err:
            raise self._translate(err) from err
        finally:
            call.cancel()
        if reply is grpc.aio.EOF:
            raise MetadataUnavailable(f"etcd at {self._endpoint} ended a lease keepalive")
        ttl: int = reply.TTL
        return ttl

    async def _lease_ttl(self, lease_id: int) -> int:
        """Remaining TTL of a lease without refreshing it (-1: gone)."""
        request = rpc.LeaseTimeToLiveRequest(ID=lease_id, keys=False)
        response = await self._rpc("leasestub", "LeaseTimeToLive", request)
        ttl: int = response.TTL
        return ttl

    async def _lease_revoke(self, lease_id: int) -> None:
        request = rpc.LeaseRevokeRequest(ID=lease_id)
        with contextlib.suppress(SessionExpired):
            await self._rpc("leasestub", "LeaseRevoke", request, [lease_id])

    def _revoke_in_background(self, lease_id: int) -> None:
        """Revoke an expired session's lease, best effort (bounded: an unreachable etcd
        drops it by its TTL, since nobody refreshes it any more)."""
        if self._closed:
            return

        async def revoke() -> None:
            with contextlib.suppress(AnabranchError, TimeoutError):
                await asyncio.wait_for(self._lease_revoke(lease_id), limits.ETCD_REQUEST_TIMEOUT_S)

        task = asyncio.get_running_loop().create_task(revoke())
        self._revocations.add(task)
        task.add_done_callback(self._revocations.discard)

    # --- watches -------------------------------------------------------------------------

    def watch(
        self, path: str, *, prefix: bool = False, start_revision: int | None = None
    ) -> EtcdWatch:
        """Changes to ``path`` (every key starting with it when ``prefix``) from
        ``start_revision``; by default from after the newest revision this client has seen,
        so its own later writes are never missed."""
        self._check_open()
        if prefix:
            validate_prefix(path)
            key, range_end = self._key(path), self._key(prefix_end(path))
        else:
            validate_path(path)
            key, range_end = self._key(path), b""
        if start_revision is None:
            start_revision = self._revision_seen + 1
        elif not isinstance(start_revision, int) or start_revision < 0:
            raise InvalidArgument(f"start_revision must be None or >= 0: {start_revision!r}")
        # Revision 0 is "all history" here (as in the memory store) but "now" to etcd.
        start_revision = max(start_revision, 1)
        watch = EtcdWatch(self, key, range_end, start_revision)
        self._watches.add(watch)
        return watch

    def _event(self, event: Any) -> WatchEvent:
        kv = event.kv
        if event.type == rpc.Event.DELETE:
            return WatchEvent(EventKind.DELETE, self._path(kv.key), b"", 0, kv.mod_revision)
        return WatchEvent(
            EventKind.PUT, self._path(kv.key), bytes(kv.value), kv.version, kv.mod_revision
        )

    # --- lifecycle -----------------------------------------------------------------------

    async def close(self) -> None:
        """Revoke open sessions (best effort), end watches, close the channel. Idempotent."""
        if self._closed:
            return
        # Best effort and concurrent: an unreachable etcd expires the leases by TTL instead.
        await asyncio.gather(
            *(session.close() for session in list(self._sessions.values())),
            return_exceptions=True,
        )
        self._closed = True
        if self._wake is not None:
            self._wake.cancel()
        self._fail_queue()
        for watch in list(self._watches):
            await watch._shutdown(Closed("etcd metadata store is closed"))
        await self._client.close()
        await asyncio.gather(*self._senders, return_exceptions=True)


class EtcdSession:
    """An etcd lease with its keepalive task (implements ``api.Session``).

    Example::

        async def demo(store: EtcdMetadataStore) -> None:
            session = await store.open_session(3.0)
            await store.put("/brokers/b1", b"", session=session)
            await session.wait_expired()  # returns once the lease is lost
    """

    def __init__(
        self,
        store: EtcdMetadataStore,
        lease_id: int,
        ttl_s: float,
        granted_ttl_s: float,
        auto_keepalive: bool,
    ) -> None:
        self._store = store
        self._id = lease_id
        self._ttl_s = ttl_s
        self.granted_ttl_s = granted_ttl_s
        """What etcd granted: ``ceil(ttl_s)`` or etcd's minimum TTL, whichever is larger."""
        self._loop = asyncio.get_running_loop()
        self._deadline = self._loop.time() + granted_ttl_s
        self._gone = asyncio.Event()
        self._auto = auto_keepalive
        self._task = self._loop.create_task(self._monitor(), name=f"etcd-lease-{lease_id}")
        # A dead monitor refreshes nothing: the session then expires by its deadline.
        self._task.add_done_callback(report_death)

    @property
    def id(self) -> int:
        return self._id

    @property
    def ttl_s(self) -> float:
        return self._ttl_s

    @property
    def expired(self) -> bool:
        if not self._gone.is_set() and self._loop.time() >= self._deadline:
            self._expire()
        return self._gone.is_set()

    async def keepalive(self) -> None:
        """Refresh the lease once; SessionExpired if etcd no longer has it, or if the
        deadline passed before etcd answered."""
        if self.expired:
            raise SessionExpired(self._id)
        sent = self._loop.time()
        if await self._store._lease_keepalive(self._id) <= 0:
            self._mark_gone()
            raise SessionExpired(self._id)
        if self.expired:
            raise SessionExpired(self._id)
        self._deadline = max(self._deadline, sent + self.granted_ttl_s)

    def _expire(self) -> None:
        """The deadline passed without a refresh: gone for good, and its lease revoked.

        Whoever saw the session expired has moved on (the broker unloaded its topics and
        opened a new session), so it must never come back -- yet etcd may still have the
        lease: a restarted etcd extends every lease's TTL, and a keepalive stuck while etcd
        was down can land after the deadline. A lease refreshed after that would keep the
        old session's ownership records alive forever (a topic "moving" for good).
        """
        self._mark_gone()
        self._store._revoke_in_background(self._id)

    async def wait_expired(self) -> None:
        """Return once the lease is gone (expired in etcd, lost, or closed)."""
        await self._gone.wait()

    async def close(self) -> None:
        """Revoke the lease now, deleting its ephemeral keys. Idempotent."""
        if self._gone.is_set():
            return
        self._mark_gone()
        await self._store._lease_revoke(self._id)

    def _mark_gone(self) -> None:
        self._gone.set()
        self._store._sessions.pop(self._id, None)
        if self._task is not asyncio.current_task():
            self._task.cancel()

    async def _monitor(self) -> None:
        """Refresh every TTL/3 (auto) or check after each deadline (manual) until gone."""
        interval = self.granted_ttl_s / 3
        with contextlib.suppress(Closed, SessionExpired):
            while not self._gone.is_set():
                if self._auto:
                    await asyncio.sleep(interval)
                    with contextlib.suppress(MetadataUnavailable):
                        await self.keepalive()
                else:
                    await asyncio.sleep(max(interval, self._deadline - self._loop.time()))
                    with contextlib.suppress(MetadataUnavailable):
                        # TimeToLive truncates to whole seconds: 0 is "under 1 s left",
                        # only -1 means gone.
                        if await self._store._lease_ttl(self._id) < 0:
                            self._mark_gone()
                if self._auto and self._loop.time() >= self._deadline:
                    # No refresh for a whole TTL: etcd has (or soon will have) dropped it.
                    self._expire()


class EtcdWatch:
    """One gRPC watch stream that re-opens from the next revision after a disconnect.

    Example::

        async def demo(store: EtcdMetadataStore) -> None:
            watch = store.watch("/topics/", prefix=True, start_revision=1)
            async for event in watch:
                print(event.kind, event.path, event.revision)
    """

    def __init__(
        self, store: EtcdMetadataStore, key: bytes, range_end: bytes, start_revision: int
    ) -> None:
        self._store = store
        self._key = key
        self._range_end = range_end
        self.next_revision = start_revision
        """Every event before this revision has been received (the resume point)."""
        self._pending: collections.deque[WatchEvent] = collections.deque()
        self._call: Any = None
        self._stop_requests: asyncio.Event | None = None
        self._error: AnabranchError | None = None
        self._done = False
        self._unavailable_since: float | None = None
        self._backoff_s = limits.ETCD_RECONNECT_BACKOFF_MIN_S
        self.reconnects = 0
        """Times the stream broke and was re-opened from ``next_revision`` (observability)."""

    def __aiter__(self) -> AsyncIterator[WatchEvent]:
        return self

    async def __anext__(self) -> WatchEvent:
        while not self._pending:
            if self._error is not None:
                raise self._error
            if self._done:
                raise StopAsyncIteration
            await self._receive()
        return self._pending.popleft()

    async def close(self) -> None:
        """Stop watching; iteration ends. Idempotent."""
        await self._shutdown(None)

    async def _shutdown(self, error: AnabranchError | None) -> None:
        if not self._done:
            self._done = True
            self._error = error
        self._drop_stream()

    def _open_stream(self) -> None:
        stop = asyncio.Event()
        create = rpc.WatchCreateRequest(
            key=self._key,
            range_end=self._range_end,
            start_revision=self.next_revision,
            # Progress notices move the resume point past quiet stretches, so a reconnect
            # after a long silence does not ask for history that compaction removed.
            progress_notify=True,
        )

        async def requests() -> AsyncIterator[Any]:
            yield rpc.WatchRequest(create_request=create)
            # Keep our half of the stream open: a finished request stream is a goodbye.
            await stop.wait()

        self._stop_requests = stop
        self._call = self._store._watch_stub.Watch(
            requests(), metadata=self._store._client.metadata
        )

    def _drop_stream(self) -> None:
        if self._stop_requests is not None:
            self._stop_requests.set()
        if self._call is not None:
            self._call.cancel()
        self._call = None
        self._stop_requests = None

    async def _receive(self) -> None:
        """Read one response into ``_pending``; on a broken stream, back off and re-open."""
        if self._call is None:
            self._open_stream()
        try:
            response = await self._call.read()
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self._done and task is not None and not task.cancelling():
                # Our own close() cancelled the call under this read: end iteration (or
                # raise Closed) instead of leaking a CancelledError nobody asked for.
                return
            raise
        except _RPC_ERRORS as err:
            if self._done:
                return
            await self._lost(self._store._translate(err))
            return
        if self._done:
            return
        if response is grpc.aio.EOF:
            await self._lost(MetadataUnavailable("etcd ended the watch stream"))
            return
        self._unavailable_since = None
        if response.compact_revision:
            await self._shutdown(Compacted(self.next_revision, response.compact_revision))
            return
        if response.canceled:
            await self._shutdown(MetadataError(f"etcd cancelled a watch: {response.cancel_reason}"))
            return
        if not response.events and not response.created:
            # A progress notice: etcd has sent this watcher everything up to the header.
            self.next_revision = max(self.next_revision, response.header.revision + 1)
            return
        newest = 0
        for event in response.events:
            # The resume point makes a replay start exactly after what we have; this guard
            # keeps the no-duplicates promise even if a server ever resent older events.
            if event.kv.mod_revision >= self.next_revision:
                self._pending.append(self._store._event(event))
                newest = max(newest, event.kv.mod_revision)
        # etcd never splits one revision across responses (fragment is off).
        if newest:
            self.next_revision = newest + 1

    async def _lost(self, error: AnabranchError) -> None:
        """The stream broke: re-open after a backoff, or give up after the window."""
        self._drop_stream()
        if not isinstance(error, MetadataUnavailable):
            await self._shutdown(error)
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        if self._unavailable_since is None:
            self._unavailable_since = now
            self._backoff_s = limits.ETCD_RECONNECT_BACKOFF_MIN_S
        if now - self._unavailable_since >= limits.ETCD_RECONNECT_WINDOW_S:
            self._unavailable_since = None
            raise error
        self.reconnects += 1
        await asyncio.sleep(self._backoff_s)
        self._backoff_s = min(self._backoff_s * 2, limits.ETCD_RECONNECT_BACKOFF_MAX_S)


def _settle(
    pending: PendingCommit,
    *,
    result: CommitResult | None = None,
    error: BaseException | None = None,
) -> None:
    """Answer a queued commit's caller (unless it gave up)."""
    future = pending.future
    if future is None or future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


# --- request builders ------------------------------------------------------------------------


def _txn_request(compare: list[Any], success: list[Any], failure: list[Any]) -> tuple[Any, int]:
    """A Txn request and its bytes; ValueTooLarge past what etcd takes."""
    request = rpc.TxnRequest(compare=compare, success=success, failure=failure)
    size = request.ByteSize()
    if size > limits.ETCD_REQUEST_BYTES_MAX:
        raise ValueTooLarge("etcd commit request", size, limits.ETCD_REQUEST_BYTES_MAX)
    return request, size


def _stat(kv: Any) -> Stat:
    return Stat(
        version=kv.version,
        create_revision=kv.create_revision,
        mod_revision=kv.mod_revision,
        session_id=kv.lease or None,
    )


def _compare_version(key: bytes, version: int) -> Any:
    return rpc.Compare(
        key=key,
        target=rpc.Compare.VERSION,
        result=rpc.Compare.EQUAL,
        version=version,
    )


def _compares(op: Op, key: bytes) -> list[Any]:
    validate_expected_version(op.expected_version)
    compares = []
    if op.expected_version is not None:
        compares.append(_compare_version(key, op.expected_version))
    if isinstance(op, Check) and op.expected_create_revision is not None:
        compares.append(
            rpc.Compare(
                key=key,
                target=rpc.Compare.CREATE,
                result=rpc.Compare.EQUAL,
                create_revision=op.expected_create_revision,
            )
        )
    return compares


def _put_op(key: bytes, value: bytes, lease: int) -> Any:
    return rpc.RequestOp(
        request_put=rpc.PutRequest(key=key, value=value, lease=lease, prev_kv=True)
    )


def _range_op(key: bytes, *, keys_only: bool = True) -> Any:
    return rpc.RequestOp(request_range=rpc.RangeRequest(key=key, keys_only=keys_only))
