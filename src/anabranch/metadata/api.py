"""The metadata store interface: versioned keys, atomic multi-op writes, sessions, watches.

Everything durable that is not message data lives here: topic and segment layouts,
consumer sessions, ledger metadata, transaction records and their index keys. Three
backends implement :class:`MetadataStore` and pass one contract suite
(``tests/contract/test_metadata_store.py``): ``memory`` (the reference), ``sqlite`` (the
embedded default) and ``etcd`` (cluster mode).

Semantics, modelled on etcd v3:

* Keys are absolute paths (``/topics/public/default/orders``); values are bytes.
* Every committed write (one ``put``/``delete``/``commit``) gets the next store
  *revision*. A key's :class:`Stat` holds its ``version`` (1 on create, +1 per put),
  ``create_revision`` and ``mod_revision``. Version 0 means "absent", so
  ``expected_version=0`` is "must not exist", ``None`` is "any", ``n`` is exact.
* A failed condition raises :class:`~anabranch.errors.BadVersion` and changes nothing.
* Ephemeral keys belong to a :class:`Session`; they are deleted (with DELETE events)
  when the session expires or closes.
* Watches deliver every change with ``revision >= start_revision`` in revision order,
  with no gaps or duplicates, or raise :class:`~anabranch.errors.Compacted` when that
  history is gone; the caller then re-lists and watches from the listing's revision + 1.

Example:
    >>> import asyncio
    >>> from anabranch.metadata.memory import MemoryMetadataStore
    >>> async def demo(store: MetadataStore) -> None:
    ...     stat = await store.put("/a", b"1", expected_version=MUST_NOT_EXIST)
    ...     page = await store.list_prefix("/")
    ...     await store.put("/a", b"2", expected_version=stat.version)
    ...     async for event in store.watch("/a", start_revision=page.revision + 1):
    ...         print(event.kind, event.value)
    ...         break
    ...     await store.close()
    >>> asyncio.run(demo(MemoryMetadataStore()))
    EventKind.PUT b'2'
"""

from __future__ import annotations

import enum
import re
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from anabranch import limits
from anabranch.errors import InvalidArgument, ValueTooLarge

MUST_NOT_EXIST = 0
"""``expected_version`` meaning the key must be absent (version 0 = absent)."""

ANY_VERSION: int | None = None
"""``expected_version`` meaning no condition."""


@dataclass(frozen=True, slots=True)
class Stat:
    """Version facts of one key."""

    version: int
    create_revision: int
    mod_revision: int
    session_id: int | None = None
    """Owning session of an ephemeral key, else None."""


@dataclass(frozen=True, slots=True)
class Record:
    """A key with its value and stat."""

    path: str
    value: bytes
    stat: Stat


@dataclass(frozen=True, slots=True)
class Page:
    """One page of an ordered listing, taken at store revision ``revision``."""

    records: list[Record]
    more: bool
    revision: int


class EventKind(enum.Enum):
    PUT = "put"
    DELETE = "delete"


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One change. For DELETE, ``value`` is b"" and ``version`` is 0."""

    kind: EventKind
    path: str
    value: bytes
    version: int
    revision: int


# --- operations of an atomic commit ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Put:
    path: str
    value: bytes
    expected_version: int | None = None
    session_id: int | None = None


@dataclass(frozen=True, slots=True)
class Delete:
    path: str
    expected_version: int | None = None


@dataclass(frozen=True, slots=True)
class Check:
    """A condition with no write: ``version`` and/or ``create_revision`` must match.

    ``create_revision`` is how a leader fences (see ``coordination.py``): a re-created
    key has version 1 again but always a new create revision.
    """

    path: str
    expected_version: int | None = None
    expected_create_revision: int | None = None


Op = Put | Delete | Check


@dataclass(frozen=True, slots=True)
class CommitResult:
    """Outcome of a successful commit: its revision and one entry per op.

    For a Put the entry is the new Stat, for a Delete whether a key was removed
    (``True``/``False``), for a Check ``None``.
    """

    revision: int
    results: list[Stat | bool | None]


# --- sessions and watches -------------------------------------------------------------------


@runtime_checkable
class Session(Protocol):
    """A liveness lease. Ephemeral keys die with it."""

    @property
    def id(self) -> int: ...

    @property
    def ttl_s(self) -> float: ...

    @property
    def expired(self) -> bool: ...

    async def keepalive(self) -> None:
        """Refresh the TTL once; raises SessionExpired if it already ran out.

        Sessions opened with ``auto_keepalive=True`` do this themselves every TTL/3.
        """
        ...

    async def wait_expired(self) -> None:
        """Return once the session has expired or was closed (loss notification)."""
        ...

    async def close(self) -> None:
        """Revoke the session now, deleting its ephemeral keys. Idempotent."""
        ...


class Watch(Protocol):
    """An ordered stream of changes; iterate it, ``close()`` it when done."""

    def __aiter__(self) -> AsyncIterator[WatchEvent]: ...

    async def __anext__(self) -> WatchEvent: ...

    async def close(self) -> None: ...


class MetadataStore(Protocol):
    """The async metadata store every backend implements."""

    async def get(self, path: str) -> Record | None:
        """The key's value and stat, or None when absent."""
        ...

    async def put(
        self,
        path: str,
        value: bytes,
        expected_version: int | None = None,
        *,
        session: Session | None = None,
    ) -> Stat:
        """Write ``value``; ephemeral when ``session`` is given. BadVersion on mismatch."""
        ...

    async def delete(self, path: str, expected_version: int | None = None) -> bool:
        """Delete the key; False when it was absent and no version was expected."""
        ...

    async def list_children(self, path: str) -> list[str]:
        """Sorted names of the direct children of ``path`` (names, not full paths)."""
        ...

    async def list_range(self, start: str, end: str, *, limit: int | None = None) -> Page:
        """Keys in ``[start, end)`` in byte order, at most ``limit`` (paging: next start
        is the last key + "\\x00")."""
        ...

    async def list_prefix(
        self, prefix: str, *, limit: int | None = None, start_after: str | None = None
    ) -> Page:
        """Keys starting with ``prefix`` in byte order, after ``start_after`` if given."""
        ...

    async def commit(self, ops: Sequence[Op]) -> CommitResult:
        """Apply every op atomically or none (BadVersion names the failed path)."""
        ...

    async def create_sequential(
        self, prefix: str, value: bytes, *, session: Session | None = None
    ) -> str:
        """Create ``prefix`` + a zero-padded number, strictly increasing under ``prefix``."""
        ...

    async def open_session(self, ttl_s: float, *, auto_keepalive: bool = True) -> Session:
        """A new session; its ephemeral keys are deleted when it expires or closes."""
        ...

    def watch(self, path: str, *, prefix: bool = False, start_revision: int | None = None) -> Watch:
        """Changes to ``path`` (or every key under it when ``prefix``) from
        ``start_revision`` (default: changes after now)."""
        ...

    async def current_revision(self) -> int:
        """The store's latest committed revision."""
        ...

    async def compact(self, revision: int) -> None:
        """Discard history before ``revision``; a later watch from an older revision
        raises Compacted (etcd's compaction; the embedded stores also compact on their own
        past ``limits.METADATA_CHANGELOG_REVISIONS_MAX`` revisions)."""
        ...

    async def close(self) -> None:
        """Release resources; later calls raise Closed. Idempotent."""
        ...


# --- validation shared by every backend -----------------------------------------------------

_CONTROL_CHARACTER = re.compile("[\x00-\x1f\x7f]")
"""One C-level scan instead of a per-character generator: paths are checked on every write."""

_WELL_FORMED_PATH = re.compile("/|(?:/[^/\x00-\x1f\x7f]+)+")
"""Every rule of :func:`validate_path` but the size, in one C-level match (the common
case: every op of every commit); a path it refuses gets the rule it broke named."""


def validate_path(path: str) -> str:
    """Check an absolute key path; return it unchanged.

    >>> validate_path("/topics/public/default/orders")
    '/topics/public/default/orders'
    """
    # A UTF-8 character is at most 4 bytes: a short well-formed path needs no encoding.
    if (
        type(path) is str
        and len(path) * 4 <= limits.METADATA_PATH_BYTES_MAX
        and _WELL_FORMED_PATH.fullmatch(path)
    ):
        return path
    if not isinstance(path, str) or not path.startswith("/"):
        raise InvalidArgument(f"metadata path must be an absolute string path: {path!r}")
    if path != "/" and path.endswith("/"):
        raise InvalidArgument(f"metadata path must not end with '/': {path!r}")
    if "//" in path:
        raise InvalidArgument(f"metadata path has an empty segment: {path!r}")
    if _CONTROL_CHARACTER.search(path):
        raise InvalidArgument(f"metadata path has a control character: {path!r}")
    if len(path.encode("utf-8")) > limits.METADATA_PATH_BYTES_MAX:
        raise InvalidArgument(f"metadata path over {limits.METADATA_PATH_BYTES_MAX} bytes")
    return path


def validate_prefix(prefix: str) -> str:
    """A listing/watch prefix: absolute, may end with '/'."""
    if not isinstance(prefix, str) or not prefix.startswith("/"):
        raise InvalidArgument(f"metadata prefix must start with '/': {prefix!r}")
    if _CONTROL_CHARACTER.search(prefix):
        raise InvalidArgument(f"metadata prefix has a control character: {prefix!r}")
    if len(prefix.encode("utf-8")) > limits.METADATA_PATH_BYTES_MAX:
        raise InvalidArgument(f"metadata prefix over {limits.METADATA_PATH_BYTES_MAX} bytes")
    return prefix


def validate_value(value: bytes) -> bytes:
    """Check a value's type and size."""
    if type(value) is bytes and len(value) <= limits.METADATA_VALUE_BYTES_MAX:
        return value
    if not isinstance(value, bytes | bytearray | memoryview):
        raise InvalidArgument(f"metadata value must be bytes, not {type(value).__name__}")
    if len(value) > limits.METADATA_VALUE_BYTES_MAX:
        raise ValueTooLarge("metadata value", len(value), limits.METADATA_VALUE_BYTES_MAX)
    return bytes(value)


def validate_expected_version(expected: int | None) -> int | None:
    if expected is not None and (not isinstance(expected, int) or expected < 0):
        raise InvalidArgument(f"expected_version must be None or >= 0: {expected!r}")
    return expected


_WRITES = (Put, Delete)


def validate_ops(ops: Sequence[Op]) -> list[Op]:
    """Check a commit's ops: count, paths, values, and no key written twice."""
    ops = list(ops)
    if len(ops) > limits.METADATA_TXN_OPS_MAX:
        raise InvalidArgument(f"{len(ops)} ops in one commit, over {limits.METADATA_TXN_OPS_MAX}")
    written: set[str] = set()
    for op in ops:
        validate_path(op.path)
        expected = op.expected_version
        if expected is not None:
            validate_expected_version(expected)
        if isinstance(op, _WRITES):
            if isinstance(op, Put):
                validate_value(op.value)
            if op.path in written:
                raise InvalidArgument(f"{op.path} written twice in one commit")
            written.add(op.path)
        elif not isinstance(op, Check):
            raise InvalidArgument(f"not a metadata op: {op!r}")
    return ops


def validate_ttl(ttl_s: float) -> float:
    if not limits.METADATA_SESSION_TTL_MIN_S <= ttl_s <= limits.METADATA_SESSION_TTL_MAX_S:
        raise InvalidArgument(
            f"session ttl {ttl_s}s outside [{limits.METADATA_SESSION_TTL_MIN_S}, "
            f"{limits.METADATA_SESSION_TTL_MAX_S}]"
        )
    return float(ttl_s)


def validate_limit(limit: int | None) -> int:
    if limit is None:
        return limits.METADATA_LIST_LIMIT_MAX
    if not isinstance(limit, int) or limit <= 0:
        raise InvalidArgument(f"limit must be a positive int: {limit!r}")
    return min(limit, limits.METADATA_LIST_LIMIT_MAX)


def prefix_end(prefix: str) -> str:
    """The smallest string greater than every string starting with ``prefix``.

    >>> prefix_end("/a/")
    '/a0'
    """
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


def sequential_name(prefix: str, counter: int) -> str:
    """``prefix`` + counter zero-padded so names sort in creation order."""
    return f"{prefix}{counter:0{limits.SEQUENTIAL_KEY_DIGITS}d}"
