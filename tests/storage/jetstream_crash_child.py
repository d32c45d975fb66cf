"""Child process of test_jetstream_crash: appends to a JetStream ledger until killed.

Usage: ``python -m tests.storage.jetstream_crash_child DATA_DIR SEED URL[,URL...]``. The
storage a broker with ``storage = "jetstream"`` runs: a SQLite metadata store
(``DATA_DIR/metadata.db``) and JetStream streams (R3, prefix ``c<SEED>``), with the
seed-chosen rollover size of ``crash_child`` so kills land in rollovers too. One line per
acknowledged append: ``<ledger_id> <entry_id> <sha256 of the payload>``, flushed at once.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import sys
from pathlib import Path

from anabranch.metadata.sqlite import SqliteMetadataStore
from anabranch.storage.jetstream_ledger import JetStreamManagedLedgerFactory
from tests.storage.crash_child import NAME, config_for


async def main(data_dir: Path, seed: int, urls: list[str]) -> None:
    rng = random.Random(seed + 1)
    store = await SqliteMetadataStore.open(data_dir / "metadata.db")
    factory = JetStreamManagedLedgerFactory(urls, store, prefix=f"c{seed}")
    ml = await factory.open(NAME, config_for(seed))
    out = sys.stdout

    async def appender(worker: int) -> None:
        n = 0
        while True:
            payload = rng.randbytes(rng.choice((1, 100, 1000, 5000))) + f"{worker}:{n}".encode()
            if rng.random() < 0.1:
                burst = [payload + bytes([k]) for k in range(rng.randint(1, 8))]
                positions = await ml.append_many(burst)
            else:
                burst, positions = [payload], [await ml.append(payload)]
            for pos, data in zip(positions, burst, strict=True):
                out.write(f"{pos.ledger_id} {pos.entry_id} {hashlib.sha256(data).hexdigest()}\n")
            out.flush()
            n += 1

    await asyncio.gather(*(appender(w) for w in range(rng.randint(1, 32))))


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(",")))
