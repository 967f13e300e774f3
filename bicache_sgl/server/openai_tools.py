"""Tool calls on ``/v1/chat/completions`` through constrained decoding.

A diffusion LM already decodes under a JSON-schema constraint (docs/structured.md), so a forced
tool call is generated as JSON that cannot fail to parse:

- ``tool_choice: {"type": "function", "function": {"name": F}}``: the output is F's
  ``arguments`` object, under F's ``parameters`` schema.
- ``tool_choice: "required"``: the output is ``{"name": <one of the tools>, "arguments": {...}}``
  (an ``anyOf`` with one branch per tool: the name as a ``const``, the arguments under that
  tool's schema); with ``parallel_tool_calls`` (OpenAI's default) a non-empty JSON array of such
  objects, one call each.
- ``tool_choice: "none"``: the tools are ignored (OpenAI's meaning): plain text.
- ``tool_choice: "auto"`` (the default when tools are given): only where the chat template
  declares a tool-call format this server parses: Hermes/Qwen's ``<tool_call>{"name": ...,
  "arguments": ...}</tool_call>`` blocks in free text. Any other template: a 400 that says so.

The answer is OpenAI's: ``message.tool_calls`` (ids, ``function.name``, ``function.arguments`` as a
JSON string), ``content`` null, ``finish_reason: "tool_calls"``. Nothing here touches the engine.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from bicache_sgl.server.protocol import APIError

# OpenAI's rule for function names
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# Hermes / Qwen 2.5 tool-call blocks (what templates that render tools ask the model to write)
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_BLOCK = re.compile(re.escape(HERMES_OPEN) + r"\s*(.*?)\s*" + re.escape(HERMES_CLOSE), re.S)
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    """What a request's ``tools`` / ``tool_choice`` ask for.

    ``mode``: ``"forced"`` (generated under :attr:`schema`), ``"auto"`` (free text, Hermes blocks
    parsed) or ``"none"`` (tools ignored). ``named``: the function a named choice forces;
    ``parallel``: a "required" call is an array of calls."""

    mode: str
    tools: tuple[dict[str, Any], ...]  # the request's tool objects, as sent (for the chat template)
    schema: dict[str, Any] | None = None
    named: str | None = None
    parallel: bool = False

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools the chat template sees (none for ``"none"``: as if they were not sent)."""
        return None if self.mode == "none" else list(self.tools)

    def calls(self, text: str) -> list[dict[str, Any]]:
        """The OpenAI ``tool_calls`` of a finished forced output (the constraint guarantees the
        JSON; anything else is a bug, answered as a 500)."""
        try:
            value = json.loads(text)
        except ValueError as e:
            raise APIError(f"the constrained tool-call output did not parse: {e}", status=500,
                           err_type="InternalServerError") from None
        if self.named is not None:
            return [tool_call(self.named, value)]
        items = value if self.parallel else [value]
        return [tool_call(c["name"], c["arguments"]) for c in items]

    def auto_split(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """``"auto"``: (the text outside tool-call blocks or None, the calls of the blocks that
        parse as ``{"name": a known tool, "arguments": {...}}``)."""
        names = {t["function"]["name"] for t in self.tools}
        calls = []
        for m in _HERMES_BLOCK.finditer(text):
            try:
                c = json.loads(m.group(1))
            except ValueError:
                continue
            if isinstance(c, dict) and c.get("name") in names and isinstance(c.get("arguments", {}), dict):
                calls.append(tool_call(c["name"], c.get("arguments", {})))
        if not calls:
            return text, []
        rest = _HERMES_BLOCK.sub("", text).strip()
        return rest or None, calls


def tool_call(name: str, arguments: Any) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def declares_tool_format(template: str | None) -> bool:
    """Whether a chat template asks the model for tool calls in a format :meth:`ToolPlan.auto_split`
    parses (Hermes/Qwen ``<tool_call>`` blocks)."""
    return bool(template) and HERMES_OPEN in template and HERMES_CLOSE in template


def _check_tools(tools: Any) -> tuple[dict[str, Any], ...]:
    if not isinstance(tools, list) or not tools:
        raise APIError("tools must be a non-empty list of {\"type\": \"function\", \"function\": {...}}",
                       param="tools")
    seen: set[str] = set()
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise APIError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                           "\"parameters\": ...}}}} (only function tools exist here)", param="tools")
        f = t["function"]
        unknown = set(t) - {"type", "function"} or set(f) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise APIError(f"tools[{i}]: {sorted(unknown)[0]} is not a field of a function tool", param="tools")
        name = f.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise APIError(f"tools[{i}].function.name must be 1-64 letters, digits, _ or -, got {name!r}",
                           param="tools")
        if name in seen:
            raise APIError(f"tools: two tools are named {name!r}", param="tools")
        seen.add(name)
        params = f.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise APIError(f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
        if f.get("description") is not None and not isinstance(f["description"], str):
            raise APIError(f"tools[{i}].function.description must be a string", param="tools")
        if f.get("strict") is not None and not isinstance(f["strict"], bool):
            raise APIError(f"tools[{i}].function.strict must be a boolean", param="tools")
    return tuple(tools)


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool's arguments schema (OpenAI: no parameters = an empty object)."""
    return tool["function"].get("parameters") or dict(EMPTY_PARAMETERS)


def plan_tools(body: dict[str, Any], template: str | None) -> ToolPlan | None:
    """``tools`` / ``tool_choice`` / ``parallel_tool_calls`` of a chat body -> the plan (None: no
    tools and no choice that needs them). ``template``: the chat template's source, for "auto"."""
    tools_v, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise APIError(f"parallel_tool_calls must be a boolean, got {parallel!r}", param="parallel_tool_calls")
    if tools_v is None or tools_v == []:
        if choice in (None, "none", "auto"):
            return None
        raise APIError(f"tool_choice {json.dumps(choice)} needs tools: send the functions in tools",
                       param="tool_choice")
    tools = _check_tools(tools_v)
    by_name = {t["function"]["name"]: t for t in tools}
    if choice is None:
        choice = "auto"  # OpenAI's default when tools are given
    if choice == "none":
        return ToolPlan("none", tools)
    if choice == "auto":
        if declares_tool_format(template):
            return ToolPlan("auto", tools)
        raise APIError("tools with tool_choice \"auto\" (the default when tools are given) need a chat template "
                       "that declares a tool-call format this server parses (Hermes/Qwen <tool_call> blocks); "
                       "this model's does not. Send tool_choice \"required\" or {\"type\": \"function\", "
                       "\"function\": {\"name\": ...}} (the call is then generated under a JSON-schema "
                       "constraint), or \"none\"", param="tools")
    if choice == "required":
        one = {"anyOf": [{"type": "object", "properties": {"name": {"const": n}, "arguments": _parameters(t)},
                          "required": ["name", "arguments"], "additionalProperties": False}
                         for n, t in by_name.items()]}
        if len(by_name) == 1:
            one = one["anyOf"][0]
        par = parallel is not False
        schema = {"type": "array", "items": one, "minItems": 1} if par else one
        return ToolPlan("forced", tools, schema=schema, parallel=par)
    if isinstance(choice, dict):
        f = choice.get("function")
        if choice.get("type") != "function" or not isinstance(f, dict) or set(choice) - {"type", "function"}:
            raise APIError("tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                           "\"function\": {\"name\": ...}}", param="tool_choice")
        name = f.get("name")
        if name not in by_name:
            raise APIError(f"tool_choice names the function {name!r}, which is not in tools", param="tool_choice")
        return ToolPlan("forced", tools, schema=_parameters(by_name[name]), named=name)
    raise APIError(f"tool_choice must be \"none\", \"auto\", \"required\" or a named function, got {choice!r}",
                   param="tool_choice")
