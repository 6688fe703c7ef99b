"""bagel-tiny with its MoT LLM (and the CFG views, which share it) tensor-parallel over two gloo
worker processes: editing with both guidance contexts gives the latents of one rank, understanding
the same greedy text, and KV blocks return to zero on both ranks."""

from __future__ import annotations

import pytest
import torch

from mstar import Runtime
from mstar.models.bagel.model import BagelTiny
from mstar.placement import Placement

TP2 = {"model": "bagel-tiny", "node_groups": [
    {"node_names": ["vit_encoder", "vae_encoder", "vae_decoder"], "ranks": [0]},
    {"node_names": ["LLM", "LLM_cfg_text", "LLM_cfg_img", "combine_cfg"], "ranks": [0, 1], "tp_size": 2}]}


def _text(s: str) -> torch.Tensor:
    return torch.tensor([b + 3 for b in s.encode()], dtype=torch.long)


def _image(seed: int, h: int = 40, w: int = 52) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8)


REQUESTS = [  # editing (main + text-free + image-free guidance contexts), then understanding
    ({"text_ids": [_text("make it blue")], "images": [_image(1)]},
     {"target": "image", "seed": 5, "num_timesteps": 5, "output_type": "latent", "cfg_renorm_type": "global"}),
    ({"text_ids": [_text("what is this?")], "images": [_image(2, 56, 30)]}, {"target": "text", "max_tokens": 8}),
]


@pytest.fixture(scope="module")
def outputs():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MSTAR_KERNELS", "torch")  # the shards are under test, not the compiled kernel
        with Runtime(BagelTiny()) as rt:
            one = [rt.generate([inputs], params)[0] for inputs, params in REQUESTS]
        with Runtime(BagelTiny(), Placement.from_dict(TP2), workers="process") as rt:
            two = [rt.generate([inputs], params)[0] for inputs, params in REQUESTS]
            used = [sum(kv["blocks_used"] for kv in r["kv"].values()) for r in rt.stats()["ranks"]]
    for o in one + two:
        assert o.finished, o.error
    return one, two, used


def test_bagel_tp2_editing_with_cfg_gives_the_latents_of_one_rank(outputs):
    one, two, _ = outputs
    (a,), (b,) = one[0].tensors("image_output"), two[0].tensors("image_output")
    torch.testing.assert_close(b, a, rtol=0, atol=1e-4)


def test_bagel_tp2_understanding_gives_the_text_of_one_rank(outputs):
    one, two, _ = outputs
    assert [int(t) for t in two[1].tensors("text")] == [int(t) for t in one[1].tensors("text")]


def test_bagel_tp2_kv_blocks_return_to_zero_on_both_ranks(outputs):
    assert outputs[2] == [0, 0]
