"""The Tinker SDK's protobuf bodies on the worker's side: a ``ForwardBackwardRequest``'s datums decoded into
tensors, and the results of ``forward_backward`` and ``asample`` encoded as the SDK reads them
(tinker/proto/response_conv.py; docs/design/tinker-protocol.md §2.4, §2.6).

A datum is checked as it is decoded, and a bad one raises a :class:`~engine.session.errors.UserError` naming the
datum and the field (``data[1].loss_fn_inputs.weights: ...``), so the client learns what to fix. Bytes are
little-endian, as the SDK writes them with numpy on the hosts it runs on.
"""

from __future__ import annotations

import itertools
import math
import struct
from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal

import torch
from google.protobuf.message import Message

from engine.session.errors import UserError, datum_error
from engine.spec import tinker_proto
from engine.spec.tinker_proto import DEFAULT_BUDGET, DType, ElementBudget, StopReason, check_elements

_READ_DTYPES = {
    DType.FLOAT32: (torch.float32, torch.float32),
    DType.INT64: (torch.int64, torch.int64),
    DType.INT32: (torch.int32, torch.int64),
    DType.BFLOAT16: (torch.bfloat16, torch.float32),
}
"""A wire dtype → the dtype its bytes are read as, and the dtype the datum's tensor has (ints widen to int64,
bfloat16 to float32, as the SDK's own decoding does)."""

_STOP_REASONS = {"stop": StopReason.STOP, "length": StopReason.LENGTH}


@dataclass
class Datum:
    """One datum of a forward / forward_backward request, as tensors."""

    tokens: torch.Tensor
    """int64 (N,): the model input, its ``encoded_text`` chunks concatenated."""
    inputs: dict[str, torch.Tensor]
    """The ``loss_fn_inputs`` by name, dense, in the shape sent: float32 (from float32 or bfloat16) or int64."""


@dataclass
class SampledSequence:
    """One sampled completion of an ``asample`` request."""

    tokens: list[int]
    """The sampled token ids, the stop sequence included when it ended the sample."""
    logprobs: list[float]
    """The sampler's log-prob of each token of ``tokens``."""
    stop_reason: Literal["stop", "length"]
    """``stop``: a stop sequence or EOS ended it; ``length``: ``max_tokens`` did."""


def _from_bytes(raw: bytes, dtype: torch.dtype) -> torch.Tensor:
    """The 1-D tensor of ``dtype`` whose bytes are ``raw`` (a whole number of elements), copied."""
    if not raw:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=dtype)


def _values(raw: bytes, dtype: torch.dtype, index: int, field: str) -> torch.Tensor:
    """:func:`_from_bytes`, or the datum's error when ``raw`` is not a whole number of ``dtype`` elements."""
    size = torch.empty((), dtype=dtype).element_size()
    if len(raw) % size:
        raise datum_error(index, field, f"{len(raw)} bytes are not a whole number of {dtype} values ({size} bytes)")
    return _from_bytes(raw, dtype)


def _chunk_tokens(index: int, position: int, chunk: Message) -> torch.Tensor:
    """The int64 token ids of a model-input chunk; text only (images and audio need models this server has not)."""
    field = f"model_input.chunks[{position}]"
    kind = chunk.WhichOneof("chunk")
    if kind == "image":
        raise datum_error(index, field, "images are not supported by this server (only encoded_text chunks)")
    if kind == "dmel":
        raise datum_error(index, field, "audio (dmel) is not supported by this server (only encoded_text chunks)")
    if kind is None:
        raise datum_error(index, field, "an empty chunk (neither encoded_text nor another kind)")
    return _values(chunk.encoded_text.tokens, torch.int32, index, field).long()  # (n,)


def _csr_problem(crow: torch.Tensor, col: torch.Tensor, nnz: int, rows: int, cols: int) -> str | None:
    """What is wrong with CSR indices for a (rows, cols) tensor of ``nnz`` listed values, or None."""
    if crow.numel() != rows + 1:
        return f"crow_indices has {crow.numel()} entries, a tensor of {rows} rows needs {rows + 1}"
    if crow[0] != 0 or bool((crow.diff() < 0).any()):
        return "crow_indices must start at 0 and never decrease"
    if crow[-1] != nnz or col.numel() != nnz:
        return f"crow_indices end at {int(crow[-1])}, but there are {col.numel()} col_indices and {nnz} values"
    if bool(((col < 0) | (col >= cols)).any()):
        return f"a column index outside [0, {cols})"
    rows_of = torch.repeat_interleave(torch.arange(rows), crow.diff())  # (nnz,)
    if torch.unique(rows_of * cols + col).numel() != nnz:
        return "an entry is listed twice"
    return None


def _densify_csr(csr: Message, shape: list[int], dtype: torch.dtype, index: int, field: str) -> torch.Tensor:
    """The dense (rows, cols) tensor of a ``SparseCsr``: the listed values at their places, 0 elsewhere (the SDK
    leaves out the entries equal to its pad value 0, ``TensorData.from_torch_sparse``). Its size was checked
    against the request's budget before (:func:`decode_datums`)."""
    if len(shape) != 2:
        raise datum_error(index, field, f"a sparse CSR tensor needs a 2-D shape, not {shape}")
    rows, cols = shape
    values = _values(csr.values, dtype, index, field)  # (nnz,)
    crow = _values(csr.crow_indices, torch.int64, index, field + ".crow_indices")  # (rows + 1,)
    col = _values(csr.col_indices, torch.int64, index, field + ".col_indices")  # (nnz,)
    problem = _csr_problem(crow, col, values.numel(), rows, cols)
    if problem is not None:
        raise datum_error(index, field, f"bad CSR indices: {problem}")
    dense = torch.zeros(rows, cols, dtype=dtype)  # (rows, cols)
    dense[torch.repeat_interleave(torch.arange(rows), crow.diff()), col] = values
    return dense


def _decode_tensor(tensor: Message, index: int, field: str) -> torch.Tensor:
    """A ``Tensor`` of a datum, dense or sparse CSR, as a dense tensor of its shape (1-D when none was sent, as the
    SDK's ``TensorData`` infers it)."""
    if tensor.dtype not in _READ_DTYPES:
        name = {member.value: member.name for member in DType}.get(tensor.dtype, str(tensor.dtype))
        raise datum_error(index, field, f"dtype {name} is none of FLOAT32, INT64, INT32, BFLOAT16")
    read_dtype, dtype = _READ_DTYPES[DType(tensor.dtype)]
    shape = list(tensor.shape)
    if any(size < 0 for size in shape):
        raise datum_error(index, field, f"shape {shape} has a negative dimension")
    if tensor.WhichOneof("encoding") == "sparse_csr":
        return _densify_csr(tensor.sparse_csr, shape, read_dtype, index, field).to(dtype)
    values = _values(tensor.dense, read_dtype, index, field)
    shape = shape or [values.numel()]
    if values.numel() != math.prod(shape):
        raise datum_error(index, field, f"{values.numel()} {read_dtype} values do not fill shape {shape}")
    return values.reshape(shape).to(dtype)


def check_input_names(request: Message, known: Collection[str]) -> None:
    """A :class:`UserError` naming the first datum and input whose name is not one of ``known`` (the inputs of the
    request's loss), before any tensor is decoded."""
    for index, datum in enumerate(request.data):
        for name in sorted(datum.loss_fn_inputs):
            if name not in known:
                problem = f"not an input of loss {request.loss_fn!r} (its inputs: {', '.join(known)})"
                raise datum_error(index, f"loss_fn_inputs.{name}", problem)


def decode_datums(
    request: Message, *, budget: ElementBudget = DEFAULT_BUDGET, inputs: Collection[str] | None = None
) -> list[Datum]:
    """The datums of a parsed ``ForwardBackwardRequest`` (:func:`engine.spec.tinker_proto.parse_forward_backward`)
    as tensors. Before anything is decoded: a :class:`UserError` for an input name that is none of ``inputs`` (when
    given), and :class:`~engine.spec.tinker_proto.TooLarge` for dense elements past ``budget``. Then a
    :class:`UserError` names the datum and field of a chunk that is not text, a tensor whose bytes do not match its
    shape and dtype, an unspecified dtype, a negative dimension, or bad CSR indices."""
    if inputs is not None:
        check_input_names(request, inputs)
    check_elements(request, budget)
    datums = []
    for index, datum in enumerate(request.data):
        chunks = [_chunk_tokens(index, position, chunk) for position, chunk in enumerate(datum.model_input)]
        tensors = {
            name: _decode_tensor(tensor, index, f"loss_fn_inputs.{name}")
            for name, tensor in sorted(datum.loss_fn_inputs.items())
        }
        datums.append(Datum(tokens=torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.int64), inputs=tensors))
    return datums


def loss_config(request: Message) -> dict[str, float | str]:
    """The loss's settings: ``loss_fn_config_v2`` (numbers and strings) when the client sent it, else the legacy
    number-only ``loss_fn_config`` (the SDK writes the numbers to both; request_conv.py)."""
    if not request.loss_fn_config_v2:
        return {name: float(value) for name, value in request.loss_fn_config.items()}
    config: dict[str, float | str] = {}
    for name, value in request.loss_fn_config_v2.items():
        kind = value.WhichOneof("value")
        if kind is None:
            raise UserError(f"loss_fn_config.{name}: neither a number nor a text")
        config[name] = float(value.number) if kind == "number" else str(value.text)
    return config


def _int64_bytes(values: list[int]) -> bytes:
    return struct.pack(f"<{len(values)}q", *values)


def _wire_tensor(tensor: torch.Tensor) -> tuple[DType, tuple[int, ...], bytes]:
    """An output tensor as the SDK's public dtypes carry it: floats as FLOAT32, integers (and booleans) as INT64;
    its trailing shape (all but the first dimension) and its bytes."""
    if tensor.is_complex():
        raise ValueError(f"a complex output tensor ({tensor.dtype}) has no wire dtype")
    dtype, wire = (torch.float32, DType.FLOAT32) if tensor.is_floating_point() else (torch.int64, DType.INT64)
    data = tensor.detach().to(device="cpu", dtype=dtype).contiguous()
    return wire, tuple(tensor.shape[1:]), data.numpy().tobytes()


def _array_record(datums: list[dict[str, tuple[DType, tuple[int, ...], bytes]]], type_tag: str) -> Message:
    """One ``ArrayRecord`` of datums whose fields share dtype and trailing shape: per field, the datums' bytes
    concatenated with their byte offsets (tinker/proto/response_conv.py
    ``_decode_batched_tensor_to_per_datum_arrays``)."""
    record = tinker_proto.ArrayRecord(type_tag=type_tag, num_datums=len(datums))
    for name, (wire, trailing_shape, _) in datums[0].items():
        pieces = [datum[name][2] for datum in datums]
        record.fields[name].CopyFrom(
            tinker_proto.BatchedTensor(
                data=b"".join(pieces),
                offsets=_int64_bytes([0, *itertools.accumulate(len(piece) for piece in pieces)]),
                dtype=wire,
                trailing_shape=trailing_shape,
            )
        )
    return record


def encode_forward_backward_output(
    outputs: list[dict[str, torch.Tensor]], metrics: dict[str, float], output_type: str = "ArrayRecord"
) -> bytes:
    """A serialized ``ForwardBackwardOutput``: the per-datum ``outputs`` (e.g. ``{"logprobs": (N,)}``) and the
    ``metrics`` (``name:reduction`` keys, §2.4). One ``ArrayRecord`` holds all datums when every field keeps its
    dtype and trailing shape across them (the usual case); otherwise each run of datums that do is its own record,
    which the SDK reads back in order. Every datum must have the same field names (the SDK pairs them by name)."""
    if len({frozenset(output) for output in outputs}) > 1:
        raise ValueError(
            f"every datum's outputs need the same names, got {sorted({tuple(sorted(o)) for o in outputs})}"
        )
    wire = [{name: _wire_tensor(tensor) for name, tensor in sorted(output.items())} for output in outputs]

    def layout(datum: dict[str, tuple[DType, tuple[int, ...], bytes]]) -> list[tuple[str, DType, tuple[int, ...]]]:
        return [(name, dtype, trailing_shape) for name, (dtype, trailing_shape, _) in datum.items()]

    message = tinker_proto.ForwardBackwardOutput(loss_fn_output_type=output_type, metrics=metrics)
    for _, run in itertools.groupby(wire, key=layout):
        message.loss_fn_outputs.append(_array_record(list(run), output_type))
    return message.SerializeToString()


def _float32_bytes(values: list[float]) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def encode_sample_response(sequences: list[SampledSequence], prompt_logprobs: list[float] | None) -> bytes:
    """A serialized ``SampleResponse``: each sequence's int32 tokens, float32 log-probs and stop reason, and
    ``prompt_logprobs`` when the request asked for them (one per prompt token, NaN at position 0, which nothing
    predicts; the SDK reads NaN as None), omitted when None."""
    message = tinker_proto.SampleResponse()
    for sequence in sequences:
        if len(sequence.logprobs) != len(sequence.tokens):
            raise ValueError(f"{len(sequence.tokens)} tokens but {len(sequence.logprobs)} logprobs")
        message.sequences.add(
            stop_reason=_STOP_REASONS[sequence.stop_reason],
            tokens=struct.pack(f"<{len(sequence.tokens)}i", *sequence.tokens),
            logprobs=_float32_bytes(sequence.logprobs),
        )
    if prompt_logprobs is not None:
        if prompt_logprobs and not math.isnan(prompt_logprobs[0]):
            raise ValueError(
                f"prompt_logprobs[0] must be NaN (nothing predicts the first token), not {prompt_logprobs[0]}"
            )
        message.prompt_logprobs = _float32_bytes(prompt_logprobs)
    return message.SerializeToString()
