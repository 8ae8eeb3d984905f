"""Reward graders: how an RL job scores each sampled completion (torch-free, so the API validates them).

A job spec's ``reward`` is one :data:`Grader`. The kinds follow OpenAI's grader JSON
(https://platform.openai.com/docs/api-reference/graders), so users can bring theirs:

- ``model``: a reward model; scored by a callback the engine passes to :func:`score`.
- ``string_check``: 1.0 or 0.0 from comparing two rendered templates.
- ``text_similarity``: fuzzy match, BLEU, GLEU or ROUGE of two rendered templates, in [0, 1].
- ``http``: a remote reward service speaking OpenRLHF's remote reward model protocol
  (OpenRLHF/OpenRLHF ``openrlhf/utils/remote_rm_utils.py``).
- ``python``: OpenAI's ``source`` (``def grade(sample, item) -> float``), run in engine/rewards/sandbox.py, or an
  importable function with TRL's reward-function signature
  (https://huggingface.co/docs/trl/grpo_trainer#using-a-custom-reward-function).
- ``score_model`` and ``label_model``: a judge (an OpenAI-compatible chat endpoint the service offers under the
  grader's ``model`` name, engine/rewards/judge.py) gives each sample a number in ``range``, or a label.
- ``multi``: named graders combined by a formula or by weights.

Templates hold only ``{{ sample.output_text }}`` and ``{{ item.<column>[.<key>...] }}``, substituted by a regex;
formulas are parsed by :mod:`ast` and interpreted over a whitelist of nodes. Nothing is ever ``eval``-ed.
"""

import ast
import functools
import http
import importlib
import ipaddress
import json
import logging
import math
import numbers
import operator
import queue
import re
import statistics
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, NoReturn

import httpx
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, TypeAdapter, field_validator, model_validator

from engine.callbacks import StopRequest
from engine.rewards import judge, sandbox
from engine.spec.rows import Text

logger = logging.getLogger(__name__)

RESERVED_NAMES = frozenset({"mean", "std", "judge_tokens"})
"""Names no grader may have: :func:`reward_metrics` reports ``reward/mean``, ``reward/std`` and
``reward/judge_tokens`` beside them."""
MAX_DEPTH = 3
"""Levels of graders in one reward: a multi of multis of leaves is 3."""
MAX_COMPONENTS = 16
"""Graders one multi combines."""
LOOPBACK = "loopback"
"""The allow-list entry for http(s) to 127.0.0.0/8, ::1 or localhost, on any port."""
MAX_SCHEDULE_S = 3600.0
"""Seconds a reward's http graders may take, at worst, for one request each: the sum over its graders of
``timeout_s`` × (``retries`` + 1) plus the backoffs ``backoff_s`` × (2^``retries`` - 1). A spec over it is refused."""
MAX_ANSWER_BYTES = 8 * 1024 * 1024
"""Largest answer read from a reward service (an http grader's); a longer one is a malformed answer."""
STOP_POLL_S = 0.25
"""How often an http grader waiting for a service (a request, a backoff) asks whether the job should stop."""


class RewardError(RuntimeError):
    """A reward could not be computed for a batch of samples."""


class RewardServiceError(RewardError):
    """A reward service (an ``http`` grader) failed, after its retries."""


class RewardFunctionError(RewardError):
    """A reward function (a ``python`` grader) could not be imported, raised, or returned something else than
    one number per sample."""


class RewardVariableError(RewardError):
    """A template names a column the dataset row does not have."""


class RewardFormulaError(RewardError):
    """A multi grader's ``calculate_output`` cannot be computed on a sample (a division by zero, a non-finite
    value)."""


class RewardStopped(Exception):
    """The job was asked to stop (``request``: cancel or pause) while its reward waited for a service."""

    def __init__(self, request: StopRequest) -> None:
        super().__init__(f"{request} requested during a reward call")
        self.request = request


StopCheck = Callable[[], StopRequest | None]
"""The engine's :meth:`engine.callbacks.Callbacks.should_stop`: whether the job should stop now."""


# ---------------------------------------------------------------------------------------------------------------
# Templates

_PLACEHOLDER = re.compile(r"\{\{\s*(.*?)\s*\}\}")
_ALLOWED_PLACEHOLDER = re.compile(r"^(sample\.output_text|item(\.[A-Za-z0-9_-]+)+)$")
_ALLOWED_HELP = "{{ sample.output_text }} and {{ item.<column>[.<key>...] }}"


def _check_template(template: str) -> str:
    unknown = [m.group(0) for m in _PLACEHOLDER.finditer(template) if not _ALLOWED_PLACEHOLDER.match(m.group(1))]
    if unknown:
        raise ValueError(f"unknown placeholder {', '.join(unknown)}; the allowed ones are {_ALLOWED_HELP}")
    return template


def _render(template: str, grader: str, completion: str, row: Mapping[str, Any]) -> str:
    """``template`` with its placeholders replaced by the completion and the dataset row's values."""

    def value(match: re.Match[str]) -> str:
        path = match.group(1)
        if path == "sample.output_text":
            return completion
        return _item_value(row, path.split(".")[1:], grader)

    return _PLACEHOLDER.sub(value, template)


def _item_value(row: Mapping[str, Any], keys: list[str], grader: str) -> str:
    if (missing := missing_item(row, keys)) is not None:
        raise RewardVariableError(
            f"grader {grader!r}: the dataset row has no {missing} (its columns: {', '.join(row)})"
        )
    value: Any = row
    for key in keys:
        value = value[key]
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


# ---------------------------------------------------------------------------------------------------------------
# Formulas of multi graders

_BINARY_OPERATORS: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: math.pow,  # a float or an error (ValueError, OverflowError), never a complex number
}
_FUNCTIONS: dict[str, tuple[Callable[..., float], int, int]] = {
    # name: (function, fewest arguments, most arguments)
    "min": (min, 2, 16),
    "max": (max, 2, 16),
    "abs": (abs, 1, 1),
    "floor": (math.floor, 1, 1),
    "ceil": (math.ceil, 1, 1),
    "exp": (math.exp, 1, 1),
    "sqrt": (math.sqrt, 1, 1),
    "log": (math.log, 1, 1),
}
_FORMULA_HELP = f"numbers, the graders' keys, + - * / ^ ** and parentheses, and {', '.join(_FUNCTIONS)}"


def _parse_formula(formula: str) -> ast.expr:
    """The expression tree of a formula; OpenAI's ``^`` (power) is read as ``**``."""
    try:
        return ast.parse(formula.replace("^", "**"), mode="eval").body
    except SyntaxError as e:
        raise ValueError(f"calculate_output is not a formula: {e.msg}") from None


def _check_formula(node: ast.expr, keys: Sequence[str]) -> None:
    """ValueError naming the first element of the formula outside the whitelist."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return
    if isinstance(node, ast.Name):
        if node.id not in keys:
            raise ValueError(f"calculate_output: unknown name {node.id!r}; the graders are {', '.join(keys)}")
        return
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        _check_formula(node.operand, keys)
        return
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPERATORS:
        _check_formula(node.left, keys)
        _check_formula(node.right, keys)
        return
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS:
        _, fewest, most = _FUNCTIONS[node.func.id]
        if node.keywords or not fewest <= len(node.args) <= most:
            raise ValueError(f"calculate_output: {ast.unparse(node)[:60]!r} has the wrong arguments")
        for arg in node.args:
            _check_formula(arg, keys)
        return
    raise ValueError(f"calculate_output: {ast.unparse(node)[:60]!r} is not allowed; formulas hold {_FORMULA_HELP}")


def _evaluate(node: ast.expr, values: Mapping[str, float]) -> float:
    """The value of a formula checked by :func:`_check_formula`, given each grader's score."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return float(node.value)
    if isinstance(node, ast.Name):
        return values[node.id]
    if isinstance(node, ast.UnaryOp):
        operand = _evaluate(node.operand, values)
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.BinOp):
        return _BINARY_OPERATORS[type(node.op)](_evaluate(node.left, values), _evaluate(node.right, values))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        function = _FUNCTIONS[node.func.id][0]
        return float(function(*(_evaluate(arg, values) for arg in node.args)))
    raise AssertionError(f"unchecked formula node {ast.dump(node)}")


# ---------------------------------------------------------------------------------------------------------------
# Specs


class _Strict(BaseModel):
    # engine.spec.config has the same base; a copy here keeps this module free of it (config embeds graders).
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


def _not_reserved(name: str) -> str:
    if name in RESERVED_NAMES:
        raise ValueError(f"{name!r} is reserved (the reward's {', '.join(sorted(RESERVED_NAMES))} metrics use it)")
    return name


GraderName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[^/\x00-\x1f\x7f]+$")]
"""A grader's ``name``: 1 to 64 characters, no ``/`` (it names metrics) and no control characters."""
ComponentKey = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$"), AfterValidator(_not_reserved)]
"""A multi grader's key for a component: an identifier, so formulas can name it."""
Template = Annotated[str, Field(max_length=10_000), AfterValidator(_check_template)]
"""Text with ``{{ sample.output_text }}`` and ``{{ item.<column>[.<key>...] }}`` placeholders."""


class _GraderBase(_Strict):
    name: Annotated[GraderName, AfterValidator(_not_reserved)] | None = None
    """Names the grader's scores in metrics (``reward/<name>``); default: its ``type``. A component of a multi
    grader is named by its key there, and its own ``name`` is ignored."""


class ModelGrader(_GraderBase):
    """A reward model scores prompt + completion (the engine scores it, through :func:`score`'s callback)."""

    type: Literal["model"] = "model"
    """The grader kind."""
    model: Annotated[str, Field(min_length=1, max_length=500, pattern=r"^[^\s\x00-\x1f\x7f]+$")]
    """The reward model: ``job:<id>[@<step>]`` (an rm job), ``builtin:tiny``, a hub id or a local path."""


class StringCheckGrader(_GraderBase):
    """1.0 when the rendered ``input`` and ``reference`` compare as ``operation`` says, else 0.0."""

    type: Literal["string_check"] = "string_check"
    """The grader kind."""
    input: Template
    """The text checked, e.g. ``{{ sample.output_text }}``."""
    reference: Template
    """The text it is checked against, e.g. ``{{ item.answer }}``."""
    operation: Literal["eq", "ne", "like", "ilike"]
    """``eq``: equal; ``ne``: different; ``like``: ``reference`` occurs in ``input``; ``ilike``: the same,
    ignoring case."""


TextMetric = Literal["fuzzy_match", "bleu", "gleu", "rouge_1", "rouge_2", "rouge_3", "rouge_4", "rouge_5", "rouge_l"]


class TextSimilarityGrader(_GraderBase):
    """How similar the rendered ``input`` is to ``reference``, in [0, 1]."""

    type: Literal["text_similarity"] = "text_similarity"
    """The grader kind."""
    input: Template
    """The text scored, e.g. ``{{ sample.output_text }}``."""
    reference: Template
    """The text it is compared with, e.g. ``{{ item.reference_answer }}``."""
    evaluation_metric: TextMetric
    """``fuzzy_match``: rapidfuzz's normalised Indel similarity; ``bleu``: sacrebleu's sentence BLEU; ``gleu``:
    NLTK's sentence GLEU on whitespace tokens; ``rouge_1`` … ``rouge_5``, ``rouge_l``: the F-measure of Google's
    rouge-score."""
    pass_threshold: Annotated[float, Field(ge=0, le=1)] | None = None
    """When set, the metric ``<name>/pass`` also reports whether each score reached it (1.0 or 0.0); the reward
    stays the score."""


class HttpGrader(_GraderBase):
    """A reward service: POST ``{"query": [prompt + completion, ...], "prompts": [...], "labels": [...]}``, answer
    ``{"rewards": [float, ...]}`` in the same order (OpenRLHF's remote reward model protocol)."""

    type: Literal["http"] = "http"
    """The grader kind."""
    url: Annotated[str, Field(min_length=1, max_length=2000)]
    """The service's http or https URL; the operator's ``allowed_urls`` must admit it."""
    timeout_s: Annotated[float, Field(gt=0, le=600)] = 30.0
    """Seconds one request may take."""
    retries: Annotated[int, Field(ge=0, le=20)] = 3
    """Attempts after the first, on connection errors, timeouts, HTTP 5xx and 429, and malformed answers."""
    backoff_s: Annotated[float, Field(ge=0, le=60)] = 1.0
    """Seconds before the first retry, doubling for each one after."""
    batch_size: Annotated[int, Field(ge=1, le=4096)] = 64
    """Samples per request."""
    label: Template | None = None
    """Each sample's entry of ``labels``, e.g. ``{{ item.answer }}`` (None: null)."""

    @model_validator(mode="after")
    def _http_url(self) -> "HttpGrader":
        if any(char.isspace() or char == "\\" or ord(char) < 32 or ord(char) == 127 for char in self.url):
            raise ValueError("url must not contain spaces, backslashes or control characters")
        try:
            url = httpx.URL(self.url)
        except httpx.InvalidURL as e:
            raise ValueError(f"url is not a URL: {e}") from None
        if url.scheme not in ("http", "https") or not url.host:
            raise ValueError("url must be an http:// or https:// URL with a host")
        if schedule_s(self) > MAX_SCHEDULE_S:
            raise ValueError(_schedule_problem(schedule_s(self)))
        return self


def schedule_s(grader: HttpGrader) -> float:
    """The longest an http grader may take over one request: every attempt timing out, after every backoff."""
    return grader.timeout_s * (grader.retries + 1) + grader.backoff_s * (2**grader.retries - 1)


def _schedule_problem(seconds: float) -> str:
    worst = "timeout_s × (retries + 1) + backoff_s × (2^retries - 1)"
    return f"{worst} allows {seconds:,.0f} s per request, over {MAX_SCHEDULE_S:,.0f} s; lower one of them"


MAX_SOURCE_CHARS = 256_000
"""Longest ``source`` of a python grader."""
FUNCTION_PATH = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"
"""A python grader's ``function``: ``module.path:function_name``."""


class PythonGrader(_GraderBase):
    """Python code scoring each sample: OpenAI's ``source``, a module defining ``grade(sample, item) -> float`` (run
    in a sandbox: engine/rewards/sandbox.py), or ``function``, an importable function with TRL's reward-function
    signature, ``fn(prompts=[...], completions=[...], **columns) -> list[float]``, every other column of the
    dataset rows passed as a list. Give exactly one."""

    type: Literal["python"] = "python"
    """The grader kind."""
    source: Annotated[str, Field(min_length=1, max_length=MAX_SOURCE_CHARS)] | None = None
    """OpenAI's Python grader: source code defining ``grade(sample, item)``, ``sample`` holding ``output_text`` and
    ``output_json`` (the output parsed, when it is JSON), ``item`` the dataset row; it returns a number. It runs
    with the standard library and those of OpenAI's grader packages the service has installed (numpy,
    rapidfuzz...: engine/rewards/sandbox.py's ``offered_packages``), without network or files, under time and
    memory limits."""
    function: Annotated[str, Field(max_length=300, pattern=FUNCTION_PATH)] | None = None
    """``module.path:function_name``; the operator's ``allowed_functions`` must admit it."""
    image_tag: Annotated[str, Field(max_length=200)] | None = None
    """OpenAI's runtime image of a source grader: accepted and ignored (one runtime here, the standard library)."""

    @field_validator("source")
    @classmethod
    def _defines_grade(cls, source: str | None) -> str | None:
        if source is None:
            return None
        try:
            tree = ast.parse(source)
        except SyntaxError as e:
            raise ValueError(f"source does not compile: {e.msg} (line {e.lineno})") from None
        except (MemoryError, RecursionError):  # the parser's own limits on nesting
            raise ValueError("source does not compile: it nests too deeply") from None
        if not any(isinstance(node, ast.FunctionDef) and node.name == "grade" for node in tree.body):
            raise ValueError("source must define grade(sample, item) at its top level")
        return source

    @model_validator(mode="after")
    def _one_kind(self) -> "PythonGrader":
        if (self.source is None) == (self.function is None):
            raise ValueError("give exactly one of source (OpenAI's grade(sample, item)) and function")
        return self


class ContentPart(_Strict):
    """A text part of a judge message's content."""

    type: Literal["input_text", "output_text"]
    """The part kind; images and audio are not read by the judges here."""
    text: Template
    """The text, with placeholders."""


class JudgeMessage(_Strict):
    """A message of a model grader's conversation with its judge."""

    role: Literal["user", "assistant", "system", "developer"]
    """Who says it; ``developer`` is sent as ``system``."""
    content: Template | Annotated[list[ContentPart], Field(min_length=1, max_length=32)]
    """The text (or text parts), with placeholders: ``{{ sample.output_text }}``, ``{{ item.<column> }}``."""
    type: Literal["message"] = "message"
    """Always ``message``."""

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content: Any) -> Any:
        for part in content if isinstance(content, list) else []:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("input_image", "input_audio"):
                raise ValueError(f"{kind} content is not supported: the judges here read text")
        return content


class JudgeSampling(_Strict):
    """How the judge samples its answer (OpenAI's ``sampling_params``)."""

    max_completions_tokens: Annotated[int, Field(ge=1, le=8192)] | None = None
    """The answer's most tokens (None: 256)."""
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    """None: the endpoint's default."""
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    """None: the endpoint's default."""
    seed: int | None = None
    """Sent as the request's ``seed``."""
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    """Sent as the request's ``reasoning_effort``, for judges that reason."""

    def request_fields(self) -> dict[str, Any]:
        fields = {"max_tokens": self.max_completions_tokens or 256, "temperature": self.temperature,
                  "top_p": self.top_p, "seed": self.seed, "reasoning_effort": self.reasoning_effort}  # fmt: skip
        return {key: value for key, value in fields.items() if value is not None}


class _JudgeGrader(_GraderBase):
    model: Annotated[str, Field(min_length=1, max_length=200)]
    """The judge, by a name the service offers (the operator's ``judges``, ``RLHF_JUDGES``): an OpenAI-compatible
    endpoint and the model it serves there."""
    input: Annotated[list[JudgeMessage], Field(min_length=1, max_length=32)]
    """The conversation the judge answers, with placeholders."""
    sampling_params: JudgeSampling = JudgeSampling()
    """How the judge samples its answer."""


class ScoreModelGrader(_JudgeGrader):
    """A judge's number for each sample; an answer without a number in ``range`` scores 0 and counts in
    ``<name>/invalid``."""

    type: Literal["score_model"] = "score_model"
    """The grader kind."""
    range: Annotated[list[float], Field(min_length=2, max_length=2)] = [0.0, 1.0]
    """The lowest and the highest score the judge may give."""
    pass_threshold: float | None = None
    """When set, ``<name>/pass`` also reports whether each score reached it (1.0 or 0.0)."""

    @field_validator("range")
    @classmethod
    def _ordered(cls, value: list[float]) -> list[float]:
        if not (math.isfinite(value[0]) and math.isfinite(value[1]) and value[0] < value[1]):
            raise ValueError("range must be two finite numbers, the lower first")
        return value


class LabelModelGrader(_JudgeGrader):
    """A judge's label for each sample: 1.0 when it is one of ``passing_labels``, else 0.0; an answer that is none
    of ``labels`` scores 0 and counts in ``<name>/invalid``."""

    type: Literal["label_model"] = "label_model"
    """The grader kind."""
    labels: Annotated[list[Annotated[str, Field(min_length=1, max_length=200)]], Field(min_length=2, max_length=64)]
    """The labels the judge chooses from."""
    passing_labels: Annotated[list[str], Field(min_length=1, max_length=64)]
    """The labels that pass: a subset of ``labels``."""

    @model_validator(mode="after")
    def _passing_are_labels(self) -> "LabelModelGrader":
        if len(set(self.labels)) != len(self.labels):
            raise ValueError("labels must be distinct")
        unknown = [label for label in self.passing_labels if label not in self.labels]
        if unknown:
            raise ValueError(f"passing_labels must be among labels; not: {', '.join(unknown)}")
        return self


class MultiGrader(_GraderBase):
    """Named graders combined into one score by ``calculate_output`` or by ``weights`` (give exactly one)."""

    type: Literal["multi"] = "multi"
    """The grader kind."""
    graders: Annotated[dict[ComponentKey, "_AnyGrader"], Field(min_length=1, max_length=MAX_COMPONENTS)]
    """The components, by key; each key names its grader's scores in metrics and in ``calculate_output``."""
    calculate_output: Annotated[str, Field(min_length=1, max_length=500)] | None = None
    """A formula over the keys, as OpenAI's multi grader: numbers, ``+ - * /``, ``^`` or ``**`` (power), unary
    ``-``, parentheses, and min, max, abs, floor, ceil, exp, sqrt, log; e.g. ``0.7 * correct + 0.3 * fuzzy``."""
    weights: dict[str, Annotated[float, Field(ge=-1e6, le=1e6)]] | None = None
    """The score is the weighted sum of these keys' scores; a component without a weight is only reported."""

    @model_validator(mode="after")
    def _combination(self) -> "MultiGrader":
        # pydantic 2.13 runs this twice per multi in a union (pydantic/pydantic#13581); it only reads, so no harm
        if (self.calculate_output is None) == (self.weights is None):
            raise ValueError("give exactly one of calculate_output and weights")
        keys = list(self.graders)
        if self.weights is not None:
            unknown = [key for key in self.weights if key not in self.graders]
            if unknown or not self.weights:
                raise ValueError(f"weights must name graders ({', '.join(keys)}), not {', '.join(unknown) or 'none'}")
        if self.calculate_output is not None:
            _check_formula(_parse_formula(self.calculate_output), keys)
        if _depth(self) > MAX_DEPTH:
            raise ValueError(f"graders nest at most {MAX_DEPTH} levels deep (a multi of multis of graders)")
        return self


_AnyGrader = Annotated[
    ModelGrader
    | StringCheckGrader
    | TextSimilarityGrader
    | HttpGrader
    | PythonGrader
    | ScoreModelGrader
    | LabelModelGrader
    | MultiGrader,
    Field(discriminator="type"),
]
MultiGrader.model_rebuild()


def _unique_names(grader: _AnyGrader) -> _AnyGrader:
    names = [name for name, _ in _walk(grader, _effective_name(grader))]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"grader names must be unique within a reward; repeated: {', '.join(repeated)}")
    return grader


def _bounded_schedule(grader: _AnyGrader) -> _AnyGrader:
    services = [sub for _, sub in _walk(grader, _effective_name(grader)) if isinstance(sub, HttpGrader)]
    total = sum(schedule_s(sub) for sub in services)
    if total > MAX_SCHEDULE_S:
        raise ValueError(f"the {len(services)} http graders: {_schedule_problem(total)}")
    return grader


Grader = Annotated[_AnyGrader, AfterValidator(_unique_names), AfterValidator(_bounded_schedule)]
"""A job's reward: one grader, told apart by ``type``, its names (its own and its components') unique, its http
graders' worst case within :data:`MAX_SCHEDULE_S`."""
_GRADER: TypeAdapter[Grader] = TypeAdapter(Grader, config=ConfigDict(title="Grader"))


def parse_grader(data: Any) -> Grader:
    """A grader from its JSON object (a dict); pydantic's ValidationError names the field at fault."""
    return _GRADER.validate_python(data)


def _effective_name(grader: _AnyGrader) -> str:
    return grader.name or grader.type


def _depth(grader: _AnyGrader) -> int:
    if isinstance(grader, MultiGrader):
        return 1 + max(_depth(sub) for sub in grader.graders.values())
    return 1


def _walk(grader: _AnyGrader, name: str) -> Iterator[tuple[str, _AnyGrader]]:
    """(name, grader) of ``grader`` and of everything nested in it, components first."""
    if isinstance(grader, MultiGrader):
        for key, sub in grader.graders.items():
            yield from _walk(sub, key)
    yield name, grader


def iter_graders(grader: Grader) -> Iterator[tuple[str, Grader]]:
    """(effective name, grader) of every leaf grader (every grader but the multis), nested ones included."""
    for name, sub in _walk(grader, _effective_name(grader)):
        if not isinstance(sub, MultiGrader):
            yield name, sub


def model_refs(grader: Grader) -> list[str]:
    """The model references of the model graders, for the service to resolve."""
    return [sub.model for _, sub in iter_graders(grader) if isinstance(sub, ModelGrader)]


def item_references(grader: Grader) -> list[tuple[str, tuple[str, ...]]]:
    """``(where, keys)`` of each ``{{ item.<column>[.<key>...] }}`` in the templates of ``grader`` and of its
    components: ``where`` the template's path inside the grader (``graders.exact.reference``), ``keys`` the column
    and the keys inside it. The dataset columns the grader reads, for the service to check a dataset's rows against
    at submit (python graders read the row in their own code: not told here)."""
    found: list[tuple[str, tuple[str, ...]]] = []

    def walk(sub: _AnyGrader, prefix: str) -> None:
        if isinstance(sub, MultiGrader):
            for key, component in sub.graders.items():
                walk(component, f"{prefix}graders.{key}.")
            return
        for where, template in _templates(sub):
            for match in _PLACEHOLDER.finditer(template):
                if match.group(1).startswith("item."):
                    found.append((prefix + where, tuple(match.group(1).split(".")[1:])))

    walk(grader, "")
    return found


def _templates(grader: _AnyGrader) -> list[tuple[str, str]]:
    """(field path, text) of a leaf grader's templates."""
    if isinstance(grader, StringCheckGrader | TextSimilarityGrader):
        return [("input", grader.input), ("reference", grader.reference)]
    if isinstance(grader, HttpGrader):
        return [("label", grader.label)] if grader.label is not None else []
    if isinstance(grader, _JudgeGrader):
        texts = []
        for i, message in enumerate(grader.input):
            if isinstance(message.content, str):
                texts.append((f"input.{i}.content", message.content))
            else:
                texts += [(f"input.{i}.content.{j}.text", part.text) for j, part in enumerate(message.content)]
        return texts
    return []


def missing_item(row: Mapping[str, Any], keys: Sequence[str]) -> str | None:
    """``item.<column>[.<key>...]`` as far as ``row`` lacks it (what rendering the template would fail on), or None
    when the row holds it."""
    value: Any = row
    for depth, key in enumerate(keys):
        if not isinstance(value, Mapping) or key not in value:
            return "item." + ".".join(keys[: depth + 1])
        value = value[key]
    return None


def replace_models(data: dict[str, Any], replace: Callable[[str, str], str], param: str) -> dict[str, Any]:
    """A copy of a validated grader's JSON object with each model grader's ``model`` replaced by
    ``replace(its spec path, e.g. "reward.graders.rm.model", the reference)`` (the service resolves ``job:<id>``)."""
    if data.get("type") == "model":
        return {**data, "model": replace(f"{param}.model", data["model"])}
    if data.get("type") == "multi":
        graders = {key: replace_models(sub, replace, f"{param}.graders.{key}") for key, sub in data["graders"].items()}
        return {**data, "graders": graders}
    return data


# ---------------------------------------------------------------------------------------------------------------
# Operator allow-lists


def check_allowed(
    grader: Grader,
    allowed_urls: Sequence[str],
    allowed_functions: Sequence[str] | None,
    judges: Collection[str] | None = None,
    source_graders: bool = True,
    own_urls: Sequence[str] = (),
) -> list[str]:
    """What the operator's allow-lists refuse in ``grader`` (empty: nothing). An ``allowed_urls`` entry is a URL
    prefix (scheme, host and port equal, the path within the entry's) or ``loopback``; ``allowed_functions`` None
    allows any function (the local CLI), which fails only when scored if it cannot be imported. ``judges``: the
    judge names model graders may use (None: any, checked when scored); ``source_graders``: whether python graders
    may give ``source``. ``own_urls``: the service's own servers (the operator's vLLM server), never a reward
    service whatever the allow-list says: a URL on one's host and port is refused, before anything connects.
    ``source`` may import the standard library and the offered packages
    (:func:`engine.rewards.sandbox.offered_packages`) only."""
    problems = []
    for name, sub in iter_graders(grader):
        if isinstance(sub, ScoreModelGrader | LabelModelGrader) and judges is not None and sub.model not in judges:
            offered = ", ".join(sorted(judges)) or "none"
            problems.append(f"grader {name!r}: the judge {sub.model!r} is not offered here (RLHF_JUDGES: {offered})")
        if isinstance(sub, PythonGrader) and sub.source is not None and not source_graders:
            problems.append(f"grader {name!r}: python source graders are switched off here (RLHF_SOURCE_GRADERS)")
        if isinstance(sub, HttpGrader) and not any(_url_allowed(sub.url, entry) for entry in allowed_urls):
            allowed = ", ".join(allowed_urls) or "none"
            problems.append(f"grader {name!r}: the reward service {_public_url(sub.url)} is not allowed ({allowed})")
        elif isinstance(sub, HttpGrader) and any(_same_server(sub.url, own) for own in own_urls):
            problems.append(
                f"grader {name!r}: the reward service {_public_url(sub.url)} is not allowed (it is one "
                "of this service's own servers)"
            )
        if (
            isinstance(sub, PythonGrader)
            and sub.function is not None
            and allowed_functions is not None
            and sub.function not in allowed_functions
        ):
            allowed = ", ".join(allowed_functions) or "none"
            problems.append(f"grader {name!r}: the reward function {sub.function} is not allowed ({allowed})")
    return problems


def import_problems(grader: Grader) -> list[str]:
    """What the source graders of ``grader`` import (absolute imports, anywhere in their source) that this machine's
    sandbox cannot give them: only the standard library and the offered packages are there
    (:func:`engine.rewards.sandbox.offered_packages`: those this Python has installed). Empty: nothing."""
    problems = []
    offered = sandbox.offered_packages().modules
    has = f"they have the standard library and these of OpenAI's grader packages: {', '.join(offered) or 'none'}"
    for name, sub in iter_graders(grader):
        if not isinstance(sub, PythonGrader) or sub.source is None:
            continue
        imported: dict[str, None] = {}
        for node in ast.walk(ast.parse(sub.source)):  # parsed once already, by PythonGrader
            if isinstance(node, ast.Import):
                imported.update(dict.fromkeys(alias.name.partition(".")[0] for alias in node.names))
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported[node.module.partition(".")[0]] = None
        missing = [module for module in imported if module not in sys.stdlib_module_names and module not in offered]
        if missing:
            imports = ", ".join(missing)
            problems.append(f"grader {name!r}: its source imports {imports}, which graders cannot import here ({has})")
    return problems


def _url_allowed(url: str, entry: str) -> bool:
    """Whether ``url`` is within the allow-list ``entry``, both parsed as httpx (which sends the request) does."""
    try:
        target = httpx.URL(url)
        prefix = None if entry == LOOPBACK else httpx.URL(entry)
    except httpx.InvalidURL:
        return False
    if target.scheme not in ("http", "https") or {".", ".."} & set(target.path.split("/")):
        return False
    if prefix is None:
        return target.host == "localhost" or _is_loopback_ip(target.host)
    if (target.scheme, target.host, _port(target)) != (prefix.scheme, prefix.host, _port(prefix)):
        return False
    if prefix.path.endswith("/"):
        return target.path.startswith(prefix.path)
    return target.path == prefix.path or target.path.startswith(prefix.path + "/")


def _same_server(url: str, own: str) -> bool:
    """Whether ``url`` reaches the server at ``own``: the same port, and the same host or both this machine's
    (``localhost``, a loopback address, or the unspecified address, which connects here)."""
    try:
        target, server = httpx.URL(url), httpx.URL(own)
    except httpx.InvalidURL:
        return False
    if _port(target) != _port(server):
        return False
    return target.host == server.host or (_is_this_machine(target.host) and _is_this_machine(server.host))


def _is_this_machine(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return address.is_loopback or address.is_unspecified


def _is_loopback_ip(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name, not an address
        return False


def _port(url: httpx.URL) -> int | None:
    return url.port or {"http": 80, "https": 443}.get(url.scheme)


def _public_url(url: str) -> str:
    """``url`` without credentials, query or fragment: what messages and logs may show."""
    parsed = httpx.URL(url)
    host = f"[{parsed.host}]" if ":" in parsed.host else parsed.host
    port = f":{parsed.port}" if parsed.port else ""
    return f"{parsed.scheme}://{host}{port}{parsed.path}"


# ---------------------------------------------------------------------------------------------------------------
# Scoring


@dataclass
class Samples:
    """A batch of sampled completions and what they were sampled from."""

    prompts: list[Text]
    """The prompts as the dataset rows give them: a string, or a list of chat messages."""
    prompt_texts: list[str]
    """The prompts as the policy saw them (chat template applied): the start of an http grader's queries."""
    completions: list[str]
    """The decoded completions."""
    rows: list[dict[str, Any]]
    """The dataset rows, every column."""

    def __post_init__(self) -> None:
        lengths = {len(self.prompts), len(self.prompt_texts), len(self.completions), len(self.rows)}
        if len(lengths) > 1:
            raise ValueError(f"prompts, prompt_texts, completions and rows differ in length ({sorted(lengths)})")

    def __len__(self) -> int:
        return len(self.completions)


@dataclass
class RewardScores:
    """A reward's scores of a batch of samples."""

    total: list[float]
    """The reward of each sample: the top grader's score."""
    components: dict[str, list[float]]
    """Every named grader's scores, leaves and multis (the top one included); ``<name>/pass`` (1.0 or 0.0) for each
    text_similarity or score_model grader with a ``pass_threshold``; ``<name>/invalid`` (1.0 or 0.0) of each model
    grader, its judge's answer unreadable (scored 0); ``<name>/errors`` of each source grader, its code failing on
    the sample (scored 0)."""
    errors: dict[str, str] = field(default_factory=dict)
    """Per grader, its first error on a sample it scored 0 for."""
    judge_tokens: dict[str, int] = field(default_factory=dict)
    """Tokens the judges used, per judge name."""


ModelScorer = Callable[[ModelGrader, Samples], list[float]]
"""Scores samples with a model grader's reward model (the engine's, which loads models)."""
Judges = Callable[[str], judge.Endpoint | None]
"""The service's judge of a model grader's ``model`` name (None: not offered): :meth:`Callbacks.judge`."""


@dataclass
class _Scoring:
    """What scoring one batch needs beside the graders, and what it collects."""

    samples: Samples
    model_scorer: ModelScorer | None
    should_stop: StopCheck | None
    judges: Judges | None
    sandbox_limits: sandbox.SandboxLimits
    components: dict[str, list[float]]
    errors: dict[str, str]
    """A grader's first error on a sample it scored 0 for (a judge's unreadable answer, a source grader's raise)."""
    judge_tokens: dict[str, int]


def score(
    grader: Grader,
    samples: Samples,
    model_scorer: ModelScorer | None = None,
    should_stop: StopCheck | None = None,
    judges: Judges | None = None,
    sandbox_limits: sandbox.SandboxLimits | None = None,
) -> RewardScores:
    """Every sample's reward, and the scores of each of the reward's graders. RewardError (RewardServiceError,
    RewardFunctionError) when one cannot be computed; RewardStopped when ``should_stop`` asks for a stop before a
    grader, or while an http grader, a judge or a source grader's sandbox is waited for."""
    scoring = _Scoring(samples, model_scorer, should_stop, judges, sandbox_limits or sandbox.SandboxLimits(), {},
                       {}, {})  # fmt: skip
    total = _score(grader, _effective_name(grader), scoring)
    return RewardScores(total=total, components=scoring.components, errors=scoring.errors,
                        judge_tokens=scoring.judge_tokens)  # fmt: skip


def reward_metrics(scores: RewardScores, prefix: str = "reward") -> dict[str, float]:
    """``<prefix>/mean`` and ``<prefix>/std`` (population) of the rewards, ``<prefix>/<name>``, the mean of
    each component's scores, and ``<prefix>/judge_tokens``, the tokens the judges of model graders used for the
    batch (when there are any). Empty for an empty batch."""
    if not scores.total:
        return {}
    metrics = {f"{prefix}/mean": statistics.fmean(scores.total), f"{prefix}/std": statistics.pstdev(scores.total)}
    for name, values in scores.components.items():
        metrics[f"{prefix}/{name}"] = statistics.fmean(values)
    if scores.judge_tokens:
        metrics[f"{prefix}/judge_tokens"] = float(sum(scores.judge_tokens.values()))
    return metrics


def _score(grader: _AnyGrader, name: str, scoring: _Scoring) -> list[float]:
    """The scores of ``grader`` (called ``name``), recorded in ``scoring.components`` with those of its
    components."""
    if isinstance(grader, MultiGrader):
        parts = {key: _score(sub, key, scoring) for key, sub in grader.graders.items()}
        scores = _combine(grader, name, parts, len(scoring.samples))
    else:
        _check_stop(scoring.should_stop)  # between the leaves of a multi of many
        scores = _LEAF_SCORERS[grader.type](grader, name, scoring)
    scoring.components[name] = scores
    threshold = grader.pass_threshold if isinstance(grader, TextSimilarityGrader | ScoreModelGrader) else None
    if threshold is not None:
        scoring.components[f"{name}/pass"] = [float(s >= threshold) for s in scores]
    return scores


def _number_problem(values: object, n: int) -> str | None:
    """Why ``values`` is not a list of ``n`` finite numbers (None: it is)."""
    if not isinstance(values, list | tuple):
        return f"a {type(values).__name__}, not a list of numbers"
    if len(values) != n:
        return f"{len(values)} scores for {n} samples"
    for i, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return f"a {type(value).__name__} at position {i}, not a finite number"
        try:
            finite = math.isfinite(value)
        except OverflowError:
            return f"an integer too large for a float at position {i}"
        if not finite:
            return f"{value!r} at position {i}, not a finite number"
    return None


# 1. model graders: the engine's callback


def _score_model(grader: ModelGrader, name: str, scoring: _Scoring) -> list[float]:
    samples, model_scorer = scoring.samples, scoring.model_scorer
    if model_scorer is None:
        raise RewardError(f"grader {name!r}: model graders need a model scorer, and none was given")
    scores = model_scorer(grader, samples)
    problem = _number_problem(scores, len(samples))
    if problem:
        raise RewardError(f"grader {name!r}: the reward model {grader.model} gave {problem}")
    return [float(s) for s in scores]


# 2. string_check and text_similarity graders


def _score_texts(grader: StringCheckGrader | TextSimilarityGrader, name: str, scoring: _Scoring) -> list[float]:
    pairs = zip(scoring.samples.completions, scoring.samples.rows, strict=True)
    return [_score_text(grader, name, completion, row) for completion, row in pairs]


def _score_text(
    grader: StringCheckGrader | TextSimilarityGrader, name: str, completion: str, row: Mapping[str, Any]
) -> float:
    text = _render(grader.input, name, completion, row)
    reference = _render(grader.reference, name, completion, row)
    if isinstance(grader, TextSimilarityGrader):
        return _similarity(grader.evaluation_metric, text, reference)
    matches = {
        "eq": text == reference,
        "ne": text != reference,
        "like": reference in text,
        "ilike": reference.lower() in text.lower(),
    }
    return float(matches[grader.operation])


MAX_METRIC_CHARS = 10_000
"""A text_similarity metric compares the first 10,000 characters of each text: fuzzy_match's time grows with the
product of the two lengths (15 s for two texts of 500,000 characters)."""
MAX_LCS_TOKENS = 1_000
"""``rouge_l`` compares the first 1,000 tokens of each text (as rouge-score tokenizes: runs of a-z and 0-9, once
lowercased): its longest common subsequence fills a table of the product of the two lengths, in Python (0.5 s for
two texts of 1,000 tokens; 36 s and 0.5 GB for 8,000)."""
_ROUGE_TOKEN = re.compile(r"[a-z0-9]+")  # google-research/google-research rouge/tokenize.py


def _first_tokens(text: str, limit: int) -> str:
    """``text`` lowercased and cut after its ``limit``-th rouge-score token: rouge-score scores it as it would the
    first ``limit`` tokens of ``text``."""
    lowered = text.lower()
    for count, match in enumerate(_ROUGE_TOKEN.finditer(lowered), start=1):
        if count == limit:
            return lowered[: match.end()]
    return lowered


def _similarity(metric: TextMetric, text: str, reference: str) -> float:
    """``text``'s similarity to ``reference`` by ``metric``, in [0, 1], over the first :data:`MAX_METRIC_CHARS`
    of each (and their first :data:`MAX_LCS_TOKENS` for ``rouge_l``); the libraries load on first use."""
    text, reference = text[:MAX_METRIC_CHARS], reference[:MAX_METRIC_CHARS]
    if metric == "fuzzy_match":
        from rapidfuzz import fuzz

        return fuzz.ratio(text, reference) / 100
    if metric == "bleu":
        import sacrebleu

        return min(1.0, sacrebleu.sentence_bleu(text, [reference]).score / 100)  # 100.00000000000004 when equal
    if metric == "gleu":
        from nltk.translate.gleu_score import sentence_gleu

        return float(sentence_gleu([reference.split()], text.split()))
    if metric == "rouge_l":
        text, reference = _first_tokens(text, MAX_LCS_TOKENS), _first_tokens(reference, MAX_LCS_TOKENS)
    rouge_type = "rougeL" if metric == "rouge_l" else "rouge" + metric.removeprefix("rouge_")
    return float(_rouge_scorer(rouge_type).score(reference, text)[rouge_type].fmeasure)


@functools.cache
def _rouge_scorer(rouge_type: str) -> Any:
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer([rouge_type])


# 3. http graders: OpenRLHF's remote reward model protocol


def _score_http(grader: HttpGrader, name: str, scoring: _Scoring) -> list[float]:
    samples, should_stop = scoring.samples, scoring.should_stop
    labels = [
        None if grader.label is None else _render(grader.label, name, completion, row)
        for completion, row in zip(samples.completions, samples.rows, strict=True)
    ]
    queries = [
        prompt + completion for prompt, completion in zip(samples.prompt_texts, samples.completions, strict=True)
    ]
    rewards: list[float] = []
    for start in range(0, len(samples), grader.batch_size):
        batch = slice(start, start + grader.batch_size)
        payload: dict[str, list[Any]] = {
            "query": queries[batch],
            "prompts": samples.prompt_texts[batch],
            "labels": labels[batch],
        }
        rewards += _post_rewards(grader, payload, should_stop)
    return rewards


def _post_rewards(grader: HttpGrader, payload: dict[str, list[Any]], should_stop: StopCheck | None) -> list[float]:
    """The service's rewards for one request, retried with exponential backoff. Messages give the status code,
    never the answer's text: a job must not read what a service it was let call says."""
    url = _public_url(grader.url)
    attempts = grader.retries + 1
    problem = ""
    for attempt in range(attempts):
        if attempt:
            logger.warning("reward service %s: %s; retry %d of %d", url, problem, attempt, grader.retries)
            _sleep(grader.backoff_s * 2 ** (attempt - 1), should_stop)
        answer = _post(grader, payload, should_stop)
        if isinstance(answer, str):
            problem = answer
            continue
        status, body = answer
        if status == 429 or status >= 500:
            problem = _http_status(status)
            continue
        if not 200 <= status < 300:  # another 4xx, or a redirect (never followed): retrying cannot help
            raise RewardServiceError(f"reward service {url} refused the request: {_http_status(status)}")
        rewards, problem = _read_rewards(body, len(payload["query"]))
        if rewards is not None:
            return rewards
    tries = f"{attempts} attempt" + ("s" if attempts > 1 else "")
    raise RewardServiceError(f"reward service {url} failed after {tries}: {problem}")


def _sleep(seconds: float, should_stop: StopCheck | None) -> None:
    """Wait ``seconds``, asking ``should_stop`` every :data:`STOP_POLL_S`; RewardStopped when it asks."""
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        _check_stop(should_stop)
        time.sleep(min(left, STOP_POLL_S))


def _check_stop(should_stop: StopCheck | None) -> None:
    request = should_stop() if should_stop is not None else None
    if request is not None:
        raise RewardStopped(request)


def _post(grader: HttpGrader, payload: dict[str, list[Any]], should_stop: StopCheck | None) -> tuple[int, bytes] | str:
    """One POST of ``payload``: (the status code, the body of a 2xx answer, at most MAX_ANSWER_BYTES + 1 bytes), or
    what went wrong. ``timeout_s`` bounds the whole request, from connecting to the body's last byte: it runs in a
    thread that this one stops waiting for past that deadline, or when ``should_stop`` asks (RewardStopped); the
    thread left behind ends at its next read (each within ``timeout_s``) or at once if it is between reads."""
    deadline = time.monotonic() + grader.timeout_s
    abandoned = threading.Event()
    answers: queue.Queue[tuple[int, bytes] | str | Exception] = queue.Queue(maxsize=1)

    def request() -> None:
        try:
            answers.put(_request(grader, payload, deadline, abandoned))
        except Exception as e:  # not the service's doing: raised again in the caller's thread
            answers.put(e)

    threading.Thread(target=request, name="reward-request", daemon=True).start()
    try:
        while (left := deadline - time.monotonic()) > 0:
            _check_stop(should_stop)
            try:
                answer = answers.get(timeout=min(left, STOP_POLL_S))
            except queue.Empty:
                continue
            if isinstance(answer, Exception):
                raise answer
            return answer
        return f"no answer within {grader.timeout_s:g} s"
    finally:
        abandoned.set()


def _request(
    grader: HttpGrader, payload: dict[str, list[Any]], deadline: float, abandoned: threading.Event
) -> tuple[int, bytes] | str:
    """:func:`_post`'s request, in its thread: the body streamed, and dropped once over MAX_ANSWER_BYTES, past
    the deadline or when abandoned."""
    # trust_env=False: no proxy from the environment between the worker and an allow-listed service.
    # identity: the cap counts the bytes as they come, with no decompression in between.
    headers = {"Accept-Encoding": "identity"}
    try:
        with (
            httpx.Client(timeout=grader.timeout_s, trust_env=False) as client,
            client.stream("POST", grader.url, json=payload, headers=headers) as response,
        ):
            if not response.is_success:
                return response.status_code, b""
            if response.headers.get("Content-Encoding", "identity").lower() != "identity":
                return "the answer is compressed, though identity was asked for"
            body = bytearray()
            for chunk in response.iter_raw():
                body += chunk
                if len(body) > MAX_ANSWER_BYTES or abandoned.is_set() or time.monotonic() > deadline:
                    break
            return response.status_code, bytes(body)
    except httpx.TimeoutException:
        return f"no answer within {grader.timeout_s:g} s"
    except httpx.NetworkError as e:  # the system's reason (refused, reset, unreachable): nothing of the service's
        return f"{type(e).__name__}: {e}"
    except httpx.HTTPError as e:  # e.g. not HTTP at all: h11's message would quote what the service sent
        return f"{type(e).__name__} (not an HTTP answer)" if isinstance(e, httpx.ProtocolError) else type(e).__name__


def _http_status(code: int) -> str:
    """``HTTP 503 Service Unavailable``: the code and its standard reason (not the one the service sent)."""
    try:
        return f"HTTP {code} {http.HTTPStatus(code).phrase}"
    except ValueError:
        return f"HTTP {code}"


def _read_rewards(body: bytes, n: int) -> tuple[list[float] | None, str]:
    """(the rewards of an answer ``{"rewards": [...]}``, "") or (None, what is wrong with it)."""
    if len(body) > MAX_ANSWER_BYTES:
        return None, f"the answer is over {MAX_ANSWER_BYTES:,} bytes"
    try:
        answer = json.loads(body)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, too long a number, nested too deep
        return None, "the answer is not JSON"
    if not isinstance(answer, dict) or not isinstance(answer.get("rewards"), list):
        return None, 'the answer has no "rewards" list'
    problem = _number_problem(answer["rewards"], n)
    if problem:
        return None, f"the rewards are {problem}"
    return [float(r) for r in answer["rewards"]], ""


# 4. python graders: TRL's reward functions


@functools.cache
def _load_function(path: str) -> Callable[..., Any]:
    module_name, function_name = path.split(":")
    try:
        function = getattr(importlib.import_module(module_name), function_name)
    except Exception as e:  # ImportError, AttributeError, or whatever the module raises as it loads
        raise RewardFunctionError(f"reward function {path} cannot be imported: {type(e).__name__}: {e}") from e
    if not callable(function):
        raise RewardFunctionError(f"reward function {path} is a {type(function).__name__}, not a function")
    return function


def _score_python(grader: PythonGrader, name: str, scoring: _Scoring) -> list[float]:
    if grader.source is not None:
        return _score_source(grader, name, scoring)
    samples, path = scoring.samples, grader.function
    assert path is not None  # one of source and function, checked by the spec
    function = _load_function(path)
    # TRL passes chat completions as messages: the completion is the assistant's reply
    completions = [
        [{"role": "assistant", "content": text}] if isinstance(prompt, list) else text
        for prompt, text in zip(samples.prompts, samples.completions, strict=True)
    ]
    # the rows' other columns, each a list (None where a row lacks it), as TRL's reward_kwargs
    names = dict.fromkeys(key for row in samples.rows for key in row if key not in _NOT_COLUMNS)
    columns = {key: [row.get(key) for row in samples.rows] for key in names}
    try:
        scores = function(prompts=samples.prompts, completions=completions, **columns)
    except Exception as e:
        _raise_failing_row(path, function, samples.prompts, completions, columns, e)
    problem = _number_problem(scores, len(samples))
    if problem:
        raise RewardFunctionError(f"reward function {path} returned {problem}")
    return [float(s) for s in scores]


_NOT_COLUMNS = frozenset({"prompt", "completion", "prompts", "completions"})
"""Row keys not passed as columns: the prompt and completion come as ``prompts`` and ``completions``."""


def _raise_failing_row(
    path: str,
    function: Callable[..., Any],
    prompts: list[Text],
    completions: list[Any],
    columns: dict[str, list[Any]],
    batch_error: Exception,
) -> NoReturn:
    """RewardFunctionError naming the first row the function raises on, called on one row at a time."""
    for i, prompt in enumerate(prompts):
        one_row = {key: values[i : i + 1] for key, values in columns.items()}
        try:
            function(prompts=[prompt], completions=completions[i : i + 1], **one_row)
        except Exception as e:
            raise RewardFunctionError(
                f"reward function {path} raised {e!r} on row {i} (prompt {_excerpt(prompt)!r})"
            ) from e
    raise RewardFunctionError(
        f"reward function {path} raised {batch_error!r} on a batch of {len(prompts)} rows, though on no row alone"
    ) from batch_error


def _excerpt(prompt: Text, limit: int = 80) -> str:
    """The prompt's text (a chat prompt's last message), cut to ``limit`` characters."""
    text = prompt[-1]["content"] if isinstance(prompt, list) else prompt
    return text if len(text) <= limit else text[: limit - 4] + " ..."


# 5. python source graders: OpenAI's grade(sample, item), in the sandbox


def _score_source(grader: PythonGrader, name: str, scoring: _Scoring) -> list[float]:
    """Each sample's ``grade(sample, item)``, the whole batch in one sandboxed process. A sample the code fails on
    scores 0 (counted in ``<name>/errors``); a batch it fails on entirely is a RewardFunctionError."""
    assert grader.source is not None
    samples = scoring.samples
    calls = [(openai_sample(text), dict(row)) for text, row in zip(samples.completions, samples.rows, strict=True)]
    stop = scoring.should_stop
    asks = (lambda: stop() is not None) if stop else None
    try:
        batch = sandbox.grade_source(grader.source, calls, scoring.sandbox_limits, should_stop=asks)
    except sandbox.SandboxUnavailable as e:
        raise RewardFunctionError(f"grader {name!r}: source graders cannot run here: {e}") from e
    if batch.batch_error == sandbox.STOPPED:
        _check_stop(stop)
    if batch.batch_error is not None:
        raise RewardFunctionError(f"grader {name!r}: {batch.batch_error}")
    failed = [error for error in batch.errors if error is not None]
    if failed and len(failed) == len(calls):
        raise RewardFunctionError(f"grader {name!r} failed on every sample of the batch; the first: {failed[0]}")
    if failed:
        scoring.errors.setdefault(name, failed[0])
    scoring.components[f"{name}/errors"] = [float(error is not None) for error in batch.errors]
    return [0.0 if value is None else value for value in batch.scores]


def openai_sample(text: str) -> dict[str, Any]:
    """The ``sample`` OpenAI's graders see: ``output_text``, and ``output_json`` when the text is JSON."""
    try:
        output_json = json.loads(text)
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
        output_json = None
    return {"output_text": text, "output_json": output_json, "output_tools": [], "choices": []}


# 6. score_model and label_model graders: a judge's answer


def _score_judged(grader: "ScoreModelGrader | LabelModelGrader", name: str, scoring: _Scoring) -> list[float]:
    """The judge's score (or 1.0 for a passing label) of each sample; an unreadable answer scores 0, counted in
    ``<name>/invalid``. RewardServiceError when the judge is not offered or fails after its retries."""
    endpoint = scoring.judges(grader.model) if scoring.judges is not None else None
    if endpoint is None:
        raise RewardServiceError(f"grader {name!r}: no judge {grader.model!r} is offered here (RLHF_JUDGES)")
    samples = scoring.samples
    if isinstance(grader, ScoreModelGrader):
        instruction = judge.score_instruction(grader.range[0], grader.range[1])
    else:
        instruction = judge.label_instruction(grader.labels)
    conversations = [
        [*_judge_messages(grader, name, completion, row), instruction]
        for completion, row in zip(samples.completions, samples.rows, strict=True)
    ]
    stop = scoring.should_stop
    try:
        answers = judge.ask(endpoint, conversations, grader.sampling_params.request_fields(),
                            should_stop=(lambda: stop() is not None) if stop else None)  # fmt: skip
    except judge.JudgeError as e:
        _check_stop(stop)
        raise RewardServiceError(f"grader {name!r}: {e}") from e
    scoring.judge_tokens[grader.model] = scoring.judge_tokens.get(grader.model, 0) + sum(a.tokens for a in answers)
    scores, invalid = [], []
    for answer in answers:
        value = _judged_value(grader, answer)
        invalid.append(float(value is None))
        scores.append(0.0 if value is None else value)
        if value is None:
            problem = "refused" if answer.refused else f"answered {answer.text[:200]!r}"
            scoring.errors.setdefault(name, f"the judge {grader.model} {problem}")
    scoring.components[f"{name}/invalid"] = invalid
    return scores


def _judged_value(grader: "ScoreModelGrader | LabelModelGrader", answer: judge.Answer) -> float | None:
    if answer.refused:
        return None
    if isinstance(grader, ScoreModelGrader):
        return judge.read_score(answer.text, grader.range[0], grader.range[1])
    label = judge.read_label(answer.text, grader.labels)
    return None if label is None else float(label in grader.passing_labels)


def _judge_messages(grader: "ScoreModelGrader | LabelModelGrader", name: str, completion: str,
                    row: Mapping[str, Any]) -> list[judge.Message]:  # fmt: skip
    """The grader's conversation for one sample, its placeholders filled in."""
    messages = []
    for message in grader.input:
        parts = [message.content] if isinstance(message.content, str) else [part.text for part in message.content]
        text = "\n".join(_render(part, name, completion, row) for part in parts)
        messages.append({"role": "system" if message.role == "developer" else message.role, "content": text})
    return messages


# 7. multi graders


def _combine(grader: MultiGrader, name: str, parts: dict[str, list[float]], n: int) -> list[float]:
    """Each sample's combined score: the weighted sum, or ``calculate_output`` of its components' scores."""
    if grader.weights is not None:
        weights = grader.weights
        return [sum(weight * parts[key][i] for key, weight in weights.items()) for i in range(n)]
    assert grader.calculate_output is not None  # one of the two, checked by the spec
    formula = _parse_formula(grader.calculate_output)
    scores = []
    for i in range(n):
        try:
            value = _evaluate(formula, {key: values[i] for key, values in parts.items()})
        except (ZeroDivisionError, ValueError, OverflowError) as e:
            raise RewardFormulaError(f"grader {name!r}: {grader.calculate_output!r} failed on sample {i}: {e}") from e
        if not math.isfinite(value):
            raise RewardFormulaError(f"grader {name!r}: {grader.calculate_output!r} is {value} on sample {i}")
        scores.append(value)
    return scores


_LEAF_SCORERS: dict[str, Callable[[Any, str, _Scoring], list[float]]] = {
    "model": _score_model,
    "string_check": _score_texts,
    "text_similarity": _score_texts,
    "http": _score_http,
    "python": _score_python,
    "score_model": _score_judged,
    "label_model": _score_judged,
}
"""Each leaf grader kind's scorer, by ``type``: (the grader, its name, the scoring) → one score per sample."""
