"""``anabranch admin topics compact|compaction-status`` and the compaction-threshold
commands of ``namespaces`` and ``topics`` (pulsar-admin's names and units).

``compact`` takes a persistent topic (a partitioned one: each partition), a
``segment://`` name, or a scalable ``topic://`` name (each of its segments).

Example:
    $ anabranch admin topics compact public/default/prices
    $ anabranch admin topics compaction-status public/default/prices --wait
    $ anabranch admin namespaces set-compaction-threshold public/default --threshold 100M
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

import typer

from anabranch.cli.admin import (
    OutputOpt,
    Target,
    _run,
    namespaces_app,
    parse_size,
    topics_app,
)

WAIT_POLL_S = 0.2


@topics_app.command("compact")
def compact(topic: str, output: OutputOpt = None) -> None:
    """Start compacting a topic (a partitioned topic's partitions, a segment, or every
    segment of a scalable topic)."""
    _run(lambda c: c.compact(topic), output, f"compaction of {topic} started")


@topics_app.command("compaction-status")
def compaction_status(
    topic: str,
    wait: Annotated[
        bool, typer.Option("--wait", "-w", help="Wait until the compaction is done.")
    ] = False,
    output: OutputOpt = None,
) -> None:
    """The status of the topic's last compaction (NOT_RUN, RUNNING, SUCCESS, ERROR)."""

    async def call(c: Any) -> Any:
        while True:
            status = await c.compaction_status(topic)
            if not wait or status["status"] != "RUNNING":
                return status
            await asyncio.sleep(WAIT_POLL_S)

    _run(call, output, f"compaction of {topic}")


def _threshold_commands(app: typer.Typer) -> None:
    """Register set/get/remove-compaction-threshold on ``app`` (namespace or topic)."""

    @app.command("set-compaction-threshold")
    def set_threshold(
        target: Target,
        threshold: Annotated[
            str, typer.Option("--threshold", "-t", help="Backlog size: 0 (off), 4096, 10M, 2G.")
        ],
        output: OutputOpt = None,
    ) -> None:
        """Compact automatically once the backlog after the last compaction passes this."""
        size = parse_size(threshold)
        if size < 0:
            raise typer.BadParameter("the threshold is 0 (off) or a size")
        _run(lambda c: c.set_compaction_threshold(target, size), output,
             f"compaction threshold of {target} set")  # fmt: skip

    @app.command("get-compaction-threshold")
    def get_threshold(target: Target, output: OutputOpt = None) -> None:
        """The compaction threshold in bytes (null: inherited)."""
        _run(lambda c: c.get_compaction_threshold(target), output,
             f"compaction threshold of {target}")  # fmt: skip

    @app.command("remove-compaction-threshold")
    def remove_threshold(target: Target, output: OutputOpt = None) -> None:
        """Remove the compaction threshold (the next level's applies)."""
        _run(lambda c: c.remove_compaction_threshold(target), output,
             f"compaction threshold of {target} removed")  # fmt: skip


_threshold_commands(namespaces_app)
_threshold_commands(topics_app)
