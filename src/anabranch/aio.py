"""The asyncio client API (the sync one in ``anabranch`` mirrors these names).

Example::

    from anabranch.aio import Client, MessageId

    async with Client("pulsar://127.0.0.1:6650") as client:
        reader = await client.create_reader("persistent://public/default/t", MessageId.earliest())
"""

from anabranch.client.auth import (
    AuthenticationBasic,
    AuthenticationTLS,
    AuthenticationToken,
)
from anabranch.client.checkpoint import Checkpoint
from anabranch.client.checkpoint_consumer import CheckpointConsumer
from anabranch.client.client import Client
from anabranch.client.consumer import (
    Consumer,
    ConsumerOptions,
    InitialPosition,
    PartitionedConsumer,
    SubscriptionType,
)
from anabranch.client.errors import ExpiredTransactionError, TransactionOperationFailed
from anabranch.client.message import Message
from anabranch.client.message_id import MessageId
from anabranch.client.producer import PartitionedProducer, Producer, ProducerOptions
from anabranch.client.queue_consumer import QueueConsumer, QueueConsumerOptions
from anabranch.client.reader import Reader
from anabranch.client.scalable_producer import ScalableProducer
from anabranch.client.stream_consumer import StreamConsumer, StreamConsumerOptions
from anabranch.client.transaction import Transaction, TransactionState, TxnId
from anabranch.errors import (
    InvalidTxnStatus,
    TransactionConflict,
    TransactionCoordinatorNotFound,
    TransactionError,
    TransactionNotFound,
)
from anabranch.protocol.compression import CompressionType

__all__ = [
    "AuthenticationBasic",
    "AuthenticationTLS",
    "AuthenticationToken",
    "Checkpoint",
    "CheckpointConsumer",
    "Client",
    "CompressionType",
    "Consumer",
    "ConsumerOptions",
    "ExpiredTransactionError",
    "InitialPosition",
    "InvalidTxnStatus",
    "Message",
    "MessageId",
    "PartitionedConsumer",
    "PartitionedProducer",
    "Producer",
    "ProducerOptions",
    "QueueConsumer",
    "QueueConsumerOptions",
    "Reader",
    "ScalableProducer",
    "StreamConsumer",
    "StreamConsumerOptions",
    "SubscriptionType",
    "Transaction",
    "TransactionConflict",
    "TransactionCoordinatorNotFound",
    "TransactionError",
    "TransactionNotFound",
    "TransactionOperationFailed",
    "TransactionState",
    "TxnId",
]
