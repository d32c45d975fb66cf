"""Typed builders for the commands anabranch sends, and who may send what.

Each builder returns a ``BaseCommand`` with ``type`` and its body set; ``frames`` turns it
into bytes. ``CLIENT_COMMANDS`` and ``BROKER_COMMANDS`` say which side may send each type;
a command arriving from the wrong side is a protocol error (DESIGN.md section 3.2).

Example:
    >>> cmd = send_receipt(producer_id=1, sequence_id=7, ledger_id=3, entry_id=4)
    >>> (cmd.type == pb.BaseCommand.SEND_RECEIPT, cmd.send_receipt.message_id.partition)
    (True, -1)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from anabranch.protocol._generated import pulsar_api_pb2 as pb

T = pb.BaseCommand

CLIENT_COMMANDS: Final[frozenset[int]] = frozenset(
    {
        T.CONNECT, T.PING, T.PONG, T.AUTH_RESPONSE,
        T.PRODUCER, T.SEND, T.CLOSE_PRODUCER,
        T.SUBSCRIBE, T.FLOW, T.ACK, T.REDELIVER_UNACKNOWLEDGED_MESSAGES, T.UNSUBSCRIBE,
        T.CLOSE_CONSUMER, T.SEEK, T.GET_LAST_MESSAGE_ID,
        T.PARTITIONED_METADATA, T.LOOKUP, T.GET_TOPICS_OF_NAMESPACE,
        T.GET_SCHEMA, T.GET_OR_CREATE_SCHEMA,
        T.TC_CLIENT_CONNECT_REQUEST, T.NEW_TXN, T.ADD_PARTITION_TO_TXN,
        T.ADD_SUBSCRIPTION_TO_TXN, T.END_TXN,
        # Broker-to-broker in upstream's legacy path: the calling broker is the "client".
        T.END_TXN_ON_PARTITION, T.END_TXN_ON_SUBSCRIPTION,
        T.SCALABLE_TOPIC_LOOKUP, T.SCALABLE_TOPIC_CLOSE, T.SCALABLE_TOPIC_SUBSCRIBE,
        T.SCALABLE_TOPIC_UNSUBSCRIBE, T.WATCH_SCALABLE_TOPICS, T.WATCH_SCALABLE_TOPICS_CLOSE,
        T.WATCH_TOPIC_LIST, T.WATCH_TOPIC_LIST_CLOSE,
    }
)  # fmt: skip
"""Types a client (or a broker acting as one) may send to a broker."""

BROKER_COMMANDS: Final[frozenset[int]] = frozenset(
    {
        T.CONNECTED, T.PING, T.PONG, T.ERROR, T.SUCCESS, T.AUTH_CHALLENGE,
        T.PRODUCER_SUCCESS, T.SEND_RECEIPT, T.SEND_ERROR,
        # The broker closes producers/consumers itself to force a reconnect.
        T.CLOSE_PRODUCER, T.CLOSE_CONSUMER,
        T.MESSAGE, T.ACK_RESPONSE, T.REACHED_END_OF_TOPIC, T.ACTIVE_CONSUMER_CHANGE,
        T.GET_LAST_MESSAGE_ID_RESPONSE,
        T.PARTITIONED_METADATA_RESPONSE, T.LOOKUP_RESPONSE, T.GET_TOPICS_OF_NAMESPACE_RESPONSE,
        T.GET_SCHEMA_RESPONSE, T.GET_OR_CREATE_SCHEMA_RESPONSE,
        T.TC_CLIENT_CONNECT_RESPONSE, T.NEW_TXN_RESPONSE, T.ADD_PARTITION_TO_TXN_RESPONSE,
        T.ADD_SUBSCRIPTION_TO_TXN_RESPONSE, T.END_TXN_RESPONSE,
        T.END_TXN_ON_PARTITION_RESPONSE, T.END_TXN_ON_SUBSCRIPTION_RESPONSE,
        T.SCALABLE_TOPIC_UPDATE, T.SCALABLE_TOPIC_SUBSCRIBE_RESPONSE,
        T.SCALABLE_TOPIC_ASSIGNMENT_UPDATE, T.WATCH_SCALABLE_TOPICS_UPDATE,
        T.WATCH_TOPIC_LIST_SUCCESS, T.WATCH_TOPIC_UPDATE,
    }
)  # fmt: skip
"""Types a broker may send to a client."""


def _message_id(
    ledger_id: int, entry_id: int, partition: int = -1, batch_index: int = -1
) -> pb.MessageIdData:
    msg_id = pb.MessageIdData(ledgerId=ledger_id, entryId=entry_id)
    # Defaults (-1) stay unset so that the bytes match what upstream brokers send.
    if partition != -1:
        msg_id.partition = partition
    if batch_index != -1:
        msg_id.batch_index = batch_index
    return msg_id


def message_id(
    ledger_id: int, entry_id: int, partition: int = -1, batch_index: int = -1
) -> pb.MessageIdData:
    """A MessageIdData; ``partition``/``batch_index`` -1 means "not set" (upstream default).

    Example:
        >>> message_id(1, 2).partition
        -1
    """
    return _message_id(ledger_id, entry_id, partition, batch_index)


# --- connection ----------------------------------------------------------------------------


def connect(
    client_version: str,
    protocol_version: int = pb.v21,
    feature_flags: pb.FeatureFlags | None = None,
    auth_method_name: str | None = None,
    auth_data: bytes | None = None,
) -> pb.BaseCommand:
    """CONNECT, as a client opens a connection.

    Example:
        >>> connect("anabranch-0.1").connect.protocol_version
        21
    """
    body = pb.CommandConnect(client_version=client_version, protocol_version=protocol_version)
    if feature_flags is not None:
        body.feature_flags.CopyFrom(feature_flags)
    if auth_method_name is not None:
        body.auth_method_name = auth_method_name
    if auth_data is not None:
        body.auth_data = auth_data
    return pb.BaseCommand(type=T.CONNECT, connect=body)


def connected(
    server_version: str,
    protocol_version: int,
    max_message_size: int,
    feature_flags: pb.FeatureFlags | None = None,
) -> pb.BaseCommand:
    """CONNECTED, the broker's answer to CONNECT.

    Example:
        >>> connected("anabranch-0.1", 21, 5242880).connected.max_message_size
        5242880
    """
    body = pb.CommandConnected(
        server_version=server_version,
        protocol_version=protocol_version,
        max_message_size=max_message_size,
    )
    if feature_flags is not None:
        body.feature_flags.CopyFrom(feature_flags)
    return pb.BaseCommand(type=T.CONNECTED, connected=body)


def ping() -> pb.BaseCommand:
    """PING (keepalive probe)."""
    return pb.BaseCommand(type=T.PING, ping=pb.CommandPing())


def pong() -> pb.BaseCommand:
    """PONG (keepalive answer)."""
    return pb.BaseCommand(type=T.PONG, pong=pb.CommandPong())


def success(request_id: int) -> pb.BaseCommand:
    """SUCCESS for a request (subscribe, close, seek, unsubscribe...)."""
    return pb.BaseCommand(type=T.SUCCESS, success=pb.CommandSuccess(request_id=request_id))


def error(request_id: int, code: int, message: str) -> pb.BaseCommand:
    """ERROR for a request; ``code`` is a ``ServerError`` value.

    Example:
        >>> error(3, pb.TopicNotFound, "no such topic").error.error == pb.TopicNotFound
        True
    """
    body = pb.CommandError(request_id=request_id, error=code, message=message)  # type: ignore[arg-type]
    return pb.BaseCommand(type=T.ERROR, error=body)


# --- produce -------------------------------------------------------------------------------


def producer(
    topic: str, producer_id: int, request_id: int, producer_name: str | None = None
) -> pb.BaseCommand:
    """PRODUCER: create a producer on ``topic``."""
    body = pb.CommandProducer(topic=topic, producer_id=producer_id, request_id=request_id)
    if producer_name is not None:
        body.producer_name = producer_name
    return pb.BaseCommand(type=T.PRODUCER, producer=body)


def producer_success(
    request_id: int, producer_name: str, last_sequence_id: int = -1
) -> pb.BaseCommand:
    """PRODUCER_SUCCESS; ``last_sequence_id`` -1 means none (dedup state empty)."""
    body = pb.CommandProducerSuccess(request_id=request_id, producer_name=producer_name)
    if last_sequence_id != -1:
        body.last_sequence_id = last_sequence_id
    return pb.BaseCommand(type=T.PRODUCER_SUCCESS, producer_success=body)


def send(
    producer_id: int,
    sequence_id: int,
    num_messages: int = 1,
    txnid_least_bits: int | None = None,
    txnid_most_bits: int | None = None,
) -> pb.BaseCommand:
    """SEND (the metadata and payload go into the frame, see ``frames``)."""
    body = pb.CommandSend(producer_id=producer_id, sequence_id=sequence_id)
    if num_messages != 1:
        body.num_messages = num_messages
    if txnid_least_bits is not None and txnid_most_bits is not None:
        body.txnid_least_bits = txnid_least_bits
        body.txnid_most_bits = txnid_most_bits
    return pb.BaseCommand(type=T.SEND, send=body)


def send_receipt(
    producer_id: int,
    sequence_id: int,
    ledger_id: int,
    entry_id: int,
    highest_sequence_id: int | None = None,
) -> pb.BaseCommand:
    """SEND_RECEIPT naming where the message was stored."""
    body = pb.CommandSendReceipt(
        producer_id=producer_id,
        sequence_id=sequence_id,
        message_id=_message_id(ledger_id, entry_id),
    )
    if highest_sequence_id is not None:
        body.highest_sequence_id = highest_sequence_id
    return pb.BaseCommand(type=T.SEND_RECEIPT, send_receipt=body)


def send_error(producer_id: int, sequence_id: int, code: int, message: str) -> pb.BaseCommand:
    """SEND_ERROR, e.g. ``ChecksumError`` for a SEND whose checksum did not match.

    Example:
        >>> send_error(1, 2, pb.ChecksumError, "bad crc").send_error.error == pb.ChecksumError
        True
    """
    body = pb.CommandSendError(
        producer_id=producer_id,
        sequence_id=sequence_id,
        error=code,  # type: ignore[arg-type]
        message=message,
    )
    return pb.BaseCommand(type=T.SEND_ERROR, send_error=body)


def close_producer(producer_id: int, request_id: int) -> pb.BaseCommand:
    """CLOSE_PRODUCER (either side)."""
    body = pb.CommandCloseProducer(producer_id=producer_id, request_id=request_id)
    return pb.BaseCommand(type=T.CLOSE_PRODUCER, close_producer=body)


# --- consume -------------------------------------------------------------------------------


def subscribe(
    topic: str,
    subscription: str,
    sub_type: int,
    consumer_id: int,
    request_id: int,
    *,
    initial_position: int = pb.CommandSubscribe.Latest,
) -> pb.BaseCommand:
    """SUBSCRIBE; ``sub_type`` is a ``CommandSubscribe.SubType`` value."""
    body = pb.CommandSubscribe(
        topic=topic,
        subscription=subscription,
        subType=sub_type,  # type: ignore[arg-type]
        consumer_id=consumer_id,
        request_id=request_id,
    )
    if initial_position != pb.CommandSubscribe.Latest:
        body.initialPosition = initial_position  # type: ignore[assignment]
    return pb.BaseCommand(type=T.SUBSCRIBE, subscribe=body)


def flow(consumer_id: int, permits: int) -> pb.BaseCommand:
    """FLOW: grant ``permits`` more messages."""
    body = pb.CommandFlow(consumer_id=consumer_id, messagePermits=permits)
    return pb.BaseCommand(type=T.FLOW, flow=body)


def message(
    consumer_id: int,
    ledger_id: int,
    entry_id: int,
    redelivery_count: int = 0,
    ack_set: Iterable[int] = (),
) -> pb.BaseCommand:
    """MESSAGE (its metadata and payload go into the frame)."""
    body = pb.CommandMessage(consumer_id=consumer_id, message_id=_message_id(ledger_id, entry_id))
    if redelivery_count:
        body.redelivery_count = redelivery_count
    body.ack_set.extend(ack_set)
    return pb.BaseCommand(type=T.MESSAGE, message=body)


def ack(
    consumer_id: int,
    message_ids: Iterable[pb.MessageIdData],
    cumulative: bool = False,
    request_id: int | None = None,
) -> pb.BaseCommand:
    """ACK of one or more message ids."""
    kind = pb.CommandAck.Cumulative if cumulative else pb.CommandAck.Individual
    body = pb.CommandAck(consumer_id=consumer_id, ack_type=kind)
    body.message_id.extend(message_ids)
    if request_id is not None:
        body.request_id = request_id
    return pb.BaseCommand(type=T.ACK, ack=body)


def ack_response(
    consumer_id: int, request_id: int, code: int | None = None, message: str | None = None
) -> pb.BaseCommand:
    """ACK_RESPONSE (ack receipts and transactional acks)."""
    body = pb.CommandAckResponse(consumer_id=consumer_id, request_id=request_id)
    if code is not None:
        body.error = code  # type: ignore[assignment]
        body.message = message or ""
    return pb.BaseCommand(type=T.ACK_RESPONSE, ackResponse=body)


def close_consumer(consumer_id: int, request_id: int) -> pb.BaseCommand:
    """CLOSE_CONSUMER (either side)."""
    body = pb.CommandCloseConsumer(consumer_id=consumer_id, request_id=request_id)
    return pb.BaseCommand(type=T.CLOSE_CONSUMER, close_consumer=body)


def reached_end_of_topic(consumer_id: int) -> pb.BaseCommand:
    """REACHED_END_OF_TOPIC (terminated topic or sealed, drained segment)."""
    body = pb.CommandReachedEndOfTopic(consumer_id=consumer_id)
    return pb.BaseCommand(type=T.REACHED_END_OF_TOPIC, reachedEndOfTopic=body)


def active_consumer_change(consumer_id: int, is_active: bool) -> pb.BaseCommand:
    """ACTIVE_CONSUMER_CHANGE (Failover subscriptions)."""
    body = pb.CommandActiveConsumerChange(consumer_id=consumer_id, is_active=is_active)
    return pb.BaseCommand(type=T.ACTIVE_CONSUMER_CHANGE, active_consumer_change=body)


def get_last_message_id_response(
    request_id: int, ledger_id: int, entry_id: int, partition: int = -1
) -> pb.BaseCommand:
    """GET_LAST_MESSAGE_ID_RESPONSE."""
    body = pb.CommandGetLastMessageIdResponse(
        request_id=request_id, last_message_id=_message_id(ledger_id, entry_id, partition)
    )
    return pb.BaseCommand(type=T.GET_LAST_MESSAGE_ID_RESPONSE, getLastMessageIdResponse=body)


# --- lookup --------------------------------------------------------------------------------


def partitioned_metadata_response(request_id: int, partitions: int) -> pb.BaseCommand:
    """PARTITIONED_METADATA_RESPONSE; 0 partitions means a non-partitioned topic."""
    body = pb.CommandPartitionedTopicMetadataResponse(
        request_id=request_id,
        partitions=partitions,
        response=pb.CommandPartitionedTopicMetadataResponse.Success,
    )
    return pb.BaseCommand(type=T.PARTITIONED_METADATA_RESPONSE, partitionMetadataResponse=body)


def lookup_response(
    request_id: int,
    broker_service_url: str,
    authoritative: bool = True,
    broker_service_url_tls: str | None = None,
) -> pb.BaseCommand:
    """LOOKUP_RESPONSE telling the client to connect to ``broker_service_url`` (or, a
    ``pulsar+ssl://`` client, to ``broker_service_url_tls``)."""
    body = pb.CommandLookupTopicResponse(
        request_id=request_id,
        brokerServiceUrl=broker_service_url,
        response=pb.CommandLookupTopicResponse.Connect,
        authoritative=authoritative,
    )
    if broker_service_url_tls:
        body.brokerServiceUrlTls = broker_service_url_tls
    return pb.BaseCommand(type=T.LOOKUP_RESPONSE, lookupTopicResponse=body)


# --- transactions and scalable topics ------------------------------------------------------


def new_txn_response(request_id: int, least_bits: int, most_bits: int) -> pb.BaseCommand:
    """NEW_TXN_RESPONSE carrying the new transaction id."""
    body = pb.CommandNewTxnResponse(
        request_id=request_id, txnid_least_bits=least_bits, txnid_most_bits=most_bits
    )
    return pb.BaseCommand(type=T.NEW_TXN_RESPONSE, newTxnResponse=body)


def scalable_topic_update(
    session_id: int, dag: pb.ScalableTopicDAG, resolved_topic_name: str
) -> pb.BaseCommand:
    """SCALABLE_TOPIC_UPDATE: the initial answer to a DAG watch and every later push."""
    body = pb.CommandScalableTopicUpdate(
        session_id=session_id, dag=dag, resolved_topic_name=resolved_topic_name
    )
    return pb.BaseCommand(type=T.SCALABLE_TOPIC_UPDATE, scalableTopicUpdate=body)


def scalable_topic_assignment_update(
    consumer_id: int, assignment: pb.ScalableConsumerAssignment
) -> pb.BaseCommand:
    """SCALABLE_TOPIC_ASSIGNMENT_UPDATE pushed after a rebalance."""
    body = pb.CommandScalableTopicAssignmentUpdate(consumer_id=consumer_id, assignment=assignment)
    return pb.BaseCommand(
        type=T.SCALABLE_TOPIC_ASSIGNMENT_UPDATE, scalableTopicAssignmentUpdate=body
    )
