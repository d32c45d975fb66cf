"""The ``anabranch`` command line.

Example:
    $ anabranch standalone --data-dir ./data
    $ anabranch broker --config broker-1.toml      # a cluster broker (etcd metadata)
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
from collections.abc import Awaitable
from pathlib import Path
from typing import Annotated, Protocol

import typer
from rich.console import Console

from anabranch.broker.config import BrokerConfig
from anabranch.cli import (
    admin_compaction,  # noqa: F401  (registers its commands)
    admin_messages,  # noqa: F401  (registers its commands)
    admin_offload,  # noqa: F401  (registers its commands)
    admin_permissions,  # noqa: F401  (registers its commands)
    admin_schemas,  # noqa: F401  (registers its commands)
    messages,
)
from anabranch.cli.admin import admin_app
from anabranch.cli.tokens import tokens_app
from anabranch.errors import AnabranchError

app = typer.Typer(no_args_is_help=True, help="anabranch: elastic, key-ordered streams.")


@app.callback()
def _commands() -> None:
    """Keeps ``standalone`` a subcommand (typer collapses a one-command app)."""


console = Console(stderr=True)


@app.command()
def standalone(
    data_dir: Annotated[Path, typer.Option(help="Where metadata and ledgers live.")] = Path("data"),
    port: Annotated[int | None, typer.Option(help="Binary protocol port.")] = None,
    http_port: Annotated[int | None, typer.Option(help="Admin HTTP port.")] = None,
    config: Annotated[Path | None, typer.Option(help="TOML config file.")] = None,
) -> None:
    """Run one broker with embedded SQLite metadata and local-disk storage."""
    cfg = BrokerConfig.load(config, data_dir=data_dir, port=port, http_port=http_port)
    from anabranch.broker.server import event_loop_factory

    with asyncio.Runner(loop_factory=event_loop_factory(cfg.use_uvloop)) as runner:
        runner.run(_run_standalone(cfg))


async def _run_standalone(cfg: BrokerConfig) -> None:
    from anabranch.broker.standalone import Standalone

    await _serve("standalone", Standalone.start(cfg))


class _Node(Protocol):
    def describe(self) -> str: ...
    async def failed(self) -> str: ...
    async def stop(self) -> None: ...


async def _serve(label: str, starting: Awaitable[_Node]) -> None:
    """Run a started node until SIGINT/SIGTERM, then stop it cleanly; when an essential
    background loop of the node keeps dying, stop it and exit with status 70 (EX_SOFTWARE)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        node = await starting
    except (AnabranchError, OSError) as err:
        # A typed start-up failure (wrong storage credentials, a bad setting) or an OS one
        # (a port in use, a data directory that cannot be written): the operator's to fix,
        # said in one line (the node's partial start-up dies with the process).
        console.print(f"[red]anabranch {label} cannot start: {err}[/]")
        raise SystemExit(1) from None
    # What start-up created lives as long as the process: out of the collector's way, so a
    # full collection (a pause every client sees as latency) scans only the working set.
    gc.freeze()
    console.print(f"[green]anabranch {label}[/] ready: {node.describe()}")
    signalled = asyncio.ensure_future(stop.wait())
    failed = asyncio.ensure_future(node.failed())
    reason: str | None = None
    try:
        await asyncio.wait((signalled, failed), return_when=asyncio.FIRST_COMPLETED)
        if failed.done() and not failed.cancelled():
            reason = failed.result()
    finally:
        signalled.cancel()
        failed.cancel()
        console.print("shutting down ...")
        await node.stop()
    if reason is not None:
        console.print(f"[red]anabranch {label} stopped: {reason}[/]")
        raise SystemExit(70)


@app.command()
def broker(
    *,
    config: Annotated[Path | None, typer.Option(help="TOML config file.")] = None,
    metadata_url: Annotated[
        str | None, typer.Option(help="Shared metadata store, e.g. etcd://127.0.0.1:2379.")
    ] = None,
    data_dir: Annotated[Path | None, typer.Option(help="Where ledgers live.")] = None,
    port: Annotated[int | None, typer.Option(help="Binary protocol port.")] = None,
    http_port: Annotated[int | None, typer.Option(help="Admin HTTP port.")] = None,
    advertised_address: Annotated[
        str | None, typer.Option(help="Host clients and other brokers reach this broker at.")
    ] = None,
) -> None:
    """Run one broker of a cluster sharing an etcd metadata store.

    Settings come from the config file, then ``ANABRANCH_*`` env vars, then these flags
    (e.g. ``ANABRANCH_METADATA_URL=etcd://10.0.0.5:2379``).
    """
    cfg = BrokerConfig.load(
        config,
        metadata_url=metadata_url,
        data_dir=data_dir,
        port=port,
        http_port=http_port,
        advertised_address=advertised_address,
    )
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if not cfg.metadata_url.startswith("etcd://"):
        console.print(
            f"[red]a cluster broker needs an etcd:// metadata URL, not {cfg.metadata_url}"
        )
        raise typer.Exit(2)
    from anabranch.broker.server import event_loop_factory

    with asyncio.Runner(loop_factory=event_loop_factory(cfg.use_uvloop)) as runner:
        runner.run(_run_broker(cfg))


async def _run_broker(cfg: BrokerConfig) -> None:
    from anabranch.broker.cluster.node import ClusterNode

    await _serve("broker", ClusterNode.start(cfg))


app.add_typer(admin_app, name="admin")
app.add_typer(tokens_app, name="tokens")
app.command()(messages.produce)
app.command()(messages.consume)


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
