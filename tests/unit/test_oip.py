"""api.oip.protocol: the protocol's requests parsed, cut into rows, answered as tensors."""

from __future__ import annotations

import json
import struct
from typing import Any

import pytest

from api.oip import protocol as oip
from core.db.versions import VersionState
from core.models.catalog import ModelSpec, input_spec
from core.models.inputs import TensorInputSpec
from core.models.repository import CostConfig, EmbeddingsConfig, TensorSpec
from scheduler.vocabulary import Lane
from tests.models import shipped


def spec_of(name: str) -> ModelSpec:
    model = shipped(name)
    return ModelSpec(
        name=name, description="", backend=model.backend, active_version=1, versions=(1,),
        max_batch_size=8, input=input_spec(model), embeddings=model.embeddings,
    )  # fmt: skip


def tensor_model(*tensors: TensorSpec) -> ModelSpec:
    return ModelSpec(
        name="mlp", description="", backend="torchscript", active_version=1, versions=(1,),
        max_batch_size=8, input=TensorInputSpec(tensors, CostConfig("constant")),
    )  # fmt: skip


def body(header: dict[str, Any], *binary: bytes) -> tuple[bytes, str | None]:
    text = json.dumps(header).encode()
    return text + b"".join(binary), (str(len(text)) if binary else None)


def as_bytes(*items: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(item)) + item for item in items)


def refused(raw: bytes, length: str | None) -> str:
    with pytest.raises(oip.ProtocolError) as caught:
        oip.parse_request(raw, length)
    return caught.value.message


def test_json_data_nested_or_flat_is_read_in_row_major_order() -> None:
    nested = {"name": "x", "datatype": "FP32", "shape": [2, 3], "data": [[1, 2, 3], [4, 5, 6.5]]}
    flat = {**nested, "data": [1, 2, 3, 4, 5, 6.5]}
    for tensor in (nested, flat):
        parsed = oip.parse_request(*body({"inputs": [tensor]}))
        assert parsed.inputs[0].data == [1, 2, 3, 4, 5, 6.5]
        assert parsed.inputs[0].shape == (2, 3)


def test_binary_tensors_follow_the_header_in_order() -> None:
    header = {
        "id": "r1",
        "inputs": [
            {"name": "text", "datatype": "BYTES", "shape": [2],
             "parameters": {"binary_data_size": len(as_bytes(b"hello", "naïve".encode()))}},
            {"name": "w", "datatype": "FP32", "shape": [2], "parameters": {"binary_data_size": 8}},
            {"name": "n", "datatype": "INT64", "shape": [1], "data": [7]},
        ],
    }  # fmt: skip
    raw, length = body(header, as_bytes(b"hello", "naïve".encode()), struct.pack("<2f", 0.5, -2))
    parsed = oip.parse_request(raw, length)
    assert parsed.id == "r1"
    assert [t.data for t in parsed.inputs] == [[b"hello", "naïve".encode()], [0.5, -2.0], [7]]


@pytest.mark.parametrize(
    ("tensor", "binary", "message"),
    [
        ({"name": "t", "datatype": "FP32", "shape": [3], "data": [1, 2]},
         b"", "shape [3] holds 3 elements, data has 2"),
        ({"name": "t", "datatype": "INT64", "shape": [1], "data": [1.5]},
         b"", "INT64 elements must be integers"),
        ({"name": "t", "datatype": "FP32", "shape": [1], "data": ["1"]},
         b"", "FP32 elements must be numbers"),
        ({"name": "t", "datatype": "BYTES", "shape": [1], "data": [1]},
         b"", "a BYTES element in JSON must be a string"),
        ({"name": "t", "datatype": "FLOAT", "shape": [1], "data": [1]},
         b"", "datatype 'FLOAT' is not one of the protocol's"),
        ({"name": "t", "datatype": "FP32", "shape": [-1], "data": [1]},
         b"", "shape must be a non-empty array of sizes"),
        ({"name": "t", "datatype": "FP32", "shape": [1]}, b"", "no data"),
        ({"name": "t", "datatype": "FP32", "shape": [2], "parameters": {"binary_data_size": 4}},
         struct.pack("<f", 1), "2 FP32 elements are 8 bytes, got 4"),
        ({"name": "t", "datatype": "BYTES", "shape": [1], "parameters": {"binary_data_size": 6}},
         struct.pack("<I", 9) + b"ab", "a BYTES element is longer than its data"),
        ({"name": "t", "datatype": "FP32", "shape": [1], "parameters": {"binary_data_size": 4}},
         struct.pack("<f", float("nan")), "elements must be finite"),
    ],
)  # fmt: skip
def test_a_tensor_that_does_not_add_up_is_refused_naming_it(
    tensor: dict[str, Any], binary: bytes, message: str
) -> None:
    raw, length = body({"inputs": [tensor]}, *([binary] if binary else []))
    said = refused(raw, length)
    assert said.startswith("input 't': ") and message in said


def test_the_framing_itself_is_checked() -> None:
    assert refused(b"{", None) == "the request's header is not valid JSON"
    assert refused(b"[]", None) == "the request must be a JSON object"
    assert refused(b'{"inputs": []}', None) == "inputs must be a non-empty array of tensors"
    header = json.dumps({"inputs": [{"name": "t", "datatype": "FP32", "shape": [1], "data": [1]}]})
    assert "is not within the body's 74 bytes" in refused(header.encode(), str(len(header) + 1))
    assert "bytes of binary data follow" in refused(header.encode() + b"xx", str(len(header)))
    twice = {"name": "t", "datatype": "FP32", "shape": [1], "data": [1]}
    assert "each tensor may be given once" in refused(*body({"inputs": [twice, twice]}))


def test_a_text_model_takes_one_job_a_row_in_either_shape() -> None:
    minilm = spec_of("minilm")
    for shape in ([2], [2, 1]):
        tensor = oip.Tensor("text", "BYTES", tuple(shape), [b"first", b"zweite"])
        assert oip.rows(minilm, [tensor], max_rows=10) == ["first", "zweite"]
    wide = oip.Tensor("text", "BYTES", (1, 2), [b"a", b"b"])
    with pytest.raises(oip.ProtocolError, match=r"shape \[1, 2\], the model takes \[N\] or"):
        oip.rows(minilm, [wide], max_rows=10)
    many = oip.Tensor("text", "BYTES", (3,), [b"a", b"b", b"c"])
    with pytest.raises(oip.ProtocolError, match="3 rows; at most 2 in one request"):
        oip.rows(minilm, [many], max_rows=2)
    latin = oip.Tensor("text", "BYTES", (1,), [b"\xff"])
    with pytest.raises(oip.ProtocolError, match="row 0: not UTF-8 text"):
        oip.rows(minilm, [latin], max_rows=10)


def test_json_and_image_models_get_their_own_input_forms() -> None:
    documents = oip.Tensor("input", "BYTES", (2,), [b'{"cost": 3}', b'{"cost": 4}'])
    assert oip.rows(spec_of("sim"), [documents], 10) == [{"cost": 3}, {"cost": 4}]
    image = oip.Tensor("image", "BYTES", (1,), [b"\xff\xd8\xff\xe0"])
    assert oip.rows(spec_of("resnet50"), [image], 10) == ["/9j/4A=="]  # base64, as jobs take


def test_an_image_model_also_takes_each_file_as_a_uint8_row() -> None:
    resnet50 = spec_of("resnet50")
    files = oip.Tensor("image", "UINT8", (2, 4), [*b"\xff\xd8\xff\xe0", *b"\x89PNG"])
    assert oip.rows(resnet50, [files], 10) == ["/9j/4A==", "iVBORw=="]
    # From JSON too: the numbers are the bytes.
    header = {"inputs": [{"name": "image", "datatype": "UINT8", "shape": [1, 3],
                          "data": [[255, 216, 255]]}]}  # fmt: skip
    parsed = oip.parse_request(*body(header))
    assert oip.rows(resnet50, parsed.inputs, 10) == ["/9j/"]
    flat = oip.Tensor("image", "UINT8", (4,), list(b"\xff\xd8\xff\xe0"))
    with pytest.raises(oip.ProtocolError, match=r"a UINT8 image tensor is \[N, L\]"):
        oip.rows(resnet50, [flat], 10)
    floats = oip.Tensor("image", "FP32", (1, 1), [1.0])
    with pytest.raises(oip.ProtocolError, match=r"takes BYTES \(or UINT8 \[N, L\]\)"):
        oip.rows(resnet50, [floats], 10)
    # Only an image model takes bytes as UINT8.
    text = oip.Tensor("text", "UINT8", (1, 2), [104, 105])
    with pytest.raises(oip.ProtocolError, match=r"datatype UINT8, the model takes BYTES$"):
        oip.rows(spec_of("minilm"), [text], 10)


@pytest.mark.parametrize(
    ("datatype", "value", "message"),
    [
        ("UINT8", 256, "256 is outside UINT8's range (0 to 255)"),
        ("UINT8", -1, "-1 is outside UINT8's range (0 to 255)"),
        ("INT8", -129, "-129 is outside INT8's range (-128 to 127)"),
        ("INT64", 2**63, f"{2**63} is outside INT64's range"),
        ("UINT64", 2**64, f"{2**64} is outside UINT64's range"),
        ("FP16", 70000, "70000 is beyond FP16's range"),
        ("FP32", 1e39, "1e+39 is beyond FP32's range"),
    ],
)
def test_a_json_number_its_datatype_cannot_hold_is_refused(
    datatype: str, value: float, message: str
) -> None:
    tensor = {"name": "t", "datatype": datatype, "shape": [1], "data": [value]}
    assert refused(*body({"inputs": [tensor]})).startswith(f"input 't': {message}")
    edge = {"UINT8": 255, "INT8": -128, "INT64": 2**63 - 1, "UINT64": 2**64 - 1,
            "FP16": 65504, "FP32": 3.4e38}[datatype]  # fmt: skip
    fits = oip.parse_request(*body({"inputs": [{**tensor, "data": [edge]}]}))
    assert fits.inputs[0].data == [edge]


def test_a_tensor_model_gets_each_row_nested_in_its_declared_shape() -> None:
    one = tensor_model(TensorSpec("x", (2, 2), "float32"))
    flat = oip.Tensor("x", "FP32", (2, 2, 2), [1, 2, 3, 4, 5, 6, 7, 8])
    assert oip.rows(one, [flat], 10) == [[[1, 2], [3, 4]], [[5, 6], [7, 8]]]
    two = tensor_model(TensorSpec("ids", (3,), "int64"), TensorSpec("scale", (), "float32"))
    ids = oip.Tensor("ids", "INT64", (2, 3), [1, 2, 3, 4, 5, 6])
    scale = oip.Tensor("scale", "FP32", (2,), [0.5, 2.0])
    assert oip.rows(two, [ids, scale], 10) == [
        {"ids": [1, 2, 3], "scale": 0.5},
        {"ids": [4, 5, 6], "scale": 2.0},
    ]
    short = oip.Tensor("scale", "FP32", (1,), [0.5])
    with pytest.raises(oip.ProtocolError, match="the same first dimension"):
        oip.rows(two, [ids, short], 10)
    with pytest.raises(oip.ProtocolError, match="input 'scale' is missing"):
        oip.rows(two, [ids], 10)
    assert [t.metadata() for t in oip.model_inputs(two)] == [
        {"name": "ids", "datatype": "INT64", "shape": [-1, 3]},
        {"name": "scale", "datatype": "FP32", "shape": [-1]},
    ]


def test_a_generation_model_is_not_served_by_the_protocol() -> None:
    with pytest.raises(oip.ProtocolError, match="served on /v1/completions"):
        oip.model_inputs(spec_of("tiny-gpt2"))


@pytest.mark.parametrize(
    ("parameters", "lane", "deadline_ms"),
    [
        ({}, None, None),
        ({"priority": 0}, None, None),
        ({"priority": 1}, Lane.URGENT, None),
        ({"priority": 2}, Lane.VIP, None),
        ({"priority": 3}, Lane.NORMAL, None),
        ({"priority": 9, "timeout": 1}, Lane.BULK, 1),
        ({"timeout": 2_500_001}, None, 2_501),
    ],
)
def test_priority_and_timeout_map_to_lanes_and_deadlines(
    parameters: dict[str, Any], lane: Lane | None, deadline_ms: int | None
) -> None:
    assert oip.lane_and_deadline(parameters) == (lane, deadline_ms)


@pytest.mark.parametrize("parameters", [{"priority": -1}, {"priority": True}, {"timeout": 0}])
def test_bad_priority_or_timeout_is_refused(parameters: dict[str, Any]) -> None:
    with pytest.raises(oip.ProtocolError):
        oip.lane_and_deadline(parameters)


def test_embeddings_come_back_as_one_fp32_tensor_in_json_or_binary() -> None:
    spec = tensor_model(TensorSpec("x", (1,), "float32"))
    spec = ModelSpec(**{**spec.__dict__, "embeddings": EmbeddingsConfig(dimensions=2)})
    tensors = oip.output_tensors(spec, [[0.5, 1.0], [2, -1.5]])
    as_json = oip.InferRequest("q", {}, [], None)
    text, length = oip.encode_response("mlp", 1, as_json, tensors)
    assert length is None
    assert json.loads(text) == {
        "model_name": "mlp", "model_version": "1", "id": "q",
        "outputs": [{"name": "embedding", "datatype": "FP32", "shape": [2, 2],
                     "data": [0.5, 1.0, 2.0, -1.5]}],
    }  # fmt: skip
    in_binary = oip.InferRequest(None, {"binary_data_output": True}, [], None)
    raw, length = oip.encode_response("mlp", None, in_binary, tensors)
    assert length is not None
    header = json.loads(raw[:length])
    assert header["outputs"][0]["parameters"] == {"binary_data_size": 16}
    assert struct.unpack("<4f", raw[length:]) == (0.5, 1.0, 2.0, -1.5)
    with pytest.raises(oip.ProtocolError, match="not a vector of 2"):
        oip.output_tensors(spec, [[1.0]])


def test_other_outputs_are_json_text_and_only_the_outputs_asked_for_come_back() -> None:
    tensors = oip.output_tensors(spec_of("sim"), [{"a": 1}, [2, "b"]])
    wanted = oip.InferRequest(None, {}, [], {"output": True})
    raw, length = oip.encode_response("sim", 1, wanted, tensors)
    assert length is not None and raw[length:] == as_bytes(b'{"a":1}', b'[2,"b"]')
    unknown = oip.InferRequest(None, {}, [], {"logits": False})
    with pytest.raises(oip.ProtocolError, match="output 'logits': no such output"):
        oip.check_outputs(spec_of("sim"), unknown)
    oip.check_outputs(spec_of("sim"), wanted)  # one it has: nothing to say


def test_an_id_or_timeout_ferry_cannot_keep_is_refused_by_the_parser() -> None:
    tensor = {"name": "t", "datatype": "FP32", "shape": [1], "data": [1]}
    assert refused(*body({"id": "a\u0000b", "inputs": [tensor]})) == (
        "id must not contain NUL characters"
    )
    with pytest.raises(oip.ProtocolError, match=r"parameters\.timeout: at most"):
        oip.lane_and_deadline({"timeout": 10**15})


def test_repository_requests_may_be_empty_and_take_only_their_fields() -> None:
    assert oip.parse_index_request(b"") is False
    assert oip.parse_index_request(b"{}") is False
    assert oip.parse_index_request(b'{"ready": true}') is True
    assert oip.parse_load_request(b"") is None
    assert oip.parse_load_request(b"{}") is None  # tritonclient's load_model sends this
    assert oip.parse_load_request(b'{"parameters": {"version": 2}}') == 2
    unload = b'{"parameters": {"unload_dependents": false}}'  # and its unload_model this
    oip.parse_unload_request(unload)
    oip.parse_unload_request(b"")


@pytest.mark.parametrize(
    ("parse", "raw", "message"),
    [
        (oip.parse_index_request, b"{", "the request is not valid JSON"),
        (oip.parse_index_request, b"[]", "the request must be a JSON object"),
        (oip.parse_index_request, b'{"ready": "yes"}', "ready must be true or false"),
        (oip.parse_index_request, b'{"repository_name": ""}',
         "repository_name: not a field of this request (it takes: ready)"),
        (oip.parse_load_request, b'{"parameters": []}', "parameters must be an object"),
        (oip.parse_load_request, b'{"parameters": {"version": "2"}}',
         "parameters.version must be an integer"),
        (oip.parse_load_request, b'{"parameters": {"version": true}}',
         "parameters.version must be an integer"),
        (oip.parse_load_request, b'{"parameters": {"version": 0}}',
         "parameters.version must be a version number (1 or more)"),
        (oip.parse_load_request, b'{"parameters": {"config": "{}"}}',
         "parameters.config: Ferry serves the models of its repository as they are"),
        (oip.parse_load_request, b'{"parameters": {"file:1/model.onnx": "AA=="}}',
         "parameters.file:1/model.onnx: Ferry serves the models of its repository"),
        (oip.parse_load_request, b'{"parameters": {"priority": 1}}',
         "parameters.priority: not a parameter of load (it takes: version)"),
        (oip.parse_load_request, b'{"version": 2}',
         "version: not a field of this request (it takes: parameters)"),
        (oip.parse_unload_request, b'{"parameters": {"unload_dependents": 1}}',
         "parameters.unload_dependents must be true or false"),
        (oip.parse_unload_request, b'{"parameters": {"version": 1}}',
         "parameters.version: not a parameter of unload (it takes: unload_dependents)"),
    ],
)  # fmt: skip
def test_a_bad_repository_request_is_refused_naming_the_field(
    parse: Any, raw: bytes, message: str
) -> None:
    with pytest.raises(oip.ProtocolError) as caught:
        parse(raw)
    assert caught.value.message.startswith(message) and caught.value.status == 400


def test_the_index_says_each_versions_state_and_why() -> None:
    def index(active: int, unloaded: bool = False, **states: VersionState) -> list[tuple[str, ...]]:
        reported = {int(v.removeprefix("v")): s for v, s in states.items()}
        entries = oip.repository_entries("m", [1, 2, 3], active, reported, unloaded)
        assert [(e["name"], e["version"]) for e in entries] == [("m", "1"), ("m", "2"), ("m", "3")]
        return [(e["state"], e["reason"]) for e in entries]

    ready, draining = VersionState("ready", None, 2), VersionState("draining", None, 1)
    failed = VersionState("failed", "out of memory", 1)
    assert index(2, v1=draining, v2=ready, v3=failed) == [
        ("UNLOADING", "no longer the active version (2 is); its jobs finish"),
        ("READY", ""),
        ("UNAVAILABLE", "not the active version (2 is); it failed to load: out of memory"),
    ]
    assert index(3, v2=ready, v3=VersionState("loading"))[1:] == [
        ("UNAVAILABLE", "not the active version (3 is)"),
        ("LOADING", ""),
    ]
    assert index(3, v3=failed)[2] == ("UNAVAILABLE", "failed to load: out of memory")
    assert index(1)[0] == (
        "UNAVAILABLE", "no live worker serves it (its jobs wait in the queue for one)"
    )  # fmt: skip
    # Unloaded: no version is available, whatever the workers say.
    assert {s for s, _ in index(2, unloaded=True, v2=ready)} == {"UNAVAILABLE"}
    assert index(2, unloaded=True, v2=ready)[1][1].startswith("unloaded: ")
    assert oip.unserved_entries("broken", [1]) == [
        {"name": "broken", "version": "1", "state": "UNAVAILABLE",
         "reason": f"not served: {oip.UNSERVED}"},
    ]  # fmt: skip
