"""ProtocolConnection: handshake, direction table, keepalive bookkeeping."""

from __future__ import annotations

import pytest

from anabranch.errors import UnexpectedCommand
from anabranch.protocol import commands
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.protocol.connection import ProtocolConnection, Role, State
from anabranch.protocol.frames import encode_command, encode_payload_frame

T = pb.BaseCommand


def _pair(now: float = 0.0) -> tuple[ProtocolConnection, ProtocolConnection]:
    client = ProtocolConnection(Role.CLIENT, now=now)
    broker = ProtocolConnection(Role.BROKER, now=now)
    flags = pb.FeatureFlags(supports_scalable_topics=True)
    broker.receive_data(client.send(commands.connect("c", 19, flags)), now=now)
    reply = commands.connected("b", broker.negotiate_version(), 1000, flags)
    client.receive_data(broker.send(reply), now=now)
    return client, broker


def test_handshake_negotiates_version_flags_and_size() -> None:
    client, broker = _pair()
    assert client.state is State.CONNECTED and broker.state is State.CONNECTED
    assert broker.protocol_version == 19 and client.protocol_version == 19
    assert broker.peer_feature_flags.supports_scalable_topics
    assert client.peer_feature_flags.supports_scalable_topics
    assert client.max_message_size == 1000 and broker.max_message_size == 1000
    assert broker.peer_client_version == "c"


def test_command_before_connect_is_rejected() -> None:
    broker = ProtocolConnection(Role.BROKER)
    with pytest.raises(UnexpectedCommand, match="before CONNECT"):
        broker.receive_data(encode_command(commands.producer("t", 1, 1)))
    assert broker.state is State.CLOSED
    with pytest.raises(UnexpectedCommand):
        broker.receive_data(encode_command(commands.connect("c")))


def test_auth_response_before_connect_is_rejected() -> None:
    auth = pb.BaseCommand(type=T.AUTH_RESPONSE, authResponse=pb.CommandAuthResponse())
    with pytest.raises(UnexpectedCommand):
        ProtocolConnection(Role.BROKER).receive_data(encode_command(auth))


def test_command_before_connected_is_rejected() -> None:
    broker = ProtocolConnection(Role.BROKER)
    data = encode_command(commands.connect("c")) + encode_command(commands.lookup_response(1, "x"))
    with pytest.raises(UnexpectedCommand):
        broker.receive_data(data)
    broker2 = ProtocolConnection(Role.BROKER)
    data2 = encode_command(commands.connect("c")) + encode_command(commands.flow(1, 1))
    with pytest.raises(UnexpectedCommand, match="handshake"):
        broker2.receive_data(data2)


def test_client_sending_broker_command_is_rejected() -> None:
    _, broker = _pair()
    md = pb.MessageMetadata(producer_name="p", sequence_id=0, publish_time=0)
    with pytest.raises(UnexpectedCommand, match="client may not send"):
        broker.receive_data(encode_payload_frame(commands.message(1, 1, 1), md, b"x"))
    assert broker.state is State.CLOSED


def test_broker_sending_client_command_is_rejected_by_client() -> None:
    client, _ = _pair()
    with pytest.raises(UnexpectedCommand, match="broker may not send"):
        client.receive_data(encode_command(commands.flow(1, 1)))


def test_connect_twice_is_rejected() -> None:
    _, broker = _pair()
    with pytest.raises(UnexpectedCommand, match="twice"):
        broker.receive_data(encode_command(commands.connect("c")))


def test_we_may_not_send_out_of_place() -> None:
    client = ProtocolConnection(Role.CLIENT)
    with pytest.raises(UnexpectedCommand):
        client.send(commands.flow(1, 1))  # before CONNECT
    broker = ProtocolConnection(Role.BROKER)
    with pytest.raises(UnexpectedCommand):
        broker.send(commands.connected("b", 21, 1))  # no CONNECT received
    _, connected_broker = _pair()
    with pytest.raises(UnexpectedCommand, match="broker may not send"):
        connected_broker.send(commands.flow(1, 1))


def test_send_error_answers_checksum_mismatch() -> None:
    client, broker = _pair()
    md = pb.MessageMetadata(producer_name="p", sequence_id=3, publish_time=0)
    data = client.send(commands.send(1, 3), md, b"payload")
    corrupt = data[:-1] + b"\x00"
    (frame,) = broker.receive_data(corrupt)
    assert frame.checksum_ok is False
    reply = broker.send(commands.send_error(1, 3, pb.ChecksumError, "checksum mismatch"))
    (answer,) = client.receive_data(reply)
    assert answer.command.send_error.error == pb.ChecksumError
    assert broker.state is State.CONNECTED


def test_error_during_handshake_keeps_client_waiting() -> None:
    client = ProtocolConnection(Role.CLIENT)
    broker = ProtocolConnection(Role.BROKER)
    broker.receive_data(client.send(commands.connect("c")))
    client.receive_data(broker.send(commands.error(0, pb.AuthenticationError, "no")))
    assert client.state is State.AWAIT_CONNECTED


def test_keepalive() -> None:
    client, broker = _pair(now=100.0)
    assert not broker.ping_due(129.9)
    assert broker.ping_due(130.0)
    ping = broker.ping(now=130.0)
    assert not broker.ping_due(131.0)
    assert not broker.idle_timed_out(159.9)
    assert broker.idle_timed_out(160.0)
    (frame,) = client.receive_data(ping, now=130.5)
    assert frame.type == T.PING
    broker.receive_data(client.send(commands.pong()), now=131.0)
    assert not broker.idle_timed_out(170.0)
    assert broker.ping_due(161.0)


def test_handshake_timeout() -> None:
    broker = ProtocolConnection(Role.BROKER, now=10.0, handshake_timeout_s=5.0)
    assert not broker.idle_timed_out(14.9)
    assert broker.idle_timed_out(15.0)
    assert not broker.ping_due(100.0)


def test_partial_frame_is_bounded() -> None:
    broker = ProtocolConnection(Role.BROKER, max_frame_size=1024)
    data = encode_command(commands.connect("c"))
    broker.receive_data(data[:-1])
    assert broker.buffered_bytes == len(data) - 1
    assert [f.type_name for f in broker.receive_data(data[-1:])] == ["CONNECT"]
    assert broker.buffered_bytes == 0


def test_entry_resend() -> None:
    client, broker = _pair()
    md = pb.MessageMetadata(producer_name="p", sequence_id=3, publish_time=0)
    (sent,) = broker.receive_data(client.send(commands.send(1, 3), md, b"hello"))
    (delivered,) = client.receive_data(broker.send_entry(commands.message(7, 1, 2), sent.entry))
    assert delivered.payload == b"hello" and delivered.command.message.consumer_id == 7


def test_payload_command_needs_metadata() -> None:
    client, _ = _pair()
    with pytest.raises(UnexpectedCommand, match="metadata"):
        client.send(commands.send(1, 1))


def test_closed_connection_refuses_everything() -> None:
    client, _ = _pair()
    client.close()
    with pytest.raises(UnexpectedCommand):
        client.send(commands.ping())
    with pytest.raises(UnexpectedCommand):
        client.receive_data(b"")
    assert not client.idle_timed_out(1e9)
