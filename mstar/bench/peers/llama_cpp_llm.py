"""llama.cpp peer of ``mstar bench compare gguf``; run by the peer virtualenv's python (which has
``llama-cpp-python``, built from source by ``make bench-peers``), never imported.

Loads one GGUF file through llama.cpp's C API (``llama_cpp``'s low-level bindings: token ids in, no
tokenizer), prints ``{"ready": true, ...}`` as one JSON line, then answers one JSON line per
command read from stdin:

* ``{"cmd": "concurrent", "prompts": [[ids]], "max_tokens": N}``: every prompt a sequence of its own
  in one context (``n_seq_max`` sequences, one KV cache): the prompts decoded together in batches
  of up to ``n_batch`` tokens, then one decode per step holding every unfinished sequence's next
  token (llama.cpp's batched decoding, what ``llama-server`` does with parallel slots);
* ``{"cmd": "sequential", ...}``: the same, one prompt at a time;
* ``{"cmd": "logits", "prompt": [ids], "out": "file.npy"}``: the float32 logits of every prompt
  position saved to ``out``;
* ``{"cmd": "quit"}``.

The ready line carries ``model_bytes`` (llama.cpp's size of the model's tensors) and ``rss_load_kib``
(this process's resident memory added by loading the model and its context: ``RssAnon``,
``RssFile``...). Answers: ``{"wall_s", "request_s": [per request], "tokens": [[ids]]}`` (greedy: llama.cpp's own
greedy sampler; EOS ignored, exactly N tokens) or ``{"error"}``. llama.cpp's logs go to stderr.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time

from json_lines import answers_channel, generation, serve  # beside this script (peers/json_lines.py)


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="a .gguf file")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--n-ctx", type=int, default=8192, help="KV cells shared by every sequence")
    ap.add_argument("--n-batch", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--kv-type", choices=["f16", "f32"], default="f16",
                    help="the KV cache's type (llama.cpp's default: f16)")
    return ap.parse_args()


class _Peer:
    def __init__(self, args: argparse.Namespace) -> None:
        import llama_cpp as L

        self.L = L
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        self.model = L.llama_model_load_from_file(args.model.encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {args.model}")
        cp = L.llama_context_default_params()
        cp.n_ctx = args.n_ctx
        cp.n_batch = args.n_batch
        cp.n_ubatch = min(512, args.n_batch)
        cp.n_seq_max = args.max_num_seqs
        cp.n_threads = cp.n_threads_batch = args.threads
        if args.kv_type == "f32":
            cp.type_k = cp.type_v = L.GGML_TYPE_F32
        cp.kv_unified = True  # one KV cache for every sequence, as llama-server's parallel slots share it
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.n_batch, self.max_seqs = args.n_batch, args.max_num_seqs
        self.vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.batch = L.llama_batch_init(args.n_batch, 0, args.max_num_seqs)
        self.sampler = L.llama_sampler_init_greedy()
        self.system = L.llama_print_system_info().decode()

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> None:
        """One ``llama_decode`` of ``(token, position, sequence, wants logits)`` items."""
        b = self.batch
        for i, (tok, pos, seq, logits) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i] = tok, pos, 1
            b.seq_id[i][0] = seq
            b.logits[i] = logits
        b.n_tokens = len(items)
        rc = self.L.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """Every prompt a sequence, decoded together; greedy, exactly ``max_tokens`` each."""
        if len(prompts) > self.max_seqs:
            raise ValueError(f"{len(prompts)} prompts, at most {self.max_seqs} sequences")
        L = self.L
        L.llama_memory_clear(L.llama_get_memory(self.ctx), True)
        items = [(t, pos, s, pos == len(p) - 1) for s, p in enumerate(prompts) for pos, t in enumerate(p)]
        row_of: dict[int, int] = {}  # sequence -> batch row of its logits in the last decode
        for start in range(0, len(items), self.n_batch):
            chunk = items[start:start + self.n_batch]
            self._decode(chunk)
            row_of.update({seq: i for i, (_, _, seq, want) in enumerate(chunk) if want})
        out: list[list[int]] = [[] for _ in prompts]
        for step in range(max_tokens):
            nxt = []
            for s in range(len(prompts)):
                tok = L.llama_sampler_sample(self.sampler, self.ctx, row_of[s])
                out[s].append(int(tok))
                nxt.append((int(tok), len(prompts[s]) + step, s, True))
            if step + 1 == max_tokens:
                break
            self._decode(nxt)
            row_of = {s: i for i, (_, _, s, _) in enumerate(nxt)}
        return out

    def logits(self, prompt: list[int], out: str) -> None:
        import numpy as np

        L = self.L
        L.llama_memory_clear(L.llama_get_memory(self.ctx), True)
        self._decode([(t, pos, 0, True) for pos, t in enumerate(prompt)])
        rows = []
        for i in range(len(prompt)):
            ptr = L.llama_get_logits_ith(self.ctx, i)
            rows.append(np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self.vocab,)).copy())
        np.save(out, np.stack(rows))

    def answer(self, cmd: dict) -> dict:
        if cmd["cmd"] == "logits":
            t0 = time.perf_counter()
            self.logits(cmd["prompt"], cmd["out"])
            return {"wall_s": time.perf_counter() - t0}
        return generation(self.generate, cmd)


def _rss_kib() -> dict[str, int]:
    """This process's resident memory now (kB): anonymous and file-backed (the mapped model file)."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f if line.startswith("Rss"))
    return {k: int(v.split()[0]) for k, v in fields.items()}


def main() -> int:
    args = _args()
    out = answers_channel()

    def start():
        import llama_cpp

        t0, before = time.perf_counter(), _rss_kib()
        peer = _Peer(args)
        after = _rss_kib()
        return {"llama_cpp": llama_cpp.__version__, "system": peer.system, "startup_s": time.perf_counter() - t0,
                "model_bytes": int(llama_cpp.llama_model_size(peer.model)),
                "rss_load_kib": {k: after[k] - before[k] for k in after}}, peer.answer

    return serve(out, start)


if __name__ == "__main__":
    sys.exit(main())
