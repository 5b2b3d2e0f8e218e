"""The Open Inference Protocol's gRPC form: Triton's ``GRPCInferenceService`` on the API's loop.

With ``FERRY_GRPC_PORT`` set, each API process serves the protocol's gRPC
service (``inference.GRPCInferenceService``, from Triton's published
``grpc_service.proto``; KServe's v2 gRPC service is its subset) beside HTTP,
on the same event loop, so ``tritonclient.grpc`` and KServe's gRPC clients
work unchanged. The calls mean what the REST routes (``api.oip.routes``) mean
and share their code: an infer request's rows become jobs through the group
commit, the answer comes when they have ended, and ``priority`` and
``timeout`` become the lane and the deadline. Tensors come as typed
``contents`` or as ``raw_input_contents`` (bytes laid out as in the binary
tensor data extension); outputs always go back as ``raw_output_contents``,
as Triton sends them.

The key is the metadata ``authorization: Bearer <key>``, checked and limited
as over HTTP; the health calls need none. Errors carry the REST error's
message with its status mapped to a gRPC code (:data:`CODES`), and
``retry-after`` in the trailing metadata where HTTP would send Retry-After.
The message size limit is ``FERRY_MAX_BODY_BYTES``. ``parameters.async``
answers at once with the jobs' ids in the response's ``job_ids`` parameter
(comma-separated; read and cancelled by ``/v1/jobs``). Calls Ferry does not
serve (streaming infer, model configuration and statistics, shared memory,
trace and log settings) answer ``UNIMPLEMENTED``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from fastapi import FastAPI

from api.deps import authenticate
from api.errors import ApiError
from api.jobs.submissions import Submitted
from api.middleware import request_id_for
from api.models.routes import readiness
from api.oip import protocol as oip
from api.oip.routes import (
    EXTENSIONS,
    VERSION,
    index_entries,
    load_model,
    metadata_of,
    not_ready,
    outputs_of,
    resolved,
    submit_rows,
    unload_model,
)
from api.oip.third_party import grpc_service_pb2 as pb
from api.oip.third_party import grpc_service_pb2_grpc as pb_grpc
from api.state import AppState, app_state
from core.db.schema import ApiKey
from core.models.catalog import text_problem
from core.ops.metrics import GRPC_DURATION, GRPC_REQUESTS

log = logging.getLogger(__name__)
Reply = TypeVar("Reply")

# A REST status as the gRPC code that means the same.
CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    409: grpc.StatusCode.ALREADY_EXISTS,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    422: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    500: grpc.StatusCode.INTERNAL,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}
# Where each datatype's elements travel in InferTensorContents (FP16 has no field: it
# travels in raw_input_contents only, as in Triton).
CONTENTS = {
    "BOOL": "bool_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


@dataclass(frozen=True)
class Call:
    """What a call brings besides its message: its metadata, request id and peer address."""

    metadata: Mapping[str, str]
    request_id: str
    address: str


def infer_request(request: pb.ModelInferRequest) -> oip.InferRequest:
    """A gRPC infer request as the protocol's parsed request (ProtocolError naming what is
    wrong, in the REST parser's words)."""
    if request.id and (problem := text_problem(request.id)):
        raise oip.ProtocolError(f"id must not contain {problem}")
    if not request.inputs:
        raise oip.ProtocolError("inputs must be a non-empty array of tensors")
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise oip.ProtocolError(
            f"raw_input_contents holds {len(raw)} tensors for {len(request.inputs)} inputs"
        )
    inputs = [
        _input(tensor, raw[index] if raw else None, f"inputs[{index}]")
        for index, tensor in enumerate(request.inputs)
    ]
    names = [t.name for t in inputs]
    if len(set(names)) != len(names):
        raise oip.ProtocolError("inputs: each tensor may be given once")
    outputs = {o.name: True for o in request.outputs} if request.outputs else None
    parameters = _values(request.parameters, "parameters")
    return oip.InferRequest(request.id or None, parameters, inputs, outputs)


def _input(
    tensor: pb.ModelInferRequest.InferInputTensor, raw: bytes | None, where: str
) -> oip.Tensor:
    _, _, shape, where, count = oip.described(
        tensor.name, tensor.datatype, list(tensor.shape), where
    )
    if raw is not None:
        if tensor.HasField("contents"):
            raise oip.ProtocolError(f"{where}: contents and raw_input_contents both given")
        data = oip.from_binary(raw, tensor.datatype, count, where)
        return oip.Tensor(tensor.name, tensor.datatype, tuple(shape), data)
    field = CONTENTS.get(tensor.datatype)
    if field is None:
        raise oip.ProtocolError(f"{where}: {tensor.datatype} travels in raw_input_contents only")
    values = list(getattr(tensor.contents, field))
    if len(values) != count:
        raise oip.ProtocolError(
            f"{where}: shape {shape} holds {count} elements, contents has {len(values)}"
        )
    if tensor.datatype != "BYTES":
        values = [oip.element(v, tensor.datatype, where) for v in values]
    return oip.Tensor(tensor.name, tensor.datatype, tuple(shape), values)


def _values(parameters: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A map of the protocol's parameters (InferParameter, ModelRepositoryParameter) as
    plain values."""
    values = {}
    for name, parameter in parameters.items():
        chosen = parameter.WhichOneof("parameter_choice")
        if chosen is None:
            raise oip.ProtocolError(f"{where}.{name}: no value")
        values[name] = getattr(parameter, chosen)
    return values


def infer_response(
    model: str, version: int | None, request: oip.InferRequest, outputs: list[oip.Tensor]
) -> pb.ModelInferResponse:
    """The outputs asked for (all when none are named), in raw_output_contents."""
    if request.outputs is not None:
        outputs = [t for t in outputs if t.name in request.outputs]
    response = pb.ModelInferResponse(
        model_name=model,
        model_version="" if version is None else str(version),
        id=request.id or "",
    )
    for tensor in outputs:
        response.outputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
        response.raw_output_contents.append(oip.to_binary(tensor))
    return response


def accepted_response(
    model: str, request: oip.InferRequest, submitted: list[Submitted]
) -> pb.ModelInferResponse:
    """The async extension's answer: no outputs; the jobs' ids, for the job API."""
    response = pb.ModelInferResponse(model_name=model, id=request.id or "")
    response.parameters["job_ids"].string_param = ",".join(done.job.id for done in submitted)
    return response


def model_version(text: str) -> int | None:
    """A call's ``version`` field: empty for the active version, else a version number."""
    if not text:
        return None
    if not text.isdecimal() or int(text) < 1:
        raise oip.ProtocolError(f"version {text!r} is not a version number (1 or more)")
    return int(text)


def address_of(peer: str) -> str:
    """The client's address in gRPC's peer string (``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``)."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return kind or "unknown"
    host, _, _ = rest.rpartition(":")
    return host.strip("[]") or "unknown"


Handler = Callable[[Any, Any, grpc.aio.ServicerContext, Call], Awaitable[Reply]]


def _answering(handler: Handler[Reply]) -> Callable[[Any, Any, Any], Awaitable[Reply]]:
    """A servicer method that counts and times its calls and answers Ferry's errors as the
    gRPC code their HTTP status means."""
    method = handler.__name__

    @functools.wraps(handler)
    async def answer(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Reply:
        started = time.perf_counter()
        metadata = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
        call = Call(
            metadata,
            request_id_for(metadata.get("x-request-id", "")),
            address_of(context.peer()),
        )
        code = grpc.StatusCode.OK
        try:
            return await handler(self, request, context, call)
        except ApiError as exc:
            code = CODES.get(exc.status, grpc.StatusCode.UNKNOWN)
            if retry := exc.headers.get("Retry-After"):
                context.set_trailing_metadata((("retry-after", retry),))
            await context.abort(code, exc.message)
        except oip.ProtocolError as exc:
            code = CODES.get(exc.status, grpc.StatusCode.UNKNOWN)
            await context.abort(code, exc.message)
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED  # the client went away (its jobs run all the same)
            raise
        except Exception:
            code = grpc.StatusCode.INTERNAL
            log.exception("unhandled error", extra={"request_id": call.request_id, "rpc": method})
            await context.abort(code, f"internal error (request_id {call.request_id})")
        finally:
            GRPC_REQUESTS.labels(method, code.name).inc()
            GRPC_DURATION.labels(method).observe(time.perf_counter() - started)
        raise AssertionError("unreachable: abort raises")

    return answer


class InferenceService(pb_grpc.GRPCInferenceServiceServicer):
    """The protocol's calls, on the app's state (made by its lifespan)."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app

    @property
    def state(self) -> AppState:
        return app_state(self.app)

    async def _key(self, call: Call) -> ApiKey:
        return await authenticate(self.state, call.metadata.get("authorization", ""), call.address)

    async def _admin(self, call: Call) -> ApiKey:
        key = await self._key(call)
        if key.scope != "admin":
            raise ApiError(403, "forbidden", "this call needs an API key with the admin scope")
        return key

    @_answering
    async def ServerLive(
        self, request: pb.ServerLiveRequest, context: Any, call: Call
    ) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    @_answering
    async def ServerReady(
        self, request: pb.ServerReadyRequest, context: Any, call: Call
    ) -> pb.ServerReadyResponse:
        ready, _ = await asyncio.to_thread(readiness, self.state, self.state.redis)
        return pb.ServerReadyResponse(ready=ready)

    @_answering
    async def ServerMetadata(
        self, request: pb.ServerMetadataRequest, context: Any, call: Call
    ) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name="ferry", version=VERSION, extensions=EXTENSIONS)

    @_answering
    async def ModelMetadata(
        self, request: pb.ModelMetadataRequest, context: Any, call: Call
    ) -> pb.ModelMetadataResponse:
        await self._key(call)
        version = model_version(request.version)
        found = await asyncio.to_thread(metadata_of, self.app, request.name, version)
        tensor = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=found["name"],
            versions=found["versions"],
            platform=found["platform"],
            inputs=[tensor(**t) for t in found["inputs"]],
            outputs=[tensor(**t) for t in found["outputs"]],
        )

    @_answering
    async def ModelReady(
        self, request: pb.ModelReadyRequest, context: Any, call: Call
    ) -> pb.ModelReadyResponse:
        await self._key(call)
        version = model_version(request.version)
        _, why = await asyncio.to_thread(
            not_ready, self.app, self.state.redis, request.name, version
        )
        return pb.ModelReadyResponse(ready=why is None)

    @_answering
    async def ModelInfer(
        self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext, call: Call
    ) -> pb.ModelInferResponse:
        key = await self._key(call)
        version = model_version(request.model_version)
        spec = resolved(self.app, request.model_name, version, taking_jobs=True)
        parsed = infer_request(request)
        submitted = await submit_rows(self.app, key, call.request_id, spec, version, parsed)
        if parsed.parameters.get("async") is True:
            return accepted_response(spec.name, parsed, submitted)
        # The client's own deadline, where shorter than the longest long-poll: its jobs
        # run all the same, and the answer says so before the call is cut off.
        remaining = context.time_remaining()
        ran_on, outputs = await outputs_of(self.app, key, spec, submitted, remaining)
        return infer_response(spec.name, ran_on, parsed, outputs)

    @_answering
    async def RepositoryIndex(
        self, request: pb.RepositoryIndexRequest, context: Any, call: Call
    ) -> pb.RepositoryIndexResponse:
        await self._admin(call)
        entries = await asyncio.to_thread(index_entries, self.app, self.state.redis)
        if request.ready:
            entries = [e for e in entries if e["state"] == oip.READY]
        model = pb.RepositoryIndexResponse.ModelIndex
        return pb.RepositoryIndexResponse(models=[model(**e) for e in entries])

    @_answering
    async def RepositoryModelLoad(
        self, request: pb.RepositoryModelLoadRequest, context: Any, call: Call
    ) -> pb.RepositoryModelLoadResponse:
        await self._admin(call)
        parameters = oip.checked_repository_parameters(
            _values(request.parameters, "parameters"), oip.LOAD_PARAMETERS, "load"
        )
        version = oip.load_version(parameters)
        await asyncio.to_thread(load_model, self.app, self.state.redis, request.model_name, version)
        return pb.RepositoryModelLoadResponse()

    @_answering
    async def RepositoryModelUnload(
        self, request: pb.RepositoryModelUnloadRequest, context: Any, call: Call
    ) -> pb.RepositoryModelUnloadResponse:
        await self._admin(call)
        oip.checked_repository_parameters(
            _values(request.parameters, "parameters"), oip.UNLOAD_PARAMETERS, "unload"
        )
        await asyncio.to_thread(unload_model, self.app, self.state.redis, request.model_name)
        return pb.RepositoryModelUnloadResponse()


@dataclass(frozen=True)
class GrpcSettings:
    """Where the gRPC server listens, and its message limit (``Settings.section``)."""

    api_host: str
    grpc_port: int
    api_processes: int
    max_body_bytes: int


async def start_server(app: FastAPI, settings: GrpcSettings) -> grpc.aio.Server:
    """The gRPC server on ``settings.grpc_port``, started on the running loop. Several API
    processes (``FERRY_API_PROCESSES``) share the port as they share HTTP's; a single one
    binds it alone, so a second server on the port is an error, not a silent split."""
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", settings.max_body_bytes),
            ("grpc.so_reuseport", 1 if settings.api_processes > 1 else 0),
        ]
    )
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceService(app), server)
    host = f"[{settings.api_host}]" if ":" in settings.api_host else settings.api_host
    address = f"{host}:{settings.grpc_port}"
    try:
        server.add_insecure_port(address)
    except RuntimeError as exc:
        raise RuntimeError(f"the gRPC server could not listen on {address}: {exc}") from exc
    await server.start()
    log.info("gRPC inference service listening", extra={"address": address})
    return server
