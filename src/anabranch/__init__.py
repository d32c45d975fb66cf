"""anabranch: elastic, key-ordered, transactional streams for Python.

The blocking client is exported here; ``anabranch.aio`` has the asyncio twins.

Example::

    from anabranch import Client

    with Client("pulsar://localhost:6650") as client:
        client.create_producer("persistent://public/default/orders").send(b"x", key="k")
"""

__version__ = "0.1.0"

from anabranch.client.auth import (
    AuthenticationBasic,
    AuthenticationTLS,
    AuthenticationToken,
)
from anabranch.client.checkpoint import Checkpoint
from anabranch.client.consumer import InitialPosition, SubscriptionType
from anabranch.client.errors import ExpiredTransactionError, TransactionOperationFailed
from anabranch.client.message import Message
from anabranch.client.message_id import MessageId
from anabranch.client.sync import (
    CheckpointConsumer,
    Client,
    Consumer,
    Producer,
    QueueConsumer,
    Reader,
    StreamConsumer,
    Transaction,
)
from anabranch.client.transaction import TransactionState, TxnId
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
    "ExpiredTransactionError",
    "InitialPosition",
    "InvalidTxnStatus",
    "Message",
    "MessageId",
    "Producer",
    "QueueConsumer",
    "Reader",
    "StreamConsumer",
    "SubscriptionType",
    "Transaction",
    "TransactionConflict",
    "TransactionCoordinatorNotFound",
    "TransactionError",
    "TransactionNotFound",
    "TransactionOperationFailed",
    "TransactionState",
    "TxnId",
    "__version__",
]
