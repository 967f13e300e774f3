"""Rendering chat messages into a prompt for ``/v1/chat/completions``.

Order of preference: ``--chat-template`` (a Jinja file, a Jinja string or a built-in name),
then the tokenizer's own ``chat_template``, then a plain ``SYSTEM:/USER:/ASSISTANT:`` format
(the same roles SGLang's frontend uses for unknown models).
"""

from __future__ import annotations

import os
from typing import Any

from bicache_sgl.server.protocol import APIError

# Built-in Jinja templates, selectable by name with --chat-template.
BUILTIN_TEMPLATES = {
    "chatml": (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    "llama-3": (
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
        "{{ m['content'] }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    ),
    # plain roles, no special tokens: works with any tokenizer
    "default": (
        "{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
    ),
}
BUILTIN_TEMPLATES["llama3"] = BUILTIN_TEMPLATES["llama-3"]
BUILTIN_TEMPLATES["plain"] = BUILTIN_TEMPLATES["default"]

ROLES = ("system", "user", "assistant", "tool", "developer", "function")


def load_chat_template(spec: str | None) -> str | None:
    """``--chat-template`` value -> Jinja source (None: use the tokenizer's)."""
    if not spec:
        return None
    if spec in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[spec]
    if os.path.isfile(spec):
        with open(spec, encoding="utf-8") as f:
            text = f.read()
        if spec.endswith(".json"):
            import json

            data = json.loads(text)
            text = data.get("chat_template", data) if isinstance(data, dict) else data
            if not isinstance(text, str):
                raise ValueError(f"{spec}: no 'chat_template' string in this JSON file")
        return text
    if "{{" in spec or "{%" in spec:
        return spec
    raise ValueError(f"--chat-template {spec!r} is neither a file, a Jinja template nor one of "
                     f"{sorted(BUILTIN_TEMPLATES)}")


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Validate OpenAI messages; list-of-parts content is joined into one string."""
    if not isinstance(messages, list) or not messages:
        raise APIError("messages must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise APIError(f"messages[{i}] must be an object", param="messages")
        role = m.get("role")
        if role not in ROLES:
            raise APIError(f"messages[{i}].role must be one of {ROLES}, got {role!r}", param="messages")
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            parts = []
            for p in content:
                if isinstance(p, str):
                    parts.append(p)
                elif isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str):
                    parts.append(p["text"])
                elif isinstance(p, dict) and p.get("type") in ("image_url", "input_audio", "image", "audio"):
                    raise APIError("this server serves a text-only model; image and audio content is not supported",
                                   param="messages")
                else:
                    raise APIError(f"messages[{i}].content has an invalid part", param="messages")
            content = "".join(parts)
        elif not isinstance(content, str):
            raise APIError(f"messages[{i}].content must be a string or a list of text parts", param="messages")
        msg = {"role": role, "content": content}
        if role == "developer":
            msg["role"] = "system"
        # a tool-calling conversation: the assistant's calls and the tool results' ids go to the
        # chat template as they were sent (templates that render tools read these keys)
        for key in ("tool_calls", "tool_call_id", "name"):
            if m.get(key) is not None:
                msg[key] = m[key]
        out.append(msg)
    return out


def template_source(tokenizer: Any, template: str | None) -> str:
    """The Jinja source :func:`render_chat` uses: ``--chat-template``, the tokenizer's, the plain one."""
    tpl = template if template is not None else getattr(tokenizer, "chat_template", None)
    return tpl if isinstance(tpl, str) else BUILTIN_TEMPLATES["default"]


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], template: str | None, *,
                continue_final_message: bool = False, extra_kwargs: dict | None = None,
                tools: list[dict[str, Any]] | None = None) -> str:
    """Messages -> prompt text (special tokens included as text; tokenized without adding BOS).
    ``tools``: OpenAI tool objects, passed to the template as ``tools`` (Hugging Face's convention)."""
    add_gen = not continue_final_message
    if continue_final_message and messages[-1]["role"] != "assistant":
        raise APIError("continue_final_message needs the last message to be from the assistant",
                       param="continue_final_message")
    tpl = template if template is not None else getattr(tokenizer, "chat_template", None)
    if tpl is None:
        tpl = BUILTIN_TEMPLATES["default"]
    kwargs = dict(extra_kwargs or {})
    if tools:
        kwargs["tools"] = tools
    try:
        text = tokenizer.apply_chat_template(messages, chat_template=tpl, tokenize=False,
                                             add_generation_prompt=add_gen,
                                             continue_final_message=continue_final_message, **kwargs)
    except TypeError:
        text = _render_jinja(tpl, messages, tokenizer, add_gen)
    except Exception as e:
        raise APIError(f"could not apply the chat template: {e}", param="messages") from None
    if continue_final_message and tpl is BUILTIN_TEMPLATES["default"]:
        # the plain template ends every message with a newline; continue the last one instead
        text = text.removesuffix("\n")
    if not isinstance(text, str):
        raise APIError("the chat template did not produce text")
    return text


def _render_jinja(tpl: str, messages, tokenizer, add_gen: bool) -> str:
    import jinja2

    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(tpl).render(messages=messages, add_generation_prompt=add_gen,
                                       bos_token=getattr(tokenizer, "bos_token", "") or "",
                                       eos_token=getattr(tokenizer, "eos_token", "") or "")
