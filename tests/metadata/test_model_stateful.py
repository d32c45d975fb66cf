"""Random operation sequences against a dict model, for the memory and SQLite stores.

Each step applies one operation to the store and to the model and compares the
outcome (stat, BadVersion or not); every step ends by comparing the full listing.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path
from typing import Any, ClassVar

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from anabranch.errors import BadVersion
from anabranch.metadata.api import Check, Delete, MetadataStore, Op, Put
from anabranch.metadata.memory import MemoryMetadataStore
from anabranch.metadata.sqlite import SqliteMetadataStore

PATHS = ["/m/a", "/m/b", "/m/b/c", "/m/d"]
EXPECTATIONS = ["any", "absent", "exact", "stale"]

paths = st.sampled_from(PATHS)
values = st.binary(max_size=8)
expectations = st.sampled_from(EXPECTATIONS)


class StoreModel(RuleBasedStateMachine):
    """Model: path -> (value, version). Backend chosen by subclasses."""

    backend: ClassVar[str] = "memory"

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.tmp = Path(tempfile.mkdtemp(prefix="meta-model-"))
        self.store: MetadataStore = self.run(self.open_store())
        self.model: dict[str, tuple[bytes, int]] = {}
        self.last_sequential = ""

    async def open_store(self) -> MetadataStore:
        if self.backend == "sqlite":
            return await SqliteMetadataStore.open(self.tmp / "meta.db", synchronous="OFF")
        return MemoryMetadataStore()

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def teardown(self) -> None:
        self.run(self.store.close())
        self.loop.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def version(self, path: str) -> int:
        return self.model[path][1] if path in self.model else 0

    def expected(self, path: str, how: str) -> int | None:
        return {"any": None, "absent": 0, "exact": self.version(path)}.get(
            how, self.version(path) + 1
        )

    def holds(self, path: str, expected: int | None) -> bool:
        return expected is None or expected == self.version(path)

    @rule(path=paths, value=values, how=expectations)
    def put(self, path: str, value: bytes, how: str) -> None:
        expected = self.expected(path, how)
        if not self.holds(path, expected):
            try:
                self.run(self.store.put(path, value, expected))
            except BadVersion as err:
                assert (err.path, err.actual) == (path, self.version(path))
                return
            raise AssertionError(f"put {path} expecting {expected} should have failed")
        stat = self.run(self.store.put(path, value, expected))
        self.model[path] = (value, self.version(path) + 1)
        assert stat.version == self.version(path)

    @rule(path=paths, how=expectations)
    def delete(self, path: str, how: str) -> None:
        expected = self.expected(path, how)
        if not self.holds(path, expected):
            try:
                self.run(self.store.delete(path, expected))
            except BadVersion:
                return
            raise AssertionError(f"delete {path} expecting {expected} should have failed")
        removed = self.run(self.store.delete(path, expected))
        assert removed == (path in self.model)
        self.model.pop(path, None)

    @rule(
        writes=st.lists(st.tuples(paths, st.booleans(), values, expectations), max_size=3),
        check=st.none() | st.tuples(paths, expectations),
    )
    def commit(
        self, writes: list[tuple[str, bool, bytes, str]], check: tuple[str, str] | None
    ) -> None:
        ops: list[Op] = []
        seen: set[str] = set()
        for path, is_put, value, how in writes:
            if path in seen:
                continue
            seen.add(path)
            expected = self.expected(path, how)
            ops.append(Put(path, value, expected) if is_put else Delete(path, expected))
        if check is not None:
            ops.append(Check(check[0], self.expected(check[0], check[1])))
        if not all(self.holds(op.path, op.expected_version) for op in ops):
            before = self.run(self.store.list_prefix("/"))
            try:
                self.run(self.store.commit(ops))
            except BadVersion:
                assert self.run(self.store.list_prefix("/")) == before
                return
            raise AssertionError(f"commit {ops} should have failed")
        self.run(self.store.commit(ops))
        for op in ops:
            if isinstance(op, Put):
                self.model[op.path] = (op.value, self.version(op.path) + 1)
            elif isinstance(op, Delete):
                self.model.pop(op.path, None)

    @rule(value=values)
    def sequential(self, value: bytes) -> None:
        path = self.run(self.store.create_sequential("/m/s-", value))
        assert path > self.last_sequential
        self.last_sequential = path
        self.model[path] = (value, 1)

    @rule(limit=st.integers(min_value=1, max_value=4))
    def list_in_pages(self, limit: int) -> None:
        seen: list[tuple[str, bytes, int]] = []
        start_after: str | None = None
        while True:
            page = self.run(self.store.list_prefix("/m/", limit=limit, start_after=start_after))
            seen.extend((r.path, r.value, r.stat.version) for r in page.records)
            if not page.more:
                break
            start_after = page.records[-1].path
        assert seen == [(p, v, n) for p, (v, n) in sorted(self.model.items())]

    @invariant()
    def every_key_matches(self) -> None:
        for path in PATHS:
            record = self.run(self.store.get(path))
            if path in self.model:
                assert record is not None
                assert (record.value, record.stat.version) == self.model[path]
            else:
                assert record is None


class MemoryModel(StoreModel):
    backend = "memory"


class SqliteModel(StoreModel):
    backend = "sqlite"


MODEL_SETTINGS = settings(max_examples=20, stateful_step_count=15, deadline=None)
TestMemoryModel = MemoryModel.TestCase
TestMemoryModel.settings = MODEL_SETTINGS
TestSqliteModel = SqliteModel.TestCase
TestSqliteModel.settings = MODEL_SETTINGS
