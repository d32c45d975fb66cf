"""SIGKILL a process appending to a JetStream ledger; every acknowledged entry survives.

The child (``jetstream_crash_child.py``) runs a JetStream-backed broker's storage (SQLite
metadata + R3 streams on a real 3-node NATS cluster) and prints each acknowledged position
and payload hash; the parent kills it at a random moment (mid-batch, mid-rollover between
the rollover marker and its metadata commit), then does what a restarted broker does:
opens the managed ledger (claim, fence marker, resolve the dead writer's open ledger up to
the next marker) and reads everything back from the stream. Every acknowledged entry must
be there, at its position, byte-identical; the ledger then takes appends and reopens.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from anabranch.metadata.sqlite import SqliteMetadataStore
from anabranch.storage.api import EARLIEST, Position
from anabranch.storage.jetstream_ledger import JetStreamManagedLedgerFactory
from anabranch.testing.nats import NatsCluster
from tests.storage.crash_child import NAME, config_for

ROOT = Path(__file__).resolve().parents[2]
SEEDS = range(16)


@pytest.fixture(scope="module")
def nats_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsCluster]:
    cluster = NatsCluster.start(tmp_path_factory.mktemp("nats"), nodes=3)
    try:
        yield cluster
    finally:
        cluster.stop()


def run_and_kill(data_dir: Path, seed: int, urls: list[str]) -> list[tuple[Position, str]]:
    """Start the child, SIGKILL it at a random moment; the acknowledgements it printed."""
    rng = random.Random(seed)
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}")
    child = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.storage.jetstream_crash_child",
            str(data_dir),
            str(seed),
            ",".join(urls),
        ],
        stdout=subprocess.PIPE,
        cwd=ROOT,
        env=env,
    )
    assert child.stdout is not None
    wanted = rng.randint(1, 600)
    early: list[str] = []
    while len(early) < wanted:
        line = child.stdout.readline()
        if not line:
            break
        early.append(line.decode())
    time.sleep(rng.random() * 0.02)
    child.send_signal(signal.SIGKILL)
    rest, _ = child.communicate()
    assert child.returncode == -signal.SIGKILL, "the child must still be running when killed"
    lines = rest.decode().splitlines()
    if rest and not rest.endswith(b"\n"):
        lines = lines[:-1]  # a half-printed line is not an acknowledgement we saw
    acked = [line.split() for line in early + lines]
    assert len(acked) >= len(early) >= 1
    return [(Position(int(lid), int(eid)), digest) for lid, eid, digest in acked]


async def restart_and_check(
    data_dir: Path, seed: int, urls: list[str], acked: list[tuple[Position, str]]
) -> None:
    store = await SqliteMetadataStore.open(data_dir / "metadata.db")
    try:
        factory = JetStreamManagedLedgerFactory(urls, store, prefix=f"c{seed}", tail_cache_bytes=0)
        ml = await factory.open(NAME, config_for(seed))
        stored: dict[Position, bytes] = {}
        position = EARLIEST
        while entries := await ml.read(position, max_entries=5000):
            stored.update((e.position, e.data) for e in entries)
            position = entries[-1].position.next()
        assert sorted(stored) == list(stored), "entries come back in position order"
        for pos, digest in acked:
            assert pos in stored, f"acknowledged entry {pos} lost ({len(stored)} kept)"
            assert hashlib.sha256(stored[pos]).hexdigest() == digest, f"entry {pos} changed"
        assert ml.entry_count == len(stored)
        new = await ml.append(b"after restart")
        assert new > max(stored, default=EARLIEST)
        await factory.close()
        again = JetStreamManagedLedgerFactory(urls, store, prefix=f"c{seed}", tail_cache_bytes=0)
        ml = await again.open(NAME, config_for(seed))
        assert ml.entry_count == len(stored) + 1
        assert (await ml.read(new))[0].data == b"after restart"
        await again.close()
    finally:
        await store.close()


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
def test_acknowledged_entries_survive_sigkill_of_the_writer(
    tmp_path: Path, seed: int, nats_cluster: NatsCluster
) -> None:
    acked = run_and_kill(tmp_path, seed, nats_cluster.urls)
    asyncio.run(restart_and_check(tmp_path, seed, nats_cluster.urls, acked))
