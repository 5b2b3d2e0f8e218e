"""The Open Inference Protocol (KServe v2, as Triton speaks it): /v2 over REST and gRPC.

``protocol`` parses requests into rows and answers with tensors; ``routes`` serves
it over HTTP and ``grpc`` as Triton's ``GRPCInferenceService``, with the protoc
modules in ``proto``.
"""
