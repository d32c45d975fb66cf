"""The ``anabranch`` command line.

Example:
    $ anabranch standalone --data-dir ./data
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from anabranch.broker.config import BrokerConfig
from anabranch.cli import messages
from anabranch.cli.admin import admin_app

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

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    node = await Standalone.start(cfg)
    console.print(f"[green]anabranch standalone[/] ready: {node.describe()}")
    try:
        await stop.wait()
    finally:
        console.print("shutting down ...")
        await node.stop()


app.add_typer(admin_app, name="admin")
app.command()(messages.produce)
app.command()(messages.consume)


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
