"""Frozen configuration dataclasses that flow engine -> scheduler -> server.

Every dataclass validates itself in ``__post_init__`` and raises ``ValueError`` with a message
that names the offending field, so the server can turn it into a 400 as-is.

Longer than ~400 lines on purpose: this is the one place every setting is declared (with its
default, its help and its check); the server's ServerArgs extends EngineConfig and its flags are
built from these fields (flags.py), so splitting the file would split the declaration.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .flags import option

REMASKING = ("low_confidence", "random")
# Unmasking algorithms (docs/server.md, "Dream's generation algorithms"): LLaDA's two, on its
# per-block linear schedule, and Dream's four (``diffusion_generate``), on its timestep schedule.
LLADA_ALGORITHMS = REMASKING
DREAM_ALGORITHMS = ("origin", "maskgit_plus", "topk_margin", "entropy")
# the bidirectional engine runs these (any bidirectional family, unless its module narrows them)
BIDIRECTIONAL_ALGORITHMS = LLADA_ALGORITHMS + DREAM_ALGORITHMS
# LLaDA2.1's token editing (SGLang's JointThreshold), run by the block-diffusion engine only: which
# family accepts which algorithm is the family's declaration (models/families, FamilyDecoding)
BLOCK_ALGORITHMS = ("low_confidence", "joint_threshold")
# every algorithm name a flag or a request may give
ALGORITHMS = BIDIRECTIONAL_ALGORITHMS + ("joint_threshold",)
# other spellings accepted for an algorithm name (SGLang's dLLM algorithm class names)
_ALGORITHM_ALIASES = {"lowconfidence": "low_confidence", "jointthreshold": "joint_threshold"}
SGLANG_ALGORITHM_NAMES = {"low_confidence": "LowConfidence", "joint_threshold": "JointThreshold"}
DEFAULT_EPS = 1e-3  # Dream's diffusion_generate default
CACHE_MODES = ("none", "prefix", "dual")
# rows a dual-cache block step computes: the whole block (Fast-dLLM), or only the positions still
# masked plus those unmasked by the previous forward (docs/performance.md, "Fewer rows per step")
STEP_ROWS = ("block", "active")
DEFAULT_MAX_N = 256  # the server's --max-n: largest n (samples per prompt) a request may ask for
DEFAULT_PROBATION = 16  # agreeing audits per bucket before a first-run profile's depth is trusted
# Probes per reusing request for a model without a profile of its own (none, or a first-run one):
# each costs one extra sequence in that request's first forward (docs/prefix_cache.md)
DEFAULT_PROBE_RATE = 0.1
DTYPES = ("auto", "float32", "float", "bfloat16", "float16", "half")

_FIXED_RE = re.compile(r"^fixed:(\d+)$")


def parse_prefix_cache_mode(mode: str) -> tuple[str, int | None]:
    """``off | naive | bicache | fixed:N`` -> (kind, N). Raises ValueError on anything else."""
    if mode in ("off", "naive", "bicache"):
        return mode, None
    m = _FIXED_RE.match(mode or "")
    if m:
        return "fixed", int(m.group(1))
    raise ValueError(f"prefix_cache must be one of off, naive, bicache, fixed:N; got {mode!r}")


def canonical_algorithm(name: Any, what: str = "dllm_algorithm") -> str:
    """An algorithm name as given (any case; SGLang's ``LowConfidence``) -> its canonical name.
    Raises ValueError listing the valid names."""
    if isinstance(name, str):
        key = name.strip().lower()
        key = _ALGORITHM_ALIASES.get(key, key)
        if key in ALGORITHMS:
            return key
    raise ValueError(f"{what} must be one of {', '.join(ALGORITHMS)}; got {name!r}")


def check(cond: bool, msg: str) -> None:
    """Raise ValueError(msg) unless ``cond``: the one check every config dataclass uses."""
    if not cond:
        raise ValueError(msg)


# The diffusion knobs a request (SamplingParams) and the engine (DecodeDefaults) both set, each
# under one name with one check: name -> (valid?, what a valid value is). A request may also send
# Dream's knobs under their generation_config.json names (WIRE_NAMES); errors name what was sent.
DECODE_KNOBS: dict[str, tuple[Any, str]] = {
    "block_length": (lambda v: is_int(v) and v >= 1, "an integer >= 1"),
    "steps_per_block": (lambda v: is_int(v) and v >= 1, "an integer >= 1"),
    "threshold": (lambda v: _is_num(v) and 0 <= v <= 1, "in [0, 1]"),
    "dllm_algorithm": (lambda v: v in ALGORITHMS, f"one of {', '.join(ALGORITHMS)}"),
    "dllm_eps": (lambda v: _is_num(v) and 0 < v < 1, "in (0, 1) (the last timestep of Dream's schedule)"),
    "dllm_alg_temp": (lambda v: _is_num(v) and v >= 0, "a number >= 0 (0: the most confident positions)"),
    "cache_mode": (lambda v: v in CACHE_MODES, f"one of {CACHE_MODES}"),
    "refresh_interval": (lambda v: is_int(v) and v >= 0, "an integer >= 0"),
    "step_rows": (lambda v: v in STEP_ROWS, f"one of {STEP_ROWS}"),
}
# request field -> knob, for the names a request may use besides the knob's own (docs/server.md)
WIRE_NAMES = {"eps": "dllm_eps", "alg_temp": "dllm_alg_temp"}
_SHOWN = {v: k for k, v in WIRE_NAMES.items()}


def check_decode_knobs(obj: Any, *, required: tuple[str, ...] = (), shown: Mapping[str, str] | None = None) -> None:
    """Check each of :data:`DECODE_KNOBS` on ``obj``; None passes unless the knob is ``required``.
    ``shown``: knob -> the name an error uses (a request's wire name)."""
    for name, (ok, what) in DECODE_KNOBS.items():
        v = getattr(obj, name)
        if v is None and name not in required:
            continue
        check(v is not None and ok(v), f"{(shown or {}).get(name, name)} must be {what}, got {v!r}")


def is_int(x: Any) -> bool:
    """An int that is not a bool (JSON true/false must not pass as 1/0)."""
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _parse_logit_bias(v: Any) -> tuple[tuple[int, float], ...]:
    """``{"50256": -100, "7": 2.5}`` (OpenAI's shape: token-id strings or ints -> bias) -> sorted
    ((id, bias), ...). The ids are checked against the vocabulary when the request is built."""
    if isinstance(v, (list, tuple)):  # already normalized (a SamplingParams round trip)
        items = [tuple(e) if isinstance(e, (list, tuple)) else e for e in v]
        if not all(isinstance(e, tuple) and len(e) == 2 for e in items):
            raise ValueError("logit_bias must be an object mapping token ids to biases")
    elif isinstance(v, Mapping):
        items = list(v.items())
    else:
        raise ValueError("logit_bias must be an object mapping token ids to biases")
    out: dict[int, float] = {}
    for key, bias in items:
        tid = key
        if isinstance(key, str):
            try:
                tid = int(key.strip())
            except ValueError:
                raise ValueError(f"logit_bias keys must be token ids (integers), got {key!r}") from None
        if not is_int(tid) or tid < 0:
            raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {key!r}")
        if not _is_num(bias) or not -100 <= bias <= 100:
            raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {bias!r} for token {tid}")
        out[tid] = float(bias)
    return tuple(sorted(out.items()))


def _schema_text(v: Any) -> str:
    """``json_schema`` as JSON text: a string is kept as it is (parsed when the constraint is
    compiled); an object or a boolean is serialized with its key order (property order matters)."""
    if isinstance(v, str):
        return v
    if isinstance(v, (Mapping, bool)):
        return json.dumps(v, ensure_ascii=False)
    raise ValueError(f"json_schema must be a JSON schema (a string or an object), got {type(v).__name__}")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation parameters (SGLang's sampling_params plus diffusion knobs).

    ``None`` for a diffusion knob means "use the engine default" (see EngineConfig); the engine
    resolves it with :meth:`resolved` before the request runs.
    """

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    # None: the model's generation_config.json default, else 1.0 (see :meth:`resolved`)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int = -1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    seed: int | None = None
    # diffusion decoding
    block_length: int | None = None
    steps: int | None = None  # total denoising steps over the generation region
    steps_per_block: int | None = None  # alternative to ``steps``
    threshold: float | None = None  # Fast-dLLM confidence threshold; None/0 = fixed schedule
    # unmasking algorithm (ALGORITHMS) and Dream's knobs: the last timestep of its schedule and the
    # temperature of its position sampling (0: top-k). The wire's ``remasking`` (LLaDA's two names)
    # is the same setting: :meth:`from_dict` translates it (``dllm_algorithm`` wins when both are sent)
    dllm_algorithm: str | None = None
    dllm_eps: float | None = None  # the request may send it as ``eps`` (WIRE_NAMES)
    dllm_alg_temp: float | None = None  # or as ``alg_temp``
    cfg_scale: float = 0.0
    cache_mode: str | None = None  # in-request cache: none | prefix | dual
    refresh_interval: int | None = None  # steps between in-request cache refreshes (0 = block start only)
    step_rows: str | None = None  # dual cache: "block" (every block position) or "active" (STEP_ROWS)
    # logit processing over the masked positions' distributions (definitions: docs/server.md)
    frequency_penalty: float = 0.0  # minus penalty x count of the token among unmasked output tokens
    presence_penalty: float = 0.0  # minus penalty if the token is among unmasked output tokens
    repetition_penalty: float = 1.0  # HF/CTRL: over the prompt and the unmasked output tokens
    min_p: float = 0.0  # drop tokens with p < min_p * max p
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), from {"id": bias}
    # structured generation (at most one; docs/structured.md)
    regex: str | None = None
    json_schema: str | None = None  # JSON text (an object is serialized, key order kept)

    def __post_init__(self) -> None:
        check(isinstance(self.max_new_tokens, int) and not isinstance(self.max_new_tokens, bool),
              "max_new_tokens must be an integer")
        check(self.max_new_tokens >= 0, f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        check(isinstance(self.min_new_tokens, int) and self.min_new_tokens >= 0,
              f"min_new_tokens must be an integer >= 0, got {self.min_new_tokens!r}")
        if self.temperature is not None:
            check(isinstance(self.temperature, (int, float)) and self.temperature >= 0,
                  f"temperature must be >= 0, got {self.temperature!r}")
        if self.top_p is not None:
            check(isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1,
                  f"top_p must be in (0, 1], got {self.top_p!r}")
        check(isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 1),
              f"top_k must be -1 (off) or >= 1, got {self.top_k!r}")
        check(isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        check(all(isinstance(s, str) for s in self.stop), "stop must be a string or a list of strings")
        check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
              "stop_token_ids must be a list of non-negative integers")
        if self.steps is not None:
            check(isinstance(self.steps, int) and self.steps >= 1, f"steps must be >= 1, got {self.steps!r}")
        check_decode_knobs(self, shown=_SHOWN)
        check(isinstance(self.cfg_scale, (int, float)) and self.cfg_scale >= 0,
              f"cfg_scale must be >= 0, got {self.cfg_scale!r}")
        for k in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, k)
            check(_is_num(v) and -2 <= v <= 2, f"{k} must be in [-2, 2], got {v!r}")
        check(_is_num(self.repetition_penalty) and 0 < self.repetition_penalty <= 2,
              f"repetition_penalty must be in (0, 2], got {self.repetition_penalty!r}")
        check(_is_num(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}")
        check(isinstance(self.logit_bias, tuple) and all(
            isinstance(e, tuple) and len(e) == 2 and is_int(e[0]) and e[0] >= 0 and _is_num(e[1])
            and -100 <= e[1] <= 100 for e in self.logit_bias),
            "logit_bias must map token ids (integers >= 0) to biases in [-100, 100]")
        check(self.regex is None or isinstance(self.regex, str), "regex must be a string")
        check(self.json_schema is None or isinstance(self.json_schema, str),
              "json_schema must be a JSON string or object")
        check(self.regex is None or self.json_schema is None, "only one of regex and json_schema can be set")

    def resolved(self, model_defaults: Mapping[str, Any] | None = None) -> "SamplingParams":
        """``temperature`` and ``top_p`` left unset (None) filled from ``model_defaults`` (the
        checkpoint's generation_config.json), else 1.0. The other knobs that fall back on server
        and model defaults are resolved with the decoding plan (decoding/plan.py)."""
        md = model_defaults or {}
        kw = {}
        for k in ("temperature", "top_p"):
            if getattr(self, k) is None:
                v = md.get(k)
                kw[k] = 1.0 if v is None else float(v)
        return dataclasses.replace(self, **kw) if kw else self

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(kind, spec) of the output constraint, or None (docs/structured.md)."""
        if self.regex is not None:
            return "regex", self.regex
        if self.json_schema is not None:
            return "json_schema", self.json_schema
        return None

    _ALIASES: ClassVar[dict[str, str]] = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens",
                                          "gen_length": "max_new_tokens", "sampling_seed": "seed", **WIRE_NAMES}
    # Keys of SGLang's sampling-params schema this engine does not implement: key -> (values that
    # ask for nothing, what the key would need). SGLang's frontend sends most of them on every
    # call with their no-op defaults, so those are accepted; any other value is refused, because
    # silently ignoring it would hand back e.g. unconstrained text to a program that asked for a
    # regex. Numbers compare by value (0 == 0.0) but never against booleans.
    UNSUPPORTED: ClassVar[dict[str, tuple[tuple[Any, ...], str]]] = {
        "ebnf": ((), "context-free grammars: a diffusion LM fills positions out of order, which needs a grammar "
                     "engine that decides whether a partial, out-of-order assignment can still be completed; use "
                     "regex or json_schema"),
        "structural_tag": ((), "structural tags (tool-call grammars); use regex or json_schema"),
        "stop_regex": (([],), "stop strings are matched literally; use stop"),
        "custom_params": (({},), "custom logit processors"),
        "no_stop_trim": ((False,), "a matched stop string is always trimmed from the text"),
        "spaces_between_special_tokens": ((True,), "the spacing of special tokens in the text is fixed"),
        "stream_interval": ((), "a stream sends one chunk per finished block"),
    }

    @classmethod
    def check_supported(cls, key: str, value: Any) -> None:
        """Raise ValueError naming ``key`` unless ``value`` asks for nothing (null or the no-op
        default) of a key in :attr:`UNSUPPORTED`. Keys outside that table pass."""
        if value is None or key not in cls.UNSUPPORTED:
            return
        noops, what = cls.UNSUPPORTED[key]
        for d in noops:
            if isinstance(value, bool) == isinstance(d, bool) and value == d:
                return
        allowed = "remove the field or set it to null" + "".join(f" or {json.dumps(d)}" for d in noops)
        raise ValueError(f"{key} is not supported yet ({what}): {allowed}")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "SamplingParams":
        """Build from an SGLang-style ``sampling_params`` dict. Raises ValueError naming the key on a
        bad value, an unknown key, or a non-default value of a key in :attr:`UNSUPPORTED`."""
        if d is None:
            return cls()
        if not isinstance(d, Mapping):
            raise ValueError("sampling_params must be a JSON object")
        names = {f.name for f in dataclasses.fields(cls)}
        kw: dict[str, Any] = {}
        remasking = d.get("remasking")
        if remasking is not None:
            if remasking not in REMASKING:
                raise ValueError(f"remasking must be one of {REMASKING}, got {remasking!r}")
            if d.get("dllm_algorithm") is None:
                kw["dllm_algorithm"] = remasking
        for wire, knob in WIRE_NAMES.items():
            if d.get(wire) is not None and d.get(knob) is not None:
                raise ValueError(f"{wire} and {knob} are one setting: send one of them")
        for sent, v in d.items():
            if sent == "remasking":
                continue
            k = cls._ALIASES.get(sent, sent)
            if v is None:  # null always means "the default", for every key
                continue
            if k in cls.UNSUPPORTED:
                cls.check_supported(k, v)
                continue
            if k not in names:
                raise ValueError(f"{k} is not a sampling parameter: it is neither in SGLang's sampling-params schema "
                                 "nor one of this server's diffusion parameters (see docs/server.md)")
            if k == "stop":
                v = (v,) if isinstance(v, str) else tuple(v) if isinstance(v, (list, tuple)) else v
                if not isinstance(v, tuple):
                    raise ValueError("stop must be a string or a list of strings")
            elif k == "stop_token_ids":
                if not isinstance(v, (list, tuple)):
                    raise ValueError("stop_token_ids must be a list of integers")
                v = tuple(v)
            elif k == "logit_bias":
                v = _parse_logit_bias(v)
            elif k == "regex":
                if not isinstance(v, str):
                    raise ValueError(f"regex must be a string, got {type(v).__name__}")
            elif k == "json_schema":
                v = _schema_text(v)
            elif k == "dllm_algorithm":
                v = canonical_algorithm(v)
            elif _field_kinds(cls)[k] is float:
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise ValueError(f"{sent} must be a number, got {v!r}")
                v = float(v)
            elif _field_kinds(cls)[k] is int:
                if isinstance(v, float) and v.is_integer():
                    v = int(v)
                if isinstance(v, bool) or not isinstance(v, int):
                    raise ValueError(f"{sent} must be an integer, got {v!r}")
            elif _field_kinds(cls)[k] is bool and not isinstance(v, bool):
                raise ValueError(f"{sent} must be a boolean, got {v!r}")
            kw[k] = v
        return cls(**kw)

    def replace(self, **kw: Any) -> "SamplingParams":
        return dataclasses.replace(self, **kw)


@functools.cache
def _field_kinds(cls: type) -> dict[str, type | None]:
    """Field -> int, float or bool where its annotation is that scalar (``X | None`` too), else
    None: what :meth:`SamplingParams.from_dict` coerces and checks a JSON value as, read from the
    declaration rather than kept in a list beside it."""
    hints = typing.get_type_hints(cls)
    out: dict[str, type | None] = {}
    for f in dataclasses.fields(cls):
        args = [a for a in typing.get_args(hints[f.name]) if a is not type(None)] or [hints[f.name]]
        out[f.name] = args[0] if len(args) == 1 and args[0] in (int, float, bool) else None
    return out


def parse_threshold(value: str) -> float | None:
    """``--threshold``: a number in [0, 1], or none/off/null (the fixed step schedule)."""
    if str(value).lower() in ("none", "off", "null"):
        return None
    try:
        v = float(value)
    except ValueError:
        raise ValueError(f"threshold must be a number in [0, 1] or 'none', got {value!r}") from None
    if not 0 <= v <= 1:
        raise ValueError(f"threshold must be in [0, 1], got {value!r}")
    return v


def parse_prefix_cache(value: str) -> str:
    """``--prefix-cache``: the mode as given, once :func:`parse_prefix_cache_mode` accepts it."""
    parse_prefix_cache_mode(value)
    return value


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmM]i?)?\s*$")
_SIZE_UNITS = {"": 1, "k": 1000, "K": 1000, "ki": 1024, "Ki": 1024, "m": 1000**2, "M": 1000**2,
               "mi": 1024**2, "Mi": 1024**2}


def parse_context_length(value: str) -> int:
    """``4096``, ``32k`` (x1000), ``1Ki`` (x1024), ``1M``/``1Mi``."""
    m = _SIZE_RE.match(str(value))
    mult = _SIZE_UNITS.get(m.group(2) or "") if m else None
    if mult is None:
        raise ValueError(f"invalid context length {value!r}")
    return int(float(m.group(1)) * mult)


@dataclass(frozen=True)
class DecodeDefaults:
    """Engine-wide defaults for the diffusion knobs of SamplingParams (a request's value wins)."""

    block_length: int = option(32, "Tokens per semi-autoregressive block.")
    steps_per_block: int | None = option(
        None, "Denoising steps per block (default: the checkpoint's generation_config.json steps, else one per "
              "token, or fewer with --threshold).")
    threshold: float | None = option(
        0.9, "Confidence threshold for parallel unmasking (Fast-dLLM); 'none' = fixed schedule.",
        parse=parse_threshold)
    cache_mode: str = option("dual", "In-request KV cache: none | prefix | dual (Fast-dLLM).", choices=CACHE_MODES)
    refresh_interval: int = option(0, "Steps between in-request cache refreshes (0 = at block starts only).")
    step_rows: str = option(
        "block", "Rows a dual-cache block step computes: 'block' = every position of the block (exact Fast-dLLM "
                 "dual cache); 'active' = only the positions still masked plus those unmasked by the previous "
                 "forward, whose K/V are then kept (fewer rows per step, approximate; docs/performance.md).",
        choices=STEP_ROWS)
    # None below: the checkpoint's generation_config.json value, else the built-in (low_confidence,
    # DEFAULT_EPS, 0); resolved per request in decoding/plan.py (DecodePlan.resolve)
    dllm_algorithm: str | None = option(
        None, f"Unmasking algorithm (any case; SGLang's LowConfidence = low_confidence, JointThreshold = "
              f"joint_threshold). LLaDA, LLaDA-MoE and Dream: {', '.join(BIDIRECTIONAL_ALGORITHMS)}; default: the "
              "checkpoint's generation_config.json 'alg', else low_confidence; requests override it with "
              "sampling_params.dllm_algorithm. LLaDA2.x: low_confidence (LLaDA2.0's threshold rule) or "
              "joint_threshold (LLaDA2.1's token editing); SDAR: low_confidence (its low_confidence_dynamic); "
              "default: joint_threshold when the checkpoint's generation_config.json sets an edit threshold, "
              "else low_confidence (docs/block_diffusion.md, section 5).")
    dllm_algorithm_config: str | None = option(
        None, "SGLang's algorithm config: a YAML or JSON file of the chosen --dllm-algorithm's parameters "
              "(LowConfidence: threshold, block_size; JointThreshold: threshold, edit_threshold, "
              "max_post_edit_steps, penalty_lambda (0 only), block_size). block_size must be the model's block "
              "length. Block-diffusion families (LLaDA2.x, SDAR) only; the other families take --threshold and "
              "--block-length.")
    dllm_eps: float | None = option(
        None, f"Dream's schedule: the last timestep (default: generation_config.json, else {DEFAULT_EPS:g}).")
    dllm_alg_temp: float | None = option(
        None, "Dream's algorithms: sample the positions to unmask with softmax(confidence / T) instead of taking "
              "the most confident (default: generation_config.json, else 0).")

    def __post_init__(self) -> None:
        check_decode_knobs(self, required=("block_length", "cache_mode", "refresh_interval", "step_rows"))
        check(self.dllm_algorithm_config is None or (isinstance(self.dllm_algorithm_config, str)
                                                     and self.dllm_algorithm_config != ""),
              f"dllm_algorithm_config must be a file path, got {self.dllm_algorithm_config!r}")
        check(self.step_rows == "block" or self.cache_mode == "dual",
              f"step_rows {self.step_rows!r} needs cache_mode 'dual' (got {self.cache_mode!r})")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to load a model and run requests. Each field is also a flag of
    ``bicache-sgl-server`` (bicache_sgl/flags.py builds them from the help strings below)."""

    model_path: str | None = option(None, "Model folder (LLaDA/Dream checkpoint). Omit for the bundled default "
                                          "model.", flags=("--model-path", "--model"))
    tokenizer_path: str | None = option(None, "Tokenizer folder (default: the model path).")
    dtype: str = option("auto", "Weights' dtype: auto (the checkpoint's on CUDA, float32 on CPU) or a torch "
                                "dtype name.", choices=DTYPES)
    device: str = option("auto", "auto | cpu | cuda | cuda:N (auto: cuda when available, else cpu).")
    # the names are the attention registry's (bicache_sgl/attention); the server lists them in --help
    attention_backend: str = option("torch", "Attention kernels, by name in the attention registry.")
    max_running_requests: int = option(16, "Requests decoded together in one batched forward.")
    max_queued_requests: int | None = option(
        None, "Waiting requests beyond this are refused with 503 (default: unbounded).")
    context_length: int | None = option(
        None, "Maximum prompt + generation length (default: from the model config). Accepts 32k, 1Ki.",
        parse=parse_context_length)
    # prefix cache (bicache)
    prefix_cache: str = option("bicache", "Shared-prefix KV cache: off | naive | bicache | fixed:N (N leading "
                                          "layers).", parse=parse_prefix_cache)
    max_prefix_cache_tokens: int | None = option(
        None, "Token budget of the shared prefix pool (LRU eviction beyond it; default: derived from memory).")
    max_total_tokens: int | None = option(
        None, "Budget of K/V positions over all running requests; requests wait for room (default: derived from "
              "memory).")
    mem_fraction_static: float | None = option(
        None, "Fraction of the free GPU memory for the prefix pool (CUDA; default: kv_cache/memory.py's).")
    bicache_profile: str | None = option(
        None, "The r -> depth profile for bicache: a JSON file, 'auto' (calibrate at start-up within "
              "--calibration-budget-s and cache the result on disk, keyed by the checkpoint), or 'none' (no "
              "profile: depth 0 until the audit's probes earn more, --bicache-audit-probe-rate). Default: "
              "bicache_profile.json beside the model, else auto.")
    calibration_budget_s: float = option(
        40.0, "Wall-clock budget of the start-up calibration ('auto' profile); buckets not measured in time get "
              "depth 0.")
    calibration_data: str | None = option(
        None, "Prompts for the start-up calibration (the calibrate CLI's jsonl/txt formats); default: prompts "
              "synthesised from the tokenizer.")
    bicache_tolerance: float = option(
        0.0, "Tolerated rate of answers changed by bicache reuse: 0 (default) = exact, a depth is used only where "
             "calibration saw no answer differ from cache off; e.g. 0.02 = where the 95% upper bound on the rate "
             "of changed answers is at most 2% (the table is re-derived from an exact profile's per-bucket counts; "
             "docs/calibration.md).")
    bicache_span_cut: str = option(
        "segment", "Where a reused prefix span ends: 'segment' (default) at the last segment boundary (an end-of-turn "
                   "token, a blank line) at or before the point where the prompt leaves the one the rows were "
                   "captured in, so a divergent turn's opening tokens are recomputed; 'none' up to that point "
                   "(the rule before issue 38; for comparisons). docs/prefix_cache.md.", choices=("segment", "none"))
    bicache_audit_rate: float = option(
        0.02, "Fraction of prefix-reusing requests whose first forward is also run without reuse; a profile "
              "bucket whose reuse disagrees is lowered (0 turns the audit off).")
    bicache_audit_min_agreement: float = option(
        0.9, "Top-1 agreement at the masked positions below which the audit lowers a bucket.")
    bicache_audit_probation: int | None = option(
        None, "Consecutive agreeing audits a profile bucket needs before its depth is trusted; until then every "
              f"reusing request in it is audited and answered from its exact forward. Default: {DEFAULT_PROBATION} "
              "for a first-run (auto-calibrated) profile, 0 for a shipped or given one.")
    bicache_audit_probe_rate: float | None = option(
        None, "Fraction of the requests that could reuse prefix state that probe the next depth of their r-bucket "
              "(planned deeper than the bucket's depth, audited, answered from their exact forward); a bucket "
              "rises to a probed depth once its probes' 95% bound on the disagreement rate is at most "
              "--bicache-audit-raise-bound. 0 turns raising off. Default: "
              f"{DEFAULT_PROBE_RATE} without a profile or with a first-run one, 0 for a shipped or given one.")
    bicache_audit_raise_bound: float = option(
        0.05, "Promised disagreement rate a raise must be held to: a bucket rises to a probed depth once n probes "
              "at it all agreed and the one-sided 95% Clopper-Pearson bound on the rate (about 3/n) is at most "
              "this (0.05: 59 probes per depth; calibration's --max-bound).")
    # off by default: on this project's CPU numbers the extra forward costs more than the reuse it
    # buys (docs/prefix_cache.md, "Multi-turn: caching finished outputs")
    cache_output: bool = option(
        False, "Multi-turn reuse: insert each finished request's prompt + answer into the prefix cache (one extra "
               "prefill-only forward per request, its capture context exactly that conversation), so the next "
               "turn also reuses the answer. Off by default: see docs/prefix_cache.md for when it pays.")
    # flattened on the command line: each DecodeDefaults field is a flag of its own
    decode: DecodeDefaults = field(default_factory=DecodeDefaults)
    random_seed: int | None = option(None, "Seed of the engine's random draws for requests without a seed "
                                           "(unset: 0).")
    chat_template: str | None = option(
        None, "Chat template for /v1/chat/completions: a Jinja file, a Jinja string, or a built-in name (chatml, "
              "llama-3, default). Default: the tokenizer's template, else a plain one. (The server resolves it; "
              "the engine gets the template text.)")
    num_threads: int | None = option(
        None, "torch CPU threads of the engine (default: every CPU but one, at most torch's own default; "
              "OMP_NUM_THREADS, when set, is followed instead). The HTTP server process uses 1.")

    def __post_init__(self) -> None:
        check(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        for name in ("max_running_requests", "max_queued_requests", "context_length", "max_prefix_cache_tokens",
                     "max_total_tokens", "bicache_audit_probation", "num_threads"):
            v = getattr(self, name)
            lo = 0 if name in ("max_queued_requests", "max_prefix_cache_tokens", "bicache_audit_probation") else 1
            if v is not None or name == "max_running_requests":
                check(is_int(v) and v >= lo, f"{name} must be an integer >= {lo}, got {v!r}")
        check(self.random_seed is None or is_int(self.random_seed),
              f"random_seed must be an integer, got {self.random_seed!r}")
        parse_prefix_cache_mode(self.prefix_cache)
        check(_is_num(self.calibration_budget_s) and self.calibration_budget_s >= 0,
              f"calibration_budget_s must be >= 0, got {self.calibration_budget_s!r}")
        check(_is_num(self.bicache_tolerance) and 0 <= self.bicache_tolerance < 1,
              f"bicache_tolerance must be in [0, 1), got {self.bicache_tolerance!r}")
        check(self.bicache_span_cut in ("segment", "none"),
              f"bicache_span_cut must be 'segment' or 'none', got {self.bicache_span_cut!r}")
        check(_is_num(self.bicache_audit_rate) and 0 <= self.bicache_audit_rate <= 1,
              f"bicache_audit_rate must be in [0, 1], got {self.bicache_audit_rate!r}")
        check(_is_num(self.bicache_audit_min_agreement) and 0 <= self.bicache_audit_min_agreement <= 1,
              f"bicache_audit_min_agreement must be in [0, 1], got {self.bicache_audit_min_agreement!r}")
        check(self.bicache_audit_probe_rate is None
              or (_is_num(self.bicache_audit_probe_rate) and 0 <= self.bicache_audit_probe_rate <= 1),
              f"bicache_audit_probe_rate must be in [0, 1], got {self.bicache_audit_probe_rate!r}")
        check(_is_num(self.bicache_audit_raise_bound) and 0 < self.bicache_audit_raise_bound < 1,
              f"bicache_audit_raise_bound must be in (0, 1), got {self.bicache_audit_raise_bound!r}")
        check(self.mem_fraction_static is None or (_is_num(self.mem_fraction_static)
                                                    and 0 < self.mem_fraction_static < 1),
               f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static!r}")
        check(isinstance(self.decode, DecodeDefaults), "decode must be a DecodeDefaults")

    @property
    def seed(self) -> int:
        """The engine's base seed (``random_seed``, unset: 0)."""
        return 0 if self.random_seed is None else self.random_seed

    @property
    def prefix_cache_kind(self) -> tuple[str, int | None]:
        return parse_prefix_cache_mode(self.prefix_cache)

    def replace(self, **kw: Any) -> "EngineConfig":
        return dataclasses.replace(self, **kw)


