"""Python client of qdelay: ``from qdelay.client import Client``."""

from qdelay.client.client import (CANCEL_OUTCOMES, STATES, Client, Consumer, DeadlineExceeded, Delivery, Message,
                                  Receipt, translate)
from qdelay.client.cluster import ClusterClient

__all__ = ["Client", "ClusterClient", "Consumer", "DeadlineExceeded", "Delivery", "Message", "Receipt", "CANCEL_OUTCOMES", "STATES",
           "translate"]
