"""Acknowledged SQLite writes survive SIGKILL.

A child process runs concurrent writers and prints each key only after its ``put``
returned. The parent kills it at a seeded random moment, reopens the database and
checks that every printed key is there with its value.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sys
from pathlib import Path

import pytest

import anabranch
from anabranch.metadata.sqlite import SqliteMetadataStore

CHILD = """
import asyncio, sys
from anabranch.metadata.sqlite import SqliteMetadataStore

async def writer(store, worker):
    for i in range(1_000_000):
        key = f"/crash/{worker}/{i:07d}"
        await store.put(key, key.encode())
        print(key, flush=True)

async def main():
    store = await SqliteMetadataStore.open(sys.argv[1])
    print("ready", flush=True)
    await asyncio.gather(*(writer(store, w) for w in range(8)))

asyncio.run(main())
"""

SRC_DIR = Path(anabranch.__file__).resolve().parent.parent


async def run_and_kill(db: Path, script: Path, kill_after_acks: int) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(SRC_DIR)}
    child = await asyncio.create_subprocess_exec(
        sys.executable, str(script), str(db), stdout=asyncio.subprocess.PIPE, env=env
    )
    assert child.stdout is not None
    assert (await child.stdout.readline()).strip() == b"ready"
    acked: list[str] = []
    while len(acked) < kill_after_acks:
        line = await child.stdout.readline()
        assert line, "child exited early"
        acked.append(line.decode().strip())
    child.send_signal(signal.SIGKILL)
    # Lines already in the pipe were printed after their put returned: acknowledged too.
    acked.extend(line.decode().strip() for line in (await child.stdout.read()).splitlines())
    assert await child.wait() == -signal.SIGKILL
    return [key for key in acked if key]


@pytest.mark.parametrize("seed", range(5))
async def test_acknowledged_writes_survive_sigkill(tmp_path: Path, seed: int) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    db = tmp_path / "meta.db"
    acked = await run_and_kill(db, script, random.Random(seed).randrange(50, 2_000))
    store = await SqliteMetadataStore.open(db)
    try:
        missing = [key for key in acked if (await store.get(key)) is None]
        stored = {r.path: r.value for r in (await store.list_prefix("/crash/")).records}
    finally:
        await store.close()
    assert missing == []
    assert all(stored[key] == key.encode() for key in acked)
    assert len(stored) >= len(acked)


UNCLOSED_CHILD = """
import asyncio, sys
from anabranch.metadata.sqlite import SqliteMetadataStore

async def main():
    store = await SqliteMetadataStore.open(sys.argv[1])
    await store.put("/kept", b"1")
    raise SystemExit(3)  # dies without closing the store

asyncio.run(main())
"""


async def test_a_process_that_never_closes_the_store_still_exits(tmp_path: Path) -> None:
    """The writer thread must not keep the interpreter alive (it waited on its queue for
    ever); what was acknowledged is still there."""
    script = tmp_path / "unclosed.py"
    script.write_text(UNCLOSED_CHILD)
    db = tmp_path / "meta.db"
    env = {**os.environ, "PYTHONPATH": str(SRC_DIR)}
    child = await asyncio.create_subprocess_exec(sys.executable, str(script), str(db), env=env)
    try:
        # A hang guard, not a performance bound: the child needs well under a second.
        code = await asyncio.wait_for(child.wait(), 120)
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()
    assert code == 3
    store = await SqliteMetadataStore.open(db)
    try:
        record = await store.get("/kept")
        assert record is not None and record.value == b"1"
    finally:
        await store.close()
