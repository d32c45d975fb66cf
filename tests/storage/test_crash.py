"""SIGKILL a process that appends with fsync=always; every acknowledged entry survives.

The child (``crash_child.py``) prints each acknowledged position and payload hash; the
parent kills it at a random moment, recovers the ledger file the way ``open`` does
(scan, truncate a torn tail) and checks every acknowledged entry is present, in its
position, byte-identical. The metadata store lives in the child and dies with it, so
recovery here is at the ledger-file level (what the file backend's open runs).
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from anabranch.storage.segment_file import SegmentFile

ROOT = Path(__file__).resolve().parents[2]
SEEDS = range(30)


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
def test_acknowledged_entries_survive_sigkill(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}")
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.storage.crash_child", str(tmp_path), str(seed)],
        stdout=subprocess.PIPE,
        cwd=ROOT,
        env=env,
    )
    assert child.stdout is not None
    # Kill after a random number of acknowledgements, then a random extra delay, so the
    # kill lands anywhere in the write / fdatasync / acknowledge cycle.
    wanted = rng.randint(1, 400)
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

    [ledger_dir] = [p for p in tmp_path.iterdir() if p.is_dir()]
    [log] = sorted(ledger_dir.glob("*.log"))
    segment = SegmentFile.open_existing(ledger_dir, int(log.stem))
    try:
        entries, _ = segment.recover()
        payloads = segment.read_entries(0, entries) if entries else []
    finally:
        segment.close()
    for ledger_id, entry_id, digest in acked:
        assert int(ledger_id) == int(log.stem)
        assert int(entry_id) < entries, f"acknowledged entry {entry_id} lost ({entries} kept)"
        assert hashlib.sha256(payloads[int(entry_id)]).hexdigest() == digest
