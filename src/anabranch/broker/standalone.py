"""Standalone mode: one process, SQLite metadata, local-disk ledgers under ``data_dir``,
the binary protocol server and (when the admin package is there) the admin HTTP app.

Shutdown order keeps every acknowledged message: stop accepting connections, stop
reading from the open ones, close the scalable-topic controllers (stepping down) and
watch sessions, let in-flight appends finish and their receipts go out
(``BrokerService.close``), close the connections, then the ledgers (cursors flushed) and
the metadata store.

Example:
    >>> import asyncio, tempfile
    >>> from pathlib import Path
    >>> async def run(cfg: BrokerConfig) -> None:
    ...     node = await Standalone.start(cfg)
    ...     print(node.describe())
    ...     await node.stop()
    >>> with tempfile.TemporaryDirectory() as tmp:   # port 0: any free port
    ...     asyncio.run(run(BrokerConfig(data_dir=Path(tmp), port=0, http_port=0,
    ...                                  metadata_url=f"sqlite:///{tmp}/meta.db")))
    broker pulsar://127.0.0.1:..., http://127.0.0.1:..., metadata sqlite:///.../meta.db, data ...
"""

from __future__ import annotations

import fcntl
import importlib
import logging
import os
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from anabranch import limits
from anabranch.broker.advertised_listeners import internal_listener_urls
from anabranch.broker.config import BrokerConfig
from anabranch.broker.policies import Policies
from anabranch.broker.server import BrokerServer
from anabranch.broker.service import BrokerService
from anabranch.clock import Clock, SystemClock
from anabranch.errors import InvalidArgument, NotAllowed
from anabranch.metadata.api import MetadataStore
from anabranch.metadata.etcd_channel import EtcdOptions
from anabranch.metadata.factory import open_metadata_store
from anabranch.security.tls import server_ssl_context
from anabranch.storage.api import ManagedLedgerFactory

if TYPE_CHECKING:
    from anabranch.storage.tiered import TieredStorage

log = logging.getLogger(__name__)


async def open_store(
    url: str, clock: Clock | None = None, etcd: EtcdOptions | None = None
) -> MetadataStore:
    """The metadata store named by ``url``; ``etcd`` carries TLS and credentials for an
    ``etcd://`` URL. The stores keep real time: ``clock`` (the broker's, possibly a test's
    manual one) is not theirs to follow, or sessions would never expire."""
    del clock
    return await open_metadata_store(url, etcd=etcd)


@dataclass
class Standalone:
    """A running standalone broker."""

    config: BrokerConfig
    store: MetadataStore
    ledgers: ManagedLedgerFactory
    service: BrokerService
    server: BrokerServer
    http_runner: Any = None
    http_port: int | None = None
    http_port_tls: int | None = None
    ssl_context: ssl.SSLContext | None = None
    data_dir_lock: int = -1
    """The descriptor holding :func:`lock_data_dir`'s lock until :meth:`stop`."""

    @classmethod
    async def start(
        cls,
        config: BrokerConfig,
        *,
        clock: Clock | None = None,
        ledger_backend: Literal["file", "memory"] = "file",
        keepalive_interval_s: float = limits.KEEPALIVE_INTERVAL_S,
        handshake_timeout_s: float = limits.HANDSHAKE_TIMEOUT_S,
        prepare: Callable[[BrokerService], None] | None = None,
        exclusive_data_dir: bool = True,
    ) -> Standalone:
        """Open storage, create the standalone cluster/tenant/namespace, start serving.

        ``prepare(service)`` runs before the server accepts connections (cluster mode
        installs its ownership gate there). ``exclusive_data_dir`` takes the data directory
        (:func:`lock_data_dir`); cluster brokers, which share theirs, fence through the
        store's ownership instead."""
        clock = clock or SystemClock()
        config.data_dir.mkdir(parents=True, exist_ok=True)
        lock = lock_data_dir(config.data_dir) if exclusive_data_dir else -1
        try:
            store = await open_store(config.metadata_url, clock, config.etcd_options())
        except BaseException:
            _unlock(lock)
            raise
        ledgers: ManagedLedgerFactory | None = None
        try:
            ledgers = _ledger_factory(ledger_backend, config, store, clock)
            await _connect_storage(ledgers)
            policies = Policies(store)
            await policies.ensure_standalone_defaults(
                config.cluster_name,
                service_url=f"http://{config.advertised_address}:"
                f"{config.advertised_http_port or config.http_port}",
                broker_service_url=f"pulsar://{config.advertised_address}:"
                f"{config.advertised_port or config.port}",
                **_tls_cluster_urls(config),
            )
            service = BrokerService(config, store, ledgers, clock, policies)
            if prepare is not None:
                prepare(service)
            await service.start()
            ssl_context = server_ssl_context(config)
            server = BrokerServer(
                service,
                config.bind_address,
                config.port,
                keepalive_interval_s=keepalive_interval_s,
                handshake_timeout_s=handshake_timeout_s,
                ssl_context=ssl_context,
                tls_port=config.broker_service_port_tls,
                plaintext=config.plaintext_enabled,
            )
            await server.start(serving=False)
        except BaseException:
            try:
                if ledgers is not None:
                    await ledgers.close()
            finally:
                try:
                    await store.close()
                finally:
                    _unlock(lock)
            raise
        node = cls(
            config, store, ledgers, service, server, ssl_context=ssl_context, data_dir_lock=lock
        )
        service.set_addresses(
            pulsar_url=node.service_url_tls if not config.plaintext_enabled else node.service_url,
            pulsar_url_tls=node.service_url_tls,
        )
        try:
            await node._start_http()
            if node.http_url is not None:
                service.set_addresses(http_url=node.http_url, http_url_tls=node.https_url)
            await service.scalable.start()
            await server.serve()  # ready: connections (queued meanwhile) are served only now
        except BaseException:
            await node.stop()
            raise
        return node

    async def _start_http(self) -> None:
        try:
            start_http = importlib.import_module("anabranch.admin.http").start_http
        except (ModuleNotFoundError, AttributeError):
            log.info("admin HTTP not available yet (anabranch.admin.http missing): skipped")
            return
        host = self.config.bind_address
        cfg = self.config
        self.http_runner = await start_http(
            self.service,
            host,
            cfg.http_port,
            ssl_context=self.ssl_context,
            tls_port=cfg.web_service_port_tls,
            plaintext=cfg.plaintext_enabled,
        )
        ports = _bound_ports(self.http_runner)
        if cfg.plaintext_enabled:
            self.http_port = ports.pop(0) if ports else cfg.http_port
        if self.ssl_context is not None:
            self.http_port_tls = ports.pop(0) if ports else cfg.web_service_port_tls

    @property
    def port(self) -> int:
        """The bound binary-protocol port."""
        return self.server.port

    @property
    def service_url(self) -> str:
        """The advertised ``pulsar://`` URL (what lookups and the registry name): the
        internal listener's when ``advertised_listeners`` are configured (upstream's
        ``brokerServiceUrl``), else ``advertised_address`` with the port."""
        internal = internal_listener_urls(self.config)
        if internal is not None and internal.pulsar_url:
            return internal.pulsar_url
        port = self.config.advertised_port or self.port
        return f"pulsar://{self.config.advertised_address}:{port}"

    @property
    def service_url_tls(self) -> str | None:
        """The advertised ``pulsar+ssl://`` URL (None without TLS); the internal
        listener's when it names one."""
        port = self.server.tls_port
        if port is None:
            return None
        internal = internal_listener_urls(self.config)
        if internal is not None and internal.pulsar_url_tls:
            return internal.pulsar_url_tls
        port = self.config.advertised_port_tls or port
        return f"pulsar+ssl://{self.config.advertised_address}:{port}"

    @property
    def http_url(self) -> str | None:
        """The advertised admin URL (None without admin HTTP); the HTTPS one when the
        plain port is off."""
        if self.http_port is None:
            return self.https_url
        port = self.config.advertised_http_port or self.http_port
        return f"http://{self.config.advertised_address}:{port}"

    @property
    def https_url(self) -> str | None:
        """The HTTPS admin URL (None without TLS)."""
        if self.http_port_tls is None:
            return None
        return f"https://{self.config.advertised_address}:{self.http_port_tls}"

    def describe(self) -> str:
        """One line for the operator."""
        http = self.http_url or "admin HTTP not built"
        tls = f"{self.service_url_tls}, {self.https_url}, " if self.service_url_tls else ""
        cfg = self.config
        ledgers = ""
        if cfg.storage == "jetstream":
            # Imported here: nats-py is an optional extra (loaded already when in use).
            from anabranch.storage.jetstream_client import redact_url

            urls = ", ".join(map(redact_url, cfg.jetstream_urls))
            ledgers = f"ledgers on JetStream R{cfg.jetstream_replicas} at {urls}, "
        return (
            f"broker {self.service_url}, {http}, {tls}metadata {cfg.metadata_url}, "
            f"{ledgers}data {cfg.data_dir}"
        )

    async def failed(self) -> str:
        """Wait until an essential background loop gave up; the reason."""
        return await self.service.fatal.wait()

    async def stop(self) -> None:
        """Clean shutdown (see the module docstring)."""
        self.server.stop_accepting()
        self.server.pause_all()
        try:
            await self.service.close()
            await self.server.stop()
            if self.http_runner is not None:
                await self.http_runner.cleanup()
            await self.ledgers.close()
        finally:
            try:
                await self.store.close()
            finally:
                lock, self.data_dir_lock = self.data_dir_lock, -1
                _unlock(lock)


DATA_DIR_LOCK_FILE = "broker.lock"


def lock_data_dir(data_dir: Path) -> int:
    """Take ``data_dir`` for this broker (an exclusive ``flock``, released when the
    returned descriptor closes, so also when the process dies); NotAllowed if another
    broker holds it. Two brokers on one directory would append to the same ledger files
    and fence each other's topics back and forth."""
    fd = os.open(data_dir / DATA_DIR_LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        by = f" (pid {holder})" if holder.isdigit() else ""
        raise NotAllowed(f"data directory {data_dir} is in use by another broker{by}") from None
    except BaseException:
        os.close(fd)
        raise
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError:
        pass  # the pid only helps the message above (a full disk must not stop the start)
    return fd


def _unlock(fd: int) -> None:
    if fd >= 0:
        os.close(fd)


def _tls_cluster_urls(config: BrokerConfig) -> dict[str, str]:
    """The cluster record's ``serviceUrlTls``/``brokerServiceUrlTls`` (from the configured
    ports: the record is written before the listeners bind)."""
    if not config.tls_enabled:
        return {}
    host = config.advertised_address
    port = config.advertised_port_tls or config.broker_service_port_tls
    return {
        "service_url_tls": f"https://{host}:{config.web_service_port_tls}",
        "broker_service_url_tls": f"pulsar+ssl://{host}:{port}",
    }


def _ledger_factory(
    backend: str, config: BrokerConfig, store: MetadataStore, clock: Clock
) -> ManagedLedgerFactory:
    if backend == "memory":
        from anabranch.storage.memory import MemoryManagedLedgerFactory

        return MemoryManagedLedgerFactory(clock=clock)
    if config.storage == "jetstream":
        try:
            from anabranch.storage.jetstream_ledger import jetstream_factory
        except ModuleNotFoundError as err:
            if err.name is None or not err.name.startswith("nats"):
                raise
            raise InvalidArgument(
                "storage = 'jetstream' needs nats-py: pip install 'anabranch[jetstream]'"
            ) from err
        made = jetstream_factory(config, store, clock)
        if config.offload_driver:
            made.tiered = _tiered_storage(config)
        return made
    from anabranch.storage.ledger import FileManagedLedgerFactory

    factory = FileManagedLedgerFactory(
        config.data_dir / "ledgers",
        store,
        clock=clock,
        writer_threads=config.storage_writer_threads,
        open_files_max=config.storage_open_files_max,
        tail_cache_bytes=config.storage_cache_bytes,
    )
    if config.offload_driver:
        factory.tiered = _tiered_storage(config)
    return factory


def _tiered_storage(config: BrokerConfig) -> TieredStorage:
    """The object store of ``offload_driver`` (obstore, the ``tiered`` extra)."""
    try:
        from anabranch.storage.object_store import S3Settings
        from anabranch.storage.tiered import TieredStorage
    except ModuleNotFoundError as err:
        if err.name is None or not err.name.startswith("obstore"):
            raise
        raise InvalidArgument(
            "offload_driver needs obstore: pip install 'anabranch[tiered]'"
        ) from err
    secret = config.s3_secret_access_key
    return TieredStorage.s3(
        S3Settings(
            config.s3_endpoint,
            config.s3_bucket,
            config.s3_region,
            config.s3_access_key_id,
            secret.get_secret_value() if secret is not None else "",
        )
    )


async def _connect_storage(ledgers: ManagedLedgerFactory) -> None:
    """Replicated storage connects at start (wrong credentials stop the broker here;
    unreachable servers are retried in the background: see ``JetStreamManagedLedgerFactory
    .connect_at_start``). Local files check the metadata store is not older than them."""
    connect = getattr(ledgers, "connect_at_start", None)
    if connect is not None:
        await connect()


def _bound_ports(runner: Any) -> list[int]:
    # aiohttp's AppRunner lists (host, port) of its sites in start order (plain, then TLS).
    return [
        int(address[1])
        for address in getattr(runner, "addresses", None) or []
        if isinstance(address, tuple) and len(address) >= 2
    ]
