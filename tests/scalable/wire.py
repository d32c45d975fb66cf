"""A raw-protocol client for the scalable-topic wire tests: frames exactly as built here."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from anabranch.protocol import commands
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.protocol.connection import ProtocolConnection, Role
from anabranch.protocol.frames import Frame

T = pb.BaseCommand
WAIT_S = 10.0
"""How long a test waits for a frame the broker owes it before failing (not a test limit:
it turns a hang into a readable assertion)."""


class RawClient:
    """One connection; :meth:`next` returns the next frame matching a predicate and keeps
    the others for later calls."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.conn = ProtocolConnection(Role.CLIENT)
        self.pending: deque[Frame] = deque()
        self.eof = False

    @classmethod
    async def connect(cls, port: int, *, token: str | None = None) -> RawClient:
        """Connect (with a token when authentication is on) and wait for CONNECTED."""
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        client = cls(reader, writer)
        method, data = (None, None) if token is None else ("token", token.encode())
        await client.send(
            commands.connect("scalable-wire-test", pb.v21, auth_method_name=method, auth_data=data)
        )
        connected = await client.next(lambda f: f.type == T.CONNECTED)
        assert connected.command.connected.feature_flags.supports_scalable_topics
        return client

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except ConnectionError:
            pass

    async def send(
        self,
        command: pb.BaseCommand,
        metadata: pb.MessageMetadata | None = None,
        payload: bytes = b"",
    ) -> None:
        self.writer.write(self.conn.send(command, metadata, payload))
        await self.writer.drain()

    # --- producing and consuming on segment topics ----------------------------------------

    async def producer(self, topic: str, producer_id: int, name: str) -> pb.CommandProducerSuccess:
        await self.send(commands.producer(topic, producer_id, producer_id, name))
        frame = await self.next(
            lambda f: f.type in (T.PRODUCER_SUCCESS, T.ERROR) and (f.body.request_id == producer_id)
        )
        assert frame.type == T.PRODUCER_SUCCESS, frame.command
        return frame.command.producer_success

    async def produce(self, producer_id: int, name: str, sequence_id: int, payload: bytes) -> Frame:
        """One SEND; returns its SEND_RECEIPT or SEND_ERROR."""
        md = pb.MessageMetadata(producer_name=name, sequence_id=sequence_id, publish_time=1)
        await self.send(commands.send(producer_id, sequence_id), md, payload)
        return await self.next(
            lambda f: (
                f.type in (T.SEND_RECEIPT, T.SEND_ERROR)
                and f.body.producer_id == producer_id
                and f.body.sequence_id == sequence_id
            )
        )

    async def _read(self) -> None:
        try:
            data = await self.reader.read(65536)
        except ConnectionError:
            data = b""
        if not data:
            self.eof = True
            return
        for frame in self.conn.receive_data(data):
            if frame.type == T.PING:
                await self.send(commands.pong())
            else:
                self.pending.append(frame)

    async def next(self, match: Callable[[Frame], bool], wait_s: float = WAIT_S) -> Frame:
        async def find() -> Frame:
            while True:
                for frame in list(self.pending):
                    if match(frame):
                        self.pending.remove(frame)
                        return frame
                assert not self.eof, "the broker closed the connection"
                await self._read()

        return await asyncio.wait_for(find(), wait_s)

    async def none(self, match: Callable[[Frame], bool], within: float) -> None:
        """Assert that no matching frame arrives within ``within`` seconds."""
        try:
            frame = await self.next(match, wait_s=within)
        except TimeoutError:
            return
        raise AssertionError(f"unexpected frame {frame.type_name}: {frame.command}")

    # --- scalable commands ---------------------------------------------------------------

    async def lookup(
        self, session_id: int, topic: str, *, create_if_missing: bool = True
    ) -> pb.CommandScalableTopicUpdate:
        body = pb.CommandScalableTopicLookup(
            session_id=session_id, topic=topic, create_if_missing=create_if_missing
        )
        await self.send(T(type=T.SCALABLE_TOPIC_LOOKUP, scalableTopicLookup=body))
        return await self.update(session_id)

    async def update(
        self, session_id: int, wait_s: float = WAIT_S
    ) -> pb.CommandScalableTopicUpdate:
        frame = await self.next(
            lambda f: (
                f.type == T.SCALABLE_TOPIC_UPDATE
                and f.command.scalableTopicUpdate.session_id == session_id
            ),
            wait_s,
        )
        return frame.command.scalableTopicUpdate

    async def close_session(self, session_id: int) -> None:
        body = pb.CommandScalableTopicClose(session_id=session_id)
        await self.send(T(type=T.SCALABLE_TOPIC_CLOSE, scalableTopicClose=body))

    async def subscribe(
        self,
        request_id: int,
        topic: str,
        subscription: str,
        consumer_name: str,
        consumer_id: int,
        *,
        consumer_type: pb.ScalableConsumerType = pb.STREAM,
    ) -> pb.CommandScalableTopicSubscribeResponse:
        body = pb.CommandScalableTopicSubscribe(
            request_id=request_id,
            topic=topic,
            subscription=subscription,
            consumer_name=consumer_name,
            consumer_id=consumer_id,
            consumer_type=consumer_type,
        )
        await self.send(T(type=T.SCALABLE_TOPIC_SUBSCRIBE, scalableTopicSubscribe=body))
        frame = await self.next(
            lambda f: (
                f.type == T.SCALABLE_TOPIC_SUBSCRIBE_RESPONSE
                and f.command.scalableTopicSubscribeResponse.request_id == request_id
            )
        )
        return frame.command.scalableTopicSubscribeResponse

    async def unsubscribe(self, request_id: int, consumer_id: int) -> None:
        body = pb.CommandScalableTopicUnsubscribe(request_id=request_id, consumer_id=consumer_id)
        await self.send(T(type=T.SCALABLE_TOPIC_UNSUBSCRIBE, scalableTopicUnsubscribe=body))
        await self.next(lambda f: f.type == T.SUCCESS and f.body.request_id == request_id)

    async def assignment_update(
        self, consumer_id: int, wait_s: float = WAIT_S
    ) -> pb.ScalableConsumerAssignment:
        frame = await self.next(
            lambda f: (
                f.type == T.SCALABLE_TOPIC_ASSIGNMENT_UPDATE
                and f.command.scalableTopicAssignmentUpdate.consumer_id == consumer_id
            ),
            wait_s,
        )
        return frame.command.scalableTopicAssignmentUpdate.assignment


def is_assignment_update(consumer_id: int) -> Callable[[Frame], bool]:
    return lambda f: (
        f.type == T.SCALABLE_TOPIC_ASSIGNMENT_UPDATE
        and f.command.scalableTopicAssignmentUpdate.consumer_id == consumer_id
    )


def segment_ids(assignment: pb.ScalableConsumerAssignment) -> list[int]:
    return [s.segment_id for s in assignment.segments]


async def watch_namespace(
    client: RawClient,
    watch_id: int,
    namespace: str,
    filters: dict[str, str] | None = None,
    current_hash: str | None = None,
) -> pb.CommandWatchScalableTopicsUpdate:
    body = pb.CommandWatchScalableTopics(watch_id=watch_id, namespace=namespace)
    for key, value in (filters or {}).items():
        body.property_filters.add(key=key, value=value)
    if current_hash is not None:
        body.current_hash = current_hash
    await client.send(T(type=T.WATCH_SCALABLE_TOPICS, watchScalableTopics=body))
    return await namespace_update(client, watch_id)


async def namespace_update(client: RawClient, watch_id: int) -> pb.CommandWatchScalableTopicsUpdate:
    frame = await client.next(
        lambda f: (
            f.type == T.WATCH_SCALABLE_TOPICS_UPDATE
            and f.command.watchScalableTopicsUpdate.watch_id == watch_id
        )
    )
    return frame.command.watchScalableTopicsUpdate
