"""What a client that never authenticates may cost the broker.

Before the broker answers CONNECTED to an admitted client it reads frames of at most
``HANDSHAKE_FRAME_SIZE_MAX_BYTES`` (a 5 MiB partial frame per connection let 100
connections without credentials take 500 MB). Wrong passwords are hashed on the basic
provider's own threads, at most ``PASSWORD_CHECKS_PENDING_MAX`` at once (a flood of them
queued in front of storage's threads: a producer's topic open waited 13 s behind 300).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import struct
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from anabranch import limits
from anabranch.protocol import commands
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.protocol.frames import Frame
from anabranch.security import htpasswd, providers_basic
from anabranch.security.authentication import Authenticated, Credentials
from anabranch.security.providers_basic import BasicProvider
from anabranch.testing.broker import InProcessBroker
from tests.broker.test_core_protocol import RawClient

T = pb.BaseCommand
TOPIC = "persistent://public/default/unauthenticated-cost"
OVER_HANDSHAKE = limits.HANDSHAKE_FRAME_SIZE_MAX_BYTES + 1024
"""A frame size above the handshake bound and far below the full one."""


def sha_hash(password: str) -> str:
    return "{SHA}" + base64.b64encode(hashlib.sha1(password.encode()).digest()).decode()


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[InProcessBroker]:
    htpasswd = tmp_path / "htpasswd"
    # ann's hash goes to the password threads; cat's {SHA} is checked inline.
    htpasswd.write_text(f"ann:$2y$04${'a' * 53}\ncat:{sha_hash('cat-pw')}\n")
    async with InProcessBroker(
        tmp_path / "data",
        authentication_enabled=True,
        authentication_providers=["basic"],
        basic_auth_conf=f"file://{htpasswd}",
        superuser_roles=["cat"],
    ) as b:
        yield b


async def connect(port: int, user_password: bytes, client: str = "raw-test") -> RawClient:
    raw = await RawClient.open(port)
    await raw.send(commands.connect(client, pb.v21, None, "basic", user_password))
    return raw


def partial_frame(size: int) -> bytes:
    """A length prefix announcing ``size`` bytes and a little of them."""
    return struct.pack(">I", size) + b"\0" * 1024


async def test_a_large_frame_before_connect_is_refused(broker: InProcessBroker) -> None:
    raw = await RawClient.open(broker.port)
    await raw.raw(partial_frame(OVER_HANDSHAKE))
    frames = await raw.closed_by_broker()
    assert [f.type for f in frames] == [T.ERROR]
    await raw.close()


async def test_a_refused_client_answered_connected_stays_bounded(
    broker: InProcessBroker,
) -> None:
    # A client other than ours gets CONNECTED for wrong credentials (its first request is
    # refused); until then it must not make the broker buffer a full-sized frame either.
    raw = await connect(broker.port, b"cat:wrong")
    await raw.expect(T.CONNECTED)
    await raw.raw(partial_frame(OVER_HANDSHAKE))
    frames = await raw.closed_by_broker()
    assert [f.type for f in frames] == [T.ERROR]
    await raw.close()


async def test_an_admitted_client_sends_full_sized_frames(broker: InProcessBroker) -> None:
    raw = await connect(broker.port, b"cat:cat-pw")
    await raw.expect(T.CONNECTED)
    await raw.producer(topic=TOPIC)
    await raw.send_message(1, 0, b"x" * OVER_HANDSHAKE)
    receipt = await raw.expect(T.SEND_RECEIPT)
    assert receipt.command.send_receipt.sequence_id == 0
    await raw.close()


class Started:
    """Authentications started; each has submitted its password check by then."""

    def __init__(self, expected: int) -> None:
        self.count = 0
        self.expected = expected
        self.all = asyncio.Event()


FLOOD = limits.PASSWORD_CHECKS_PENDING_MAX + 8
"""Wrong passwords sent at once: more than the default executor's threads (at most 32),
which storage uses, and over the bound of pending checks."""


@pytest.fixture
def stuck_checks(monkeypatch: pytest.MonkeyPatch) -> Iterator[Started]:
    """Password hashes that never finish until the test ends."""
    release = threading.Event()
    started = Started(FLOOD)

    real_check = htpasswd.check_password

    def check_password(hashed: str, password: str) -> bool:
        if hashed.startswith("{SHA}"):
            return real_check(hashed, password)
        release.wait()
        return False

    original = BasicProvider.authenticate

    async def authenticate(self: BasicProvider, credentials: Credentials) -> Authenticated:
        started.count += 1
        if started.count >= started.expected:
            started.all.set()
        return await original(self, credentials)

    monkeypatch.setattr(providers_basic, "check_password", check_password)
    monkeypatch.setattr(BasicProvider, "authenticate", authenticate)
    try:
        yield started
    finally:
        release.set()


async def first_frame(raw: RawClient) -> Frame | None:
    return await raw.recv()


async def test_a_wrong_password_flood_leaves_storage_and_new_clients_served(
    broker: InProcessBroker, stuck_checks: Started
) -> None:
    attackers = [
        await connect(broker.port, b"ann:wrong-%d" % i, client="anabranch-test")
        for i in range(FLOOD)
    ]
    await stuck_checks.all.wait()
    # The checks over the bound are refused at once, not queued behind the stuck ones.
    answers = [asyncio.ensure_future(first_frame(raw)) for raw in attackers]
    refused: list[Frame | None] = []
    pending = set(answers)
    while len(refused) < FLOOD - limits.PASSWORD_CHECKS_PENDING_MAX:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        refused += [task.result() for task in done]
    for frame in refused:
        assert frame is not None
        assert frame.type == T.ERROR
        assert frame.command.error.error == pb.AuthenticationError
        assert "too many password checks" in frame.command.error.message
    # An admitted client opens a new topic: its ledger is created on storage's threads.
    legit = await connect(broker.port, b"cat:cat-pw")
    await legit.expect(T.CONNECTED)
    await legit.producer(topic=TOPIC)
    await legit.send_message(1, 0, b"m")
    await legit.expect(T.SEND_RECEIPT)
    await legit.close()
    for task in pending:
        task.cancel()
    for raw in attackers:
        await raw.close()
