"""``python -m mstar.bench.engine_bench``: the engine's hot spots, old and new path side by side.

* **attention**: 16 decode rows x 8 layers over a paged cache with scattered blocks (contexts
  100-380, 8 query / 4 KV heads, head_dim 64, fp32, one cache per layer): the PyTorch path of
  ``paged_attention``, the compiled kernel (``mstar.layers.paged_decode``), and SDPA on the same
  K/V already contiguous (per row, and one padded call per layer with a key mask).
* **block attention**: the multi-token queries of the compiled kernel (``paged_block``), 8 layers
  over scattered blocks: a V-JEPA 2-AC frame block (66 queries, bidirectional, over 132..2,112 keys:
  the steps of an H=30 rollout, 8 heads of 32) and a Llama prefill chunk (256 causal queries
  after 128 cached tokens, 8:4 heads of 64): the PyTorch path (SDPA per sequence), the kernel, and
  SDPA on the same K/V already contiguous.
* **decode step**: one decode step of the ``compare llm`` model (hidden 512, 8 layers, 8:4 heads,
  vocab 32000, fp32, random weights) at batch 1 and 16 after prompts of 32-256 tokens: backbone,
  LM head and argmax, called directly (no runtime), for three configurations of the same weights:
  PyTorch attention + plain matmuls (before), compiled attention + plain matmuls, and the default
  (after: compiled attention, panel linears with fused SiLU-mul / residual adds, compiled RMSNorm
  and rotary; ``MSTAR_PREPACK=onednn`` makes it oneDNN's linears instead).

Configurations run in rotating order inside every repeat (``mstar.bench.harness``); figures are
best-of-N and median, in ms.
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

from mstar.bench import harness
from mstar.bench.llm_bench import BENCH_SHAPE, make_prompts
from mstar.layers.attention_backends import get_backend
from mstar.layers.paged_attention import AttentionMetadata, QueryMode, paged_attention
from mstar.layers.paged_decode import kernel, paged_block, paged_decode
from mstar.model.submodule import EngineInputs
from mstar.models.llama.config import LlamaConfig
from mstar.models.llama.loader import build_llama_model


def _alternate(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, tuple[float, float]]:
    """name -> (best, median) ms, the functions run by the harness ``repeats`` rotating rounds after
    one warm-up call each."""
    times = harness.rotate_timed(fns, repeats)
    return {name: (min(t) * 1e3, statistics.median(t) * 1e3) for name, t in times.items()}


def _scattered_cache(ctx: list[int], layers: int, kv_heads: int, head_dim: int, block_size: int,
                     seed: int = 0):
    rng = random.Random(seed)
    needed = [-(-n // block_size) for n in ctx]
    ids = list(range(sum(needed)))
    rng.shuffle(ids)
    tables, start = [], 0
    for n in needed:
        tables.append(ids[start:start + n])
        start += n
    shape = (len(ids), block_size, kv_heads, head_dim)
    caches = [(torch.randn(shape), torch.randn(shape)) for _ in range(layers)]
    return tables, caches


def _layers(q, kv, caches, meta, decode, block=None):
    """Every layer's attention for one forward (one metadata: planned once, as in a model)."""
    return [paged_attention(q, kv, kv, kc, vc, meta, decode=decode, block=block) for kc, vc in caches]


def _block_case(hq: int, hkv: int, d: int, bs: int, n: int, ctxs: list[int], mode: QueryMode, layers: int,
                repeats: int) -> dict[str, tuple[float, float]]:
    """One sequence of ``n`` queries per context in ``ctxs``, one forward of ``layers`` layers each."""
    tables, caches = _scattered_cache(ctxs, layers, hkv, d, bs)
    q, kv = torch.randn(n, hq, d), torch.zeros(n, hkv, d)

    def metas():
        return [AttentionMetadata.build([n], [t], [c], [mode]) for t, c in zip(tables, ctxs)]

    causal = mode is QueryMode.CAUSAL_APPEND
    dense = [[(kc[t].flatten(0, 1)[:c].transpose(0, 1)[None].contiguous(),
               vc[t].flatten(0, 1)[:c].transpose(0, 1)[None].contiguous(),
               (torch.arange(c)[None, :] <= (c - n + torch.arange(n))[:, None]) if causal else None)
              for t, c in zip(tables, ctxs)] for kc, vc in caches]
    qs = q.transpose(0, 1)[None]
    return _alternate({
        "paged_attention, PyTorch path": lambda: [_layers(q, kv, caches, m, None) for m in metas()],
        "paged_attention, compiled kernel": lambda: [_layers(q, kv, caches, m, None, paged_block) for m in metas()],
        "SDPA on contiguous K/V": lambda: [F.scaled_dot_product_attention(qs, k_, v_, attn_mask=mask, enable_gqa=True)
                                           for layer in dense for k_, v_, mask in layer],
    }, repeats)


def block_probe(repeats: int, layers: int = 8) -> dict[str, dict[str, tuple[float, float]]]:
    """probe -> path -> (best, median) ms (slots -1: the keys are in the cache already, nothing is
    stored, so every path reads the same)."""
    return {
        "V-JEPA frame blocks (66 queries over 132..2,112 keys, 31 steps)":
            _block_case(8, 8, 32, 66, 66, [66 * (t + 1) for t in range(1, 32)], QueryMode.BLOCK_APPEND, layers,
                        repeats),
        "Llama prefill chunk (256 causal queries after 128 cached)":
            _block_case(8, 4, 64, 16, 256, [384], QueryMode.CAUSAL_APPEND, layers, repeats),
    }


def attention_probe(repeats: int, rows: int = 16, layers: int = 8) -> dict[str, tuple[float, float]]:
    hq, hkv, d, bs = 8, 4, 64, 16
    rng = random.Random(0)
    ctx = [rng.randint(100, 380) for _ in range(rows)]
    tables, caches = _scattered_cache(ctx, layers, hkv, d, bs)
    q, kv = torch.randn(rows, hq, d), torch.zeros(rows, hkv, d)

    def meta():
        return AttentionMetadata.build([1] * rows, tables, ctx, [QueryMode.CAUSAL_APPEND] * rows)

    dense = [[(kc[t].flatten(0, 1)[:n].transpose(0, 1)[None].contiguous(),
               vc[t].flatten(0, 1)[:n].transpose(0, 1)[None].contiguous()) for t, n in zip(tables, ctx)]
             for kc, vc in caches]
    width = max(ctx)
    padded = [tuple(torch.stack([F.pad(x[0], (0, 0, 0, width - x.shape[2])) for x in (kv_[i] for kv_ in layer)])
                    for i in (0, 1)) for layer in dense]
    key_mask = (torch.arange(width)[None, :] < torch.tensor(ctx)[:, None])[:, None, None, :]
    qs = q[:, :, None, :]  # [rows, Hq, 1, D]
    fns = {
        "paged_attention, PyTorch path": lambda: _layers(q, kv, caches, meta(), None),
        "paged_attention, compiled kernel": lambda: _layers(q, kv, caches, meta(), paged_decode),
        "SDPA on contiguous K/V, per row": lambda: [
            F.scaled_dot_product_attention(q[i][None, :, None], k_, v_, enable_gqa=True)
            for layer in dense for i, (k_, v_) in enumerate(layer)],
        "SDPA on padded contiguous K/V, one call per layer": lambda: [
            F.scaled_dot_product_attention(qs, k_, v_, attn_mask=key_mask, enable_gqa=True) for k_, v_ in padded],
    }
    return _alternate(fns, repeats)


class _DecodeStep:
    """One decode step of ``len(prompts)`` requests over their prefilled paged caches."""

    def __init__(self, module, prompts: list[list[int]], block_size: int = 16) -> None:
        spec = module.kv_spec
        lens = [len(p) + 1 for p in prompts]  # the prompt, then the decode token
        needed = [-(-n // block_size) for n in lens]
        shape = (sum(needed), block_size, spec.num_kv_heads, spec.head_dim)
        self.caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(spec.num_layers)]
        starts = [sum(needed[:i]) for i in range(len(prompts))]
        self.tables = [list(range(s, s + n)) for s, n in zip(starts, needed)]
        self.lens = lens
        slots = [t[p // block_size] * block_size + p % block_size
                 for t, n in zip(self.tables, lens) for p in range(n - 1)]
        ids = torch.tensor([t for p in prompts for t in p])
        positions = torch.tensor([p for n in lens for p in range(n - 1)])
        self.run(module, ids, [n - 1 for n in lens], [n - 1 for n in lens], slots, positions)  # prefill
        self.last = [t[(n - 1) // block_size] * block_size + (n - 1) % block_size
                     for t, n in zip(self.tables, lens)]

    def run(self, module, ids, qlens, ctx, slots, positions):
        n = len(qlens)
        meta = AttentionMetadata.build(qlens, self.tables, ctx, [QueryMode.CAUSAL_APPEND] * n, slots)
        ei = EngineInputs(walks=["decode"] * n, nodes=["LLM"] * n, request_ids=[str(i) for i in range(n)],
                          infos=[], splits={}, args=[], attention=meta, kv_caches=self.caches,
                          positions=positions, num_tokens=qlens)
        with torch.inference_mode():
            hidden = module.model(ids, ei)
            rows = torch.tensor(qlens).cumsum(0) - 1
            return module.compute_logits(hidden[rows]).argmax(-1)

    def __call__(self, module):
        n = len(self.lens)
        return self.run(module, torch.full((n,), 5), [1] * n, self.lens, self.last,
                        torch.tensor([ln - 1 for ln in self.lens]))


def decode_step_probe(batch: int, repeats: int) -> dict[str, tuple[float, float]]:
    config = LlamaConfig.from_hf_dict(BENCH_SHAPE.hf_config(), source="bench")
    plain = build_llama_model(config, load_format="dummy", prepack=False)
    packed = build_llama_model(config, load_format="dummy", prepack=True)
    torch_backend, compiled = get_backend("torch"), get_backend("compiled")
    step = _DecodeStep(plain, make_prompts(batch))

    def with_backend(module, backend):
        for layer in module.model.layers:
            layer.self_attn.backend = backend
        return step(module)

    fns = {
        "before: PyTorch attention, plain matmuls": lambda: with_backend(plain, torch_backend),
        "compiled attention, plain matmuls": lambda: with_backend(plain, compiled),
        "after: compiled attention, prepacked linears, norm, rotary": lambda: with_backend(packed, compiled),
    }
    return _alternate(fns, repeats)


def run_engine_bench(repeats: int = 15, batches: tuple[int, ...] = (1, 16)) -> list[tuple[str, str, float, float]]:
    """(probe, path, best ms, median ms) of every probe; the block probes get a third of the repeats
    (at least 3: they are the slow ones)."""
    if kernel() is None:
        raise RuntimeError("the compiled kernel is unavailable here (see the warning above)")
    rows = [("attention, 16 rows x 8 layers", name, best, med) for name, (best, med) in attention_probe(repeats).items()]
    rows += [(f"{probe} x 8 layers", name, best, med)
             for probe, paths in block_probe(max(3, repeats // 3)).items() for name, (best, med) in paths.items()]
    rows += [(f"decode step, batch {b}", name, best, med)
             for b in batches for name, (best, med) in decode_step_probe(b, repeats).items()]
    return rows


def format_table(rows: list[tuple[str, str, float, float]]) -> str:
    return harness.markdown_table(["probe", "path", "best ms", "median ms"],
                                  [(p, n, f"{b:.2f}", f"{m:.2f}") for p, n, b, m in rows], "llrr")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--batch", default="1,16")
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        rows = run_engine_bench(args.repeats, tuple(int(x) for x in args.batch.split(",")))
    except RuntimeError as e:
        raise SystemExit(str(e)) from e
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads; best / median ms "
          f"over {args.repeats} rotating repeats\n")
    print(format_table(rows))


if __name__ == "__main__":
    main()
