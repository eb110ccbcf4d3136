"""``from qdelay.aio import Client``: the asyncio client (its code is in client/aio.py)."""

from qdelay.client.aio import Batching, Client, Consumer, Delivery, Outgoing, Receipt, Status

__all__ = ["Batching", "Client", "Consumer", "Delivery", "Outgoing", "Receipt", "Status"]
