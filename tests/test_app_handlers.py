"""How DelayService is registered with the gRPC server (server/app.py add_delay_service):
every method through one generic handler, looked up by name, none as a registered method
(grpc.aio would wait on a pending request per registered method for every call), and the
raw-bytes methods without protobuf (de)serializers."""

from __future__ import annotations

from collections import namedtuple

from qdelay.server.app import RAW_REQUEST_METHODS, RAW_RESPONSE_METHODS, SERVICE_NAME, add_delay_service
from qdelay.v1 import qdelay_pb2 as pb
from qdelay.v1 import qdelay_pb2_grpc as pb_grpc

_Details = namedtuple("_Details", ["method", "invocation_metadata"])


class RecordingServer:
    def __init__(self) -> None:
        self.generic: list = []
        self.registered: list = []

    def add_generic_rpc_handlers(self, handlers) -> None:
        self.generic.extend(handlers)

    def add_registered_method_handlers(self, service, handlers) -> None:
        self.registered.append((service, handlers))


def test_every_method_is_served_by_the_generic_handler_and_none_is_registered():
    server = RecordingServer()
    add_delay_service(pb_grpc.DelayServiceServicer(), server)  # type: ignore[arg-type]  (any servicer)
    assert server.registered == []
    (generic,) = server.generic
    names = [m.name for m in pb.DESCRIPTOR.services_by_name["DelayService"].methods]
    assert "SendBatch" in names and "Subscribe" in names
    for name in names:
        handler = generic.service(_Details(f"/{SERVICE_NAME}/{name}", ()))
        assert handler is not None, name
        assert (handler.request_deserializer is None) == (name in RAW_REQUEST_METHODS), name
        assert (handler.response_serializer is None) == (name in RAW_RESPONSE_METHODS), name
    assert generic.service(_Details(f"/{SERVICE_NAME}/NoSuchMethod", ())) is None
