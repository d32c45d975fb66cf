"""Topic discovery for regex subscriptions: what GET_TOPICS_OF_NAMESPACE costs with and
without a broker-side pattern and the list hash, and how soon a topic-list watcher hears of
a new topic.

One broker subprocess (standalone, ``fsync=never``) with ``--topics`` registered topics in
``public/default``, a tenth of them named ``orders-*``. Cases, ``--reps`` repetitions of
``--requests`` sequential requests each (medians of the repetitions' p50s reported):

* ``unfiltered`` (the baseline: what the official Python client sends, no pattern, no hash);
* ``pattern`` (``topics_pattern`` matching the tenth: ``filtered=true``);
* ``pattern_unchanged`` (pattern plus the current ``topics_hash``: ``changed=false``, no
  names), what our client's polls cost while nothing changes;
* ``watch``: a WATCH_TOPIC_LIST on the pattern, then ``--creations`` matching topics created
  through the admin API; the time from the creation's HTTP answer to the WATCH_TOPIC_UPDATE
  (the official client, polling, hears of it up to 60 s later).

The broker's peak RSS is reported beside. The last printed line is one JSON object.

Usage: ``python benchmarks/topic_discovery.py [--topics 2000] [--reps 5] [--requests 50]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from _common import loadavg, median_tree, pct, peak_rss_bytes

from anabranch.protocol import commands
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.protocol.connection import ProtocolConnection, Role
from anabranch.protocol.frames import Frame
from anabranch.testing.broker import BrokerProcess

T = pb.BaseCommand
NS = "public/default"
PATTERN = "persistent://public/default/orders-.*"


class Wire:
    """A bare protocol connection: send a command, read frames."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.conn = ProtocolConnection(Role.CLIENT)
        self.frames: list[Frame] = []

    @classmethod
    async def open(cls, port: int) -> Wire:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        wire = cls(reader, writer)
        await wire.send(commands.connect("bench-topic-discovery", pb.v21))
        await wire.expect(T.CONNECTED)
        return wire

    async def send(self, command: pb.BaseCommand) -> None:
        self.writer.write(self.conn.send(command))
        await self.writer.drain()

    async def expect(self, kind: int) -> Frame:
        while True:
            while self.frames:
                frame = self.frames.pop(0)
                if frame.type == kind:
                    return frame
            data = await self.reader.read(1 << 20)
            if not data:
                raise ConnectionError("the broker closed the connection")
            self.frames.extend(self.conn.receive_data(data))

    def close(self) -> None:
        self.writer.close()


async def create_topics(http: aiohttp.ClientSession, base: str, names: list[str]) -> None:
    slots = asyncio.Semaphore(16)

    async def one(name: str) -> None:
        async with slots, http.put(f"{base}/admin/v2/persistent/{NS}/{name}") as resp:
            if resp.status not in (204, 409):
                raise RuntimeError(f"create {name}: {resp.status} {await resp.text()}")

    await asyncio.gather(*(one(n) for n in names))


async def get_topics_case(
    wire: Wire, requests: int, pattern: str | None, with_hash: bool
) -> dict[str, float]:
    latencies, sizes = [], []
    topics_hash: str | None = None
    for i in range(requests + 1):
        body = pb.CommandGetTopicsOfNamespace(request_id=i + 1, namespace=NS)
        if pattern is not None:
            body.topics_pattern = pattern
        if with_hash and topics_hash is not None:
            body.topics_hash = topics_hash
        started = time.perf_counter()
        await wire.send(T(type=T.GET_TOPICS_OF_NAMESPACE, getTopicsOfNamespace=body))
        frame = await wire.expect(T.GET_TOPICS_OF_NAMESPACE_RESPONSE)
        elapsed = time.perf_counter() - started
        answer = frame.command.getTopicsOfNamespaceResponse
        topics_hash = answer.topics_hash
        if i == 0:
            continue  # the first one primes the hash
        latencies.append(elapsed)
        sizes.append(answer.ByteSize())
    return {
        "p50_ms": round(pct(latencies, 0.5) * 1000, 3),
        "p99_ms": round(pct(latencies, 0.99) * 1000, 3),
        "answer_bytes": int(statistics.median(sizes)),
    }


async def watch_case(
    wire: Wire, http: aiohttp.ClientSession, base: str, creations: int, run: int
) -> dict[str, float]:
    body = pb.CommandWatchTopicList(
        request_id=10_000 + run, watcher_id=run + 1, namespace=NS, topics_pattern=PATTERN
    )
    await wire.send(T(type=T.WATCH_TOPIC_LIST, watchTopicList=body))
    await wire.expect(T.WATCH_TOPIC_LIST_SUCCESS)
    latencies = []
    for i in range(creations):
        name = f"orders-new-{run}-{i}"
        async with http.put(f"{base}/admin/v2/persistent/{NS}/{name}") as resp:
            assert resp.status == 204, await resp.text()
        started = time.perf_counter()
        frame = await wire.expect(T.WATCH_TOPIC_UPDATE)
        latencies.append(time.perf_counter() - started)
        assert f"persistent://{NS}/{name}" in frame.command.watchTopicUpdate.new_topics
    close = pb.CommandWatchTopicListClose(request_id=20_000 + run, watcher_id=run + 1)
    await wire.send(T(type=T.WATCH_TOPIC_LIST_CLOSE, watchTopicListClose=close))
    await wire.expect(T.SUCCESS)
    return {"update_after_create_p50_ms": round(pct(latencies, 0.5) * 1000, 3)}


async def main(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        broker = BrokerProcess(Path(tmp) / "data", fsync="never")
        await broker.start()
        try:
            base = f"http://127.0.0.1:{broker.http_port}"
            async with aiohttp.ClientSession() as http:
                names = [f"orders-{i}" if i % 10 == 0 else f"other-{i}" for i in range(args.topics)]
                await create_topics(http, base, names)
                wire = await Wire.open(broker.port)
                runs: list[dict[str, Any]] = []
                for run in range(args.reps):
                    runs.append(
                        {
                            "unfiltered": await get_topics_case(wire, args.requests, None, False),
                            "pattern": await get_topics_case(wire, args.requests, PATTERN, False),
                            "pattern_unchanged": await get_topics_case(
                                wire, args.requests, PATTERN, True
                            ),
                            "watch": await watch_case(wire, http, base, args.creations, run),
                        }
                    )
                wire.close()
            rss = peak_rss_bytes(broker.pid) if broker.pid is not None else None
        finally:
            await broker.stop()
    return {
        "benchmark": "topic_discovery",
        "topics": args.topics,
        "reps": args.reps,
        "requests": args.requests,
        "baseline": "unfiltered",
        **median_tree(runs),
        "broker_peak_rss_mb": None if rss is None else round(rss / 2**20, 1),
        "loadavg": round(loadavg(), 2),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topics", type=int, default=2000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--creations", type=int, default=10)
    result = asyncio.run(main(parser.parse_args()))
    print(json.dumps(result))
