"""Child process of test_crash: appends until killed, printing each acknowledged entry.

Usage: ``python -m tests.storage.crash_child DATA_DIR SEED``. One line per acknowledged
append: ``<ledger_id> <entry_id> <sha256 of the payload>``, flushed at once.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import sys
from pathlib import Path

from anabranch.metadata.memory import MemoryMetadataStore
from anabranch.storage.api import ManagedLedgerConfig
from anabranch.storage.ledger import FileManagedLedgerFactory


async def main(data_dir: Path, seed: int) -> None:
    rng = random.Random(seed)
    factory = FileManagedLedgerFactory(data_dir, MemoryMetadataStore())
    # One ledger only: the parent recovers the file itself (metadata dies with the child).
    ml = await factory.open("crash", ManagedLedgerConfig(fsync="always", ledger_entries_max=10**9))
    out = sys.stdout

    async def appender(worker: int) -> None:
        n = 0
        while True:
            payload = rng.randbytes(rng.choice((1, 100, 1000, 5000))) + f"{worker}:{n}".encode()
            pos = await ml.append(payload)
            out.write(f"{pos.ledger_id} {pos.entry_id} {hashlib.sha256(payload).hexdigest()}\n")
            out.flush()
            n += 1

    await asyncio.gather(*(appender(w) for w in range(rng.randint(1, 32))))


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), int(sys.argv[2])))
