"""Python client of qdelay: ``from qdelay.client import Client``."""

from qdelay.client.client import (
    CANCEL_OUTCOMES,
    STATES,
    Client,
    Consumer,
    DeadlineExceeded,
    Delivery,
    Message,
    Outgoing,
    Receipt,
    SentReceipt,
    SentReceipts,
    translate,
)
from qdelay.client.cluster import ClusterClient

__all__ = [
    "Client",
    "ClusterClient",
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
