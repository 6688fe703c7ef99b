"""Llama behind the OpenAI chat API: messages -> prompt ids, streamed token ids -> text deltas."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from mstar.layers.grammar import GrammarSpec
from mstar.model.adapter import (
    CHAT,
    COMPLETIONS,
    GENERATE,
    ApiAdapter,
    ApiRequest,
    ItemDecoder,
    TextDelta,
    TextStreamDecoder,
    ToolCallsOut,
    stop_strings,
    text_sampling_params,
)
from mstar.models.llama.tools import parse_tool_calls, render_messages, tool_request

# OpenAI request fields -> our sampling fields (None values are left to the model's defaults)
_SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "seed": "seed",
                    "repetition_penalty": "repetition_penalty", "ignore_eos": "ignore_eos",
                    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
                    "logit_bias": "logit_bias"}


def _text_of(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(p.get("text") or "" for p in content if p.get("type") == "text")


def _compile_template(source: str) -> Any:
    """A chat template compiled as ``apply_chat_template`` does (sandboxed, trimmed blocks, loop controls)."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


class ChatTemplate:
    """The checkpoint's Jinja chat template (tokenizer_config.json, or a .gguf file's metadata), or a
    plain "role: text" layout."""

    def __init__(self, model_path: str | None) -> None:
        self.template = None
        self.specials: dict[str, str] = {}
        if model_path and str(model_path).lower().endswith(".gguf"):
            from mstar.models.llama.gguf_tokenizer import gguf_chat_template

            source, self.specials = gguf_chat_template(model_path)
            self.template = _compile_template(source) if source is not None else None
            return
        cfg = Path(model_path) / "tokenizer_config.json" if model_path else None
        if cfg is not None and cfg.is_file():
            data = json.loads(cfg.read_text())
            source = data.get("chat_template")
            if isinstance(source, str):
                self.template = _compile_template(source)
                for key in ("bos_token", "eos_token"):
                    tok = data.get(key)
                    self.specials[key] = tok.get("content", "") if isinstance(tok, dict) else (tok or "")

    def render(self, messages: list[Mapping[str, Any]]) -> tuple[str, bool]:
        """The prompt text and whether it already holds the special tokens (no BOS to add)."""
        msgs = [{"role": m["role"], "content": _text_of(m.get("content"))} for m in messages]
        if self.template is not None:
            return self.template.render(messages=msgs, add_generation_prompt=True, **self.specials), True
        return "".join(f"{m['role']}: {m['content']}\n" for m in msgs) + "assistant:", False


def response_grammar(fmt: Any) -> GrammarSpec | None:
    """The grammar of a chat ``response_format``: None for text, any JSON object for ``json_object``,
    the schema of ``json_schema`` (``{"name", "schema", "strict", "description"}``)."""
    if fmt is None:
        return None
    if not isinstance(fmt, Mapping) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise ValueError('response_format: type must be "text", "json_object" or "json_schema"')
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    inner = fmt.get("json_schema")
    if not isinstance(inner, Mapping) or not isinstance(inner.get("name"), str) or not inner["name"]:
        raise ValueError("response_format: json_schema needs an object with a name and a schema")
    unknown = sorted(set(inner) - {"name", "schema", "strict", "description"})
    if unknown:
        raise ValueError(f"response_format: json_schema has unknown fields {unknown}")
    schema = inner.get("schema", {})
    if not isinstance(schema, Mapping):
        raise ValueError("response_format: json_schema.schema must be an object")
    return GrammarSpec("json_schema", json.dumps(schema, sort_keys=True))


class LlamaChatAdapter(ApiAdapter):
    routes = frozenset({CHAT, COMPLETIONS, GENERATE})
    chat_options = frozenset({"n", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "logit_bias",
                              "response_format", "tools", "tool_choice"})

    def __init__(self, model) -> None:
        self.model = model
        self.template = ChatTemplate(model.model_path)

    def chat_request(self, body, images, audio):
        if images or audio:
            raise ValueError(f"{self.model.name} is a text model: image and audio inputs are not supported")
        tools = tool_request(body.get("tools"), body.get("tool_choice"))
        parallel = body.get("parallel_tool_calls")
        prompt, has_specials = self.template.render(render_messages(body["messages"], _text_of, tools))
        ids = self.model.tokenizer.encode(prompt, add_special_tokens=not has_specials)
        params = text_sampling_params(body, _SAMPLING_FIELDS)
        if body.get("logprobs"):
            params["sampling"]["logprobs"] = body.get("top_logprobs") or 0
        spec = response_grammar(body.get("response_format"))
        if tools is not None and tools.forced:
            if spec is not None:
                raise ValueError("response_format: a JSON answer and a required tool call cannot both be asked for")
            spec, field = tools.grammar(), "tools"
        else:
            field = "response_format"
        if spec is not None:
            try:
                self.model.grammars.check(spec)
            except ValueError as e:
                raise ValueError(f"{field}: {e}") from e
            params["sampling"]["grammar"] = spec.to_params()
        req = self._request(ids, params, body)
        if tools is None:
            return req
        return dataclasses.replace(req, tool_mode="forced" if tools.forced else "auto",
                                   parallel_tool_calls=parallel is not False)

    def completion_request(self, body, prompt):
        """A text prompt is encoded with the tokenizer's special tokens (a BOS), as vLLM does; token ids
        are the prompt as they are. ``logprobs`` is the number of alternatives (the legacy API's)."""
        if isinstance(prompt, str):
            ids = self.model.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            ids = list(prompt)
        params = text_sampling_params(body, _SAMPLING_FIELDS)
        if body.get("logprobs") is not None:
            params["sampling"]["logprobs"] = body["logprobs"]
        req = self._request(ids, params, body)
        if not body.get("echo"):
            return req
        text = prompt if isinstance(prompt, str) else self.model.tokenizer.decode(ids, skip_special_tokens=True)
        return dataclasses.replace(req, echo=text)

    def _request(self, ids: list[int], params: dict[str, Any], body: Mapping[str, Any]) -> ApiRequest:
        if not ids:
            raise ValueError("the prompt is empty")
        inputs = {"input_ids": [torch.tensor(ids, dtype=torch.long)]}
        request = self.model.parse_request(inputs, params)  # context-length and vocabulary checks -> 400
        return ApiRequest(inputs, request, prompt_tokens=len(ids), stop=stop_strings(body))

    def new_decoder(self, route, request):
        req = request.params  # an LMRequest: parsed once, by ``_request``
        text = _TextDecoder(self.model.tokenizer, frozenset(req.stop_ids), request.stop,
                            logprobs=req.sampling.logprobs is not None)
        return text if request.tool_mode is None else ToolCallDecoder(text, request)


_TextDecoder = TextStreamDecoder  # the shared incremental detokenizer (mstar.model.adapter)


class ToolCallDecoder(ItemDecoder):
    """An answer that may be function calls: the text is held (its tokens still counted) until the
    answer ends, then either its calls (``ToolCallsOut``, finish_reason "tool_calls") or the text."""

    def __init__(self, text: TextStreamDecoder, request: ApiRequest) -> None:
        self.text, self.request = text, request
        self.held: list[str] = []
        self.calls = False  # the answer was function calls

    @property
    def done(self) -> bool:  # type: ignore[override]
        return self.text.done

    def _hold(self, outs: list) -> list:
        out = []
        for d in outs:
            if isinstance(d, TextDelta):
                self.held.append(d.text)
                out.append(TextDelta("", d.num_tokens, d.logprobs))
            else:
                out.append(d)
        return out

    def feed(self, name, value):
        return self._hold(self.text.feed(name, value))

    def end(self, reason):
        self.text.end(reason)

    @property
    def finish_reason(self) -> str:  # type: ignore[override]
        return "tool_calls" if self.calls else self.text.finish_reason

    def finish(self):
        out = self._hold(self.text.finish())
        answer = "".join(self.held)
        calls = parse_tool_calls(answer, forced=self.request.tool_mode == "forced")
        if not self.request.parallel_tool_calls:
            calls = calls[:1]
        if calls and self.text.finish_reason != "length":
            self.calls = True
            return [*out, ToolCallsOut(calls)]
        return [*out, TextDelta(answer, 0)] if answer else out
