"""Which request fields this server implements, and which it refuses.

The rule (docs/server.md, "Parameters"): every field of SGLang's and OpenAI's request schemas is
either implemented, accepted as pure metadata, or refused with a 400 that names it. A refused
field is still accepted when its value asks for nothing (``null`` or the schema's no-op default),
because clients send those defaults on every call. Nothing is accepted and then ignored.

This module imports nothing from the rest of the server; callers turn :class:`FieldError` into
their error answer.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from bicache_sgl.config import SamplingParams


class FieldError(ValueError):
    """A request field that is unknown or asks for something not implemented."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Refused:
    """A field this server does not implement. ``noops``: values that ask for nothing;
    ``ok``: a predicate for no-op values that a list cannot express (e.g. ``tool_choice:
    "auto"`` without tools); ``why``: what the field would need."""

    why: str
    noops: tuple[Any, ...] = ()
    ok: Callable[[Any, Mapping[str, Any]], bool] | None = None


def _same(value: Any, noop: Any) -> bool:
    # 0 == 0.0, but False is not 0 and True is not 1
    return isinstance(value, bool) == isinstance(noop, bool) and value == noop


def check_refused(name: str, value: Any, spec: Refused, body: Mapping[str, Any], where: str = "") -> None:
    """Raise FieldError unless ``value`` asks for nothing."""
    if value is None or any(_same(value, d) for d in spec.noops):
        return
    if spec.ok is not None and spec.ok(value, body):
        return
    shown = "".join(f" or {json.dumps(d)}" for d in spec.noops)
    raise FieldError(where + name,
                     f"{where}{name} is not supported ({spec.why}): remove the field or set it to null{shown}")


def check_body(body: Mapping[str, Any], implemented: frozenset[str], metadata: frozenset[str],
               refused: Mapping[str, Refused], *, unknown: str, where: str = "") -> None:
    """Check every key of ``body``: implemented and metadata keys pass, refused keys pass only
    with a no-op value, and an unknown key raises (``unknown="refuse"``) or passes
    (``unknown="ignore"``)."""
    for key, value in body.items():
        if key in implemented or key in metadata:
            continue
        spec = refused.get(key)
        if spec is not None:
            check_refused(key, value, spec, body, where)
        elif unknown == "refuse":
            raise FieldError(where + key, f"{where}{key} is not a field of this API; remove it (docs/server.md lists "
                                          "the fields this server implements)")


def _none_or_all_none(value: Any, body: Mapping[str, Any]) -> bool:
    return isinstance(value, list) and all(v is None for v in value)


def _no_adapter(value: Any, body: Mapping[str, Any]) -> bool:
    """SGLang's "no adapter": None or "" (some clients send "" on every request), or a list of them."""
    items = value if isinstance(value, list) else [value]
    return all(v is None or v == "" for v in items)


def _empty_list(value: Any, body: Mapping[str, Any]) -> bool:
    return value == []


def _only_text(value: Any, body: Mapping[str, Any]) -> bool:
    return value == [] or value == ["text"]


# ---------------------------------------------------------------------------------------------
# native /generate: top-level keys of SGLang's GenerateReqInput (sampling_params is checked by
# SamplingParams.from_dict). Unknown top-level keys are ignored: SGLang's own clients add new
# metadata keys from version to version (lora_path, sampling_seed, return_routed_experts ...).
# ---------------------------------------------------------------------------------------------

GENERATE_IMPLEMENTED = frozenset({
    "text", "input_ids", "sampling_params", "rid", "return_logprob", "logprob_start_len", "top_logprobs_num",
    "return_text_in_logprobs", "stream", "log_metrics", "bicache_depth",
})
GENERATE_METADATA = frozenset({"conversation_id", "label"})
_MULTIMODAL = "this server serves a text-only model"
_PD = "prefill/decode disaggregation"
GENERATE_REFUSED: dict[str, Refused] = {
    "input_embeds": Refused("prompts are token ids or text, not embeddings"),
    "image_data": Refused(_MULTIMODAL, ([],), _none_or_all_none),
    "video_data": Refused(_MULTIMODAL, ([],), _none_or_all_none),
    "audio_data": Refused(_MULTIMODAL, ([],), _none_or_all_none),
    "modalities": Refused(_MULTIMODAL, ([],), _only_text),
    "token_ids_logprob": Refused("logprobs of chosen token ids; use top_logprobs_num"),
    "return_hidden_states": Refused("hidden states are not returned", (False,)),
    "return_routed_experts": Refused("the models served here have no experts", (False,)),
    "return_bytes": Refused("text is returned as a string", (False,)),
    "session_params": Refused("sessions"),
    "lora_path": Refused("LoRA adapters", (), _no_adapter),
    "lora_id": Refused("LoRA adapters", (), _no_adapter),
    "custom_logit_processor": Refused("custom logit processors"),
    "bootstrap_host": Refused(_PD),
    "bootstrap_port": Refused(_PD),
    "bootstrap_room": Refused(_PD),
    "bootstrap_pair_key": Refused(_PD),
    "data_parallel_rank": Refused("data parallelism; there is one rank", (0,)),
    "background": Refused("background requests", (False,)),
    "priority": Refused("priority scheduling"),
    "sampling_seed": Refused("a top-level seed; set sampling_params.seed instead"),
}


def check_generate_body(body: Mapping[str, Any]) -> None:
    """Top-level keys of a /generate body (see the tables above)."""
    check_body(body, GENERATE_IMPLEMENTED, GENERATE_METADATA, GENERATE_REFUSED, unknown="ignore")


# ---------------------------------------------------------------------------------------------
# OpenAI /v1/completions and /v1/chat/completions: OpenAI's request schema plus SGLang's extras.
# Unknown keys are refused, as OpenAI's own API does.
# ---------------------------------------------------------------------------------------------

# passed into sampling_params as they are (SGLang extras and the diffusion knobs)
SAMPLING_PASSTHROUGH = ("temperature", "top_p", "top_k", "stop", "stop_token_ids", "ignore_eos",
                        "skip_special_tokens", "seed", "n", "block_length", "steps", "steps_per_block", "threshold",
                        "remasking", "cfg_scale", "cache_mode", "refresh_interval", "step_rows",
                        # the unmasking algorithm and Dream's knobs (docs/server.md, "Dream's algorithms")
                        "dllm_algorithm", "eps", "alg_temp",
                        # penalties, min-p, logit bias and constraints (docs/server.md, docs/structured.md)
                        "frequency_penalty", "presence_penalty", "repetition_penalty", "min_p", "logit_bias",
                        "regex", "json_schema")

# response_format is turned into sampling_params.json_schema by the OpenAI routes
# (openai_common.response_format_schema)
_COMMON_IMPLEMENTED = frozenset({"model", "max_tokens", "min_tokens", "stream", "stream_options", "logprobs",
                                 "response_format", *SAMPLING_PASSTHROUGH})
COMPLETION_IMPLEMENTED = _COMMON_IMPLEMENTED | {"prompt", "echo"}
CHAT_IMPLEMENTED = _COMMON_IMPLEMENTED | {"messages", "max_completion_tokens", "top_logprobs",
                                          "continue_final_message", "chat_template_kwargs",
                                          # without a reasoning parser there is nothing to separate:
                                          # the whole text is the content, which is what both
                                          # values of these flags give then (as in SGLang)
                                          "separate_reasoning", "stream_reasoning",
                                          # tool calls through constrained decoding (openai_tools.py)
                                          "tools", "tool_choice", "parallel_tool_calls"}
# identify the caller; they change nothing in the answer, by design
COMPLETION_METADATA = frozenset({"user"})
CHAT_METADATA = frozenset({"user", "metadata", "safety_identifier", "prompt_cache_key"})


def _sampling_refused(key: str) -> Refused:
    noops, why = SamplingParams.UNSUPPORTED[key]
    return Refused(why, noops)


def _no_tools(body: Mapping[str, Any]) -> bool:
    return not body.get("tools") and not body.get("functions")


# Fields that newer SGLang releases and vLLM-style clients (guidellm, litellm, vLLM's own
# benchmark scripts) send that this server does not implement: each refused with why, and
# accepted when its value asks for nothing (the defaults those clients send).
_GUIDED = "vLLM's guided-decoding fields; send response_format (json_schema), regex or json_schema"
_DP = "routing to a data-parallel rank; with --dp-size the router picks the worker"
_CACHE_KEY = "prefix-cache partitioning; every request shares one prefix cache"
_CLIENT_EXTRAS_REFUSED: dict[str, Refused] = {
    # SGLang (newer than the pinned 0.5.2)
    "return_routed_experts": Refused("the models served here have no experts", (False,)),
    "routed_experts_start_len": Refused("the models served here have no experts", (0,)),
    "return_cached_tokens_details": Refused("per-source cached-token details; there is one device cache "
                                            "(/generate's meta_info has cached_tokens)", (False,)),
    "return_token_ids": Refused("token ids in OpenAI answers; /generate returns output_ids", (False,)),
    "return_prompt_token_ids": Refused("token ids in OpenAI answers; /generate returns them", (False,)),
    "return_meta_info": Refused("meta_info in OpenAI answers; /generate returns it", (False,)),
    "stop_regex": Refused("stop strings are matched literally; use stop", ([], "")),
    "session_id": Refused("sessions"),
    "custom_params": Refused("custom logit processors", ({},)),
    "custom_logit_processor": Refused("custom logit processors"),
    "images_config": Refused(_MULTIMODAL),
    "max_dynamic_patch": Refused(_MULTIMODAL),
    "min_dynamic_patch": Refused(_MULTIMODAL),
    "use_audio_in_video": Refused(_MULTIMODAL, (False,)),
    "routed_dp_rank": Refused(_DP),
    "data_parallel_rank": Refused(_DP),
    "disagg_prefill_dp_rank": Refused(_PD),
    "extra_key": Refused(_CACHE_KEY),
    "cache_salt": Refused(_CACHE_KEY),
    "ngram_corpus_id": Refused("n-gram speculative decoding"),
    "priority": Refused("priority scheduling", (0,)),
    "custom_labels": Refused("custom metric labels"),
    # vLLM's extensions
    "include_stop_str_in_output": Refused("a matched stop string is always trimmed from the text", (False,)),
    "guided_json": Refused(_GUIDED),
    "guided_regex": Refused(_GUIDED),
    "guided_choice": Refused(_GUIDED),
    "guided_grammar": Refused(_GUIDED),
    "guided_decoding_backend": Refused(_GUIDED),
    "structured_outputs": Refused(_GUIDED),
    "prompt_logprobs": Refused("prompt logprobs; use /v1/completions with echo and logprobs", (0,)),
    "truncate_prompt_tokens": Refused("prompt truncation; a prompt must fit the context"),
    "use_beam_search": Refused("beam search", (False,)),
    "length_penalty": Refused("beam search", (1,)),
    "allowed_token_ids": Refused("token allow-lists; use logit_bias"),
    "bad_words": Refused("banned words; use logit_bias", ([],)),
    "return_tokens_as_token_ids": Refused("token ids as logprob tokens", (False,)),
    "logits_processors": Refused("custom logit processors"),
    "prompt_embeds": Refused("prompts are token ids or text, not embeddings"),
    "mm_processor_kwargs": Refused(_MULTIMODAL),
    "kv_transfer_params": Refused(_PD),
    "vllm_xargs": Refused("vLLM's extension arguments"),
    "request_id": Refused("caller-chosen request ids on /v1 routes; use /generate"),
}
_COMMON_REFUSED: dict[str, Refused] = {
    **_CLIENT_EXTRAS_REFUSED,
    **{k: _sampling_refused(k) for k in ("ebnf", "structural_tag", "no_stop_trim", "spaces_between_special_tokens")},
    "lora_path": Refused("LoRA adapters", (), _no_adapter),
    "session_params": Refused("sessions"),
    "return_hidden_states": Refused("hidden states are not returned", (False,)),
    "rid": Refused("caller-chosen request ids on /v1 routes; use /generate"),
    "bootstrap_host": Refused(_PD),
    "bootstrap_port": Refused(_PD),
    "bootstrap_room": Refused(_PD),
}
COMPLETION_REFUSED: dict[str, Refused] = {
    **_COMMON_REFUSED,
    "best_of": Refused("server-side best-of sampling; use n", (1,)),
    "suffix": Refused("insertion (suffix) prompts", ("",)),
}
CHAT_REFUSED: dict[str, Refused] = {
    **_COMMON_REFUSED,
    "input_ids": Refused("pre-tokenized chat prompts; send messages, or token ids to /v1/completions"),
    "task": Refused("DeepSeek-V4 quick-instruction tasks"),
    "echo": Refused("echoing the prompt in chat; use /v1/completions with echo", (False,)),
    "add_generation_prompt": Refused("the generation prompt follows continue_final_message (false: added)",
                                     (True,)),
    "chat_template": Refused("per-request chat templates; start the server with --chat-template"),
    "documents": Refused("retrieval documents in the chat template"),
    # OpenAI's deprecated function-calling fields: tools and tool_choice are implemented instead
    "functions": Refused("the deprecated functions API; send tools and tool_choice", ([],)),
    "function_call": Refused("the deprecated functions API; send tools and tool_choice", ("none",),
                             lambda v, body: v == "auto" and _no_tools(body)),
    "audio": Refused("audio output; this server serves a text-only model"),
    "modalities": Refused("this server serves a text-only model", ([],), _only_text),
    "prediction": Refused("predicted outputs"),
    "reasoning_effort": Refused("reasoning models"),
    "reasoning": Refused("reasoning models"),
    "verbosity": Refused("verbosity control"),
    "web_search_options": Refused("web search"),
    "store": Refused("storing completions", (False,)),
    "service_tier": Refused("service tiers; there is one", ("auto", "default")),
    "moderation": Refused("moderation"),
    "prompt_cache_retention": Refused("prompt cache retention; the prefix cache evicts by LRU"),
    "prompt_cache_options": Refused("prompt cache options; the prefix cache is automatic"),
}


def check_completion_body(body: Mapping[str, Any]) -> None:
    check_body(body, COMPLETION_IMPLEMENTED, COMPLETION_METADATA, COMPLETION_REFUSED, unknown="refuse")


def check_chat_body(body: Mapping[str, Any]) -> None:
    check_body(body, CHAT_IMPLEMENTED, CHAT_METADATA, CHAT_REFUSED, unknown="refuse")


# continuous_usage_stats: vLLM's extension, implemented by SGLang (usage on every chunk)
STREAM_OPTIONS_IMPLEMENTED = frozenset({"include_usage", "continuous_usage_stats"})
STREAM_OPTIONS_REFUSED: dict[str, Refused] = {
    "include_obfuscation": Refused("stream obfuscation padding", (False,)),
}


def check_stream_options(so: Mapping[str, Any]) -> None:
    check_body(so, STREAM_OPTIONS_IMPLEMENTED, frozenset(), STREAM_OPTIONS_REFUSED, unknown="refuse",
               where="stream_options.")
