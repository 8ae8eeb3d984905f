"""The Tinker SDK's protobuf bodies, with the SDK as the reference: requests built and serialized by its own code
(``tinker.types``, tinker/proto/request_conv.py) are parsed and decoded by ours, and results encoded by ours are
read back by its tinker/proto/response_conv.py."""

import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard
from google.protobuf import descriptor_pb2
from tinker import types
from tinker.proto import tinker_public_pb2
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response

from engine.session.errors import UserError
from engine.session.wire import (
    SampledSequence,
    decode_datums,
    encode_forward_backward_output,
    encode_sample_response,
    loss_config,
)
from engine.spec import tinker_proto
from engine.spec.tinker_proto import (
    ElementBudget,
    TooLarge,
    WireError,
    check_elements,
    parse_forward_backward,
    parse_stored,
    stored_body,
)

ROOT = Path(__file__).resolve().parents[3]


def sdk_body(
    data: list[types.Datum],
    *,
    loss_fn: str = "cross_entropy",
    config: dict[str, float | str] | None = None,
    compress: bool = False,
) -> bytes:
    """The body the SDK posts to /api/v1/forward_backward (tinker/resources/training.py), forward_only set."""
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=config),  # type: ignore[arg-type]
        model_id="sess1:train:0",
        seq_id=7,
    )
    message = forward_backward_request_to_proto(request)
    message.forward_only = True
    body = message.SerializeToString()
    return zstandard.ZstdCompressor().compress(body) if compress else body


def sdk_message(body: bytes) -> tinker_public_pb2.ForwardBackwardRequest:
    return tinker_public_pb2.ForwardBackwardRequest.FromString(body)


def naive_dense(crow: list[int], col: list[int], values: list[float], shape: list[int]) -> list[list[float]]:
    """CSR to dense by its definition: row r holds values[k] at col[k] for k in [crow[r], crow[r + 1])."""
    dense = [[0.0] * shape[1] for _ in range(shape[0])]
    for row in range(shape[0]):
        for k in range(crow[row], crow[row + 1]):
            dense[row][col[k]] = values[k]
    return dense


def test_our_messages_are_the_sdks_field_for_field() -> None:
    sdk = descriptor_pb2.FileDescriptorProto.FromString(tinker_public_pb2.DESCRIPTOR.serialized_pb)
    sdk_messages = {message.name: message for message in sdk.message_type}
    ours = {message.name: message for message in tinker_proto.FILE.message_type}
    needed = {"ForwardBackwardRequest", "Datum", "Chunk", "Tensor", "ForwardBackwardOutput", "SampleResponse"}
    assert needed <= set(ours)
    assert len(ours) == 20  # everything but SamplingParams and its stop lists, which travel as JSON
    for name, message in ours.items():
        assert message == sdk_messages[name], name
    assert list(tinker_proto.FILE.enum_type) == list(sdk.enum_type)
    assert tinker_proto.FILE.package == sdk.package


def test_the_messages_import_without_torch() -> None:
    code = "import engine.spec.tinker_proto, sys; assert 'torch' not in sys.modules and 'numpy' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


@pytest.mark.parametrize("compress", [False, True])
def test_a_request_of_the_sdk_decodes_to_its_values(compress: bool) -> None:
    prompt, completion = [5, 6, 7], [8, 9]
    data = [
        types.Datum(
            model_input=types.ModelInput(
                chunks=[types.EncodedTextChunk(tokens=prompt), types.EncodedTextChunk(tokens=completion)]
            ),
            loss_fn_inputs={
                "target_tokens": [6, 7, 8, 9, 2],  # a list: int64 by its name
                "weights": np.array([0.0, 0.0, 1.0, 1.0, 0.5], dtype=np.float32),
                "advantages": torch.tensor([0.25, -1.5, 3.0, 0.0, 1e-8]),
                "logprobs": [-0.1, -2.0, -0.3, -4.5, -0.01],
            },
        ),
        types.Datum(
            model_input=types.ModelInput.from_ints([2**31 - 1, 0, 42]),
            loss_fn_inputs={"target_tokens": torch.tensor([0, 42, 3]), "weights": [1.0, 1.0, 1.0]},
        ),
    ]
    config = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.25, "loss_id": "abc"}
    request = parse_forward_backward(
        sdk_body(data, loss_fn="ppo", config=config, compress=compress), "zstd" if compress else None
    )
    assert (request.model_id, request.seq_id, request.loss_fn, request.forward_only) == (
        "sess1:train:0",
        7,
        "ppo",
        True,
    )
    assert loss_config(request) == config

    datums = decode_datums(request)
    assert len(datums) == 2
    assert datums[0].tokens.dtype == torch.int64
    assert datums[0].tokens.tolist() == prompt + completion
    assert datums[1].tokens.tolist() == [2**31 - 1, 0, 42]
    for datum, sent in zip(datums, data, strict=True):
        assert sorted(datum.inputs) == sorted(sent.loss_fn_inputs)
        for name, tensor in datum.inputs.items():
            expected = sent.loss_fn_inputs[name]
            assert tensor.dtype == (torch.int64 if expected.dtype == "int64" else torch.float32), name
            assert list(tensor.shape) == expected.shape, name
            assert tensor.tolist() == expected.to_numpy().tolist(), name


def test_two_dimensional_inputs_come_sparse_and_decode_dense() -> None:
    target_tokens = torch.zeros(4, 6, dtype=torch.int64)
    target_tokens[0, 1], target_tokens[2, 5], target_tokens[3, 0] = 11, 12, 13
    weights = torch.zeros(4, 6)
    weights[1, 2], weights[3, 0] = 0.75, -2.5
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3, 4]),
        loss_fn_inputs={"target_tokens": target_tokens, "weights": weights, "advantages": torch.ones(4, 6)},
    )
    body = sdk_body([datum])
    sent = sdk_message(body).data[0].loss_fn_inputs
    # the check is meaningful: the SDK really sent the sparse ones as CSR, the full one dense
    assert [sent[name].WhichOneof("encoding") for name in ("target_tokens", "weights")] == ["sparse_csr"] * 2
    assert sent["advantages"].WhichOneof("encoding") == "dense"

    inputs = decode_datums(parse_forward_backward(body, None))[0].inputs
    assert inputs["target_tokens"].dtype == torch.int64 and inputs["weights"].dtype == torch.float32
    assert torch.equal(inputs["target_tokens"], target_tokens)
    assert torch.equal(inputs["weights"], weights)
    assert torch.equal(inputs["advantages"], torch.ones(4, 6))
    for name in ("target_tokens", "weights"):
        td = datum.loss_fn_inputs[name]
        assert td.sparse_crow_indices is not None and td.sparse_col_indices is not None and td.shape is not None
        naive = naive_dense(td.sparse_crow_indices, td.sparse_col_indices, td._numpy.tolist(), td.shape)
        assert inputs[name].tolist() == naive


def test_the_dtypes_the_sdk_does_not_send_widen() -> None:
    request = tinker_proto.ForwardBackwardRequest()
    datum = request.data.add()
    datum.model_input.add().encoded_text.tokens = np.array([3, 4], dtype=np.int32).tobytes()
    datum.loss_fn_inputs["ids"].CopyFrom(
        tinker_proto.Tensor(dense=np.array([[1, -2], [3, 4]], np.int32).tobytes(), dtype=3, shape=[2, 2])
    )
    bf16 = torch.tensor([1.5, -0.125, 3.0e10], dtype=torch.bfloat16)
    datum.loss_fn_inputs["scale"].CopyFrom(
        tinker_proto.Tensor(dense=bf16.view(torch.int16).numpy().tobytes(), dtype=4, shape=[3])
    )
    datum.loss_fn_inputs["unshaped"].CopyFrom(tinker_proto.Tensor(dense=np.float32([1, 2, 3]).tobytes(), dtype=1))
    inputs = decode_datums(request)[0].inputs
    assert inputs["ids"].dtype == torch.int64 and inputs["ids"].tolist() == [[1, -2], [3, 4]]
    assert inputs["scale"].dtype == torch.float32 and inputs["scale"].tolist() == bf16.float().tolist()
    assert inputs["unshaped"].tolist() == [1.0, 2.0, 3.0]  # no shape: 1-D, as TensorData infers it


def test_loss_config_falls_back_on_the_legacy_map() -> None:
    request = tinker_proto.ForwardBackwardRequest(loss_fn_config={"kl_coeff": 0.5, "clip_low_threshold": 0.8})
    assert loss_config(request) == {"kl_coeff": 0.5, "clip_low_threshold": 0.8}
    request.loss_fn_config_v2["kl_coeff"].number = 0.25  # v2, when sent, is the whole config
    assert loss_config(request) == {"kl_coeff": 0.25}
    request.loss_fn_config_v2["broken"].SetInParent()
    with pytest.raises(UserError, match=r"^loss_fn_config\.broken: "):
        loss_config(request)
    assert loss_config(tinker_proto.ForwardBackwardRequest()) == {}


def a_good_datum() -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]},
    )


def csr_weights(crow: list[int], col: list[int], values: list[float]) -> tinker_public_pb2.Tensor:
    message = tinker_public_pb2.Tensor(dtype=tinker_public_pb2.DTYPE_FLOAT32, shape=[2, 3])
    message.sparse_csr.values = np.float32(values).tobytes()
    message.sparse_csr.crow_indices = np.int64(crow).tobytes()
    message.sparse_csr.col_indices = np.int64(col).tobytes()
    return message


def spoil_weights(tensor: tinker_public_pb2.Tensor) -> Callable[[tinker_public_pb2.Datum], None]:
    """Replace the datum's weights by ``tensor``."""
    return lambda datum: datum.loss_fn_inputs["weights"].CopyFrom(tensor)


def spoil_image(datum: tinker_public_pb2.Datum) -> None:
    datum.model_input.add().image.data = b"\x89PNG"


def spoil_dmel(datum: tinker_public_pb2.Datum) -> None:
    datum.model_input.add().dmel.dmel = b"\x00"


def spoil_tokens(datum: tinker_public_pb2.Datum) -> None:
    datum.model_input.add().encoded_text.tokens = b"\x01\x00\x00"


def spoil_chunk(datum: tinker_public_pb2.Datum) -> None:
    datum.model_input.add()


FLOAT32, UNSPECIFIED = tinker_public_pb2.DTYPE_FLOAT32, tinker_public_pb2.DTYPE_UNSPECIFIED
BAD_DATUMS = {
    "image": (spoil_image, "model_input.chunks[1]", "images are not supported by this server"),
    "dmel": (spoil_dmel, "model_input.chunks[1]", "audio"),
    "ragged tokens": (spoil_tokens, "model_input.chunks[1]", "not a whole number"),
    "empty chunk": (spoil_chunk, "model_input.chunks[1]", "empty chunk"),
    "too few bytes": (
        spoil_weights(tinker_public_pb2.Tensor(dense=np.float32([1, 1]).tobytes(), dtype=FLOAT32, shape=[3])),
        "loss_fn_inputs.weights",
        "do not fill shape",
    ),
    "ragged bytes": (
        spoil_weights(tinker_public_pb2.Tensor(dense=b"\x00" * 11, dtype=FLOAT32, shape=[3])),
        "loss_fn_inputs.weights",
        "not a whole number",
    ),
    "unspecified dtype": (
        spoil_weights(tinker_public_pb2.Tensor(dense=np.float32([1, 1, 1]).tobytes(), dtype=UNSPECIFIED, shape=[3])),
        "loss_fn_inputs.weights",
        "dtype UNSPECIFIED",
    ),
    "unknown dtype": (
        spoil_weights(tinker_public_pb2.Tensor(dense=b"", dtype=9, shape=[0])),  # type: ignore[arg-type]
        "loss_fn_inputs.weights",
        "dtype 9",
    ),
    "negative dimension": (
        spoil_weights(tinker_public_pb2.Tensor(dense=b"", dtype=FLOAT32, shape=[-1, 0])),
        "loss_fn_inputs.weights",
        "negative dimension",
    ),
    "1-D sparse": (
        spoil_weights(tinker_public_pb2.Tensor(sparse_csr={}, dtype=FLOAT32, shape=[3])),
        "loss_fn_inputs.weights",
        "2-D shape",
    ),
    "crow length": (spoil_weights(csr_weights([0, 1], [0], [1.0])), "loss_fn_inputs.weights", "bad CSR indices"),
    "crow decreasing": (
        spoil_weights(csr_weights([0, 2, 1], [0, 1], [1.0, 2.0])),
        "loss_fn_inputs.weights",
        "never decrease",
    ),
    "crow end": (spoil_weights(csr_weights([0, 1, 1], [0, 1], [1.0, 2.0])), "loss_fn_inputs.weights", "end at 1"),
    "column out of range": (
        spoil_weights(csr_weights([0, 1, 2], [0, 3], [1.0, 2.0])),
        "loss_fn_inputs.weights",
        "outside",
    ),
    "column negative": (
        spoil_weights(csr_weights([0, 1, 2], [-1, 0], [1.0, 2.0])),
        "loss_fn_inputs.weights",
        "outside",
    ),
    "entry twice": (
        spoil_weights(csr_weights([0, 2, 2], [1, 1], [1.0, 2.0])),
        "loss_fn_inputs.weights",
        "listed twice",
    ),
    "ragged crow bytes": (
        spoil_weights(tinker_public_pb2.Tensor(sparse_csr={"crow_indices": b"\x00" * 5}, dtype=FLOAT32, shape=[2, 3])),
        "loss_fn_inputs.weights.crow_indices",
        "not a whole number",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_DATUMS))
def test_a_bad_datum_is_the_users_error_naming_datum_and_field(case: str) -> None:
    spoil, field, problem = BAD_DATUMS[case]
    message = sdk_message(sdk_body([a_good_datum(), a_good_datum()]))
    assert decode_datums(parse_forward_backward(message.SerializeToString(), None))  # unspoiled, it decodes
    spoil(message.data[1])
    request = parse_forward_backward(message.SerializeToString(), None)
    with pytest.raises(UserError) as raised:
        decode_datums(request)
    assert str(raised.value).startswith(f"data[1].{field}: ")
    assert problem in str(raised.value)


def test_a_good_csr_of_the_wire_decodes_as_the_naive_loop() -> None:
    crow, col, values = [0, 2, 3], [0, 2, 1], [1.5, -2.0, 4.0]
    message = sdk_message(sdk_body([a_good_datum()]))
    spoil_weights(csr_weights(crow, col, values))(message.data[0])
    weights = decode_datums(parse_forward_backward(message.SerializeToString(), None))[0].inputs["weights"]
    assert weights.tolist() == naive_dense(crow, col, values, [2, 3])


def test_dense_elements_past_the_datum_or_request_budget_are_refused_before_anything_is_allocated() -> None:
    message = sdk_message(sdk_body([a_good_datum()] * 3))
    message.data[1].loss_fn_inputs["weights"].CopyFrom(csr_weights([0, 0, 0], [], []))  # 6 elements once dense
    request = parse_forward_backward(message.SerializeToString(), None)
    # per datum: 3 tokens + 3 targets + 3 weights, or 6 of a sparse (2, 3) weights: 9, 12 and 9
    assert decode_datums(request, budget=ElementBudget(datum=12, request=30))[1].inputs["weights"].shape == (2, 3)
    with pytest.raises(
        TooLarge,
        match=r"^data\[1\]: 12 elements once dense \(loss_fn_inputs\.weights: 6\), more "
        r"than the 11 a datum",
    ) as datum:
        decode_datums(request, budget=ElementBudget(datum=11, request=30))
    assert datum.value.bound == "datum"
    with pytest.raises(TooLarge, match=r"^data: 30 elements .* by data\[2\] of 3 datums, more than the 29") as total:
        decode_datums(request, budget=ElementBudget(datum=12, request=29))
    assert total.value.bound == "request"
    # a sparse shape of 2^26 x 2^26 in a few bytes is counted, not allocated
    message.data[0].loss_fn_inputs["weights"].shape[:] = [1 << 26, 1 << 26]
    with pytest.raises(TooLarge, match=f"loss_fn_inputs.weights: {1 << 52}"):
        check_elements(message, ElementBudget(datum=1 << 22, request=1 << 24))


def test_input_names_the_loss_does_not_take_are_refused_before_decoding() -> None:
    message = sdk_message(sdk_body([a_good_datum(), a_good_datum()]))
    message.data[1].loss_fn_inputs["mask"].CopyFrom(
        tinker_public_pb2.Tensor(dense=b"\x00" * 3, dtype=FLOAT32, shape=[1 << 40])  # would not decode either
    )
    request = parse_forward_backward(message.SerializeToString(), None)
    with pytest.raises(
        UserError,
        match=r"^data\[1\]\.loss_fn_inputs\.mask: not an input of loss 'cross_entropy' "
        r"\(its inputs: target_tokens, weights\)",
    ):
        decode_datums(request, inputs=("target_tokens", "weights"))


def test_a_body_is_stored_compressed_and_read_back() -> None:
    body = sdk_body([a_good_datum()] * 20)
    compressed = zstandard.ZstdCompressor(level=1).compress(body)
    assert stored_body(compressed, "zstd") == compressed  # as the SDK sent it
    plain = stored_body(body, None)
    assert len(plain) < len(body) and zstandard.ZstdDecompressor().decompress(plain) == body
    for payload in (compressed, plain, body):  # the last: a plain message, as an earlier version stored it
        assert parse_stored(payload).SerializeToString() == parse_forward_backward(body, None).SerializeToString()
    with pytest.raises(TooLarge, match=f"more than {len(body) - 1} bytes") as past:
        parse_stored(plain, max_bytes=len(body) - 1)
    assert past.value.bound == "body"


def test_bodies_that_are_not_requests_are_wire_errors() -> None:
    body = sdk_body([a_good_datum()] * 20)
    assert parse_forward_backward(zstandard.ZstdCompressor().compress(body), "ZSTD").seq_id == 7
    cases = [
        (b"\xff\xff\xff\xff", None, "not a protobuf"),
        (body, "zstd", "not valid zstd"),
        (body, "gzip", "unsupported Content-Encoding"),
        (zstandard.ZstdCompressor().compress(body), "zstd", f"more than {len(body) - 1} bytes"),
        (body, None, f"more than {len(body) - 1}"),
    ]
    for payload, encoding, problem in cases:
        with pytest.raises(WireError, match=problem):
            parse_forward_backward(payload, encoding, max_bytes=len(body) - 1)
    assert issubclass(WireError, ValueError)
    assert parse_forward_backward(body, None, max_bytes=len(body)).seq_id == 7  # the bound itself is allowed


def test_outputs_read_back_by_the_sdk() -> None:
    outputs = [
        {
            "logprobs": torch.tensor([-0.5, -1.25, -3.0]),
            "elementwise_loss": torch.tensor([0.1, 0.2, 0.3], dtype=torch.bfloat16),
            "argmax": torch.tensor([4, 5, 6], dtype=torch.int32),
            "topk": torch.arange(6, dtype=torch.float64).reshape(3, 2),
        },
        {
            "logprobs": torch.tensor([-2.0]),
            "elementwise_loss": torch.tensor([7.0], dtype=torch.bfloat16),
            "argmax": torch.tensor([9], dtype=torch.int32),
            "topk": torch.tensor([[10.0, 11.0]]),
        },
    ]
    metrics = {"loss:sum": 4.75, "tokens:sum": 4.0}
    body = encode_forward_backward_output(outputs, metrics)
    assert len(tinker_public_pb2.ForwardBackwardOutput.FromString(body).loss_fn_outputs) == 1  # one record
    result = deserialize_forward_backward_output(body)
    assert result.metrics == metrics
    assert result.loss_fn_output_type == "ArrayRecord"
    assert len(result.loss_fn_outputs) == 2
    for sent, got in zip(outputs, result.loss_fn_outputs, strict=True):
        assert sorted(got) == sorted(sent)
        for name, tensor in sent.items():
            assert got[name].dtype == ("float32" if tensor.is_floating_point() else "int64"), name
            assert got[name].shape == list(tensor.shape), name
            expected = tensor.float() if tensor.is_floating_point() else tensor.long()
            assert got[name].to_torch().tolist() == expected.tolist(), name


def test_outputs_whose_trailing_shape_changes_go_as_records_in_order() -> None:
    outputs = [{"topk": torch.full((2, k), float(i))} for i, k in enumerate([2, 2, 3, 2])]
    body = encode_forward_backward_output(outputs, {}, output_type="tinker:ArrayRecord")
    assert [r.num_datums for r in tinker_public_pb2.ForwardBackwardOutput.FromString(body).loss_fn_outputs] == [2, 1, 1]
    result = deserialize_forward_backward_output(body)
    assert result.loss_fn_output_type == "ArrayRecord"  # the part after the last colon
    assert [datum["topk"].to_torch().tolist() for datum in result.loss_fn_outputs] == [
        o["topk"].tolist() for o in outputs
    ]


def test_outputs_of_no_datum_and_of_no_field() -> None:
    assert (
        deserialize_forward_backward_output(encode_forward_backward_output([], {"loss:sum": 0.0})).loss_fn_outputs == []
    )
    assert deserialize_forward_backward_output(encode_forward_backward_output([{}, {}], {})).loss_fn_outputs == [{}, {}]
    with pytest.raises(ValueError, match="same names"):
        encode_forward_backward_output([{"logprobs": torch.zeros(2)}, {"loss": torch.zeros(2)}], {})


def test_a_sample_response_read_back_by_the_sdk() -> None:
    sequences = [
        SampledSequence(tokens=[5, 2**31 - 1, 0], logprobs=[-0.5, -1e-6, -20.0], stop_reason="stop"),
        SampledSequence(tokens=[7, 8], logprobs=[-1.0, -2.0], stop_reason="length"),
        SampledSequence(tokens=[], logprobs=[], stop_reason="length"),
    ]
    prompt_logprobs = [math.nan, -3.5, -0.25]
    got = deserialize_sample_response(encode_sample_response(sequences, prompt_logprobs))
    assert [s.tokens for s in got.sequences] == [s.tokens for s in sequences]
    assert [s.stop_reason for s in got.sequences] == ["stop", "length", "length"]
    for sent, sequence in zip(sequences, got.sequences, strict=True):
        assert sequence.logprobs_np is None or sequence.logprobs_np.dtype == np.float32
        assert (sequence.logprobs or []) == pytest.approx(sent.logprobs, rel=1e-6)
    assert got.prompt_logprobs == [None, -3.5, -0.25]  # NaN at position 0 reads as None
    assert deserialize_sample_response(encode_sample_response(sequences, None)).prompt_logprobs is None


def test_a_sample_response_refuses_what_the_sdk_would_misread() -> None:
    with pytest.raises(ValueError, match="2 tokens but 1 logprobs"):
        encode_sample_response([SampledSequence(tokens=[1, 2], logprobs=[-1.0], stop_reason="stop")], None)
    with pytest.raises(ValueError, match="must be NaN"):
        encode_sample_response([], [0.0, -1.0])
