"""The static wire dispatch table: complete, hot path unchecked, unserved commands close."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from anabranch.broker.command_table import CLOSE_HOOKS, TABLE
from anabranch.core.authz import Need
from anabranch.protocol import commands
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.testing.broker import InProcessBroker
from tests.broker.test_core_protocol import RawClient

T = pb.BaseCommand

BROKER_TO_CLIENT = commands.BROKER_COMMANDS - commands.CLIENT_COMMANDS
WIRE_COMMANDS = frozenset(T.Type.values()) - BROKER_TO_CLIENT
"""Every command type a client may send: the protobuf enum minus broker→client types."""

NOT_SERVED = frozenset({T.END_TXN_ON_PARTITION, T.END_TXN_ON_SUBSCRIPTION})
"""Client-sendable types this broker answers with ERROR and a close (no table row)."""

HOT = (T.SEND, T.ACK, T.FLOW)


def test_every_client_command_has_a_row_or_is_declared_unserved() -> None:
    missing = WIRE_COMMANDS - TABLE.keys() - NOT_SERVED
    assert not missing, f"no table row for {[T.Type.Name(t) for t in sorted(missing)]}"
    assert not (TABLE.keys() & BROKER_TO_CLIENT), "a broker→client command has a row"
    assert not (TABLE.keys() & NOT_SERVED)


def test_inline_rows_pay_no_permission_check() -> None:
    for kind, row in TABLE.items():
        if not row.spawned:
            assert row.need in (Need.NONE, Need.OWNED), T.Type.Name(kind)
    for kind in HOT:
        assert not TABLE[kind].spawned and TABLE[kind].need is Need.OWNED


def test_scoped_rows_name_their_resource() -> None:
    for kind, row in TABLE.items():
        assert (row.resource is not None) == row.need.scoped, T.Type.Name(kind)


def test_creation_commands_check_what_pulsar_checks() -> None:
    assert TABLE[T.PRODUCER].need is Need.PRODUCE
    assert TABLE[T.SUBSCRIBE].need is Need.CONSUME
    assert TABLE[T.SCALABLE_TOPIC_SUBSCRIBE].need is Need.CONSUME
    for kind in (T.LOOKUP, T.PARTITIONED_METADATA, T.SCALABLE_TOPIC_LOOKUP, T.GET_SCHEMA):
        assert TABLE[kind].need is Need.LOOKUP
    assert TABLE[T.GET_TOPICS_OF_NAMESPACE].need is Need.NAMESPACE
    assert TABLE[T.WATCH_TOPIC_LIST].need is Need.NAMESPACE
    assert {TABLE[k].need for k in (T.CONNECT, T.PING, T.PONG)} == {Need.NONE}


def test_close_hooks_are_functions() -> None:
    assert len(CLOSE_HOOKS) == 4 and all(callable(h) for h in CLOSE_HOOKS)


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[InProcessBroker]:
    async with InProcessBroker(tmp_path, ledgers="memory") as b:
        yield b


@pytest.mark.parametrize("kind", sorted(NOT_SERVED))
async def test_an_unserved_command_gets_error_and_a_close(
    broker: InProcessBroker, kind: int
) -> None:
    client = await RawClient.open(broker.port)
    try:
        await client.handshake()
        fields: dict[int, tuple[str, Any]] = {
            T.END_TXN_ON_PARTITION: (
                "endTxnOnPartition",
                pb.CommandEndTxnOnPartition(request_id=1, txnid_most_bits=0, txnid_least_bits=0),
            ),
            T.END_TXN_ON_SUBSCRIPTION: (
                "endTxnOnSubscription",
                pb.CommandEndTxnOnSubscription(request_id=1, txnid_most_bits=0, txnid_least_bits=0),
            ),
        }
        field = fields[kind]
        command = T(type=kind)  # type: ignore[arg-type]
        getattr(command, field[0]).CopyFrom(field[1])
        await client.send(command)
        seen = await client.closed_by_broker()
        assert [f.type for f in seen] == [T.ERROR]
        assert seen[0].command.error.error == pb.NotAllowedError
    finally:
        await client.close()
