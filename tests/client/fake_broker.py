"""A scripted broker for client tests: our own ProtocolConnection in the broker role.

It answers the handshake, lookups (optionally redirecting), partitioned metadata,
PRODUCER, SEND (receipts from a counter), SUBSCRIBE, and records every frame, so tests
can assert on exactly what the client sent. Consumers get MESSAGE frames pushed by the
test through ``deliver``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from anabranch.protocol import commands
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.protocol.connection import ProtocolConnection, Role
from anabranch.protocol.frames import Frame, encode_payload_frame

T = pb.BaseCommand


@dataclass
class Session:
    conn: ProtocolConnection
    writer: asyncio.StreamWriter

    def write(self, data: bytes) -> None:
        self.writer.write(data)


@dataclass
class FakeBroker:
    partitions: dict[str, int] = field(default_factory=dict)
    redirect_to: str | None = None
    last_sequence_id: int = -1
    answer_sends: bool = True
    answer_pings: bool = True
    paused: bool = False
    """Answer nothing at all, handshakes included (a SIGSTOPped broker: TCP still up)."""
    send_error: int | None = None
    frames: list[Frame] = field(default_factory=list)
    sessions: list[Session] = field(default_factory=list)
    next_entry: int = 0
    server: asyncio.Server | None = None
    port: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def url(self) -> str:
        return f"pulsar://127.0.0.1:{self.port}"

    async def start(self) -> FakeBroker:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.drop_connections()
        await self.server.wait_closed()

    async def drop_connections(self) -> None:
        for s in self.sessions:
            s.writer.close()
        self.sessions.clear()
        await asyncio.sleep(0)

    def of_type(self, kind: int) -> list[Frame]:
        return [f for f in self.frames if f.type == kind]

    async def wait_for(self, kind: int, count: int = 1) -> list[Frame]:
        while len(self.of_type(kind)) < count:
            self.changed.clear()
            await self.changed.wait()
        return self.of_type(kind)

    def deliver(
        self,
        consumer_id: int,
        entry_id: int,
        metadata: pb.MessageMetadata,
        payload: bytes,
        redelivery_count: int = 0,
    ) -> None:
        cmd = commands.message(consumer_id, 1, entry_id, redelivery_count)
        self.sessions[-1].write(encode_payload_frame(cmd, metadata, payload))

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        session = Session(ProtocolConnection(Role.BROKER), writer)
        self.sessions.append(session)
        try:
            while data := await reader.read(65536):
                for frame in session.conn.receive_data(data):
                    self.frames.append(frame)
                    self.changed.set()
                    self._answer(session, frame)
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    def _answer(self, s: Session, frame: Frame) -> None:
        if self.paused:
            return
        c, kind = frame.command, frame.type
        if kind == T.CONNECT:
            s.write(s.conn.send(commands.connected("fake", s.conn.negotiate_version(), 5242880)))
        elif kind == T.PING and self.answer_pings:
            s.write(s.conn.send(commands.pong()))
        elif kind == T.LOOKUP:
            rid = c.lookupTopic.request_id
            if self.redirect_to and not c.lookupTopic.authoritative:
                body = pb.CommandLookupTopicResponse(
                    request_id=rid,
                    brokerServiceUrl=self.redirect_to,
                    response=pb.CommandLookupTopicResponse.Redirect,
                    authoritative=True,
                )
                s.write(
                    s.conn.send(pb.BaseCommand(type=T.LOOKUP_RESPONSE, lookupTopicResponse=body))
                )
            else:
                s.write(s.conn.send(commands.lookup_response(rid, self.url)))
        elif kind == T.PARTITIONED_METADATA:
            n = self.partitions.get(c.partitionMetadata.topic, 0)
            s.write(
                s.conn.send(
                    commands.partitioned_metadata_response(c.partitionMetadata.request_id, n)
                )
            )
        elif kind == T.PRODUCER:
            name = c.producer.producer_name or "fake-producer"
            reply = commands.producer_success(c.producer.request_id, name, self.last_sequence_id)
            s.write(s.conn.send(reply))
        elif kind == T.SEND:
            if self.send_error is not None:
                err = commands.send_error(
                    c.send.producer_id, c.send.sequence_id, self.send_error, "no"
                )
                s.write(s.conn.send(err))
            elif self.answer_sends:
                receipt = commands.send_receipt(
                    c.send.producer_id, c.send.sequence_id, 1, self.next_entry
                )
                self.next_entry += 1
                s.write(s.conn.send(receipt))
        elif kind in (T.SUBSCRIBE, T.CLOSE_PRODUCER, T.CLOSE_CONSUMER, T.SEEK, T.UNSUBSCRIBE):
            s.write(s.conn.send(commands.success(frame.body.request_id)))
        elif kind == T.GET_LAST_MESSAGE_ID:
            rid = c.getLastMessageId.request_id
            s.write(s.conn.send(commands.get_last_message_id_response(rid, 1, self.next_entry - 1)))
