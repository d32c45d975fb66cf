"""A real cluster for tests: one etcd, N ``anabranch broker`` subprocesses and, with
``storage="jetstream"``, a NATS JetStream cluster.

Two storage layouts:

* ``storage="file"`` (the default) is **one-machine mode**: the brokers share one data
  directory (``root/data``, the file ledgers) besides the etcd store, which is how a
  takeover finds the previous owner's ledgers. It cannot span machines.
* ``storage="jetstream"`` is **across-machines mode**: ``nats_nodes`` ``nats-server``
  processes (:class:`~anabranch.testing.nats.NatsCluster`, ``sync_interval: always``) start
  beside etcd, every broker gets the JetStream settings (R``jetstream_replicas`` streams,
  3 by default) and its *own* data directory ``root/broker-<i>/``; nothing is shared but
  etcd and JetStream, as on three hosts. :meth:`LocalCluster.add_broker` starts one more
  broker on an empty data directory (a "fresh machine"), :meth:`LocalCluster.stream_leader`
  names the NATS node leading a topic's stream (so a test can SIGKILL it).

Every process runs on free loopback ports. Faults are signals to one PID:
:meth:`ClusterBroker.kill` (SIGKILL), :meth:`~ClusterBroker.pause` /
:meth:`~ClusterBroker.resume` (SIGSTOP / SIGCONT), and :meth:`~ClusterBroker.restart` (the
same command line, ports and data); NATS nodes likewise (``cluster.nats.nodes``). ``start``
waits until every broker answers CONNECT *and* is listed in the cluster's broker registry;
``stop`` stops the brokers, NATS and etcd.

Each broker's settings are a TOML file under ``root`` (``broker-<i>.toml``), its output
``broker-<i>.log``; short ``session_ttl_s`` make failover tests quick. ``env`` is added to
every broker's environment after the caller's ``ANABRANCH_*`` variables are stripped (e.g.
``{"ANABRANCH_FAILPOINTS": "ack-before-fsync"}``). Subclasses (the fault harness) override
:meth:`LocalCluster._etcd_endpoint_for` (a proxy per broker) and
:meth:`LocalCluster._make_broker` (another launcher).

Example (subprocesses and etcd: seconds to start, so not run here)::

    async def demo(tmp_path: Path) -> None:
        async with LocalCluster(tmp_path, brokers=3, session_ttl_s=3.0) as cluster:
            owner = await cluster.owner_of("persistent://public/default/t")
            owner.kill()
            await cluster.wait_registered(2)

    async def across_machines(tmp_path: Path) -> None:
        async with LocalCluster(tmp_path, storage="jetstream", nats_nodes=3) as cluster:
            leader = await cluster.stream_leader("persistent://public/default/t")
            leader.kill()                      # the stream elects another leader
            fresh = await cluster.add_broker()  # an empty data directory
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp

from anabranch.broker.service import managed_ledger_name
from anabranch.core.names import parse_name
from anabranch.testing.broker import BrokerSubprocess
from anabranch.testing.etcd import EtcdServer
from anabranch.testing.nats import NatsCluster, NatsNode
from anabranch.testing.ports import free_port
from anabranch.testing.security import BrokerSecurity

READY_TIMEOUT_S = 60.0
"""How long a broker may take to serve and register (a loaded 2-core CI box: ~2 s)."""


class ClusterBroker(BrokerSubprocess):
    """One broker subprocess of a :class:`LocalCluster`."""

    READY_TIMEOUT_S = READY_TIMEOUT_S

    def __init__(
        self, root: Path, index: int, settings: dict[str, Any], env: dict[str, str] | None = None
    ) -> None:
        super().__init__(
            str(settings["advertised_address"]),
            int(settings["port"]),
            root / f"broker-{index}.log",
            f"broker {index}",
        )
        self.index = index
        self.env = dict(env or {})
        self.http_port = int(settings["http_port"])
        self.advertised_port = int(settings.get("advertised_port") or self.port)
        """The port clients and other brokers reach it at (a proxy in front, or its own)."""
        self.advertised_http_port = int(settings.get("advertised_http_port") or self.http_port)
        self.config_path = root / f"broker-{index}.toml"
        self.config_path.write_text(_toml(settings))
        token = settings.get("broker_client_auth_token")
        if token:
            self.probe_auth = ("token", str(token).encode())
        self.tls_port: int | None = (
            int(settings["broker_service_port_tls"]) if settings.get("tls_enabled") else None
        )
        self.https_port: int | None = (
            int(settings["web_service_port_tls"]) if settings.get("tls_enabled") else None
        )

    @property
    def broker_id(self) -> str:
        """``host:port`` as advertised, the broker's id in the registry."""
        return f"{self.host}:{self.advertised_port}"

    @property
    def service_url(self) -> str:
        return f"pulsar://{self.host}:{self.advertised_port}"

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.advertised_http_port}"

    @property
    def service_url_tls(self) -> str | None:
        """``pulsar+ssl://host:port`` when the broker has a TLS listener."""
        return None if self.tls_port is None else f"pulsar+ssl://{self.host}:{self.tls_port}"

    def _command(self) -> tuple[list[str], dict[str, str]]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ANABRANCH_")}
        env.update(self.env)
        args = [
            sys.executable,
            "-m",
            "anabranch.cli.main",
            "broker",
            "--config",
            str(self.config_path),
        ]
        return args, env


class LocalCluster:
    """etcd + ``brokers`` cluster brokers under ``root`` (see the module docstring).

    ``storage`` is ``"file"`` (one shared data directory: one machine) or ``"jetstream"``
    (``nats_nodes`` NATS servers, R``jetstream_replicas`` streams, one data directory per
    broker; ``nats_auth`` = (user, password) makes the servers require a login, which the
    brokers are given).

    ``broker_settings`` are extra BrokerConfig fields written into every broker's TOML.
    ``security`` (a :class:`~anabranch.testing.security.TokenAuth`, a
    :class:`~anabranch.testing.certificates.TlsSetup`, ...) adds authentication/TLS
    settings: TLS ports are then allocated per broker, the brokers present the set-up's
    broker token to each other, and :meth:`http` sends its superuser token.
    """

    def __init__(
        self,
        root: Path,
        brokers: int = 3,
        *,
        cluster_name: str = "test-cluster",
        session_ttl_s: float = 3.0,
        load_report_interval_s: float = 1.0,
        fsync: str = "always",
        host: str = "127.0.0.1",
        env: dict[str, str] | None = None,
        security: BrokerSecurity | None = None,
        storage: str = "file",
        nats_nodes: int = 3,
        jetstream_replicas: int | None = None,
        nats_auth: tuple[str, str] | None = None,
        nats_urls: list[str] | None = None,
        **broker_settings: Any,
    ) -> None:
        if storage not in ("file", "jetstream"):
            raise ValueError(f"storage must be 'file' or 'jetstream', not {storage!r}")
        self.root = Path(root)
        self.storage = storage
        self.nats_nodes = nats_nodes
        self.nats_auth = nats_auth
        self.nats_urls = nats_urls
        self.jetstream_replicas = (
            min(3, nats_nodes) if jetstream_replicas is None else jetstream_replicas
        )
        self.nats: NatsCluster | None = None
        self.security = security
        self.http_headers: dict[str, str] = {}
        token = getattr(security, "superuser_token", None)
        if isinstance(token, str):
            self.http_headers["Authorization"] = f"Bearer {token}"
        security_settings = security.broker_config() if security is not None else {}
        self.root.mkdir(parents=True, exist_ok=True)
        self.cluster_name = cluster_name
        self.session_ttl_s = session_ttl_s
        self.host = host
        self.data_dir = self.root / "data"
        """The shared data directory of file mode (unused with JetStream: see
        :meth:`data_dir_of`)."""
        self.etcd: EtcdServer | None = None
        self._count = brokers
        self.env = dict(env or {})
        self._settings = {
            "cluster_name": cluster_name,
            "data_dir": str(self.data_dir),
            "bind_address": host,
            "advertised_address": host,
            "fsync": fsync,
            "session_ttl_s": session_ttl_s,
            "load_report_interval_s": load_report_interval_s,
            **security_settings,
            **broker_settings,
        }
        self.brokers: list[ClusterBroker] = []

    async def start(self) -> None:
        """Start etcd (and NATS), then every broker; wait until all are registered."""
        self.etcd = await asyncio.to_thread(EtcdServer.start, self.root / "etcd")
        try:
            if self.storage == "jetstream" and self.nats_urls is None:
                self.nats = await asyncio.to_thread(
                    NatsCluster.start,
                    self.root / "nats",
                    nodes=self.nats_nodes,
                    auth=self.nats_auth,
                )
            for index in range(self._count):
                self.brokers.append(await self._new_broker(index))
            await asyncio.gather(*(broker.start() for broker in self.brokers))
            await self.wait_registered(self._count)
        except BaseException:
            await self.stop()
            raise

    def data_dir_of(self, index: int) -> Path:
        """Broker ``index``'s data directory: its own with JetStream, the shared one with
        files."""
        if self.storage == "jetstream":
            return self.root / f"broker-{index}"
        return self.data_dir

    def jetstream_settings(self) -> dict[str, Any]:
        """The JetStream part of a broker's settings (empty in file mode)."""
        if self.storage != "jetstream":
            return {}
        urls = self.nats_urls
        if urls is None:
            assert self.nats is not None
            urls = self.nats.urls
        out: dict[str, Any] = {
            "storage": "jetstream",
            "jetstream_urls": urls,
            "jetstream_replicas": self.jetstream_replicas,
        }
        if self.nats_auth is not None:
            out["jetstream_username"], out["jetstream_password"] = self.nats_auth
        return out

    async def _new_broker(self, index: int) -> ClusterBroker:
        settings = {
            **self.jetstream_settings(),
            **self._settings,  # a caller's jetstream_* settings win (a wrong password)
            "data_dir": str(self.data_dir_of(index)),
            "metadata_url": f"etcd://{await self._etcd_endpoint_for(index)}",
            "port": free_port(self.host),
            "http_port": free_port(self.host),
        }
        if settings.get("tls_enabled"):
            settings["broker_service_port_tls"] = free_port(self.host)
            settings["web_service_port_tls"] = free_port(self.host)
        settings.update(await self._fronts_for(index, settings))
        return self._make_broker(index, settings)

    async def add_broker(self) -> ClusterBroker:
        """Start one more broker (the next index) on an empty data directory, as on a
        freshly installed machine, and wait until it is registered.

        With files the new broker shares the one data directory (there is no other
        machine); with JetStream its directory ``root/broker-<i>/`` is new and empty, so
        whatever it serves comes from JetStream and etcd."""
        index = len(self.brokers)
        broker = await self._new_broker(index)
        self.brokers.append(broker)
        await broker.start()
        await self.wait_registered(len(self.live()))
        return broker

    async def stream_leader(self, topic: str) -> NatsNode:
        """The NATS node leading the JetStream stream of ``topic`` (a ``persistent://``
        topic or ``segment://`` name; the topic must have been loaded once)."""
        if self.nats is None:
            raise RuntimeError("stream_leader needs storage='jetstream'")
        return await asyncio.to_thread(self.nats.stream_leader, self.stream_of(topic))

    def stream_of(self, topic: str) -> str:
        """The JetStream stream name of ``topic``'s managed ledger."""
        # Imported here: nats-py is an optional extra, file-mode clusters run without it.
        from anabranch.storage.jetstream_ledger import stream_name

        prefix = str(self._settings.get("jetstream_stream_prefix", "ab"))
        return stream_name(prefix, managed_ledger_name(parse_name(topic)))

    async def _etcd_endpoint_for(self, index: int) -> str:
        """``host:port`` broker ``index`` reaches etcd at (here: etcd itself)."""
        assert self.etcd is not None
        return self.etcd.endpoint

    async def _fronts_for(self, index: int, settings: dict[str, Any]) -> dict[str, Any]:
        """Extra settings putting something in front of broker ``index``'s ports (here:
        nothing; the fault harness advertises proxies)."""
        return {}

    def _make_broker(self, index: int, settings: dict[str, Any]) -> ClusterBroker:
        return ClusterBroker(self.root, index, settings, self.env)

    async def stop(self) -> None:
        """SIGKILL every broker (tests end fast; clean stops are tested on purpose), then
        stop etcd."""
        for broker in self.brokers:
            broker.resume()
            broker.kill()
        if self.nats is not None:
            for node in self.nats.nodes:
                node.resume()
            await asyncio.to_thread(self.nats.kill)
            self.nats = None
        if self.etcd is not None:
            await asyncio.to_thread(self.etcd.stop)
            self.etcd = None

    async def __aenter__(self) -> LocalCluster:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    # --- views ------------------------------------------------------------------------------

    @property
    def service_url(self) -> str:
        """``pulsar://h:p1,h:p2,...``: every broker (a client picks one to bootstrap)."""
        return "pulsar://" + ",".join(b.broker_id for b in self.brokers)

    @property
    def service_url_tls(self) -> str:
        """``pulsar+ssl://h:p1,h:p2,...`` (brokers with TLS listeners)."""
        return "pulsar+ssl://" + ",".join(
            f"{b.host}:{b.tls_port}" for b in self.brokers if b.tls_port is not None
        )

    def live(self) -> list[ClusterBroker]:
        """Brokers whose process is running (paused ones included)."""
        return [b for b in self.brokers if b.running]

    def by_id(self, broker_id: str) -> ClusterBroker:
        for broker in self.brokers:
            if broker.broker_id == broker_id:
                return broker
        raise KeyError(broker_id)

    def by_url(self, url: str) -> ClusterBroker:
        """The broker of a ``pulsar://`` or ``http://`` URL."""
        host_port = url.split("://", 1)[-1].rstrip("/")
        for broker in self.brokers:
            if host_port in (broker.broker_id, f"{broker.host}:{broker.advertised_http_port}"):
                return broker
        raise KeyError(url)

    # --- HTTP helpers -------------------------------------------------------------------------

    async def http(
        self, method: str, path: str, *, via: ClusterBroker | None = None, **kwargs: Any
    ) -> tuple[int, Any]:
        """One admin request at ``via`` (default: the first running broker); no redirects
        followed. Returns (status, JSON body or text or None)."""
        broker = via or self.live()[0]
        timeout = aiohttp.ClientTimeout(total=30.0)
        if self.http_headers:
            kwargs["headers"] = {**self.http_headers, **kwargs.get("headers", {})}
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.request(
                method, broker.http_url + path, allow_redirects=False, **kwargs
            ) as response,
        ):
            text = await response.text()
            body: Any = text
            if response.content_type == "application/json" and text:
                body = await response.json()
            if response.status in (301, 302, 307, 308):
                body = response.headers.get("Location")
            return response.status, body

    async def owner_of(self, topic: str, *, via: ClusterBroker | None = None) -> ClusterBroker:
        """The broker serving ``topic`` per HTTP lookup (assigning it if unowned)."""
        domain, rest = topic.split("://", 1)
        status, body = await self.http("GET", f"/lookup/v2/topic/{domain}/{rest}", via=via)
        if status == 307:  # an unowned topic: the chosen broker claims it
            target = self.by_url(str(body).split("/lookup/", 1)[0])
            path = str(body)[len(target.http_url) :]
            status, body = await self.http("GET", path, via=target)
        if status != 200:
            raise RuntimeError(f"lookup of {topic} failed: {status} {body}")
        return self.by_url(str(body["brokerUrl"]))

    async def segment_owner(
        self, segment: str, *, via: ClusterBroker | None = None
    ) -> ClusterBroker | None:
        """The broker whose ownership record holds ``segment://...`` (None: unowned or
        not ``owned`` right now); assigns nothing."""
        rest = segment.split("://", 1)[1]
        status, body = await self.http("GET", f"/admin/v2/cluster/segments/{rest}/owner", via=via)
        if status == 404:
            return None
        if status != 200:
            raise RuntimeError(f"owner of {segment}: {status} {body}")
        return self.by_url(str(body["pulsarUrl"])) if body["state"] == "owned" else None

    async def http_follow(
        self, method: str, path: str, *, via: ClusterBroker | None = None, **kwargs: Any
    ) -> tuple[int, Any, ClusterBroker]:
        """Like :meth:`http`, following up to 3 redirects to other brokers (admin
        mutations at a non-owner or non-leader); returns the broker that answered too."""
        broker = via or self.live()[0]
        for _ in range(3):
            status, body = await self.http(method, path, via=broker, **kwargs)
            if status != 307:
                return status, body, broker
            location = str(body)
            broker = self.by_url(location.split("/admin/", 1)[0].split("/lookup/", 1)[0])
            path = location[len(broker.http_url) :]
        return status, body, broker

    async def registered(self, *, via: ClusterBroker | None = None) -> list[str]:
        """Broker ids in the registry."""
        status, body = await self.http("GET", f"/admin/v2/brokers/{self.cluster_name}", via=via)
        if status != 200:
            raise RuntimeError(f"broker list failed: {status} {body}")
        return [str(b) for b in body]

    async def wait_registered(self, count: int, timeout_s: float = READY_TIMEOUT_S) -> list[str]:
        """Wait until exactly ``count`` brokers are registered; returns their ids."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        last: list[str] = []
        while True:
            with contextlib.suppress(OSError, RuntimeError, aiohttp.ClientError, IndexError):
                last = await self.registered()
                if len(last) == count:
                    return last
            if loop.time() > end:
                raise TimeoutError(f"{count} brokers not registered after {timeout_s}s: {last}")
            await asyncio.sleep(0.1)


def _toml_string(value: object) -> str:
    escaped = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


def _toml(settings: dict[str, Any]) -> str:
    lines = []
    for key, value in settings.items():
        if value is None:
            continue
        if isinstance(value, list):
            lines.append(f"{key} = [{', '.join(_toml_string(v) for v in value)}]")
        elif isinstance(value, bool):
            lines.append(f"{key} = {'true' if value else 'false'}")
        elif isinstance(value, int | float):
            lines.append(f"{key} = {value}")
        else:
            lines.append(f"{key} = {_toml_string(value)}")
    return "\n".join(lines) + "\n"
