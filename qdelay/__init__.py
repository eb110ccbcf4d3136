"""qdelay: a durable delay-message server.

Subpackages (each a top-level folder of the repository):
``qdelay.segments`` (storage: frames, segments, message log), ``qdelay.server``
(gRPC API and scheduling), ``qdelay.replication`` (master/slave), ``qdelay.tools``
(inspection and the Spark pipeline), ``qdelay.client`` (Python client), ``qdelay.v1``
(code generated from proto/qdelay/v1).
"""

__version__ = "0.1.0"
