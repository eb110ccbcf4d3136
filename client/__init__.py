"""Python client of qdelay: ``from qdelay.client import Client``."""

from qdelay.client.batching import Batching
from qdelay.client.client import (
    CANCEL_OUTCOMES,
    STATES,
    Client,
    Consumer,
    DeadlineExceeded,
    Message,
    Outgoing,
    SentReceipt,
    SentReceipts,
    translate,
)
from qdelay.client.cluster import ClusterClient
from qdelay.client.sharded import AioShardedClient, ShardedClient, ShardedConsumer
from qdelay.client.types import Delivery, GroupStatus, Receipt, Status

__all__ = [
    "Batching",
    "Client",
    "GroupStatus",
    "Status",
    "ClusterClient",
    "ShardedClient",
    "ShardedConsumer",
    "AioShardedClient",
    "Consumer",
    "DeadlineExceeded",
    "Delivery",
    "Message",
    "Outgoing",
    "Receipt",
    "SentReceipt",
    "SentReceipts",
    "CANCEL_OUTCOMES",
    "STATES",
    "translate",
]
