"""The protobuf messages of the Tinker SDK's bodies (``tinker_public``, SDK 0.38.0), built here without the SDK.

``forward`` / ``forward_backward`` arrive as a serialized ``ForwardBackwardRequest`` (zstd-compressed when the
client config asks for it), and their results and those of ``asample`` must go back as ``ForwardBackwardOutput`` /
``SampleResponse`` (docs/design/tinker-protocol.md §2.4, §2.6, §2.7). The descriptor below is written field by
field with the SDK's numbers, types, oneofs and maps (tinker/proto/tinker_public_pb2.py; a test compares the two),
and lives in a private descriptor pool so that importing the SDK in the same process never clashes with it.

Torch-free (protobuf and the standard library only): the API parses a request here for its model id and seq id;
the worker decodes the datums into tensors in engine/session/wire.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import IntEnum
from typing import Literal, NamedTuple

import zstandard
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError, Message

PACKAGE = "tinker_public"
MAX_BODY_BYTES = 64 * 1024 * 1024
"""The default bound on a forward_backward body after decompression (the SDK's chunks are ~5 MB, one long datum
may be more)."""
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
"""The first bytes of a zstd frame (RFC 8878 §3.1.1); a serialized request starts with its field 1's tag, 0x0a."""

_Field = descriptor_pb2.FieldDescriptorProto
_BOOL, _BYTES, _DOUBLE, _ENUM = _Field.TYPE_BOOL, _Field.TYPE_BYTES, _Field.TYPE_DOUBLE, _Field.TYPE_ENUM
_INT32, _INT64, _MESSAGE, _STRING = _Field.TYPE_INT32, _Field.TYPE_INT64, _Field.TYPE_MESSAGE, _Field.TYPE_STRING
_UINT32 = _Field.TYPE_UINT32


class DType(IntEnum):
    """``tinker_public.DType``: the element type of a ``Tensor`` or ``BatchedTensor`` (wire names ``DTYPE_*``)."""

    UNSPECIFIED = 0
    FLOAT32 = 1
    INT64 = 2
    INT32 = 3
    BFLOAT16 = 4


class StopReason(IntEnum):
    """``tinker_public.StopReason``: why a sampled sequence ended (wire names ``STOP_REASON_*``)."""

    STOP = 0
    LENGTH = 1


class WireError(ValueError):
    """A body that is not a message of the protocol: bad compression, too large, or not protobuf."""


Bound = Literal["body", "datum", "request"]
"""What a :class:`TooLarge` body passed: its bytes once decompressed, one datum's dense elements, or all of them."""


class TooLarge(WireError):
    """A body past one of its bounds, named by ``bound``, so that the server can name the setting behind it."""

    def __init__(self, message: str, bound: Bound) -> None:
        super().__init__(message)
        self.bound: Bound = bound


class ElementBudget(NamedTuple):
    """The most elements a forward_backward may carry once every tensor is dense (a sparse one's shape, not its
    bytes, is what the worker allocates): its tokens and ``loss_fn_inputs``, per datum and over the request."""

    datum: int
    request: int


DEFAULT_BUDGET = ElementBudget(datum=1 << 22, request=1 << 24)
"""4M elements a datum (a 128k-token datum with every input of every loss fits 4 times over) and 16M a request
(64 MiB as float32): what the SDK's densest chunks reach, never what a few sparse shapes claim."""


class _MapField(NamedTuple):
    """A ``map<string, value>`` field: a repeated field of a nested ``<Name>Entry`` message."""

    name: str
    number: int
    value_kind: int
    value_type: str = ""


def _field(
    name: str,
    number: int,
    kind: int,
    type_name: str = "",
    *,
    repeated: bool = False,
    oneof: int | None = None,
    optional: bool = False,
) -> descriptor_pb2.FieldDescriptorProto:
    """One field; ``type_name`` is a message or enum of the package, ``oneof`` the index of a declared oneof,
    ``optional`` a proto3 ``optional`` (its synthetic oneof is added by :func:`_message`)."""
    field = _Field(
        name=name, number=number, type=kind, label=_Field.LABEL_REPEATED if repeated else _Field.LABEL_OPTIONAL
    )
    if type_name:
        field.type_name = f".{PACKAGE}.{type_name}"
    if oneof is not None:
        field.oneof_index = oneof
    if optional:
        field.proto3_optional = True
    return field


def _message(
    name: str,
    fields: Sequence[descriptor_pb2.FieldDescriptorProto | _MapField],
    oneofs: Sequence[str] = (),
) -> descriptor_pb2.DescriptorProto:
    """A message of ``fields`` in order, its declared ``oneofs`` first, then one synthetic oneof ``_<field>`` per
    proto3 optional field (as protoc orders them), and a nested entry message per map field."""
    message = descriptor_pb2.DescriptorProto(name=name)
    for oneof in oneofs:
        message.oneof_decl.add(name=oneof)
    for field in fields:
        if isinstance(field, _MapField):
            entry = "".join(part.capitalize() for part in field.name.split("_")) + "Entry"
            message.nested_type.append(
                _message(entry, [_field("key", 1, _STRING), _field("value", 2, field.value_kind, field.value_type)])
            )
            message.nested_type[-1].options.map_entry = True
            message.field.append(_field(field.name, field.number, _MESSAGE, f"{name}.{entry}", repeated=True))
            continue
        if field.proto3_optional:
            field.oneof_index = len(message.oneof_decl)
            message.oneof_decl.add(name=f"_{field.name}")
        message.field.append(field)
    return message


def _enum(name: str, values: type[IntEnum], prefix: str) -> descriptor_pb2.EnumDescriptorProto:
    """The enum ``name`` with the members of ``values``, each named ``prefix + member``."""
    enum = descriptor_pb2.EnumDescriptorProto(name=name)
    for member in values:
        enum.value.add(name=prefix + member.name, number=member.value)
    return enum


def _file() -> descriptor_pb2.FileDescriptorProto:
    """``tinker_public.proto``: the SDK's messages of the forward_backward and sample bodies (not SamplingParams,
    which travels as JSON)."""
    messages = [
        # The results of asample (tinker/proto/response_conv.py deserialize_sample_response).
        _message(
            "SampleResponse",
            [
                _field("sequences", 1, _MESSAGE, "SampledSequence", repeated=True),
                _field("prompt_logprobs", 2, _BYTES, optional=True),  # float32, NaN at position 0
                _field("topk_prompt_logprobs", 3, _MESSAGE, "TopkLogprobs", optional=True),
                _field("prompt_cache_hit_tokens", 4, _INT32),
                _field("target_prompt_logprobs", 5, _MESSAGE, "Tensor", optional=True),
                _field("prompt_alt_tokens", 6, _MESSAGE, "PromptAltTokens", optional=True),
            ],
        ),
        _message(
            "PromptAltTokens", [_field("tokens", 1, _MESSAGE, "Tensor"), _field("logprobs", 2, _MESSAGE, "Tensor")]
        ),
        _message(
            "SampledSequence",
            [
                _field("stop_reason", 1, _ENUM, "StopReason"),
                _field("tokens", 2, _BYTES),  # int32
                _field("logprobs", 3, _BYTES, optional=True),  # float32, one per token
                _field("topk_sampled_logprobs", 4, _MESSAGE, "TopkLogprobs", optional=True),
            ],
        ),
        _message(
            "TopkLogprobs",
            [
                _field("token_ids", 1, _BYTES),  # int32, row-major (length, k)
                _field("logprobs", 2, _BYTES),  # float32, row-major (length, k)
                _field("k", 3, _UINT32),
                _field("length", 4, _UINT32),
            ],
        ),
        # Tensors: a datum's loss_fn_inputs, and the per-datum outputs batched.
        _message(
            "SparseCsr",
            [
                _field("values", 1, _BYTES),  # in the tensor's dtype
                _field("crow_indices", 2, _BYTES),  # int64, rows + 1
                _field("col_indices", 3, _BYTES),  # int64, one per value
            ],
        ),
        _message(
            "Tensor",
            [
                _field("dense", 1, _BYTES, oneof=0),
                _field("sparse_csr", 2, _MESSAGE, "SparseCsr", oneof=0),
                _field("dtype", 3, _ENUM, "DType"),
                _field("shape", 4, _INT64, repeated=True),
            ],
            oneofs=["encoding"],
        ),
        _message(
            "BatchedTensor",
            [
                _field("data", 1, _BYTES),  # every datum's values, concatenated
                _field("offsets", 2, _BYTES),  # int64 byte offsets into data, num_datums + 1
                _field("dtype", 3, _ENUM, "DType"),
                _field("trailing_shape", 4, _INT64, repeated=True),
            ],
        ),
        _message(
            "ArrayRecord",
            [
                _field("type_tag", 1, _STRING),
                _MapField("fields", 2, _MESSAGE, "BatchedTensor"),
                _field("num_datums", 3, _INT64),
            ],
        ),
        _message(
            "ForwardBackwardOutput",
            [
                _field("loss_fn_output_type", 1, _STRING),
                _field("loss_fn_outputs", 2, _MESSAGE, "ArrayRecord", repeated=True),
                _MapField("metrics", 3, _DOUBLE),
            ],
        ),
        # The request (tinker/proto/request_conv.py forward_backward_request_to_proto).
        _message(
            "ForwardBackwardRequest",
            [
                _field("model_id", 1, _STRING),
                _field("seq_id", 2, _INT32),
                _field("data", 3, _MESSAGE, "Datum", repeated=True),
                _field("loss_fn", 4, _STRING),
                _MapField("loss_fn_config", 5, _DOUBLE),  # legacy: the numbers only
                _field("forward_only", 6, _BOOL),
                _MapField("loss_fn_config_v2", 7, _MESSAGE, "LossConfigValue"),
            ],
        ),
        _message(
            "LossConfigValue", [_field("number", 1, _DOUBLE, oneof=0), _field("text", 2, _STRING, oneof=0)], ["value"]
        ),
        _message(
            "Datum",
            [
                _field("model_input", 1, _MESSAGE, "Chunk", repeated=True),
                _MapField("loss_fn_inputs", 2, _MESSAGE, "Tensor"),
                _field("model_input_spans", 3, _MESSAGE, "ProvenanceSpan", repeated=True),
                _field("loss_fn_input_spans", 4, _MESSAGE, "ProvenanceSpan", repeated=True),
            ],
        ),
        _message(
            "ProvenanceSpan",
            [
                _field("prompt_tokens", 1, _MESSAGE, "PromptProvenanceSpan", oneof=0),
                _field("sampled_tokens", 2, _MESSAGE, "SampledProvenanceSpan", oneof=0),
            ],
            oneofs=["span"],
        ),
        *(
            _message(
                span, [_field("sequence_id", 1, _STRING), _field("offset", 2, _INT64), _field("length", 3, _INT64)]
            )
            for span in ("PromptProvenanceSpan", "SampledProvenanceSpan")
        ),
        _message(
            "Chunk",
            [
                _field("encoded_text", 1, _MESSAGE, "EncodedTextChunk", oneof=0),
                _field("image", 2, _MESSAGE, "ImageChunk", oneof=0),
                _field("dmel", 3, _MESSAGE, "DmelChunk", oneof=0),
            ],
            oneofs=["chunk"],
        ),
        _message("EncodedTextChunk", [_field("tokens", 1, _BYTES)]),  # int32
        _message(
            "ImageChunk",
            [
                _field("data", 1, _BYTES),
                _field("format", 2, _STRING),
                _field("expected_tokens", 3, _INT32, optional=True),
                _field("override_dimensions", 4, _MESSAGE, "ImageDimensions", optional=True),
            ],
        ),
        _message("ImageDimensions", [_field("width", 1, _UINT32), _field("height", 2, _UINT32)]),
        _message("DmelChunk", [_field("dmel", 1, _BYTES)]),
    ]
    return descriptor_pb2.FileDescriptorProto(
        name="tinker_public.proto",
        package=PACKAGE,
        syntax="proto3",
        message_type=messages,
        enum_type=[_enum("StopReason", StopReason, "STOP_REASON_"), _enum("DType", DType, "DTYPE_")],
    )


FILE = _file()
_POOL = descriptor_pool.DescriptorPool()
_POOL.Add(FILE)


def _message_class(name: str) -> type[Message]:
    """The generated class of message ``name`` of the package, from the private pool."""
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"{PACKAGE}.{name}"))


ForwardBackwardRequest = _message_class("ForwardBackwardRequest")
Datum = _message_class("Datum")
Chunk = _message_class("Chunk")
Tensor = _message_class("Tensor")
LossConfigValue = _message_class("LossConfigValue")
ForwardBackwardOutput = _message_class("ForwardBackwardOutput")
ArrayRecord = _message_class("ArrayRecord")
BatchedTensor = _message_class("BatchedTensor")
SampleResponse = _message_class("SampleResponse")
SampledSequence = _message_class("SampledSequence")


def _decompress(body: bytes, max_bytes: int) -> bytes:
    """The zstd frames of ``body`` decompressed, read in pieces so that a body claiming (or expanding to) more than
    ``max_bytes`` fails before it is held in memory."""
    reader = zstandard.ZstdDecompressor().stream_reader(body, read_across_frames=True)
    pieces: list[bytes] = []
    size = 0
    try:
        while piece := reader.read(min(1 << 20, max_bytes + 1 - size)):
            pieces.append(piece)
            size += len(piece)
            if size > max_bytes:
                raise TooLarge(f"the body decompresses to more than {max_bytes} bytes", "body")
    except zstandard.ZstdError as error:
        raise WireError(f"the body is not valid zstd: {error}") from error
    return b"".join(pieces)


def parse_forward_backward(body: bytes, content_encoding: str | None, *, max_bytes: int = MAX_BODY_BYTES) -> Message:
    """The ``ForwardBackwardRequest`` of a ``/api/v1/forward_backward`` body, decompressed first when its
    ``Content-Encoding`` is ``zstd``. Raises :class:`WireError` for another encoding, a message over ``max_bytes``
    (after decompression) or bytes that are not the message."""
    encoding = (content_encoding or "identity").strip().lower()
    if encoding == "zstd":
        body = _decompress(body, max_bytes)
    elif encoding != "identity":
        raise WireError(f"unsupported Content-Encoding {content_encoding!r}: send zstd or none")
    if len(body) > max_bytes:
        raise TooLarge(f"the body is {len(body)} bytes, more than {max_bytes}", "body")
    request = ForwardBackwardRequest()
    try:
        request.ParseFromString(body)
    except DecodeError as error:
        raise WireError(f"the body is not a protobuf tinker_public.ForwardBackwardRequest: {error}") from error
    return request


def stored_body(body: bytes, content_encoding: str | None) -> bytes:
    """What the server keeps of a forward_backward body it parsed: zstd-compressed, as the SDK sends it, or
    compressed here when it came plain (:func:`parse_stored` reads it back)."""
    if (content_encoding or "").strip().lower() == "zstd":
        return body
    return zstandard.ZstdCompressor().compress(body)


def parse_stored(payload: bytes, *, max_bytes: int = MAX_BODY_BYTES) -> Message:
    """The ``ForwardBackwardRequest`` of a stored body (:func:`stored_body`; a plain serialized message, as an
    earlier version stored it, is read as it is)."""
    return parse_forward_backward(payload, "zstd" if payload.startswith(ZSTD_MAGIC) else None, max_bytes=max_bytes)


_ITEM_BYTES = {DType.FLOAT32: 4, DType.INT64: 8, DType.INT32: 4, DType.BFLOAT16: 2}


def tensor_elements(tensor: Message) -> int:
    """The elements of a ``Tensor`` once dense: the product of its shape (sizes taken positive: a negative one is
    refused later), or of a dense one without a shape, its bytes over its element size (1 for an unknown dtype)."""
    if tensor.shape:
        return math.prod(abs(size) for size in tensor.shape)
    if tensor.WhichOneof("encoding") == "dense":
        return len(tensor.dense) // _ITEM_BYTES.get(tensor.dtype, 1)
    return 0


def _chunk_elements(chunk: Message) -> int:
    """A model-input chunk's elements: its int32 tokens, or the bytes of another kind (refused later)."""
    kind = chunk.WhichOneof("chunk")
    if kind == "encoded_text":
        return len(chunk.encoded_text.tokens) // 4
    return chunk.ByteSize()


def check_elements(request: Message, budget: ElementBudget) -> None:
    """Raise :class:`TooLarge` when a datum of ``request`` (its tokens and its ``loss_fn_inputs``, each as dense as
    the worker makes it) or all of them carry more elements than ``budget``: counted from the shapes, before
    anything is allocated."""
    total = 0
    for index, datum in enumerate(request.data):
        sizes = {f"loss_fn_inputs.{name}": tensor_elements(tensor) for name, tensor in datum.loss_fn_inputs.items()}
        sizes["model_input"] = sum(_chunk_elements(chunk) for chunk in datum.model_input)
        elements = sum(sizes.values())
        if elements > budget.datum:
            largest = max(sizes, key=lambda field: sizes[field])
            raise TooLarge(
                f"data[{index}]: {elements} elements once dense ({largest}: {sizes[largest]}), more than the "
                f"{budget.datum} a datum may carry",
                "datum",
            )
        total += elements
        if total > budget.request:
            raise TooLarge(
                f"data: {total} elements once dense by data[{index}] of {len(request.data)} datums, more than the "
                f"{budget.request} a request may carry; send fewer datums a request",
                "request",
            )
