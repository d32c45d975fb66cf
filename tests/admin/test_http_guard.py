"""The admin HTTP server's bounds (``admin/http_guard.py``): a connection cap, an idle
timeout that also covers an unfinished request head, and a deadline for a request body."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from anabranch import limits
from anabranch.admin.http_guard import GuardedRunner, guarded_runner
from anabranch.admin.routes import body_bytes
from anabranch.testing.broker import InProcessBroker

HANG_GUARD_S = 30.0
"""Only so that a regression fails instead of hanging; never a performance bound."""


async def echo(request: web.Request) -> web.Response:
    return web.Response(body=await body_bytes(request))


@pytest.fixture
async def server() -> AsyncIterator[tuple[GuardedRunner, int]]:
    app = web.Application()
    app.router.add_post("/echo", echo)
    runner = guarded_runner(app, connections_max=2, idle_timeout_s=0.2)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield runner, int(runner.addresses[0][1])
    finally:
        await runner.cleanup()


async def closed_by_server(reader: asyncio.StreamReader) -> bytes:
    return await asyncio.wait_for(reader.read(), HANG_GUARD_S)


async def test_an_unfinished_request_head_is_closed(server: tuple[GuardedRunner, int]) -> None:
    _, port = server
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\n")  # the head never ends
    assert await closed_by_server(reader) == b""
    writer.close()


async def test_connections_past_the_cap_are_closed_and_served_again_after(
    server: tuple[GuardedRunner, int],
) -> None:
    runner, port = server
    held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    assert await closed_by_server(reader) == b""
    assert runner.guard is not None and runner.guard.refused == 1
    writer.close()
    for held_reader, held_writer in held:  # idle: the server closes them, making room
        assert await closed_by_server(held_reader) == b""
        held_writer.close()
    assert await served(port)


async def test_one_address_cannot_take_every_connection() -> None:
    app = web.Application()
    app.router.add_post("/echo", echo)
    runner = guarded_runner(app, connections_max=10, per_ip_max=2, idle_timeout_s=60.0)
    await runner.setup()
    await web.TCPSite(runner, "0.0.0.0", 0).start()
    port = int(runner.addresses[0][1])
    try:
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await closed_by_server(reader) == b""
        writer.close()
        assert runner.guard is not None and runner.guard.refused == 1
        # Another address still gets in while the first one holds its share.
        assert await served(port, source="127.0.0.2")
        for _, held_writer in held:
            held_writer.close()
        assert await served(port)  # the first address's share came back
    finally:
        await runner.cleanup()


async def served(port: int, source: str = "127.0.0.1") -> bool:
    """Whether a request is answered, trying a few times: the server may not have seen
    the freed connections go yet."""
    for _ in range(50):
        reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
        writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nok")
        try:
            line = await asyncio.wait_for(reader.readline(), HANG_GUARD_S)
        except ConnectionResetError:  # refused after the request was written
            line = b""
        writer.close()
        if line.startswith(b"HTTP/1.1 200"):
            return True
        await asyncio.sleep(0.05)
    return False


async def test_a_trickled_body_gets_400(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limits, "ADMIN_REQUEST_BODY_TIMEOUT_S", 0.2)
    async with InProcessBroker(tmp_path, ledgers="memory") as broker:
        assert broker.http_url is not None
        port = int(broker.http_url.rsplit(":", 1)[1])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        head = "POST /admin/v2/namespaces/public/default/retention HTTP/1.1\r\n"
        head += "Host: x\r\nConnection: close\r\nContent-Type: application/json\r\n"
        head += "Content-Length: 100\r\n\r\n"
        writer.write(head.encode() + b'{"retentionTimeInMinutes"')
        head_bytes = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HANG_GUARD_S)
        length = int(head_bytes.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        body = await reader.readexactly(length)
        writer.close()
        assert head_bytes.startswith(b"HTTP/1.1 400")
        assert b"did not arrive within" in body
        retention = await broker.service.policies.namespace_policies("public/default")
        assert retention.retention is None


async def test_the_broker_serves_its_admin_api_through_the_guard(tmp_path: Path) -> None:
    async with InProcessBroker(tmp_path, ledgers="memory") as broker:
        assert broker.node is not None
        runner = broker.node.http_runner
        assert isinstance(runner, GuardedRunner) and runner.guard is not None
