"""Issue 15: names that do not fit a file name, errors that leaked the data directory's
path, and a ``max_message_size`` storage could not hold.

* a managed ledger's directory name fits any filesystem for every valid topic name
  (``storage.ledger.disk_name``): a 250-character topic works and survives a restart;
* no file path or traceback reaches a client, over the wire or over HTTP
  (``error_codes.client_message``): storage wraps OSError in a path-free StorageIOError;
  (a 1000-character topic is not valid: a name component is at most 255 characters);
* ``max_message_size`` is capped at what one storage record holds.
"""

from __future__ import annotations

import errno
from pathlib import Path

import aiohttp
import pydantic
import pytest

from anabranch import limits
from anabranch.aio import Client
from anabranch.broker.config import BrokerConfig
from anabranch.protocol import commands
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.storage.files import OsFile, StorageFile
from anabranch.storage.ledger import DISK_NAME_BYTES_MAX, FileManagedLedgerFactory, disk_name
from anabranch.testing.broker import InProcessBroker
from tests.broker.test_core_protocol import RawClient

T = pb.BaseCommand
NS = "persistent://public/default/"
LONG_NAMES = [
    "a" * 250,
    ("x=:-" * 64)[:255],  # the longest valid name; ':' and '=' quote to three bytes each
]


def assert_no_leak(message: str, data_dir: Path) -> None:
    assert str(data_dir) not in message
    assert "/tmp" not in message and ".log" not in message
    assert "Traceback" not in message and "Errno" not in message


# --- on-disk names ---------------------------------------------------------------------------


def test_disk_names_fit_any_filesystem_and_keep_short_names() -> None:
    short = "public/default/persistent/orders"
    assert disk_name(short) == "public%2Fdefault%2Fpersistent%2Forders"  # as stored today
    names = [f"public/default/persistent/{n}" for n in LONG_NAMES]
    names += [n + "-partition-1" for n in names] + [n[:-1] for n in names]
    disk = [disk_name(n) for n in names]
    assert len(set(disk)) == len(names)
    for d in disk:
        assert len(d.encode()) <= DISK_NAME_BYTES_MAX
        assert set(d) <= set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.~%-#")
        assert "#" in d  # hashed, so a short name never maps to a long one's directory
        assert not d.endswith(("%", "%3"))


@pytest.mark.parametrize("local", LONG_NAMES, ids=["250", "255-quoted-765"])
async def test_long_topic_name_produce_consume_and_restart(tmp_path: Path, local: str) -> None:
    topic = NS + local
    async with (
        InProcessBroker(tmp_path, metadata="sqlite") as broker,
        Client(broker.service_url) as client,
    ):
        consumer = await client.subscribe(topic, "sub")
        producer = await client.create_producer(topic)
        for i in range(3):
            await producer.send(f"m{i}".encode())
        got = [await consumer.receive(timeout=10) for _ in range(2)]
        assert [m.value for m in got if m is not None] == [b"m0", b"m1"]
        for m in got:
            assert m is not None
            await consumer.acknowledge(m)
        await consumer.close()
    for path in (tmp_path / "ledgers").iterdir():
        assert len(path.name.encode()) <= DISK_NAME_BYTES_MAX
    async with (
        InProcessBroker(tmp_path, metadata="sqlite") as broker,
        Client(broker.service_url) as client,
    ):
        consumer = await client.subscribe(topic, "sub")
        msg = await consumer.receive(timeout=10)
        assert msg is not None and msg.value == b"m2"
        reader = await client.create_reader(topic, "earliest")
        values = []
        while (m := await reader.read_next(timeout=2.0)) is not None:
            values.append(m.value)
        assert values == [b"m0", b"m1", b"m2"]


async def test_http_create_of_a_long_topic_name(tmp_path: Path) -> None:
    async with InProcessBroker(tmp_path) as broker, aiohttp.ClientSession() as session:
        url = f"{broker.http_url}/admin/v2/persistent/public/default/{'h' * 250}"
        async with session.put(url) as response:
            assert response.status == 204, await response.text()
        async with session.get(url + "/stats") as response:
            assert response.status == 200, await response.text()


# --- storage errors reach clients without paths ----------------------------------------------


class BrokenOpener:
    """Opens files normally until ``armed``; then opening a ledger file or writing to one
    raises an OSError that carries the file's path (as the OS's errors do)."""

    def __init__(self) -> None:
        self.armed = False
        self.fail_open = True

    def __call__(self, path: Path) -> StorageFile:
        if self.armed and self.fail_open:
            raise OSError(errno.EIO, "Input/output error", str(path))
        opener = self

        class Breaking(OsFile):
            def write(self, data: bytes) -> None:
                if opener.armed:
                    raise OSError(errno.EIO, "Input/output error", str(self.path))
                super().write(data)

        return Breaking(path)


def _broken(broker: InProcessBroker) -> BrokenOpener:
    factory = broker.service.ledgers
    assert isinstance(factory, FileManagedLedgerFactory)
    opener = BrokenOpener()
    factory.opener = opener
    opener.armed = True
    return opener


async def test_storage_error_on_open_answers_without_a_path(tmp_path: Path) -> None:
    async with InProcessBroker(tmp_path) as broker:
        _broken(broker)
        raw = await RawClient.open(broker.port)
        try:
            await raw.handshake()
            await raw.send(commands.producer(NS + "broken-open", 1, 1))
            err = (await raw.expect(T.ERROR)).command.error
        finally:
            await raw.close()
        assert err.error == pb.PersistenceError  # a typed storage error, not UnknownError
        assert "Input/output error" in err.message
        assert_no_leak(err.message, tmp_path)


async def test_storage_error_on_write_answers_without_a_path(tmp_path: Path) -> None:
    async with InProcessBroker(tmp_path) as broker:
        raw = await RawClient.open(broker.port)
        try:
            await raw.handshake()
            _broken(broker).fail_open = False  # files open; their writes fail
            await raw.producer(topic=NS + "broken-write")
            await raw.send_message(1, 0, b"payload")
            err = (await raw.expect(T.SEND_ERROR)).command.send_error
        finally:
            await raw.close()
        assert err.error == pb.PersistenceError
        assert "Input/output error" in err.message
        assert_no_leak(err.message, tmp_path)


async def test_unexpected_exception_answers_internal_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = str(tmp_path / "secret" / "x.db")

    async def boom(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOENT, "No such file", secret)

    async with InProcessBroker(tmp_path) as broker:
        monkeypatch.setattr(broker.service.ledgers, "open", boom)
        raw = await RawClient.open(broker.port)
        try:
            await raw.handshake()
            await raw.send(commands.producer(NS + "t", 1, 7))
            err = (await raw.expect(T.ERROR)).command.error
        finally:
            await raw.close()
        assert (err.request_id, err.error, err.message) == (7, pb.UnknownError, "internal error")


async def test_http_storage_error_answers_without_a_path(tmp_path: Path) -> None:
    async with InProcessBroker(tmp_path) as broker, aiohttp.ClientSession() as session:
        _broken(broker)
        url = f"{broker.http_url}/admin/v2/persistent/public/default/broken-http"
        async with session.put(url) as response:
            body = await response.json()
            assert response.status == 500
        assert "Input/output error" in body["reason"]  # typed: says what failed
        assert_no_leak(body["reason"], tmp_path)


# --- max_message_size ------------------------------------------------------------------------


async def test_max_message_size_is_capped_at_what_storage_holds(tmp_path: Path) -> None:
    cap = limits.MESSAGE_SIZE_CAP_BYTES
    assert cap + limits.FRAME_PADDING_BYTES <= limits.STORAGE_RECORD_BYTES_MAX
    assert (
        BrokerConfig.model_validate(
            {"data_dir": tmp_path, "max_message_size": cap}
        ).max_message_size
        == cap
    )
    with pytest.raises(pydantic.ValidationError) as info:
        BrokerConfig.model_validate({"data_dir": tmp_path, "max_message_size": 64 * 1024 * 1024})
    assert str(64 * 1024 * 1024) in str(info.value) and str(cap) in str(info.value)
    with pytest.raises(pydantic.ValidationError):
        BrokerConfig.model_validate({"data_dir": tmp_path, "max_message_size": cap + 1})

    # A message between max_message_size and the storage record limit: MessageTooBig.
    async with InProcessBroker(tmp_path, max_message_size=cap) as broker:
        raw = await RawClient.open(broker.port)
        try:
            await raw.handshake()
            await raw.producer(topic=NS + "big")
            await raw.send_message(1, 0, b"x" * (cap + 1))
            err = (await raw.expect(T.SEND_ERROR)).command.send_error
            assert err.error == pb.NotAllowedError and str(cap) in err.message
            await raw.send_message(1, 1, b"y" * cap)  # the largest message is stored
            receipt = (await raw.expect(T.SEND_RECEIPT)).command.send_receipt
            assert receipt.sequence_id == 1
        finally:
            await raw.close()
