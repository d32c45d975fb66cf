"""Careless or hostile admin requests on scalable topics (probe 18).

Each test drives a real broker over loopback HTTP and would fail without its fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest

from anabranch import limits
from anabranch.testing.broker import InProcessBroker

NS = "public/default"


async def test_mutations_of_missing_topics_leave_no_controller(tmp_path: Path) -> None:
    """Splits, merges, subscription changes, deletes and failed creates of topics that do
    not exist answer 404 and leave nothing behind: no controller in memory, no leader
    record in the metadata store, no name in the namespace's topic list."""
    async with InProcessBroker(tmp_path, metadata="memory") as broker:
        base = f"{broker.http_url}/admin/v2/scalable"
        requests = [
            ("POST", f"{base}/{NS}/ghost-a/split/0"),
            ("POST", f"{base}/{NS}/ghost-b/merge/0/1"),
            ("PUT", f"{base}/{NS}/ghost-c/subscriptions/s"),
            ("DELETE", f"{base}/{NS}/ghost-d/subscriptions/s"),
            ("DELETE", f"{base}/{NS}/ghost-e"),
            ("PUT", f"{base}/no-tenant/no-ns/ghost-f"),
        ]
        async with aiohttp.ClientSession() as http:
            for method, url in requests:
                async with http.request(method, url) as response:
                    assert response.status == 404, (method, url, await response.text())
            async with http.get(f"{base}/{NS}") as response:
                assert await response.json() == []
        assert broker.service.scalable.local_controllers() == []
        page = await broker.service.store.list_prefix("/topics/")
        assert [r.path for r in page.records if "ghost" in r.path] == []


async def split_until_refused(
    http: aiohttp.ClientSession, base: str, attempts: int
) -> tuple[int, str, int]:
    """Split the lowest active segment until a split is refused: (status, reason, the
    segment that was refused)."""
    active = 0
    for _ in range(attempts):
        async with http.post(f"{base}/split/{active}") as response:
            if response.status != 200:
                return response.status, (await response.json())["reason"], active
            layout = await response.json()
        active = min(int(k) for k, s in layout["segments"].items() if s["state"] == "ACTIVE")
    raise AssertionError(f"{attempts} splits were all accepted")


async def assert_still_usable(
    broker: InProcessBroker, http: aiohttp.ClientSession, base: str, refused: int, status: int
) -> None:
    """The refused segment is still open for writes, and asking again gets the same
    answer (not "a split or merge in progress")."""
    layout = await (await http.get(base)).json()
    segment = layout["segments"][str(refused)]
    assert segment["state"] == "ACTIVE"
    start, end = segment["hashRange"]["start"], segment["hashRange"]["end"]
    name = f"segment://{NS}/big/{start:04x}-{end:04x}-{refused}"
    topic = await broker.service.get_topic(name, create=False)
    assert topic is not None and not topic.ledger.is_terminated
    async with http.post(f"{base}/split/{refused}") as response:
        assert response.status == status, await response.text()


async def test_split_over_the_segment_cap_is_refused_before_sealing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Split/merge cycles kept sealed segments in the layout without bound; over
    SCALABLE_SEGMENTS_MAX a split answers 429 and seals nothing."""
    monkeypatch.setattr(limits, "SCALABLE_SEGMENTS_MAX", 9)
    async with InProcessBroker(tmp_path, metadata="memory") as broker:
        base = f"{broker.http_url}/admin/v2/scalable/{NS}/big"
        async with aiohttp.ClientSession() as http:
            async with http.put(base) as response:
                assert response.status == 204
            status, reason, refused = await split_until_refused(http, base, 10)
            assert status == 429
            assert "segments in the layout" in reason and "9" in reason
            await assert_still_usable(broker, http, base, refused, 429)


async def test_split_whose_layout_is_too_large_leaves_the_topic_usable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A layout over the metadata value limit used to be found out only at its write,
    after the parent was sealed: the segment stayed ACTIVE in the layout but refused
    every message, and each later split or merge answered "in progress" for ever."""
    monkeypatch.setattr(limits, "METADATA_VALUE_BYTES_MAX", 8 * 1024)
    async with InProcessBroker(tmp_path, metadata="memory") as broker:
        base = f"{broker.http_url}/admin/v2/scalable/{NS}/big"
        async with aiohttp.ClientSession() as http:
            async with http.put(base) as response:
                assert response.status == 204
            status, reason, refused = await split_until_refused(http, base, 100)
            assert status == 413
            await assert_still_usable(broker, http, base, refused, 413)
            assert "layout of topic://public/default/big" in reason


async def test_a_failed_create_tolerates_a_controller_that_retired_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A create that fails drops the controller it made; the controller may retire itself
    (its follower saw no topic) while that cleanup reads the layout. The cleanup raised
    KeyError then and the lookup logged a traceback (seen under the fuzzer)."""
    async with InProcessBroker(tmp_path, metadata="memory") as broker:
        scalable = broker.service.scalable
        controller = await scalable.controller(f"topic://{NS}/racy")
        store = broker.service.store
        real_get = store.get

        async def get_and_retire(path: str) -> Any:
            controller._retire()  # what a follower's watch does on a deleted topic
            return await real_get(path)

        async def failing_create(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("boom")

        monkeypatch.setattr(store, "get", get_and_retire)
        monkeypatch.setattr(controller, "create", failing_create)
        with pytest.raises(RuntimeError, match="boom"):
            await scalable.create(f"topic://{NS}/racy", 1)
        assert scalable.local_controllers() == []
