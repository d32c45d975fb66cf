"""Brokers for tests: :class:`InProcessBroker` on this event loop (port 0) and
:class:`BrokerProcess`, a real ``anabranch standalone`` subprocess to kill and restart.

Example:
    >>> import tempfile
    >>> async def demo(tmp_path: Path) -> None:
    ...     async with InProcessBroker(tmp_path, metadata="memory") as broker:
    ...         print(broker.service_url)      # pulsar://127.0.0.1:<port>
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     asyncio.run(demo(Path(tmp)))
    pulsar://127.0.0.1:...

A :class:`BrokerProcess` takes about a second to start (a new interpreter), so its
example is not run here::

    proc = BrokerProcess(tmp_path / "data")
    await proc.start()
    try:
        proc.kill()                     # SIGKILL: a crash
        await proc.start()              # same ports, same data
    finally:
        await proc.stop()
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

from anabranch import limits
from anabranch.broker.config import BrokerConfig
from anabranch.broker.probe import handshake
from anabranch.broker.service import BrokerService
from anabranch.broker.standalone import Standalone
from anabranch.clock import Clock
from anabranch.failpoints import ENV_VAR as FAILPOINTS_ENV
from anabranch.testing.ports import free_port
from anabranch.testing.security import BrokerSecurity


class InProcessBroker:
    """A standalone broker on ``127.0.0.1:0`` in this event loop.

    ``metadata`` is ``"memory"`` or ``"sqlite"`` (under ``data_dir``); ``ledgers`` is
    ``"file"`` (default) or ``"memory"``; ``security`` (e.g.
    :class:`~anabranch.testing.security.TokenAuth`) adds authentication/TLS settings; other
    keyword arguments are BrokerConfig fields.
    """

    def __init__(
        self,
        data_dir: Path,
        *,
        metadata: Literal["memory", "sqlite"] = "memory",
        ledgers: Literal["file", "memory"] = "file",
        clock: Clock | None = None,
        keepalive_interval_s: float = limits.KEEPALIVE_INTERVAL_S,
        handshake_timeout_s: float = limits.HANDSHAKE_TIMEOUT_S,
        security: BrokerSecurity | None = None,
        **config: Any,
    ) -> None:
        data_dir = Path(data_dir)
        url = "memory://" if metadata == "memory" else f"sqlite:///{data_dir / 'metadata.db'}"
        fields: dict[str, Any] = {
            "data_dir": data_dir,
            "port": 0,
            "http_port": 0,
            "metadata_url": url,
            "use_uvloop": False,
        }
        if security is not None:
            fields.update(security.broker_config())
        fields.update(config)
        self.config = BrokerConfig(**fields)
        self.security = security
        self._ledgers = ledgers
        self._clock = clock
        self._keepalive = keepalive_interval_s
        self._handshake = handshake_timeout_s
        self.node: Standalone | None = None

    async def __aenter__(self) -> InProcessBroker:
        self.node = await Standalone.start(
            self.config,
            clock=self._clock,
            ledger_backend=self._ledgers,
            keepalive_interval_s=self._keepalive,
            handshake_timeout_s=self._handshake,
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.node is not None:
            await self.node.stop()
            self.node = None

    def _node(self) -> Standalone:
        if self.node is None:
            raise RuntimeError("the broker is not running (use 'async with')")
        return self.node

    @property
    def port(self) -> int:
        return self._node().port

    @property
    def service_url(self) -> str:
        """``pulsar://127.0.0.1:<port>``."""
        return self._node().service_url

    @property
    def http_url(self) -> str | None:
        """``http://127.0.0.1:<port>`` once the admin app exists, else None."""
        return self._node().http_url

    @property
    def service(self) -> BrokerService:
        return self._node().service


async def wait_for_broker(host: str, port: int, deadline_s: float = 30.0) -> None:
    """Wait until a broker at ``host:port`` completes a CONNECT handshake."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while True:
        try:
            await handshake(host, port)
            return
        except (OSError, asyncio.IncompleteReadError, ConnectionError):
            if loop.time() > end:
                raise TimeoutError(f"no broker at {host}:{port} after {deadline_s}s") from None
            await asyncio.sleep(0.05)


class BrokerSubprocess:
    """A broker in a child process of this one, to crash, pause and restart.

    ``start`` launches the command line of :meth:`_command` (output appended to
    ``log_path``) and waits until the broker answers CONNECT at ``host:port``; ``kill``
    is SIGKILL, ``pause``/``resume`` SIGSTOP/SIGCONT, ``stop`` SIGTERM (clean shutdown)
    and waits, ``restart`` is stop + start. ``label`` names it in errors.
    """

    READY_TIMEOUT_S = 60.0
    """How long a start may take to answer CONNECT."""

    def __init__(self, host: str, port: int, log_path: Path, label: str) -> None:
        self.host = host
        self.port = port
        self.log_path = log_path
        self.label = label
        self.process: subprocess.Popen[bytes] | None = None
        self.probe_auth: tuple[str | None, bytes | None] = (None, None)
        """CONNECT credentials of the readiness probe (a broker with authentication on)."""
        self._starting = asyncio.Lock()

    @property
    def service_url(self) -> str:
        return f"pulsar://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def _command(self) -> tuple[list[str], dict[str, str]]:
        """The arguments and environment to launch with (run just before each launch)."""
        raise NotImplementedError

    async def start(self) -> None:
        """Start the process (if not running) and wait until it serves.

        Starts take turns: two at once (a fault's own restart and the heal's) would both
        see no process and launch two; the one refused the data directory's lock would
        then be the one remembered, leaving the serving one unknown and never stopped.
        """
        async with self._starting:
            await self._start()

    async def _start(self) -> None:
        if self.running:
            return
        args, env = self._command()
        spawn = asyncio.get_running_loop().run_in_executor(None, self._spawn, args, env)
        try:
            self.process = await asyncio.shield(spawn)
        except asyncio.CancelledError:
            # The thread launches the process whether or not we wait: own it and kill it,
            # or it outlives the harness (a broker nobody stops).
            self.process = await spawn
            self.kill()
            raise
        try:
            await self._wait_ready()
        except BaseException:
            self.kill()
            raise

    def _spawn(self, args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        with open(self.log_path, "ab") as log_file:
            return subprocess.Popen(args, stdout=log_file, stderr=log_file, env=env)

    async def _wait_ready(self) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + self.READY_TIMEOUT_S
        while True:
            if self.process is None or self.process.poll() is not None:
                code = None if self.process is None else self.process.returncode
                raise RuntimeError(f"{self.label} exited ({code}); see {self.log_path}")
            try:
                method, data = self.probe_auth
                await handshake(self.host, self.port, auth_method=method, auth_data=data)
                return
            except (OSError, asyncio.IncompleteReadError, ConnectionError):
                if loop.time() > end:
                    message = f"{self.label} not serving; see {self.log_path}"
                    raise TimeoutError(message) from None
                await asyncio.sleep(0.1)

    def _signal(self, sig: signal.Signals) -> None:
        if self.running:
            assert self.process is not None
            os.kill(self.process.pid, sig)

    def kill(self) -> None:
        """SIGKILL the process (a crash) and reap it."""
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def pause(self) -> None:
        """SIGSTOP: the process keeps its sockets but runs nothing (a long GC pause)."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        self._signal(signal.SIGCONT)

    async def stop(self) -> None:
        """SIGTERM (clean shutdown; resumed first if paused) and wait; SIGKILL if it does
        not exit in 60 s."""
        process = self.process
        if process is None or process.poll() is not None:
            return
        self.resume()
        os.kill(process.pid, signal.SIGTERM)
        try:
            await asyncio.to_thread(process.wait, 60.0)
        except subprocess.TimeoutExpired:
            self.kill()

    async def restart(self) -> None:
        """Clean stop, then start again with the same command line, ports and data."""
        await self.stop()
        await self.start()


class BrokerProcess(BrokerSubprocess):
    """``python -m anabranch.cli.main standalone`` on fixed free ports, for crash tests.

    Ports and data dir stay the same across restarts (see :class:`BrokerSubprocess`).
    Output goes to ``<data_dir>.log``.
    """

    def __init__(
        self,
        data_dir: Path,
        *,
        host: str = "127.0.0.1",
        fsync: str = "always",
        security: BrokerSecurity | None = None,
        failpoints: str = "",
        env: dict[str, str] | None = None,
    ) -> None:
        self.extra_env = dict(env or {})
        """More ``ANABRANCH_*`` settings for the broker (say short autoscale intervals)."""
        self.failpoints = failpoints
        """Comma-separated failpoints (:mod:`anabranch.failpoints`) for the next start."""
        self.data_dir = Path(data_dir)
        super().__init__(host, free_port(host), self.data_dir.with_suffix(".log"), "broker")
        self.http_port = free_port(host)
        self.fsync = fsync
        self.security_env: dict[str, str] = {}
        if security is not None:
            settings = security.broker_config()
            self.security_env = _settings_env(settings)
            token = settings.get("broker_client_auth_token")
            if token:
                self.probe_auth = ("token", str(token).encode())

    def _command(self) -> tuple[list[str], dict[str, str]]:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("ANABRANCH_")}
        env["ANABRANCH_FSYNC"] = self.fsync
        env["ANABRANCH_BIND_ADDRESS"] = self.host
        if self.failpoints:
            env[FAILPOINTS_ENV] = self.failpoints
        env.update(self.security_env)
        env.update(self.extra_env)
        args = [
            sys.executable, "-m", "anabranch.cli.main", "standalone",
            "--data-dir", str(self.data_dir),
            "--port", str(self.port), "--http-port", str(self.http_port),
        ]  # fmt: skip
        return args, env


def _settings_env(settings: dict[str, Any]) -> dict[str, str]:
    """BrokerConfig fields as ``ANABRANCH_*`` variables (lists comma-separated).

    Example:
        >>> _settings_env({"authentication_enabled": True, "superuser_roles": ["a", "b"]})
        {'ANABRANCH_AUTHENTICATION_ENABLED': 'true', 'ANABRANCH_SUPERUSER_ROLES': 'a,b'}
    """
    env: dict[str, str] = {}
    for key, value in settings.items():
        if value is None:
            continue
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, list):
            text = ",".join(str(v) for v in value)
        else:
            text = str(value)
        env[f"ANABRANCH_{key.upper()}"] = text
    return env
