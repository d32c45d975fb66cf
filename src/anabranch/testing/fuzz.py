"""Live fuzzing of a broker: generated and mutated frames, and malformed HTTP requests.

Issue 15 asks for a broker that a hostile client cannot crash, stall or bloat. This module
is the driver both the CI test (``tests/faults/test_fuzz.py``, tens of thousands of
frames) and the benchmark (``benchmarks/fuzz_frames.py``, a million) use:

* :class:`FrameGenerator` builds well-formed frames of every ``BaseCommand`` type by
  walking the protobuf descriptors: every required field set, optional ones at random,
  integers at their extremes (0, -1, 2^31-1, 2^63-1, 2^64-1) or small (so ids meet
  again: a SEND for producer 3 after a PRODUCER 3), names from a small pool of valid
  topics (so topics are really loaded, but only a few) or invalid ones; SEND and MESSAGE
  carry a random message section.
* :class:`Mutator` breaks frames: bit flips, interesting bytes, truncation, inserted and
  duplicated bytes, length-prefix lies, ``cmdSize`` lies, checksum lies, a command type
  that does not match its body (or no type at all), and concatenations of two frames.
* :func:`fuzz_frames` keeps ``connections`` concurrent connections to a live broker.
  Each sends CONNECT (nine times in ten) and waits for CONNECTED (the broker refuses
  anything pipelined before the handshake completes), then bursts of frames, each
  followed by a PING. A burst of well-formed frames must get a PONG for every PING in
  it, within ``ANSWER_TIMEOUT_S``, else it counts in ``unanswered_pings``; after a
  burst with mutated frames the connection is dropped (its byte stream may be out of
  step). Meanwhile a *probe* process (``python -m anabranch.testing.fuzz probe``, its
  own process so that the fuzzer's CPU use never shows as a broker stall) keeps a
  healthy connection and measures each PING→PONG round trip: the largest is the
  broker's longest stall. The broker's RSS is sampled from ``/proc``.
* :func:`fuzz_http` sends random and mutated JSON bodies and parameter values to every
  route of the broker's OpenAPI document (plus random paths and methods) and records
  any 500 and any body that shows a traceback or a file path.

Each connection's frames follow from the seed (the interleaving of connections does not):
the report keeps, for every unanswered burst, everything its connection sent, to replay.

Example:
    >>> import random
    >>> gen = FrameGenerator(random.Random(1))
    >>> from anabranch.protocol.frames import FrameDecoder
    >>> frame = gen.frame(pb.BaseCommand.PING)
    >>> [f.type_name for f in FrameDecoder().feed(frame)]
    ['PING']
    >>> len(Mutator(random.Random(1)).mutate(frame, frame)) > 0
    True
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from google.protobuf.descriptor import FieldDescriptor  # type: ignore[import-untyped]
from google.protobuf.message import Message  # type: ignore[import-untyped]

from anabranch.protocol import commands
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.protocol.commands import CLIENT_COMMANDS
from anabranch.protocol.frames import (
    MAGIC_CHECKSUM,
    PAYLOAD_COMMANDS,
    encode_command,
    encode_entry,
)

_U32 = struct.Struct(">I")
_U16 = struct.Struct(">H")

ALL_TYPES: tuple[int, ...] = tuple(sorted(pb.BaseCommand.Type.values()))
"""Every BaseCommand type number."""

CLIENT_TYPES: tuple[int, ...] = tuple(
    sorted(int(t) for t in CLIENT_COMMANDS if t not in (pb.BaseCommand.CONNECT,))
)
"""What a client may send after CONNECT."""
SESSION_TYPES: tuple[int, ...] = tuple(
    t
    for t in CLIENT_TYPES
    if t
    not in (
        pb.BaseCommand.AUTH_RESPONSE,
        pb.BaseCommand.END_TXN_ON_PARTITION,
        pb.BaseCommand.END_TXN_ON_SUBSCRIPTION,
    )
)
"""Most generated frames: client commands the broker handles without closing the
connection (so a burst goes on). A few are any client command or any type at all, which
the broker answers with ERROR and a close."""

_BODY_FIELDS: dict[int, FieldDescriptor] = dict(pb.BaseCommand.DESCRIPTOR.fields_by_number)

FUZZ_TOPICS: tuple[str, ...] = (
    *(f"persistent://public/default/fuzz-{i}" for i in range(6)),
    "non-persistent://public/default/fuzz-np",
    "persistent://public/default/fuzz-p-partition-0",
)
"""The valid names the generator uses (a bounded set: the fuzzer must not measure how many
topics the broker can hold, which the resource caps bound separately)."""

_BAD_NAMES: tuple[str, ...] = (
    "",
    "persistent://",
    "persistent://public/default/",
    "persistent://nope/none/x",
    "segment://public/default/fuzz-0/ffff-0000-1",
    "persistent://public/default/" + "x" * 300,
    "persistent://public/default/../../etc/passwd",
    "persistent://public/default/a\x00b",
    "persistent://public/default/\u00e9\u2603\U0001f600",
    "http://x/y",
    "%2e%2e/%2e%2e",
    "public/default/&txn",
)
_WORDS: tuple[str, ...] = ("sub", "s1", "p", "fuzz", "Shared", "public", "default", "a" * 64)
_INT32 = (0, 1, -1, 2, 2**31 - 1, -(2**31), 2**15, 1000)
_UINT32 = (0, 1, 2, 2**32 - 1, 2**31 - 1, 2**31, 1000)
_INT64 = (0, 1, -1, 2**63 - 1, -(2**63), 2**31 - 1, 2**32, 10**12)
_UINT64 = (0, 1, 2**64 - 1, 2**63 - 1, 2**63, 2**32, 10**12)
_MAX_DEPTH = 3
_REPEATS = (0, 0, 1, 1, 2, 3, 17) * 4 + (200,)


class FrameGenerator:
    """Well-formed frames with random and extreme field values (see the module docstring)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self._junk = [
            "".join(chr(rng.randint(1, 0x2FF)) for _ in range(rng.choice((0, 1, 8, 40, 1000))))
            for _ in range(64)
        ]

    # --- values -------------------------------------------------------------------------

    def _int(self, extremes: Sequence[int], lo: int, hi: int) -> int:
        roll = self.rng.random()
        if roll < 0.5:
            return self.rng.randint(max(lo, 0), min(hi, 7))  # ids that meet again
        if roll < 0.8:
            return self.rng.choice(extremes)
        return self.rng.randint(lo, hi)

    def _string(self, name: str) -> str:
        roll = self.rng.random()
        if "topic" in name or name in ("original_principal",):
            if roll < 0.8:
                return self.rng.choice(FUZZ_TOPICS)
            return self.rng.choice(_BAD_NAMES)
        if roll < 0.5:
            return self.rng.choice(_WORDS)
        if roll < 0.7:
            return self.rng.choice(FUZZ_TOPICS)
        if roll < 0.85:
            return self.rng.choice(_BAD_NAMES)
        return self.rng.choice(self._junk)

    def _bytes(self) -> bytes:
        return self.rng.randbytes(self.rng.choice((0, 1, 8, 33, 256, 256, 4096)))

    def _scalar(self, fd: FieldDescriptor) -> Any:
        ct = fd.cpp_type
        if ct == FieldDescriptor.CPPTYPE_INT32:
            return self._int(_INT32, -(2**31), 2**31 - 1)
        if ct == FieldDescriptor.CPPTYPE_UINT32:
            return self._int(_UINT32, 0, 2**32 - 1)
        if ct == FieldDescriptor.CPPTYPE_INT64:
            return self._int(_INT64, -(2**63), 2**63 - 1)
        if ct == FieldDescriptor.CPPTYPE_UINT64:
            return self._int(_UINT64, 0, 2**64 - 1)
        if ct == FieldDescriptor.CPPTYPE_BOOL:
            return self.rng.random() < 0.5
        if ct in (FieldDescriptor.CPPTYPE_DOUBLE, FieldDescriptor.CPPTYPE_FLOAT):
            return self.rng.choice((0.0, -1.0, 1e300, float("inf"), float("nan"), 0.5))
        if ct == FieldDescriptor.CPPTYPE_ENUM:
            return self.rng.choice(fd.enum_type.values).number
        if fd.type == FieldDescriptor.TYPE_BYTES:
            return self._bytes()
        return self._string(fd.name)

    def fill(self, message: Message, depth: int = 0) -> Message:
        """Set every required field of ``message`` and some optional ones, recursively."""
        rng = self.rng
        for fd in message.DESCRIPTOR.fields:
            if not fd.is_required and (depth >= _MAX_DEPTH or rng.random() < 0.5):
                continue
            if fd.is_repeated:
                count = rng.choice(_REPEATS) if depth < _MAX_DEPTH else 0
                container = getattr(message, fd.name)
                for _ in range(count):
                    if fd.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE:
                        self.fill(container.add(), depth + 1)
                    else:
                        container.append(self._scalar(fd))
            elif fd.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE:
                sub = getattr(message, fd.name)
                sub.SetInParent()
                self.fill(sub, depth + 1)
            else:
                setattr(message, fd.name, self._scalar(fd))
        return message

    # --- frames -------------------------------------------------------------------------

    def command(self, command_type: int | None = None) -> pb.BaseCommand:
        """A BaseCommand of ``command_type`` (random when None) with a random body."""
        if command_type is None:
            roll = self.rng.random()
            pool = SESSION_TYPES if roll < 0.995 else CLIENT_TYPES if roll < 0.9975 else ALL_TYPES
            command_type = self.rng.choice(pool)
        cmd = pb.BaseCommand()
        cmd.type = command_type  # type: ignore[assignment]
        body = _BODY_FIELDS.get(command_type)
        if body is not None:
            sub = getattr(cmd, body.name)
            sub.SetInParent()
            self.fill(sub)
        return cmd

    def metadata(self) -> pb.MessageMetadata:
        md = pb.MessageMetadata()
        if self.rng.random() < 0.5:  # a plain message most of the time
            md.producer_name = self.rng.choice(_WORDS)
            md.sequence_id = self._int(_UINT64, 0, 2**64 - 1)
            md.publish_time = self._int(_UINT64, 0, 2**64 - 1)
            return md
        self.fill(md, depth=1)
        return md

    def frame(self, command_type: int | None = None) -> bytes:
        """One well-formed frame (a payload frame for SEND and MESSAGE)."""
        cmd = self.command(command_type)
        if cmd.type not in PAYLOAD_COMMANDS:
            return encode_command(cmd)
        entry = encode_entry(self.metadata(), self._bytes(), checksum=self.rng.random() < 0.8)
        raw = bytes(cmd.SerializeToString())
        rest = _U32.pack(len(raw)) + raw + entry
        return _U32.pack(len(rest)) + rest


def _varint(value: int) -> bytes:
    out = bytearray()
    value &= (1 << 64) - 1
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


_INTERESTING = (0x00, 0xFF, 0x7F, 0x80, 0x01, 0xFE)
_SIZE_LIES = (0, 1, 3, 4, 5, 2**31 - 1, 2**32 - 1, 2**31, 64 << 20, 1 << 20)


class Mutator:
    """Breaks frames (see the module docstring). Every result is non-empty."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.ops: tuple[Callable[[bytearray, bytes], bytes], ...] = (
            self._bit_flips,
            self._interesting_bytes,
            self._truncate,
            self._insert,
            self._duplicate,
            self._length_lie,
            self._cmd_size_lie,
            self._checksum_lie,
            self._type_lie,
            self._concat,
        )

    def mutate(self, frame: bytes, other: bytes) -> bytes:
        """``frame`` broken by one to three mutations (``other`` is spliced in by some)."""
        data = frame
        for _ in range(self.rng.choice((1, 1, 1, 2, 3))):
            data = self.rng.choice(self.ops)(bytearray(data), other) or b"\x00"
        return data

    def _pos(self, data: bytearray) -> int:
        return self.rng.randrange(len(data)) if data else 0

    def _bit_flips(self, data: bytearray, other: bytes) -> bytes:
        for _ in range(self.rng.randint(1, 8)):
            if data:
                data[self._pos(data)] ^= 1 << self.rng.randrange(8)
        return bytes(data)

    def _interesting_bytes(self, data: bytearray, other: bytes) -> bytes:
        for _ in range(self.rng.randint(1, 4)):
            if data:
                data[self._pos(data)] = self.rng.choice(_INTERESTING)
        return bytes(data)

    def _truncate(self, data: bytearray, other: bytes) -> bytes:
        return bytes(data[: self._pos(data)])

    def _insert(self, data: bytearray, other: bytes) -> bytes:
        at = self._pos(data)
        data[at:at] = self.rng.randbytes(self.rng.choice((1, 4, 16, 300)))
        return bytes(data)

    def _duplicate(self, data: bytearray, other: bytes) -> bytes:
        at = self._pos(data)
        chunk = data[at : at + self.rng.randint(1, 64)]
        data[at:at] = chunk * self.rng.randint(1, 4)
        return bytes(data)

    def _size_lie(self, actual: int) -> int:
        roll = self.rng.random()
        if roll < 0.5:
            return max(0, actual + self.rng.choice((-4, -2, -1, 1, 2, 4, 100)))
        return self.rng.choice(_SIZE_LIES)

    def _length_lie(self, data: bytearray, other: bytes) -> bytes:
        if len(data) >= 4:
            (actual,) = _U32.unpack_from(data, 0)
            data[0:4] = _U32.pack(self._size_lie(actual) & 0xFFFFFFFF)
        return bytes(data)

    def _cmd_size_lie(self, data: bytearray, other: bytes) -> bytes:
        if len(data) >= 8:
            (actual,) = _U32.unpack_from(data, 4)
            data[4:8] = _U32.pack(self._size_lie(actual) & 0xFFFFFFFF)
        return bytes(data)

    def _checksum_lie(self, data: bytearray, other: bytes) -> bytes:
        at = data.find(_U16.pack(MAGIC_CHECKSUM), 8)
        if at != -1 and at + 6 <= len(data):
            data[at + 2 + self.rng.randrange(4)] ^= 1 << self.rng.randrange(8)
        elif data:
            data[-1] ^= 0x01  # no checksum: damage the payload instead
        return bytes(data)

    def _type_lie(self, data: bytearray, other: bytes) -> bytes:
        """Re-frame the command with another ``type`` appended (the last one wins), so the
        type no longer matches the body; sizes stay consistent."""
        if len(data) < 8:
            return bytes(data)
        (cmd_size,) = _U32.unpack_from(data, 4)
        if 8 + cmd_size > len(data):
            return bytes(data)
        roll = self.rng.random()
        if roll < 0.6:
            new_type = self.rng.choice(ALL_TYPES)
        elif roll < 0.8:
            new_type = self.rng.choice((0, 1, 99, 2**31 - 1, 2**32 - 1, 2**64 - 1))
        else:
            new_type = self.rng.randrange(2**32)
        cmd = bytes(data[8 : 8 + cmd_size]) + b"\x08" + _varint(new_type)
        rest = _U32.pack(len(cmd)) + cmd + bytes(data[8 + cmd_size :])
        return _U32.pack(len(rest)) + rest

    def _concat(self, data: bytearray, other: bytes) -> bytes:
        if self.rng.random() < 0.5:
            return bytes(data) + other
        return bytes(data[: self._pos(data)]) + other


# --- the live run -----------------------------------------------------------------------


@dataclass
class FuzzReport:
    """What a run saw. ``crashes`` is 1 when the broker process died (it is not restarted);
    ``max_stall_ms`` is the probe's longest PING→PONG round trip."""

    target: int = 0
    frames: int = 0
    mutated: int = 0
    frames_answered: int = 0
    """Frames of bursts whose closing PING was answered: all of them were handled."""
    bytes_sent: int = 0
    connections: int = 0
    closed_by_broker: int = 0
    unanswered_pings: int = 0
    slowest_burst_ms: float = 0.0
    """The longest a burst of well-formed frames waited for its PONG (one connection's
    commands are handled in order, so a slow command holds up that connection only)."""
    slowest_burst: bytes = field(default=b"", repr=False)
    crashes: int = 0
    max_stall_ms: float = 0.0
    p99_stall_ms: float = 0.0
    probe_pings: int = 0
    probe_failures: int = 0
    rss_start_mb: float = 0.0
    rss_peak_mb: float = 0.0
    rss_end_mb: float = 0.0
    http_requests: int = 0
    http_500: int = 0
    http_leaks: int = 0
    frame_leaks: int = 0
    """Answers on the binary protocol showing a traceback or one of the given markers."""
    leak_markers: tuple[bytes, ...] = field(default=(), repr=False)
    http_statuses: dict[str, int] = field(default_factory=dict)
    elapsed_s: float = 0.0
    examples: list[str] = field(default_factory=list)
    """A few inputs that misbehaved (described, truncated)."""
    stuck: list[bytes] = field(default_factory=list, repr=False)
    """For each burst of well-formed frames the broker did not answer, everything its
    connection sent after CONNECT (to replay)."""

    def to_json(self) -> str:
        fields = asdict(self)
        fields.pop("stuck")
        fields.pop("slowest_burst")
        fields.pop("leak_markers")
        return json.dumps(fields, sort_keys=True)


_PONG = encode_command(commands.pong())
_PING = encode_command(commands.ping())
_CONNECT = encode_command(commands.connect("anabranch-fuzz"))
ANSWER_TIMEOUT_S = 10.0
"""How long a connection that sent only well-formed frames waits for the PONG after its
burst before giving up on it (counted in ``unanswered_pings``: a broker that answers no
PING after well-formed input is stuck on that connection; the probe measures stalls
of the whole broker precisely)."""
MUTATED_ANSWER_TIMEOUT_S = 0.5
"""The same wait after a burst with mutated frames (not counted: see the call)."""


def rss_mb(pid: int) -> float:
    """The resident set size of process ``pid`` in MiB (0.0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


async def _read_until_pong(
    reader: asyncio.StreamReader, count: int = 1, report: FuzzReport | None = None
) -> bool:
    """Discard what the broker sends until ``count`` PONGs (True) or its close (False);
    count answers that show one of ``report.leak_markers`` (a traceback, a path)."""
    tail = b""
    while count > 0:
        chunk = await reader.read(65536)
        if not chunk:
            return False
        # Every match ends in ``chunk``: ``tail`` is shorter than a PONG.
        joined = tail + chunk
        count -= joined.count(_PONG)
        tail = joined[-(len(_PONG) - 1) :]
        if report is not None and any(m in chunk for m in report.leak_markers):
            report.frame_leaks += 1
            if len(report.examples) < 10:
                report.examples.append(f"leak in an answer: {chunk[:300]!r}")
    return True


async def _one_connection(
    host: str, port: int, gen: FrameGenerator, mut: Mutator, report: FuzzReport
) -> None:
    """One connection: CONNECT (most of the time), then bursts of frames, each closed by
    a PING whose PONG says the broker handled the whole burst, until the broker closes
    the connection, a burst goes unanswered, or a random number of bursts is done."""
    rng = gen.rng
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError:
        await asyncio.sleep(0.05)
        return
    report.connections += 1
    try:
        if rng.random() < 0.9:
            # Frames pipelined behind CONNECT, before CONNECTED, are refused by design
            # (nothing before the handshake completes): wait for the answer.
            writer.write(_CONNECT)
            try:
                answer = await asyncio.wait_for(reader.read(65536), ANSWER_TIMEOUT_S)
            except TimeoutError:
                report.unanswered_pings += 1
                if len(report.examples) < 10:
                    report.examples.append("unanswered CONNECT")
                return
            if not answer:
                report.closed_by_broker += 1
                return
        conn = _Conn(reader, writer, gen, mut, report)
        for _ in range(rng.choice((1, 2, 5, 20))):
            if report.frames >= report.target or not await _burst(conn):
                return
    except (ConnectionError, OSError):
        report.closed_by_broker += 1
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


def _describe(data: bytes) -> str:
    """The commands in ``data`` (well-formed frames), for a report."""
    from anabranch.protocol.frames import FrameDecoder

    try:
        frames = FrameDecoder(max_frame_size=1 << 30).feed(data)
    except Exception as err:  # a report must not fail: say what happened instead
        return f"undecodable ({err!r})"
    return "; ".join(str(f.command).replace("\n", " ")[:300] for f in frames)


@dataclass
class _Conn:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    gen: FrameGenerator
    mut: Mutator
    report: FuzzReport
    history: list[bytes] = field(default_factory=list)
    """What the connection sent after CONNECT."""


async def _burst(conn: _Conn) -> bool:
    """Send one burst and its PING; whether it was well-formed and answered (then the
    connection may go on)."""
    gen, mut, report, writer, history = conn.gen, conn.mut, conn.report, conn.writer, conn.history
    rng = gen.rng
    burst = min(report.target - report.frames, rng.choice((1, 4, 16, 64, 256)))
    mutate_rate = rng.choice((0.0, 0.0, 0.02, 0.3, 1.0))
    parts: list[bytes] = []
    previous = _PING
    mutated = 0
    for _ in range(burst):
        frame = gen.frame()
        if rng.random() < mutate_rate:
            frame = mut.mutate(frame, previous)
            mutated += 1
        previous = frame
        parts.append(frame)
    report.frames += burst
    report.mutated += mutated
    # Every PING of the burst must be answered (the generator makes PINGs too: the first
    # PONG may answer one of those, before the rest of the burst was handled).
    pings = parts.count(_PING) + 1
    parts.append(_PING)
    data = b"".join(parts)
    history.append(data)
    report.bytes_sent += len(data)
    started = time.perf_counter()
    writer.write(data)
    try:
        # A mutated length prefix may leave the broker waiting for bytes that never come
        # (our PING becomes part of that frame): wait briefly then, for one PONG or the
        # close, and end the connection (its byte stream may be out of step). A burst of
        # only well-formed frames must be answered, every PING of it.
        _, answered = await asyncio.wait_for(
            asyncio.gather(
                writer.drain(), _read_until_pong(conn.reader, 1 if mutated else pings, report)
            ),
            MUTATED_ANSWER_TIMEOUT_S if mutated else ANSWER_TIMEOUT_S,
        )
    except TimeoutError:
        if not mutated:
            report.unanswered_pings += 1
            if len(report.examples) < 10:
                port = writer.get_extra_info("sockname")[1]
                report.examples.append(f"port {port}: unanswered burst: {_describe(data)}")
            report.stuck.append(b"".join(history))
        return False
    if answered:
        report.frames_answered += burst
        if not mutated:
            took_ms = (time.perf_counter() - started) * 1000
            if took_ms > report.slowest_burst_ms:
                report.slowest_burst_ms = round(took_ms, 1)
                report.slowest_burst = data
    else:
        report.closed_by_broker += 1
    return answered and not mutated


async def _worker(
    host: str, port: int, seed: int, report: FuzzReport, alive: Callable[[], bool]
) -> None:
    rng = random.Random(seed)
    gen, mut = FrameGenerator(rng), Mutator(rng)
    while report.frames < report.target and alive():
        await _one_connection(host, port, gen, mut, report)


class Probe:
    """The stall probe in its own process (see the module docstring)."""

    def __init__(self, host: str, port: int, interval_s: float = 0.01) -> None:
        self._args = [
            sys.executable, "-m", "anabranch.testing.fuzz", "probe",
            host, str(port), str(interval_s),
        ]  # fmt: skip
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self._process = subprocess.Popen(
            self._args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=dict(os.environ)
        )
        assert self._process.stdout is not None
        self._process.stdout.readline()  # "ready": connected and handshaken

    def stop(self) -> dict[str, float]:
        """Stop it; its figures (max_ms, p99_ms, pings, failures)."""
        process = self._process
        assert process is not None
        out, _ = process.communicate(b"stop\n", timeout=60)
        lines = out.decode().strip().splitlines()
        result: dict[str, float] = json.loads(lines[-1]) if lines else {}
        return result


async def _probe_main(host: str, port: int, interval_s: float) -> dict[str, float]:
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(_CONNECT)
    await writer.drain()
    await reader.read(65536)  # CONNECTED
    print("ready", flush=True)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_reader(sys.stdin.fileno(), stop.set)
    rtts: list[float] = []
    failures = 0
    while not stop.is_set():
        start = time.perf_counter()
        try:
            writer.write(_PING)
            await writer.drain()
            if not await _read_until_pong(reader):
                raise ConnectionError("closed")
            rtts.append((time.perf_counter() - start) * 1000)
        except (ConnectionError, OSError):
            failures += 1
            await asyncio.sleep(0.5)
            with contextlib.suppress(OSError):
                reader, writer = await asyncio.open_connection(host, port)
                writer.write(_CONNECT)
                await writer.drain()
                await reader.read(65536)
        await asyncio.sleep(interval_s)
    rtts.sort()
    return {
        "max_ms": rtts[-1] if rtts else 0.0,
        "p99_ms": rtts[int(len(rtts) * 0.99)] if rtts else 0.0,
        "pings": float(len(rtts)),
        "failures": float(failures),
    }


async def fuzz_frames(
    host: str,
    port: int,
    *,
    frames: int,
    seed: int = 0,
    connections: int = 6,
    broker_pid: int | None = None,
    progress: Callable[[FuzzReport], None] | None = None,
    leak_markers: Sequence[str] = (),
) -> FuzzReport:
    """Send ``frames`` generated and mutated frames to the broker at ``host:port`` (see
    the module docstring); watch process ``broker_pid`` (crash, RSS) when given; count
    answers that show a traceback or one of ``leak_markers`` (e.g. the data directory)."""
    markers = (b"Traceback", *(m.encode() for m in leak_markers))
    report = FuzzReport(target=frames, leak_markers=markers)
    started = time.perf_counter()

    def alive() -> bool:
        return broker_pid is None or rss_mb(broker_pid) > 0.0

    if broker_pid is not None:
        report.rss_start_mb = report.rss_peak_mb = rss_mb(broker_pid)
    probe = Probe(host, port)
    await asyncio.to_thread(probe.start)
    try:
        # A worker that fails cancels the others and its error leaves the group.
        async with asyncio.TaskGroup() as group:
            workers = [
                group.create_task(_worker(host, port, seed * 1000 + i, report, alive))
                for i in range(connections)
            ]
            while not all(w.done() for w in workers):
                await asyncio.wait(workers, timeout=0.5)
                if broker_pid is not None:
                    now = rss_mb(broker_pid)
                    if now == 0.0:
                        report.crashes = 1
                    report.rss_peak_mb = max(report.rss_peak_mb, now)
                if progress is not None:
                    progress(report)
    finally:
        figures = await asyncio.to_thread(probe.stop)
    report.max_stall_ms = round(figures.get("max_ms", 0.0), 1)
    report.p99_stall_ms = round(figures.get("p99_ms", 0.0), 1)
    report.probe_pings = int(figures.get("pings", 0))
    report.probe_failures = int(figures.get("failures", 0))
    if broker_pid is not None:
        report.rss_end_mb = rss_mb(broker_pid)
        if report.rss_end_mb == 0.0:
            report.crashes = 1
    report.elapsed_s = round(time.perf_counter() - started, 1)
    return report


# --- HTTP -------------------------------------------------------------------------------

_CONTENT_TYPES = (*("application/json",) * 4, "text/plain", "", "application/x-www-form-urlencoded")
_METHODS = ("GET", "PUT", "POST", "DELETE", "PATCH", "HEAD", "OPTIONS")
_PARAM_VALUES = (
    "public", "default", "fuzz-0", "fuzz-1", "fuzz-http", "sub", "0", "-1", "1",
    "99999999999999999999", "", "..", "%2e%2e", "a%2Fb", "x" * 300, "\u00e9\u2603",
    "persistent", "ffff", "0000-ffff", "null", "true", "%00", "a&b", "1:2", "-1:-1",
)  # fmt: skip


class HttpFuzzer:
    """Random and mutated requests for the routes of an OpenAPI document."""

    def __init__(self, rng: random.Random, openapi: dict[str, Any]) -> None:
        self.rng = rng
        self.routes: list[tuple[str, str, dict[str, Any] | None]] = []
        for path, ops in openapi.get("paths", {}).items():
            for method, op in ops.items():
                body = op.get("requestBody", {}).get("content", {}).get("application/json", {})
                self.routes.append((method.upper(), path, body.get("schema")))

    def json_value(self, depth: int = 0) -> Any:
        rng = self.rng
        kind = rng.randrange(9 if depth < 3 else 6)
        if kind == 0:
            return None
        if kind == 1:
            return rng.random() < 0.5
        if kind == 2:
            return rng.choice((0, -1, 2**63, 2**64, 10**30, 2**31 - 1, 1.5, -0.0))
        if kind == 3:
            return rng.choice(_PARAM_VALUES)
        if kind == 4:
            return rng.choice(FUZZ_TOPICS)
        if kind == 5:
            return "".join(chr(rng.randint(1, 0x2FF)) for _ in range(rng.choice((0, 5, 50))))
        if kind in (6, 7):
            keys = [*_WORDS, "retentionTimeInMinutes", "retentionSizeInMB", "roles"]
            return {rng.choice(keys): self.json_value(depth + 1) for _ in range(rng.randint(0, 5))}
        return [self.json_value(depth + 1) for _ in range(rng.randint(0, 5))]

    def body_for(self, schema: dict[str, Any] | None) -> bytes:
        rng = self.rng
        roll = rng.random()
        if schema is not None and roll < 0.4:
            props = schema.get("properties", {})
            value: Any = {k: self.json_value(1) for k in props if rng.random() < 0.7}
        elif roll < 0.7:
            value = self.json_value()
        elif roll < 0.8:
            return rng.randbytes(rng.choice((0, 1, 16, 512)))
        else:
            raw = bytearray(json.dumps(self.json_value()).encode())
            for _ in range(rng.randint(1, 4)):
                if raw:
                    raw[rng.randrange(len(raw))] = rng.randrange(256)
            return bytes(raw[: rng.randint(0, len(raw))] if rng.random() < 0.3 else raw)
        return json.dumps(value).encode()

    def request(self) -> tuple[str, str, bytes, str]:
        """(method, path, body, content type)."""
        rng = self.rng
        if not self.routes or rng.random() < 0.1:
            count = rng.randint(0, 6)
            path = "/admin/v2/" + "/".join(rng.choice(_PARAM_VALUES) for _ in range(count))
            return rng.choice(_METHODS), path, self.body_for(None), "application/json"
        method, template, schema = rng.choice(self.routes)
        if rng.random() < 0.1:
            method = rng.choice(_METHODS)
        path = "/".join(
            rng.choice(_PARAM_VALUES) if part.startswith("{") and part.endswith("}") else part
            for part in template.split("/")
        )
        if rng.random() < 0.2:
            path += "?" + rng.choice(("force=true", "authoritative=x", "a=%ZZ", "force"))
        ctype = rng.choice(_CONTENT_TYPES)
        return method, path, self.body_for(schema), ctype


async def fuzz_http(
    base_url: str, *, requests: int, seed: int = 0, leak_markers: Sequence[str] = ()
) -> FuzzReport:
    """Send ``requests`` random/mutated requests to the admin API at ``base_url``."""
    import aiohttp

    rng = random.Random(seed)
    report = FuzzReport()
    started = time.perf_counter()
    timeout = aiohttp.ClientTimeout(total=30)
    markers = ("Traceback", 'File "', *leak_markers)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.get(base_url + "/openapi.json") as resp:
            doc = await resp.json() if resp.status == 200 else {}
        fuzzer = HttpFuzzer(rng, doc)
        for _ in range(requests):
            method, path, body, ctype = fuzzer.request()
            headers = {"Content-Type": ctype} if ctype else {}
            try:
                async with session.request(
                    method, base_url + path, data=body, headers=headers, allow_redirects=False
                ) as resp:
                    text = await resp.text(errors="replace")
                    status = resp.status
            except aiohttp.ClientError as err:
                status, text = 0, repr(err)
            except ValueError as err:  # a path aiohttp itself refuses to send
                report.http_statuses["refused-by-client"] = (
                    report.http_statuses.get("refused-by-client", 0) + 1
                )
                del err
                continue
            report.http_requests += 1
            key = str(status)
            report.http_statuses[key] = report.http_statuses.get(key, 0) + 1
            bad = (status >= 500 and status != 503) or status == 0
            leak = any(m in text for m in markers)
            report.http_500 += bad
            report.http_leaks += leak
            if (bad or leak) and len(report.examples) < 10:
                report.examples.append(f"{method} {path} {body[:200]!r} -> {status} {text[:200]}")
    report.elapsed_s = round(time.perf_counter() - started, 1)
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="anabranch.testing.fuzz")
    sub = parser.add_subparsers(dest="cmd", required=True)
    probe = sub.add_parser("probe", help="PING the broker until stdin has a line; print figures")
    probe.add_argument("host")
    probe.add_argument("port", type=int)
    probe.add_argument("interval_s", type=float)
    args = parser.parse_args(argv)
    figures = asyncio.run(_probe_main(args.host, args.port, args.interval_s))
    print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    main()
