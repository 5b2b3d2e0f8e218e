"""The gRPC form's pure part: messages to the protocol's tensors and back, codes, and
protoc's output kept current (the calls themselves: tests/integration/test_oip_grpc.py)."""

from __future__ import annotations

import asyncio
import struct

import grpc
import pytest
from fastapi import FastAPI

from api.oip import protocol as oip
from api.oip import protos
from api.oip.grpc import (
    CODES,
    CONTENTS,
    GrpcSettings,
    accepted_response,
    address_of,
    infer_request,
    infer_response,
    model_version,
    start_server,
)
from api.oip.routes import _MEANINGS
from api.oip.third_party import grpc_service_pb2 as pb
from core.config.settings import Settings
from harness.ports import free_port


def request_with(*tensors: tuple[str, str, list[int]]) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="m")
    for name, datatype, shape in tensors:
        request.inputs.add(name=name, datatype=datatype, shape=shape)
    return request


def test_typed_contents_become_the_protocols_tensors() -> None:
    request = request_with(("a", "INT64", [2, 2]), ("b", "FP32", [2]), ("c", "BYTES", [1]))
    request.inputs[0].contents.int64_contents.extend([1, -2, 3, 4])
    request.inputs[1].contents.fp32_contents.extend([0.5, 1.5])
    request.inputs[2].contents.bytes_contents.append(b"hi")
    request.id = "r1"
    request.parameters["priority"].uint64_param = 2
    request.parameters["timeout"].int64_param = 5_000
    request.parameters["async"].bool_param = True
    parsed = infer_request(request)
    assert parsed.id == "r1"
    assert parsed.parameters == {"priority": 2, "timeout": 5_000, "async": True}
    assert [(t.name, t.datatype, t.shape, t.data) for t in parsed.inputs] == [
        ("a", "INT64", (2, 2), [1, -2, 3, 4]),
        ("b", "FP32", (2,), [0.5, 1.5]),
        ("c", "BYTES", (1,), [b"hi"]),
    ]
    assert parsed.outputs is None
    assert oip.lane_and_deadline(parsed.parameters) == ("vip", 5)


def test_raw_contents_are_read_as_the_binary_extension_lays_them_out() -> None:
    request = request_with(("text", "BYTES", [2]), ("x", "FP16", [2]))
    request.raw_input_contents.append(struct.pack("<I", 3) + b"abc" + struct.pack("<I", 0))
    request.raw_input_contents.append(struct.pack("<2e", 1.0, -2.0))
    request.outputs.add(name="embedding")
    parsed = infer_request(request)
    assert [t.data for t in parsed.inputs] == [[b"abc", b""], [1.0, -2.0]]
    assert parsed.outputs == {"embedding": True}


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda r: None, "inputs must be a non-empty array of tensors"),
        (
            lambda r: r.inputs.add(name="a", datatype="INT32", shape=[2])
            .contents.int_contents.append(1),
            "input 'a': shape [2] holds 2 elements, contents has 1",
        ),
        (
            lambda r: r.inputs.add(name="a", datatype="FP16", shape=[1])
            .contents.fp32_contents.append(1.0),
            "input 'a': FP16 travels in raw_input_contents only",
        ),
        (
            lambda r: r.inputs.add(name="a", datatype="INT8", shape=[1])
            .contents.int_contents.append(300),
            "input 'a': 300 is outside INT8's range (-128 to 127)",
        ),
        (
            lambda r: r.inputs.add(name="a", datatype="FP32", shape=[1])
            .contents.fp32_contents.append(float("nan")),
            "input 'a': elements must be finite",
        ),
        (
            lambda r: r.inputs.add(name="a", datatype="COMPLEX", shape=[1]),
            "input 'a': datatype 'COMPLEX' is not one of the protocol's",
        ),
        (
            lambda r: r.inputs.add(name="", datatype="BYTES", shape=[1]),
            "inputs[0].name must be a non-empty string",
        ),
        (
            lambda r: [r.inputs.add(name="a", datatype="BOOL", shape=[1]),
                       r.inputs.add(name="b", datatype="BOOL", shape=[1]),
                       r.raw_input_contents.append(b"\x01")],
            "raw_input_contents holds 1 tensors for 2 inputs",
        ),
        (
            lambda r: [r.inputs.add(name="a", datatype="BOOL", shape=[1])
                       .contents.bool_contents.append(True),
                       r.raw_input_contents.append(b"\x01")],
            "input 'a': contents and raw_input_contents both given",
        ),
        (
            lambda r: [r.inputs.add(name="a", datatype="BYTES", shape=[0]),
                       r.inputs.add(name="a", datatype="BYTES", shape=[0])],
            "inputs: each tensor may be given once",
        ),
        (
            lambda r: [r.inputs.add(name="a", datatype="BYTES", shape=[0]),
                       r.parameters["priority"]],
            "parameters.priority: no value",
        ),
        (
            lambda r: [r.inputs.add(name="a", datatype="BYTES", shape=[0]),
                       r.MergeFrom(pb.ModelInferRequest(id="bad\x00id"))],
            "id must not contain NUL characters",
        ),
    ],
)  # fmt: skip
def test_a_request_the_protocol_refuses_says_what_is_wrong(build: object, message: str) -> None:
    request = pb.ModelInferRequest(model_name="m")
    build(request)  # type: ignore[operator]
    with pytest.raises(oip.ProtocolError) as refused:
        infer_request(request)
    assert refused.value.message == message and refused.value.status == 400


def test_outputs_go_back_raw_as_triton_sends_them_and_only_those_asked_for() -> None:
    embedding = oip.Tensor("embedding", "FP32", (2, 2), [1.0, 2.0, 3.0, 4.0])
    text = oip.Tensor("output", "BYTES", (2,), [b"{}", b"[1]"])
    everything = oip.InferRequest("q", {}, [], None)
    response = infer_response("m", 3, everything, [embedding, text])
    assert (response.model_name, response.model_version, response.id) == ("m", "3", "q")
    assert [(o.name, o.datatype, list(o.shape)) for o in response.outputs] == [
        ("embedding", "FP32", [2, 2]),
        ("output", "BYTES", [2]),
    ]
    assert response.raw_output_contents[0] == struct.pack("<4f", 1.0, 2.0, 3.0, 4.0)
    assert response.raw_output_contents[1] == b"\x02\x00\x00\x00{}\x03\x00\x00\x00[1]"
    only = oip.InferRequest(None, {}, [], {"output": True})
    narrowed = infer_response("m", None, only, [embedding, text])
    assert [o.name for o in narrowed.outputs] == ["output"]
    assert narrowed.model_version == "" and narrowed.id == ""


def test_the_async_answer_carries_the_job_ids() -> None:
    class Done:
        def __init__(self, id_: str) -> None:
            self.job = type("J", (), {"id": id_})()

    response = accepted_response("m", oip.InferRequest("r", {}, [], None), [Done("a"), Done("b")])  # type: ignore[list-item]
    assert response.parameters["job_ids"].string_param == "a,b"
    assert response.id == "r" and not response.outputs


def test_versions_addresses_and_codes() -> None:
    assert model_version("") is None and model_version("12") == 12
    for bad in ("0", "-1", "v2", "1.5", "²"):
        with pytest.raises(oip.ProtocolError):
            model_version(bad)
    assert address_of("ipv4:10.0.0.7:51234") == "10.0.0.7"
    assert address_of("ipv6:[::1]:51234") == "::1"
    assert address_of("unix:/run/ferry.sock") == "unix"
    # Every status the protocol's routes answer has the gRPC code that means it.
    assert set(_MEANINGS) <= set(CODES)
    assert CODES[404] == grpc.StatusCode.NOT_FOUND and CODES[429] == CODES[413]
    # Every datatype of the protocol travels somewhere in typed contents but FP16.
    assert set(oip.DATATYPES) - set(CONTENTS) == {"FP16"}


def test_the_generated_modules_are_what_protoc_writes_from_the_protos() -> None:
    assert protos.stale() == [], f"run: {protos.COMMAND}"


@pytest.mark.parametrize("processes", [1, 2])
def test_one_api_process_binds_the_grpc_port_alone_several_share_it(processes: int) -> None:
    settings = Settings(grpc_port=free_port(), api_processes=processes).section(GrpcSettings)

    async def two_servers() -> bool:
        first = await start_server(FastAPI(), settings)
        try:
            second = await start_server(FastAPI(), settings)
        except RuntimeError as exc:
            assert f"could not listen on 127.0.0.1:{settings.grpc_port}" in str(exc)
            return False
        finally:
            await first.stop(0)
        await second.stop(0)
        return True

    # Alone, a second server on the port is an error, not a silent split of the calls;
    # FERRY_API_PROCESSES' processes share it as they share HTTP's (SO_REUSEPORT).
    assert asyncio.run(two_servers()) is (processes > 1)


def test_a_message_over_the_body_limit_is_refused_before_any_handler_runs() -> None:
    settings = Settings(grpc_port=free_port(), max_body_bytes=2048).section(GrpcSettings)

    async def call(size: int) -> grpc.StatusCode:
        # No app state: a call that reached the handler would end INTERNAL, not this.
        server = await start_server(FastAPI(), settings)
        try:
            request = pb.ModelInferRequest(model_name="m")
            request.raw_input_contents.append(b"x" * size)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{settings.grpc_port}") as channel:
                infer = channel.unary_unary(
                    "/inference.GRPCInferenceService/ModelInfer",
                    request_serializer=pb.ModelInferRequest.SerializeToString,
                    response_deserializer=pb.ModelInferResponse.FromString,
                )
                try:
                    await infer(request, timeout=10)
                except grpc.aio.AioRpcError as exc:
                    return exc.code()
                return grpc.StatusCode.OK
        finally:
            await server.stop(0)

    assert asyncio.run(call(4096)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert asyncio.run(call(100)) == grpc.StatusCode.INTERNAL  # under it: the handler ran
