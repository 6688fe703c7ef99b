"""OpenAI tool calling for chat models whose template has no tool syntax of its own (SmolLM2's plain
ChatML): the tools are described in the system message and calls are written as
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (the Hermes convention many open
chat models are tuned on); a tool's result comes back as a ``tool`` turn in ``<tool_response>`` tags.

``tool_choice`` "required" or a named function constrains the answer to one call of the allowed
tools (a JSON schema over their names and parameters, through the grammar engine), so it always
parses; "auto" lets the model answer freely and reads the calls it wrote; "none" leaves the tools out.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mstar.layers.grammar import GrammarSpec
from mstar.model.adapter import ToolCall

__all__ = ["ToolRequest", "parse_tool_calls", "render_messages", "tool_request"]

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]


@dataclass(frozen=True)
class ToolRequest:
    """The tools a request offers and how the answer may use them: ``forced`` (one call of
    ``allowed``, constrained) or not (the model may write calls)."""

    tools: tuple[Tool, ...]
    allowed: tuple[str, ...]
    forced: bool

    def system_text(self) -> str:
        specs = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                   "parameters": t.parameters}} for t in self.tools]
        lines = "\n".join(json.dumps(s) for s in specs)
        return ("You may call functions to answer. The functions are, one JSON signature per line, in "
                f"<tools></tools> tags:\n<tools>\n{lines}\n</tools>\nTo call one, write a JSON object with its "
                'name and arguments in <tool_call></tool_call> tags: <tool_call>{"name": <function-name>, '
                '"arguments": <args-object>}</tool_call>')

    def grammar(self) -> GrammarSpec:
        """One call of an allowed tool, as a JSON object. Its arguments hold only the parameters the
        function declares unless its schema says otherwise (``additionalProperties``), as in OpenAI's
        strict function calling: left open, a small model keeps inventing keys until ``max_tokens``."""
        by_name = {t.name: t for t in self.tools}

        def arguments(t: Tool) -> dict[str, Any]:
            if "properties" in t.parameters and "additionalProperties" not in t.parameters:
                return {**t.parameters, "additionalProperties": False}
            return t.parameters

        calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                  "properties": {"name": {"const": n}, "arguments": arguments(by_name[n])}} for n in self.allowed]
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        return GrammarSpec("json_schema", json.dumps(schema, sort_keys=True))


def _tool(spec: Any, i: int) -> Tool:
    if not isinstance(spec, Mapping) or spec.get("type") != "function" or not isinstance(spec.get("function"), Mapping):
        raise ValueError(f'tools[{i}] must be {{"type": "function", "function": {{"name", ...}}}}')
    fn = spec["function"]
    unknown = sorted(set(fn) - {"name", "description", "parameters", "strict"})
    if unknown:
        raise ValueError(f"tools[{i}].function has unknown fields {unknown}")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"tools[{i}].function.name must be 1-64 letters, digits, _ or -, got {name!r}")
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    if not isinstance(params, Mapping):
        raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
    description = fn.get("description") or ""
    if not isinstance(description, str):
        raise ValueError(f"tools[{i}].function.description must be a string")
    return Tool(name, description, dict(params))


def tool_request(tools: Any, choice: Any) -> ToolRequest | None:
    """The request's tools and ``tool_choice`` (None: no tools, or "none"); ValueError naming the
    field for a bad one."""
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise ValueError("tool_choice needs tools")
        return None
    if not isinstance(tools, list) or len(tools) > 128:
        raise ValueError("tools must be a list of at most 128 functions")
    parsed = tuple(_tool(t, i) for i, t in enumerate(tools))
    names = [t.name for t in parsed]
    if len(set(names)) != len(names):
        raise ValueError("tools: function names must be unique")
    if choice is None or choice == "auto":
        return ToolRequest(parsed, tuple(names), forced=False)
    if choice == "none":
        return None
    if choice == "required":
        return ToolRequest(parsed, tuple(names), forced=True)
    fn = choice.get("function") if isinstance(choice, Mapping) and choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, Mapping) else None
    if name is None:
        raise ValueError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                         '{"name": ...}}')
    if name not in names:
        raise ValueError(f"tool_choice names {name!r}, which is not one of the tools ({', '.join(names)})")
    return ToolRequest(parsed, (name,), forced=True)


def _call_text(call: Mapping[str, Any]) -> str:
    fn = call.get("function") or {}
    try:
        arguments = json.loads(fn.get("arguments") or "{}")
    except json.JSONDecodeError as e:
        raise ValueError(f"messages: a tool call's arguments are not JSON: {e}") from e
    return "<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": arguments}) + "\n</tool_call>"


def render_messages(messages: Sequence[Mapping[str, Any]], text_of: Any,
                    tools: ToolRequest | None) -> list[dict[str, str]]:
    """Chat messages as the template's plain ``{role, content}`` turns: an assistant's tool calls as
    ``<tool_call>`` text, a tool's result in ``<tool_response>`` tags, and the tools described at the
    start of the system message (one added when there is none)."""
    out = []
    for m in messages:
        content = text_of(m.get("content"))
        if m.get("tool_calls"):
            content = "\n".join([content] * bool(content) + [_call_text(c) for c in m["tool_calls"]])
        if m["role"] == "tool":
            content = f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": m["role"], "content": content})
    if tools is not None:
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {"role": out[0]["role"], "content": f"{out[0]['content']}\n\n{tools.system_text()}"}
        else:
            out.insert(0, {"role": "system", "content": tools.system_text()})
    return out


def parse_tool_calls(text: str, forced: bool) -> tuple[ToolCall, ...]:
    """The calls an answer holds: a forced answer is one call's JSON; a free one, its ``<tool_call>``
    blocks whose JSON has a name and arguments (others are left as text)."""
    bodies = [text] if forced else _CALL.findall(text)
    calls = []
    for body in bodies:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(obj.get("arguments"), dict):
            calls.append(ToolCall(f"call_{uuid.uuid4().hex[:24]}", obj["name"], json.dumps(obj["arguments"])))
    return tuple(calls)
