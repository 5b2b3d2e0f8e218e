"""Triton's published .proto files of the inference protocol's gRPC service, kept as they
are, and the modules protoc writes from them (``python -m api.oip.protos --write``; a unit
test fails while these differ from what it writes). Nothing here is written by hand."""
