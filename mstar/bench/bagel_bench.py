"""BAGEL benchmarks (``mstar bench compare t2i``): bagel-tiny text-to-image through the runtime (the
guidance branches batched into one forward per step, requests batched together) against the dense
oracle loop (``mstar.bench.bagel_oracle``: three sequential passes per step, one request after
another), same weights, same seeds, alternating in one run; and image understanding through the
runtime (time to first token and tokens/s as the batch grows).
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass

import torch

from mstar.bench import harness
from mstar.bench.bagel_oracle import Context, DenseBagel, add_text, generate_image
from mstar.bench.stats import spread, spread_cell
from mstar.models.bagel.flow import flow_settings

__all__ = ["I2TRow", "T2IRow", "format_i2t", "format_t2i", "run_i2t", "run_t2i_compare"]

PROMPTS = ["a red cube on a wooden table", "a lighthouse at dusk", "two cats playing chess",
           "a bowl of ramen, top view", "snowy mountains under a full moon", "a paper boat in the rain",
           "an astronaut riding a horse", "a watercolor of a fox"]


@dataclass
class T2IRow:
    batch: int
    ours_s: list[float]
    oracle_s: list[float]
    max_diff: float

    @property
    def ratios(self) -> list[float]:
        return [o / u for u, o in zip(self.ours_s, self.oracle_s)]


@dataclass
class I2TRow:
    batch: int
    ttft_ms: list[float]  # per request, median over repeats of the per-run median
    tok_s: list[float]  # generated tokens / wall time, per repeat


def _ids(model, text: str) -> torch.Tensor:
    return torch.tensor(model.tokenizer.encode(text), dtype=torch.long)


def _oracle(model) -> DenseBagel:
    parts = model.build_submodules(["LLM", "vit_encoder", "vae_encoder"])
    return DenseBagel(parts["LLM"], parts["vit_encoder"].vit, parts["vae_encoder"].vae, model.spec.latent_patch_size)


def _oracle_images(model, oracle: DenseBagel, prompts: list[str], seeds: list[int], size: int, steps: int):
    fs = flow_settings({"num_timesteps": steps}, editing=False)
    ld = model.spec.latent_downsample
    h = w = size // ld
    outs = []
    for prompt, seed in zip(prompts, seeds):
        main = Context()
        empty = main.copy()
        add_text(oracle, main, _ids(model, prompt).tolist())
        g = torch.Generator().manual_seed(seed)
        noise = torch.randn(h * w, model.spec.latent_dim, generator=g)
        outs.append(generate_image(oracle, main, empty, main, noise, h, w, cfg_text_scale=fs.cfg_text_scale,
                                   cfg_img_scale=fs.cfg_img_scale, cfg_interval=fs.cfg_interval,
                                   renorm_type=fs.cfg_renorm_type, num_timesteps=steps, shift=fs.timestep_shift))
    return outs


def _ours_images(rt, model, prompts, seeds, size, steps):
    params = {"target": "image", "height": size, "width": size, "num_timesteps": steps, "output_type": "latent"}
    handles = [rt.submit({"text_ids": [_ids(model, p)]}, {**params, "seed": s}) for p, s in zip(prompts, seeds)]
    outs = []
    for h in handles:
        r = h.result()
        if not r.finished:
            raise RuntimeError(f"t2i request failed: {r.error}")
        outs.append(r.tensors("image_output")[0])
    return outs


def run_t2i_compare(batches=(1, 4), repeats: int = 3, size: int = 64, steps: int = 50,
                    model_name: str = "bagel-tiny", progress=print) -> list[T2IRow]:
    """Latency of B text-to-image requests (B at once through the runtime vs one after another
    through the oracle), in seconds per batch; both produce latents from the same noise."""
    from mstar.model import resolve_model
    from mstar.runtime.api import Runtime

    model = resolve_model(model_name)
    oracle = _oracle(model)
    rows = []
    with Runtime(model) as rt, torch.inference_mode():
        warm = {"ours": lambda: _ours_images(rt, model, PROMPTS[:1], [0], size, 4),
                "oracle": lambda: _oracle_images(model, oracle, PROMPTS[:1], [0], size, 4)}
        for k, b in enumerate(batches):
            prompts = [PROMPTS[i % len(PROMPTS)] for i in range(b)]
            seeds = list(range(b))
            fns = {"ours": lambda p=prompts, s=seeds: _ours_images(rt, model, p, s, size, steps),
                   "oracle": lambda p=prompts, s=seeds: _oracle_images(model, oracle, p, s, size, steps)}
            # one short warm-up of each before the first batch size; the order rotates per repeat
            per = harness.rotate(list(fns), lambda sys_, _r, fns=fns: harness.timed(fns[sys_]), repeats,
                                 warmup=lambda sys_: warm[sys_](), warm=k == 0,
                                 log=lambda msg, b=b: progress(f"  t2i B={b} {msg}"),
                                 label=lambda t: f"{t[0]:.3f} s")
            diff = max(float((a - c).abs().max()) for (_, got), (_, ref) in zip(per["ours"], per["oracle"])
                       for a, c in zip(got, ref))
            rows.append(T2IRow(b, [t for t, _ in per["ours"]], [t for t, _ in per["oracle"]], diff))
    return rows


def run_i2t(batches=(1, 2, 4, 8, 16), repeats: int = 3, max_tokens: int = 32,
            model_name: str = "bagel-tiny", progress=print) -> list[I2TRow]:
    """B image-understanding requests at once (one 56x42 image + a question each, greedy,
    ``max_tokens`` each with EOS ignored): time to first token and generated tokens/s."""
    from mstar.model import resolve_model
    from mstar.runtime.api import Runtime

    model = resolve_model(model_name)
    g = torch.Generator().manual_seed(0)
    images = [torch.randint(0, 256, (42, 56, 3), generator=g, dtype=torch.uint8) for _ in range(max(batches))]
    params = {"target": "text", "max_tokens": max_tokens, "sampling": {"ignore_eos": True}}
    rows = []
    with Runtime(model) as rt:
        def run(b: int) -> tuple[list[float], float]:
            t0 = time.perf_counter()
            handles = [rt.submit({"text_ids": [_ids(model, "what is in this picture?")], "images": [images[i]]},
                                 params) for i in range(b)]
            firsts: list[float] = [0.0] * b
            counts = [0] * b

            def consume(i: int) -> None:  # one reader per request: its first token's arrival time
                for _ in handles[i]:
                    if not counts[i]:
                        firsts[i] = time.perf_counter()
                    counts[i] += 1

            readers = [threading.Thread(target=consume, args=(i,)) for i in range(b)]
            for r in readers:
                r.start()
            for r in readers:
                r.join()
            return [(f - t0) * 1e3 for f in firsts], sum(counts) / (time.perf_counter() - t0)

        for i, b in enumerate(batches):  # one system: the harness repeats it, one warm-up before the first size
            per = harness.rotate(["mstar"], lambda _s, _r, b=b: run(b), repeats, warmup=lambda _s: run(1), warm=i == 0,
                                 log=lambda msg, b=b: progress(f"  i2t B={b} {msg}"),
                                 label=lambda t: f"TTFT {statistics.median(t[0]):.1f} ms, {t[1]:.0f} tok/s")["mstar"]
            rows.append(I2TRow(b, [statistics.median(t) for t, _ in per], [rate for _, rate in per]))
    return rows


def format_t2i(rows: list[T2IRow]) -> str:
    lines = ["| batch | ours s/batch | oracle s/batch | speed-up (oracle / ours) | max latent diff |",
             "|---:|---:|---:|---:|---:|"]
    for r in rows:
        ours, oracle, ratio = (spread_cell(spread(r.ours_s)), spread_cell(spread(r.oracle_s)),
                               spread_cell(spread(r.ratios), ".2f"))
        lines.append(f"| {r.batch} | {ours} | {oracle} | {ratio}x | {r.max_diff:.1e} |")
    return "\n".join(lines)


def format_i2t(rows: list[I2TRow]) -> str:
    lines = ["| batch | TTFT ms (median request) | tokens/s |", "|---:|---:|---:|"]
    for r in rows:
        ttft, rate = spread_cell(spread(r.ttft_ms), ".1f"), spread_cell(spread(r.tok_s), ".0f")
        lines.append(f"| {r.batch} | {ttft} | {rate} |")
    return "\n".join(lines)
