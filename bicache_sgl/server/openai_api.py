"""OpenAI-compatible routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``.

They reuse the native request machinery (:class:`~bicache_sgl.server.protocol.Item`,
:class:`~bicache_sgl.server.bridge.Submission`); only the request and response shapes differ.
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from bicache_sgl.server.chat import normalize_messages, render_chat
from bicache_sgl.server.protocol import (APIError, Item, LogprobOptions, check_batch_size, check_length,
                                         check_token_ids, is_int, parse_json_body, require_object,
                                         sampling_params_from)

# request keys copied into sampling_params as they are (SGLang extras and diffusion knobs)
_PASSTHROUGH = ("temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "ignore_eos",
                "skip_special_tokens", "seed", "n", "frequency_penalty", "presence_penalty", "repetition_penalty",
                "regex", "json_schema", "ebnf", "no_stop_trim", "spaces_between_special_tokens",
                "block_length", "steps", "steps_per_block", "threshold", "remasking", "cfg_scale", "cache_mode",
                "refresh_interval")
MAX_TOP_LOGPROBS = 20


def _finish(fr: Any) -> tuple[str | None, Any]:
    """SGLang finish_reason dict -> (OpenAI finish_reason, matched_stop)."""
    if not isinstance(fr, dict):
        return None, None
    kind = fr.get("type")
    if kind == "stop":
        return "stop", fr.get("matched")
    if kind == "length":
        return "length", None
    return kind, None


def register_openai_routes(app: FastAPI, state: Any) -> None:
    from bicache_sgl.server.app import ORJSONResponse, SSE_DONE, sse, stream_text

    def model_card() -> dict[str, Any]:
        return {"id": state.served_model_name, "object": "model", "created": state.created, "owned_by": "sglang",
                "root": state.served_model_name, "parent": None, "max_model_len": state.context_length}

    def known_names() -> set[str]:
        names = {state.served_model_name, state.model_path, "default"}
        if state.model_path:
            names.add(os.path.basename(os.path.normpath(state.model_path)))
        return {n for n in names if n}

    def check_model(name: Any) -> None:
        if name is None or name == "":
            return
        if not isinstance(name, str):
            raise APIError("model must be a string", param="model")
        if name not in known_names():
            raise APIError(f"The model '{name}' does not exist; this server serves '{state.served_model_name}'.",
                           status=404, err_type="invalid_request_error", code="model_not_found", param="model")

    @app.get("/v1/models")
    async def list_models():
        return ORJSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        check_model(model_id)
        return ORJSONResponse(model_card())

    # -- shared helpers -------------------------------------------------------------------
    def sampling_dict(body: dict, max_key_value: Any, default_max: int | None) -> dict[str, Any]:
        sp: dict[str, Any] = {}
        for k in _PASSTHROUGH:
            if body.get(k) is not None:
                sp[k] = body[k]
        if max_key_value is not None:
            sp["max_new_tokens"] = max_key_value
        elif default_max is not None:
            sp["max_new_tokens"] = default_max
        if body.get("min_tokens") is not None:
            sp["min_new_tokens"] = body["min_tokens"]
        return sp

    def make_items(id_lists: list[list[int]], sp: dict, explicit_max: bool, lp: LogprobOptions) -> list[Item]:
        params, explicit = sampling_params_from(sp, state.default_sampling, max_n=state.args.max_n)
        explicit = explicit_max
        check_batch_size(len(id_lists) * params.n, state.args.max_batch_size,
                         "sequences (prompts x n)" if params.n > 1 else "prompts")
        items = []
        for pi, ids in enumerate(id_lists):
            p = check_length(len(ids), params, explicit, state.context_length, state.args.block_length)
            n = p.n
            base = p.replace(n=1) if n > 1 else p
            for j in range(n):
                items.append(Item(input_ids=list(ids), params=base, logprob=lp, prompt_index=pi, sample_index=j))
        return items

    def check_logprob_count(v: Any, name: str) -> int:
        if not is_int(v) or v < 0 or v > MAX_TOP_LOGPROBS:
            raise APIError(f"{name} must be an integer in [0, {MAX_TOP_LOGPROBS}], got {v!r}", param=name)
        return v

    def check_bool(body: dict, key: str) -> bool:
        v = body.get(key)
        if v is None:
            return False
        if not isinstance(v, bool):
            raise APIError(f"{key} must be a boolean, got {v!r}", param=key)
        return v

    def include_usage(body: dict) -> bool:
        so = body.get("stream_options")
        if so is None:
            return False
        if not isinstance(so, dict):
            raise APIError("stream_options must be an object", param="stream_options")
        return bool(so.get("include_usage"))

    def usage(items: list[Item], finals: list[Any]) -> dict[str, int]:
        seen: set[int] = set()
        prompt = 0
        for it in items:
            if it.prompt_index not in seen:
                seen.add(it.prompt_index)
                prompt += len(it.input_ids)
        completion = sum(len(f.output_ids or []) for f in finals if f is not None)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def token_text(entry: list) -> str:
        t = entry[2] if len(entry) > 2 else None
        return t if isinstance(t, str) else state.decode_token(int(entry[1]))

    def completion_logprobs(entries: list, tops: list | None, offset0: int) -> dict[str, Any]:
        tokens, lps, top_out, offsets = [], [], [], []
        off = offset0
        for k, e in enumerate(entries):
            t = token_text(e)
            tokens.append(t)
            lps.append(e[0])
            offsets.append(off)
            off += len(t)
            top = tops[k] if tops is not None and k < len(tops) else None
            top_out.append({token_text(x): x[0] for x in top} if top else None)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": top_out, "text_offset": offsets}

    def chat_logprobs(entries: list, tops: list | None) -> dict[str, Any]:
        content = []
        for k, e in enumerate(entries):
            t = token_text(e)
            top = tops[k] if tops is not None and k < len(tops) else None
            content.append({
                "token": t, "bytes": list(t.encode("utf-8")), "logprob": e[0],
                "top_logprobs": [{"token": token_text(x), "bytes": list(token_text(x).encode("utf-8")),
                                  "logprob": x[0]} for x in (top or [])],
            })
        return {"content": content}

    def meta_of(ev: Any) -> dict:
        return dict(getattr(ev, "meta_info", None) or {})

    async def collect(sub, request: Request) -> list[Any] | None:
        finals: list[Any] = [None] * len(sub.items)
        async for i, ev in sub.events(request.is_disconnected):
            if ev.finished:
                finals[i] = ev
        if any(f is None for f in finals):
            return None
        for f in finals:
            if getattr(f, "error", None):
                raise APIError(f"generation failed: {f.error}", status=500, err_type="InternalServerError")
        state.check_not_aborted_by_shutdown(finals)
        return finals

    def stream_error(ev: Any) -> bytes:
        return sse({"error": {"message": str(ev.error), "type": "InternalServerError", "code": 500}})

    # -- /v1/completions --------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(request: Request):
        body = require_object(parse_json_body(await request.body()))
        check_model(body.get("model"))
        prompt = body.get("prompt")
        prompt_texts: list[str | None]
        if isinstance(prompt, str):
            if not prompt:
                raise APIError("prompt is empty", param="prompt")
            prompt_texts = [prompt]
            id_lists = [state.tokenize(prompt)]
        elif isinstance(prompt, list) and prompt:
            if not all(is_int(p) for p in prompt):  # a list of prompts: bounded before tokenizing
                check_batch_size(len(prompt), state.args.max_batch_size)
            if all(isinstance(p, str) for p in prompt):
                if any(p == "" for p in prompt):
                    raise APIError("prompt contains an empty string", param="prompt")
                prompt_texts = list(prompt)
                id_lists = [state.tokenize(p) for p in prompt]
            elif all(is_int(p) for p in prompt):
                id_lists = [check_token_ids(prompt, state.vocab_size, "prompt")]
                prompt_texts = [None]
            elif all(isinstance(p, list) for p in prompt):
                id_lists = [check_token_ids(p, state.vocab_size, "prompt") for p in prompt]
                prompt_texts = [None] * len(prompt)
            else:
                raise APIError("prompt must be a string, a list of strings, a list of token ids or a list of "
                               "lists of token ids", param="prompt")
        else:
            raise APIError("prompt must be a non-empty string or list", param="prompt")
        if any(not ids for ids in id_lists):
            raise APIError("the prompt tokenizes to nothing", param="prompt")
        if body.get("suffix"):
            raise APIError("suffix is not supported", param="suffix")
        max_tokens = body.get("max_tokens")
        if max_tokens is not None and (not is_int(max_tokens) or max_tokens < 0):
            raise APIError(f"max_tokens must be an integer >= 0, got {max_tokens!r}", param="max_tokens")
        echo = check_bool(body, "echo")
        stream = check_bool(body, "stream")
        logprobs = body.get("logprobs")
        if logprobs is not None:
            logprobs = check_logprob_count(logprobs, "logprobs")
        sp = sampling_dict(body, max_tokens, 16)
        lp = LogprobOptions(return_logprob=logprobs is not None,
                            logprob_start_len=0 if (echo and logprobs is not None) else -1,
                            top_logprobs_num=logprobs or 0, return_text_in_logprobs=logprobs is not None)
        items = make_items(id_lists, sp, True, lp)
        texts = [p if p is not None else state.tokenizer.decode(ids) for p, ids in zip(prompt_texts, id_lists)]
        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        model = state.served_model_name
        sub = state.new_submission(items)
        await sub.submit()

        def logprobs_for(item: Item, meta: dict, start_out: int, end_out: int | None, with_input: bool,
                         offset0: int):
            if logprobs is None:
                return None
            entries, tops = [], []
            if with_input:
                inp = meta.get("input_token_logprobs") or []
                entries += inp
                tops += (meta.get("input_top_logprobs") or [None] * len(inp))[:len(inp)]
            out = (meta.get("output_token_logprobs") or [])[start_out:end_out]
            out_tops = (meta.get("output_top_logprobs") or [None] * len(out))
            out_tops = out_tops[start_out:end_out] if meta.get("output_top_logprobs") else [None] * len(out)
            entries += out
            tops += out_tops
            return completion_logprobs(entries, tops, offset0)

        if not stream:
            finals = await collect(sub, request)
            if finals is None:
                return ORJSONResponse({}, status_code=499)
            choices = []
            for i, (item, ev) in enumerate(zip(items, finals)):
                meta = meta_of(ev)
                reason, matched = _finish(ev.finish_reason or meta.get("finish_reason"))
                prefix = texts[item.prompt_index] if echo else ""
                choices.append({"index": i, "text": prefix + (ev.text or ""),
                                "logprobs": logprobs_for(item, meta, 0, None, echo, 0),
                                "finish_reason": reason, "matched_stop": matched})
            return ORJSONResponse({"id": rid, "object": "text_completion", "created": created, "model": model,
                                   "choices": choices, "usage": usage(items, finals)})

        want_usage = include_usage(body)

        async def gen():
            sent = [0] * len(items)
            sent_lp = [0] * len(items)
            started = [False] * len(items)
            finals: list[Any] = [None] * len(items)
            async for i, ev in sub.events(request.is_disconnected):
                if getattr(ev, "error", None):
                    yield stream_error(ev)
                    continue
                item = items[i]
                text = stream_text(items[i], ev)
                delta = text[sent[i]:]
                first = not started[i]
                if echo and first:
                    delta = texts[item.prompt_index] + delta
                if not delta and not ev.finished:
                    continue
                meta = meta_of(ev)
                n_out = len(meta.get("output_token_logprobs") or [])
                lps = None
                if logprobs is not None and (n_out > sent_lp[i] or (echo and first) or ev.finished):
                    lps = logprobs_for(item, meta, sent_lp[i], None, echo and first, 0)
                    sent_lp[i] = n_out
                reason, matched = _finish(ev.finish_reason) if ev.finished else (None, None)
                sent[i] = len(text)
                started[i] = True
                if ev.finished:
                    finals[i] = ev
                yield sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                           "choices": [{"index": i, "text": delta, "logprobs": lps, "finish_reason": reason,
                                        "matched_stop": matched}], "usage": None})
            if sub.disconnected:
                return
            if want_usage and all(f is not None for f in finals):
                yield sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                           "choices": [], "usage": usage(items, finals)})
            yield SSE_DONE

        return StreamingResponse(gen(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    # -- /v1/chat/completions ---------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = require_object(parse_json_body(await request.body()))
        check_model(body.get("model"))
        messages = normalize_messages(body.get("messages"))
        cont = check_bool(body, "continue_final_message")
        kwargs = body.get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise APIError("chat_template_kwargs must be an object", param="chat_template_kwargs")
        prompt_text = render_chat(state.tokenizer, messages, state.chat_template, continue_final_message=cont,
                                  extra_kwargs=kwargs)
        ids = state.tokenize_rendered(prompt_text)
        if not ids:
            raise APIError("the rendered conversation is empty", param="messages")
        max_tokens = body.get("max_completion_tokens")
        if max_tokens is None:
            max_tokens = body.get("max_tokens")
        if max_tokens is not None and (not is_int(max_tokens) or max_tokens < 0):
            raise APIError(f"max_tokens must be an integer >= 0, got {max_tokens!r}", param="max_tokens")
        want_lp = check_bool(body, "logprobs")
        top = body.get("top_logprobs")
        top = 0 if top is None else check_logprob_count(top, "top_logprobs")
        if top and not want_lp:
            raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
        stream = check_bool(body, "stream")
        sp = sampling_dict(body, max_tokens, None)
        lp = LogprobOptions(return_logprob=want_lp, logprob_start_len=-1, top_logprobs_num=top,
                            return_text_in_logprobs=want_lp)
        items = make_items([ids], sp, max_tokens is not None, lp)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        model = state.served_model_name
        sub = state.new_submission(items)
        await sub.submit()

        def lp_for(meta: dict, start: int):
            if not want_lp:
                return None
            out = (meta.get("output_token_logprobs") or [])[start:]
            tops = meta.get("output_top_logprobs")
            tops = tops[start:] if tops else None
            return chat_logprobs(out, tops)

        if not stream:
            finals = await collect(sub, request)
            if finals is None:
                return ORJSONResponse({}, status_code=499)
            choices = []
            for i, ev in enumerate(finals):
                meta = meta_of(ev)
                reason, matched = _finish(ev.finish_reason or meta.get("finish_reason"))
                choices.append({"index": i,
                                "message": {"role": "assistant", "content": ev.text or "", "reasoning_content": None,
                                            "tool_calls": None},
                                "logprobs": lp_for(meta, 0), "finish_reason": reason, "matched_stop": matched})
            return ORJSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": model,
                                   "choices": choices, "usage": usage(items, finals)})

        want_usage = include_usage(body)

        def chunk(i: int, delta: dict, reason=None, matched=None, lps=None) -> bytes:
            return sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                        "choices": [{"index": i, "delta": delta, "logprobs": lps, "finish_reason": reason,
                                     "matched_stop": matched}], "usage": None})

        async def gen():
            sent = [0] * len(items)
            sent_lp = [0] * len(items)
            finals: list[Any] = [None] * len(items)
            for i in range(len(items)):
                yield chunk(i, {"role": "assistant", "content": ""})
            async for i, ev in sub.events(request.is_disconnected):
                if getattr(ev, "error", None):
                    yield stream_error(ev)
                    continue
                text = stream_text(items[i], ev)
                delta = text[sent[i]:]
                meta = meta_of(ev)
                n_out = len(meta.get("output_token_logprobs") or [])
                if delta or (want_lp and n_out > sent_lp[i]):
                    yield chunk(i, {"content": delta}, lps=lp_for(meta, sent_lp[i]))
                    sent[i] = len(text)
                    sent_lp[i] = max(sent_lp[i], n_out)
                if ev.finished:
                    finals[i] = ev
                    reason, matched = _finish(ev.finish_reason)
                    yield chunk(i, {}, reason, matched)
            if sub.disconnected:
                return
            if want_usage and all(f is not None for f in finals):
                yield sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                           "choices": [], "usage": usage(items, finals)})
            yield SSE_DONE

        return StreamingResponse(gen(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
