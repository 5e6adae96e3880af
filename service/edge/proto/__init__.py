"""The Open Inference Protocol v2's gRPC messages (``grpc_predict_v2.proto``).

``grpc_predict_v2_pb2`` is generated from the ``.proto`` and checked in, so serving
needs only the protobuf runtime (no protoc, no grpcio-tools); ``python -m
service.edge.proto`` regenerates it (grpcio-tools, a dev dependency). Its descriptors
live in a private pool, not protobuf's default one: Triton's client (tritonclient.grpc)
registers the same message names (package ``inference``) in the default pool, and the
two must load in one process (the tests do).
"""
