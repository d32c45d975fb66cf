"""The object store tiered storage writes to: S3 (or any S3-compatible server) over obstore.

Only what offloading needs: create-only puts (``If-None-Match: *``, so two offload
attempts can never overwrite each other's object), ranged gets (one entry, or a range of
entries, of an offloaded ledger is one GET), deletes and a credential check. obstore's
own errors become the storage error tree here and nowhere else:

* connection refused / reset, timeouts and 5xx → :class:`ObjectStoreUnavailable`
  (retriable: the offloader backs off and the ledger stays hot);
* 401/403 (a wrong key or secret, or no right on the bucket) →
  :class:`ObjectStoreAccessDenied` with a message that names the settings to fix;
* a missing object → :class:`~anabranch.errors.NotFound`; an existing key on a
  create-only put → :class:`~anabranch.errors.AlreadyExists`.

Messages keep obstore's reason but never the endpoint's URL or the credentials.

obstore is the ``tiered`` extra: this module is imported only when an offload driver is
configured.

Example (against an S3-compatible server)::

    async def demo() -> None:
        store = S3ObjectStore(S3Settings("http://127.0.0.1:8333", "b", "us-east-1",
                                         "key", "secret"))
        await store.put_new("a/1", b"hello")
        assert await store.get_range("a/1", 1, 3) == b"el"
        await store.delete("a/1")
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import obstore
from obstore.exceptions import (
    AlreadyExistsError,
    BaseError,
    NotFoundError,
    PermissionDeniedError,
    PreconditionError,
    UnauthenticatedError,
)
from obstore.store import S3Store

from anabranch.errors import (
    AlreadyExists,
    NotFound,
    ObjectStoreAccessDenied,
    ObjectStoreUnavailable,
    StorageError,
)

log = logging.getLogger(__name__)

_NOT_FOUND = (NotFoundError, FileNotFoundError)
"""obstore raises the builtin FileNotFoundError (and FileExistsError, PermissionError)
for some statuses instead of its own classes."""
_FAILURES = (BaseError, OSError)

_URL = re.compile(r"https?://\S+")


@dataclass(frozen=True, slots=True)
class S3Settings:
    """Where and as whom to reach the bucket. ``repr`` hides the secret.

    >>> "secret" in repr(S3Settings("http://h:1", "b", "us-east-1", "k", "secret"))
    False
    """

    endpoint: str
    bucket: str
    region: str
    access_key_id: str
    secret_access_key: str = field(repr=False)
    max_retries: int = 2
    """obstore's own retries of one request (the offloader retries whole offloads)."""
    request_timeout_s: float = 30.0
    connect_timeout_s: float = 2.0


def _reason(err: BaseException) -> str:
    """The first line of obstore's message without URLs (they name the endpoint)."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return _URL.sub("<endpoint>", text)[:300]


def translate(err: BaseException, operation: str, key: str) -> StorageError | Exception:
    """``err`` (from obstore) as one of our errors; the full text goes to the log."""
    log.info("object store %s %s failed: %r", operation, key, err)
    if isinstance(err, PermissionDeniedError | UnauthenticatedError | PermissionError):
        return ObjectStoreAccessDenied(operation)
    if isinstance(err, _NOT_FOUND):
        return NotFound(key)
    if isinstance(err, AlreadyExistsError | PreconditionError | FileExistsError):
        return AlreadyExists(key)
    text = str(err)
    if "403 Forbidden" in text or "401 Unauthorized" in text:
        return ObjectStoreAccessDenied(operation)
    return ObjectStoreUnavailable(operation, _reason(err))


class S3ObjectStore:
    """One bucket; see the module docstring."""

    def __init__(self, settings: S3Settings) -> None:
        self.settings = settings
        retry: Any = {
            "max_retries": settings.max_retries,
            "backoff": {
                "init_backoff": timedelta(milliseconds=50),
                "max_backoff": timedelta(milliseconds=500),
                "base": 2,
            },
            "retry_timeout": timedelta(seconds=settings.request_timeout_s),
        }
        options: Any = {
            "allow_http": settings.endpoint.startswith("http://"),
            "timeout": timedelta(seconds=settings.request_timeout_s),
            "connect_timeout": timedelta(seconds=settings.connect_timeout_s),
        }
        self._store = S3Store(
            settings.bucket,
            endpoint=settings.endpoint,
            region=settings.region,
            access_key_id=settings.access_key_id,
            secret_access_key=settings.secret_access_key,
            virtual_hosted_style_request=False,
            client_options=options,
            retry_config=retry,
        )

    @property
    def bucket(self) -> str:
        return self.settings.bucket

    async def put_new(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key`` unless the key exists (AlreadyExists then)."""
        try:
            await obstore.put_async(self._store, key, data, mode="create")
        except _FAILURES as err:
            raise translate(err, "put", key) from None

    async def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``start..end-1`` of object ``key``."""
        try:
            got = await obstore.get_range_async(self._store, key, start=start, end=end)
        except _FAILURES as err:
            raise translate(err, "get", key) from None
        return bytes(got)

    async def size(self, key: str) -> int:
        """The object's length in bytes."""
        try:
            meta = await obstore.head_async(self._store, key)
        except _FAILURES as err:
            raise translate(err, "head", key) from None
        return int(meta["size"])

    async def delete(self, key: str) -> None:
        """Remove ``key`` (a missing key is fine: deletes are retried)."""
        try:
            await obstore.delete_async(self._store, key)
        except _NOT_FOUND:
            return
        except _FAILURES as err:
            raise translate(err, "delete", key) from None

    async def check(self) -> None:
        """Prove the bucket answers and the credentials are accepted (a HEAD of a key
        that does not exist: NotFound is the good answer)."""
        try:
            await obstore.head_async(self._store, "anabranch-credential-check")
        except _NOT_FOUND:
            return
        except _FAILURES as err:
            raise translate(err, "credential check", "-") from None
