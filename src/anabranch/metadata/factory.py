"""Open a metadata store from a URL (the broker's ``metadata_url`` setting).

* ``memory://`` - the in-memory reference store (tests, throwaway standalone).
* ``sqlite:///abs/path/meta.db[?synchronous=NORMAL]`` - the embedded default.
* ``etcd://host:port[,host:port][/namespace]`` - cluster mode; keys live under
  ``namespace`` when one is given.

Example:
    >>> import asyncio, tempfile
    >>> async def demo(url: str) -> None:
    ...     store = await open_metadata_store(url)
    ...     print(type(store).__name__)
    ...     await store.close()
    >>> with tempfile.TemporaryDirectory() as tmp:  # e.g. sqlite:///var/lib/anabranch/meta.db
    ...     asyncio.run(demo(f"sqlite:///{tmp}/meta.db"))
    SqliteMetadataStore
    >>> asyncio.run(demo("memory://"))
    MemoryMetadataStore
"""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

from anabranch.clock import Clock
from anabranch.errors import InvalidArgument
from anabranch.metadata.api import MetadataStore
from anabranch.metadata.etcd_channel import EtcdOptions


async def open_metadata_store(
    url: str, *, clock: Clock | None = None, etcd: EtcdOptions | None = None
) -> MetadataStore:
    """The store ``url`` names; InvalidArgument for a malformed or unknown URL.

    ``clock`` drives session TTLs of the embedded stores; etcd keeps time itself.
    ``etcd`` carries TLS and credentials for an ``etcd://`` URL.
    """
    if not isinstance(url, str):
        raise InvalidArgument(f"metadata URL must be a string: {url!r}")
    parts = urlsplit(url)
    if parts.scheme == "memory":
        if parts.netloc or parts.path or parts.query:
            raise InvalidArgument(f"memory:// takes no location: {url!r}")
        from anabranch.metadata.memory import MemoryMetadataStore

        return MemoryMetadataStore(clock)
    if parts.scheme == "sqlite":
        return await _open_sqlite(url, clock)
    if parts.scheme == "etcd":
        if not parts.netloc or parts.query:
            raise InvalidArgument(f"etcd URL must be etcd://host:port[,host:port][/ns]: {url!r}")
        from anabranch.metadata.etcd import EtcdMetadataStore

        namespace = parts.path.rstrip("/")
        return await EtcdMetadataStore.open(parts.netloc, namespace=namespace, options=etcd)
    raise InvalidArgument(f"unknown metadata URL scheme (memory, sqlite, etcd): {url!r}")


async def _open_sqlite(url: str, clock: Clock | None) -> MetadataStore:
    parts = urlsplit(url)
    if parts.netloc or not parts.path.startswith("/") or parts.path.endswith("/"):
        raise InvalidArgument(f"sqlite URL must be sqlite:///absolute/file: {url!r}")
    options = parse_qs(parts.query, strict_parsing=False)
    unknown = set(options) - {"synchronous"}
    if unknown or any(len(values) != 1 for values in options.values()):
        raise InvalidArgument(f"sqlite URL options: only one synchronous=...: {url!r}")
    from anabranch.metadata.sqlite import SqliteMetadataStore

    synchronous = options.get("synchronous", ["FULL"])[0]
    return await SqliteMetadataStore.open(parts.path, clock=clock, synchronous=synchronous)
