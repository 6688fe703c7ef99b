"""lerobot's pi0.5 (``PI05Pytorch.sample_actions``) one request at a time, for ``mstar bench compare
policy``. Runs inside the reference virtualenv (``make ref-pi05``), never imports mstar.

``python pi05_lerobot.py JOB.json``; the job names:

* ``shim_dir``: the directory of ``pi05_ref_shim.py`` (which imports lerobot's model on Python 3.11);
* ``sizes``: the model's sizes (vision tower, both Gemma stacks, vocabulary, image side);
* ``checkpoint``: a directory; its ``model.safetensors`` is loaded, or written first (seeded random
  weights in lerobot's ``pi05_base`` key names, tied embedding left out) when it does not exist;
* ``threads`` (optional): torch threads.

Once the model is built it prints one JSON line (``reference``: what runs, ``threads``), then
answers each JSON line on stdin with one on stdout: ``{"inputs": F, "actions_out": G, "warmup": k}``
runs the N requests of the safetensors file F (``images`` [N, cam, 3, H, W] in [-1, 1],
``img_masks`` [N, cam], ``tokens`` [N, L], ``masks`` [N, L], ``noise`` [N, horizon, 32]) ``k``
times untimed, then one by one, timed, writes their actions [N, horizon, 32] to G and answers
``{"seconds": [...]}``. It exits at the end of stdin.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

_EMBED = "paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight"
_LM_HEAD = "paligemma_with_expert.paligemma.lm_head.weight"


def _shrink(mp, sizes: dict) -> None:
    """lerobot hardcodes the Gemma variants, the So400m tower and the vocabulary: use ``sizes``."""
    gemma = {k: mp.GemmaConfig(**sizes[k]) for k in ("gemma_2b", "gemma_300m")}
    mp.get_gemma_config = lambda variant: gemma[variant]
    paligemma, expert = mp.PaliGemmaForConditionalGenerationWithPiGemma, mp.PiGemmaForCausalLM
    vis = sizes["vision"]

    def small_paligemma(config):
        vc = config.vision_config
        vc.hidden_size, vc.intermediate_size = vis["hidden_size"], vis["intermediate_size"]
        vc.num_hidden_layers, vc.num_attention_heads = vis["num_layers"], vis["num_heads"]
        vc.projection_dim = config.text_config.hidden_size
        config.text_config.vocab_size = sizes["vocab"]
        return paligemma(config=config)

    def small_expert(config):
        config.vocab_size = sizes["vocab"]
        return expert(config=config)

    mp.PaliGemmaForConditionalGenerationWithPiGemma = small_paligemma
    mp.PiGemmaForCausalLM = small_expert


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """lerobot zero-initialises the adaRMS projections and the norm offsets: give them values."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".dense." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
            elif "norm" in name and name.endswith("weight"):
                p.add_(torch.randn(p.shape, generator=g) * 0.1)


def build(job: dict) -> torch.nn.Module:
    sys.path.insert(0, job["shim_dir"])
    import pi05_ref_shim as ref

    _shrink(ref.modeling_pi05, job["sizes"])
    side = job["sizes"]["image"]
    torch.manual_seed(job.get("seed", 0))
    model = ref.PI05Pytorch(ref.PI05Config(image_resolution=(side, side), dtype="float32")).eval()
    file = Path(job["checkpoint"]) / "model.safetensors"
    if file.is_file():
        state = load_file(str(file))
        state[_EMBED] = state[_LM_HEAD]
        model.load_state_dict(state, strict=True)
    else:
        _randomize(model, job.get("seed", 0) + 1)
        with torch.no_grad():
            pg = model.paligemma_with_expert.paligemma
            pg.model.language_model.embed_tokens.weight.copy_(pg.lm_head.weight)
        weights = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items() if k != _EMBED}
        file.parent.mkdir(parents=True, exist_ok=True)
        save_file(weights, str(file))
    return model


def run(model: torch.nn.Module, cmd: dict) -> dict:
    inp = load_file(cmd["inputs"])
    n, cams = inp["images"].shape[:2]

    def one(i: int) -> torch.Tensor:
        images = [inp["images"][i, c:c + 1] for c in range(cams)]
        masks = [inp["img_masks"][i, c:c + 1] for c in range(cams)]
        return model.sample_actions(images, masks, inp["tokens"][i:i + 1], inp["masks"][i:i + 1],
                                    noise=inp["noise"][i:i + 1].clone(), num_steps=10)

    with torch.no_grad():
        for i in range(cmd.get("warmup", 0)):
            one(i % n)
        seconds, actions = [], []
        for i in range(n):
            t0 = time.perf_counter()
            actions.append(one(i)[0])
            seconds.append(time.perf_counter() - t0)
    save_file({"actions": torch.stack(actions).contiguous()}, cmd["actions_out"])
    return {"seconds": seconds}


def main(path: str) -> None:
    job = json.loads(Path(path).read_text())
    if "threads" in job:
        torch.set_num_threads(int(job["threads"]))
    model = build(job)
    from importlib.metadata import version

    desc = (f"lerobot {version('lerobot')} PI05Pytorch.sample_actions, transformers {version('transformers')}, "
            f"torch {torch.__version__}")
    print(json.dumps({"reference": desc, "threads": torch.get_num_threads()}), flush=True)
    for line in sys.stdin:
        if line.strip():
            print(json.dumps(run(model, json.loads(line))), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
