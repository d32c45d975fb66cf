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
from typing import Annotated, Any, NoReturn, Protocol

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape

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
    cfg = _load_config("standalone", config, data_dir=data_dir, port=port, http_port=http_port)
    from anabranch.broker.server import event_loop_factory

    with asyncio.Runner(loop_factory=event_loop_factory(cfg.use_uvloop)) as runner:
        runner.run(_run_standalone(cfg))


async def _run_standalone(cfg: BrokerConfig) -> None:
    from anabranch.broker.standalone import Standalone

    await _serve("standalone", Standalone.start(cfg))


def _load_config(label: str, path: Path | None, **overrides: Any) -> BrokerConfig:
    """The node's settings; an unreadable config file or a bad setting (file, env var or
    flag) is a start-up failure: one line and exit status 1, as in :func:`_serve`."""
    try:
        return BrokerConfig.load(path, **overrides)
    except ValidationError as err:  # pydantic's report spans lines and links its docs
        reasons = "; ".join(
            f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors(include_url=False)
        )
        _cannot_start(label, reasons)
    except (AnabranchError, ValueError) as err:  # ValueError: a config file not UTF-8
        _cannot_start(label, str(err))


def _cannot_start(label: str, reason: str) -> NoReturn:
    # Escaped: reasons quote paths and values, which rich would read as markup.
    console.print(f"[red]anabranch {label} cannot start: {escape(reason)}[/]")
    raise SystemExit(1)


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
        _cannot_start(label, str(err))
    # What start-up created lives as long as the process: out of the collector's way, so a
    # full collection (a pause every client sees as latency) scans only the working set.
    gc.freeze()
    console.print(f"[green]anabranch {label}[/] ready: {escape(node.describe())}")
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
        console.print(f"[red]anabranch {label} stopped: {escape(reason)}[/]")
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
    cfg = _load_config(
        "broker",
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
            f"[red]a cluster broker needs an etcd:// metadata URL, not {escape(cfg.metadata_url)}"
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
