"""Reward graders: how an RL job scores each sampled completion (torch-free, so the API validates them).

A job spec's ``reward`` is one :data:`Grader`. The kinds follow OpenAI's grader JSON
(https://platform.openai.com/docs/api-reference/graders), so users can bring theirs:

- ``model``: a reward model; scored by a callback the engine passes to :func:`score`.
- ``string_check``: 1.0 or 0.0 from comparing two rendered templates.
- ``text_similarity``: fuzzy match, BLEU, GLEU or ROUGE of two rendered templates, in [0, 1].
- ``http``: a remote reward service speaking OpenRLHF's remote reward model protocol
  (OpenRLHF/OpenRLHF ``openrlhf/utils/remote_rm_utils.py``).
- ``python``: an importable function with TRL's reward-function signature
  (https://huggingface.co/docs/trl/grpo_trainer#using-a-custom-reward-function).
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
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, NoReturn

import httpx
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, TypeAdapter, field_validator, model_validator

from engine.callbacks import StopRequest
from engine.spec.rows import Text

logger = logging.getLogger(__name__)

RESERVED_NAMES = frozenset({"mean", "std"})
"""Names no grader may have: :func:`reward_metrics` reports ``reward/mean`` and ``reward/std`` beside them."""
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
    value: Any = row
    for depth, key in enumerate(keys):
        if not isinstance(value, Mapping) or key not in value:
            missing = "item." + ".".join(keys[: depth + 1])
            raise RewardError(f"grader {grader!r}: the dataset row has no {missing} (its columns: {', '.join(row)})")
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
        raise ValueError(f"{name!r} is reserved (the reward's {' and '.join(sorted(RESERVED_NAMES))} use it)")
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


FUNCTION_PATH = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"
"""A python grader's ``function``: ``module.path:function_name``."""


class PythonGrader(_GraderBase):
    """An importable function with TRL's reward-function signature: ``fn(prompts=[...], completions=[...],
    **columns) -> list[float]``, every other column of the dataset rows passed as a list."""

    type: Literal["python"] = "python"
    """The grader kind."""
    source: Annotated[str | None, Field(exclude=True)] = None
    """OpenAI's Python grader source code: not run here, refused naming this field (before ``function``, so the
    refusal names it first)."""
    function: Annotated[str, Field(max_length=300, pattern=FUNCTION_PATH)]
    """``module.path:function_name``; the operator's ``allowed_functions`` must admit it."""

    @field_validator("source")
    @classmethod
    def _no_source(cls, source: str | None) -> None:
        if source is not None:
            raise ValueError(
                "Python source graders are not run by this server; give function, a module.path:function_name "
                "the operator allows (RLHF_REWARD_FUNCTIONS), instead of source"
            )
        return None


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
    ModelGrader | StringCheckGrader | TextSimilarityGrader | HttpGrader | PythonGrader | MultiGrader,
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


def check_allowed(grader: Grader, allowed_urls: Sequence[str], allowed_functions: Sequence[str] | None) -> list[str]:
    """What the operator's allow-lists refuse in ``grader`` (empty: nothing). An ``allowed_urls`` entry is a URL
    prefix (scheme, host and port equal, the path within the entry's) or ``loopback``; ``allowed_functions`` None
    allows any function (the local CLI), which fails only when scored if it cannot be imported."""
    problems = []
    for name, sub in iter_graders(grader):
        if isinstance(sub, HttpGrader) and not any(_url_allowed(sub.url, entry) for entry in allowed_urls):
            allowed = ", ".join(allowed_urls) or "none"
            problems.append(f"grader {name!r}: the reward service {_public_url(sub.url)} is not allowed ({allowed})")
        if isinstance(sub, PythonGrader) and allowed_functions is not None and sub.function not in allowed_functions:
            allowed = ", ".join(allowed_functions) or "none"
            problems.append(f"grader {name!r}: the reward function {sub.function} is not allowed ({allowed})")
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
    """Every named grader's scores, leaves and multis (the top one included), and ``<name>/pass`` (1.0 or 0.0)
    for each text_similarity grader with a ``pass_threshold``."""


ModelScorer = Callable[[ModelGrader, Samples], list[float]]
"""Scores samples with a model grader's reward model (the engine's, which loads models)."""


def score(
    grader: Grader, samples: Samples, model_scorer: ModelScorer | None = None, should_stop: StopCheck | None = None
) -> RewardScores:
    """Every sample's reward, and the scores of each of the reward's graders. RewardError (RewardServiceError,
    RewardFunctionError) when one cannot be computed; RewardStopped when ``should_stop`` asks for a stop while an
    http grader waits for its service."""
    components: dict[str, list[float]] = {}
    total = _score(grader, _effective_name(grader), samples, model_scorer, should_stop, components)
    return RewardScores(total=total, components=components)


def reward_metrics(scores: RewardScores, prefix: str = "reward") -> dict[str, float]:
    """``<prefix>/mean`` and ``<prefix>/std`` (population) of the rewards, and ``<prefix>/<name>``, the mean of
    each component's scores. Empty for an empty batch."""
    if not scores.total:
        return {}
    metrics = {f"{prefix}/mean": statistics.fmean(scores.total), f"{prefix}/std": statistics.pstdev(scores.total)}
    for name, values in scores.components.items():
        metrics[f"{prefix}/{name}"] = statistics.fmean(values)
    return metrics


def _score(
    grader: _AnyGrader,
    name: str,
    samples: Samples,
    model_scorer: ModelScorer | None,
    should_stop: StopCheck | None,
    components: dict[str, list[float]],
) -> list[float]:
    """The scores of ``grader`` (called ``name``), recorded in ``components`` with those of its components."""
    if isinstance(grader, MultiGrader):
        parts = {
            key: _score(sub, key, samples, model_scorer, should_stop, components) for key, sub in grader.graders.items()
        }
        scores = _combine(grader, name, parts, len(samples))
    elif isinstance(grader, ModelGrader):
        scores = _score_model(grader, name, samples, model_scorer)
    elif isinstance(grader, StringCheckGrader | TextSimilarityGrader):
        pairs = zip(samples.completions, samples.rows, strict=True)
        scores = [_score_text(grader, name, completion, row) for completion, row in pairs]
    elif isinstance(grader, HttpGrader):
        scores = _score_http(grader, name, samples, should_stop)
    else:
        scores = _score_python(grader, samples)
    components[name] = scores
    if isinstance(grader, TextSimilarityGrader) and grader.pass_threshold is not None:
        components[f"{name}/pass"] = [float(s >= grader.pass_threshold) for s in scores]
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


def _score_model(grader: ModelGrader, name: str, samples: Samples, model_scorer: ModelScorer | None) -> list[float]:
    if model_scorer is None:
        raise RewardError(f"grader {name!r}: model graders need a model scorer, and none was given")
    scores = model_scorer(grader, samples)
    problem = _number_problem(scores, len(samples))
    if problem:
        raise RewardError(f"grader {name!r}: the reward model {grader.model} gave {problem}")
    return [float(s) for s in scores]


# 2. string_check and text_similarity graders


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


def _similarity(metric: TextMetric, text: str, reference: str) -> float:
    """``text``'s similarity to ``reference`` by ``metric``, in [0, 1]; the libraries load on first use."""
    if metric == "fuzzy_match":
        from rapidfuzz import fuzz

        return fuzz.ratio(text, reference) / 100
    if metric == "bleu":
        import sacrebleu

        return min(1.0, sacrebleu.sentence_bleu(text, [reference]).score / 100)  # 100.00000000000004 when equal
    if metric == "gleu":
        from nltk.translate.gleu_score import sentence_gleu

        return float(sentence_gleu([reference.split()], text.split()))
    rouge_type = "rougeL" if metric == "rouge_l" else "rouge" + metric.removeprefix("rouge_")
    return float(_rouge_scorer(rouge_type).score(reference, text)[rouge_type].fmeasure)


@functools.cache
def _rouge_scorer(rouge_type: str) -> Any:
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer([rouge_type])


# 3. http graders: OpenRLHF's remote reward model protocol


def _score_http(grader: HttpGrader, name: str, samples: Samples, should_stop: StopCheck | None) -> list[float]:
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


def _score_python(grader: PythonGrader, samples: Samples) -> list[float]:
    function = _load_function(grader.function)
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
        _raise_failing_row(grader.function, function, samples.prompts, completions, columns, e)
    problem = _number_problem(scores, len(samples))
    if problem:
        raise RewardFunctionError(f"reward function {grader.function} returned {problem}")
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


# 5. multi graders


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
            raise RewardError(f"grader {name!r}: {grader.calculate_output!r} failed on sample {i}: {e}") from e
        if not math.isfinite(value):
            raise RewardError(f"grader {name!r}: {grader.calculate_output!r} is {value} on sample {i}")
        scores.append(value)
    return scores
