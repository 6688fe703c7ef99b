"""pi0.5's modules against the reference fixture (lerobot 0.6.1 ``PI05Pytorch``, fp32), without lerobot.

The fixture (``tests/fixtures/pi05``, written by ``make pi05-fixture``) holds tiny weights under a
lerobot checkpoint's key names, two requests (the second with a masked camera and right padding),
and the reference's prefix K/V, first velocity and final actions. Here the weights go through the
real loader (``model.safetensors`` in a directory) and the LLM module runs over a small paged cache,
prefix and flow steps as the runtime drives them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mstar.layers.paged_attention import AttentionMetadata, QueryMode
from mstar.model import EngineInputs, ForwardInfo
from mstar.model.checkpoint import CheckpointError
from mstar.models.pi05.config import PI05_BASE, PI05_TINY
from mstar.models.pi05.flow import step_time
from mstar.models.pi05.loader import LLM, VISION, build_components, config_from_json

FIXTURE = Path(__file__).parent / "fixtures" / "pi05" / "pi05_tiny.safetensors"
ATOL = 1e-5


@dataclass
class Fixture:
    weights: dict[str, torch.Tensor]
    inputs: dict[str, torch.Tensor]
    outputs: dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def fx() -> Fixture:
    raw = load_file(str(FIXTURE))
    part = {p: {k[len(p) + 1:]: v for k, v in raw.items() if k.startswith(p + ".")} for p in ("w", "in", "out")}
    return Fixture(part["w"], part["in"], part["out"])


def write_checkpoint(directory: Path, weights: dict[str, torch.Tensor]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(directory / "model.safetensors"))
    return directory


@pytest.fixture(scope="module")
def parts(fx, tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("pi05"), fx.weights)
    torch.manual_seed(0)
    return build_components(PI05_TINY, {VISION, LLM}, model_path=str(path), load_format="auto",
                            dtype=torch.float32, seed=0)


@dataclass
class PagedHarness:
    """A paged cache with consecutive blocks per request, driving the LLM module as the engine does."""

    node: torch.nn.Module
    block_size: int = 16
    num_blocks: int = 32
    caches: list = field(default_factory=list)
    tables: dict[str, list[int]] = field(default_factory=dict)
    lengths: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        s = self.node.kv_spec
        shape = (self.num_blocks, self.block_size, s.num_kv_heads, s.head_dim)
        self.caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(s.num_layers)]

    def _blocks(self, rid: str, n: int) -> list[int]:
        if rid not in self.tables:
            first = sum(len(t) for t in self.tables.values())
            self.tables[rid] = list(range(first, first + -(-n // self.block_size)))
        return self.tables[rid]

    def run(self, items: list[tuple[str, str, int, dict]]) -> dict[str, list[torch.Tensor]]:
        """``items``: (request id, walk, step, inputs) -> the module's outputs, one forward."""
        prepared, lens, tables, ctx, modes, slots, pos = [], [], [], [], [], [], []
        for rid, walk, step, inputs in items:
            info = ForwardInfo(rid, walk, "prefix" if walk == "prefix" else "expert", (step,), {})
            ni = self.node.prepare_inputs(walk, info, inputs)
            seq = ni.sequences[0]
            before = self.lengths.get(rid, 0)
            table = self._blocks(rid, seq.num_tokens)
            if seq.mode is QueryMode.READ_ONLY:
                slots += [-1] * seq.num_tokens
                ctx.append(before)
            else:
                slots += [table[j // self.block_size] * self.block_size + j % self.block_size
                          for j in range(before, before + seq.num_tokens)]
                self.lengths[rid] = before + seq.num_tokens
                ctx.append(before + seq.num_tokens)
            prepared.append((info, ni))
            lens.append(seq.num_tokens)
            tables.append(table)
            modes.append(seq.mode)
            pos.append(torch.arange(before, before + seq.num_tokens))
        names = list(prepared[0][1].tensor_inputs)
        tensors = {n: torch.cat([ni.tensor_inputs[n] for _, ni in prepared]) for n in names}
        ei = EngineInputs(walks=[w for _, w, _, _ in items], nodes=[i.node for i, _ in prepared],
                          request_ids=[r for r, *_ in items], infos=[i for i, _ in prepared],
                          splits={n: [ni.tensor_inputs[n].shape[0] for _, ni in prepared] for n in names},
                          args=[ni.args for _, ni in prepared],
                          attention=AttentionMetadata.build(lens, tables, ctx, modes, slots),
                          kv_caches=self.caches, positions=torch.cat(pos), num_tokens=lens)
        with torch.inference_mode():
            return self.node(None, ei, **tensors)

    def snapshot(self) -> list[torch.Tensor]:
        return [t.clone() for kv in self.caches for t in kv]


def request_inputs(fx: Fixture, parts, b: int) -> dict[str, list[torch.Tensor]]:
    """The prefix walk's inputs of fixture request ``b`` (the vision output of its valid cameras)."""
    i = fx.inputs
    valid = i["img_masks"][:, b]
    with torch.inference_mode():
        emb = parts[VISION](i["images"][valid, b])
    return {"image_embeds": [emb.flatten(0, 1)], "token_ids": [i["tokens"][b]], "token_mask": [i["masks"][b]]}


def run_flow(h: PagedHarness, fx: Fixture, parts, rids=(0, 1)) -> tuple[dict, dict]:
    """Prefix of every request in one forward, then the 10 flow steps batched; (velocity0, actions)."""
    h.run([(f"r{b}", "prefix", 0, request_inputs(fx, parts, b)) for b in rids])
    x = {b: fx.inputs["noise"][b] for b in rids}
    v0 = {}
    for step in range(PI05_TINY.num_steps):
        out = h.run([(f"r{b}", "actions", step, {"actions": [x[b]]}) for b in rids])
        for j, b in enumerate(rids):
            x[b] = out["actions"][j]
            if step == 0:
                v0[b] = out["velocity"][j]
    return v0, x


def test_vision_matches_reference(fx, parts):
    with torch.inference_mode():
        for c in range(fx.inputs["images"].shape[0]):
            got = parts[VISION](fx.inputs["images"][c])
            torch.testing.assert_close(got, fx.outputs["image_embs"][c], atol=ATOL, rtol=0)


def test_prefix_kv_matches_reference_on_valid_tokens(fx, parts):
    h = PagedHarness(parts[LLM])
    h.run([(f"r{b}", "prefix", 0, request_inputs(fx, parts, b)) for b in (0, 1)])
    for b in (0, 1):
        valid = fx.outputs["prefix_pad_masks"][b]
        n = int(valid.sum())
        assert h.lengths[f"r{b}"] == n  # only valid tokens are stored
        table = torch.tensor(h.tables[f"r{b}"])
        for layer, (k_cache, v_cache) in enumerate(h.caches):
            k = k_cache[table].flatten(0, 1)[:n]
            v = v_cache[table].flatten(0, 1)[:n]
            ref_k = fx.outputs[f"k.{layer}"][b].transpose(0, 1)[valid]  # [n, kv_heads, d]
            ref_v = fx.outputs[f"v.{layer}"][b].transpose(0, 1)[valid]
            torch.testing.assert_close(k, ref_k, atol=ATOL, rtol=0)
            torch.testing.assert_close(v, ref_v, atol=ATOL, rtol=0)


def test_prefix_embeddings_match_reference(fx, parts):
    from mstar.models.pi05.nodes import prefix_tokens

    for b in (0, 1):
        inp = request_inputs(fx, parts, b)
        with torch.inference_mode():
            x = prefix_tokens(parts[LLM].prefix, inp["image_embeds"][0], inp["token_ids"][0], inp["token_mask"][0])
        ref = fx.outputs["prefix_embs"][b][fx.outputs["prefix_pad_masks"][b]]
        torch.testing.assert_close(x, ref, atol=ATOL, rtol=0)


def test_velocity_and_actions_match_reference_and_cache_is_read_only(fx, parts):
    prefix_only = PagedHarness(parts[LLM])
    prefix_only.run([(f"r{b}", "prefix", 0, request_inputs(fx, parts, b)) for b in (0, 1)])
    h = PagedHarness(parts[LLM])
    v0, actions = run_flow(h, fx, parts)
    for a, b in zip(h.snapshot(), prefix_only.snapshot()):
        assert torch.equal(a, b)  # the ten flow steps wrote nothing
    for b in (0, 1):
        torch.testing.assert_close(v0[b], fx.outputs["velocity0"][b], atol=ATOL, rtol=0)
        torch.testing.assert_close(actions[b], fx.outputs["actions"][b], atol=ATOL, rtol=0)


def test_staggered_requests_share_forwards(fx, parts):
    """Request 1's prefix beside request 0's flow step 3, then both at different steps in one
    forward: each still gets the reference's actions."""
    h = PagedHarness(parts[LLM])
    h.run([("r0", "prefix", 0, request_inputs(fx, parts, 0))])
    x = {0: fx.inputs["noise"][0], 1: fx.inputs["noise"][1]}
    for step in range(3):
        (x[0],) = h.run([("r0", "actions", step, {"actions": [x[0]]})])["actions"]
    out = h.run([("r0", "actions", 3, {"actions": [x[0]]}), ("r1", "prefix", 0, request_inputs(fx, parts, 1))])
    x[0] = out["actions"][0]
    steps = {0: 4, 1: 0}
    while steps[1] < PI05_TINY.num_steps:
        live = [b for b in (0, 1) if steps[b] < PI05_TINY.num_steps]
        out = h.run([(f"r{b}", "actions", steps[b], {"actions": [x[b]]}) for b in live])
        for j, b in enumerate(live):
            x[b] = out["actions"][j]
            steps[b] += 1
    for b in (0, 1):
        torch.testing.assert_close(x[b], fx.outputs["actions"][b], atol=ATOL, rtol=0)


def test_masked_camera_and_padding_change_nothing(fx, parts):
    """Request 1 with different pixels in its masked camera and different padded token ids."""
    h = PagedHarness(parts[LLM])
    i = fx.inputs
    images = i["images"][:, 1].clone()
    images[2] = torch.rand_like(images[2])  # the masked camera
    tokens = i["tokens"][1].clone()
    tokens[15:] = 7  # padding
    from mstar.models.pi05.nodes import VisionNode

    vision = VisionNode(parts[VISION])
    emb = vision(None, _stateless_inputs(1, [images.shape[0] - 1]),
                 images=vision.prepare_inputs("prefix", None, {"images": [images], "image_masks": [i["img_masks"][:, 1]]})
                 .tensor_inputs["images"])["image_embeds"][0]
    h.run([("r1", "prefix", 0, {"image_embeds": [emb], "token_ids": [tokens], "token_mask": [i["masks"][1]]})])
    x = i["noise"][1]
    for step in range(PI05_TINY.num_steps):
        (x,) = h.run([("r1", "actions", step, {"actions": [x]})])["actions"]
    torch.testing.assert_close(x, fx.outputs["actions"][1], atol=ATOL, rtol=0)


def _stateless_inputs(n: int, rows: list[int]) -> EngineInputs:
    return EngineInputs(walks=["prefix"] * n, nodes=["vision"] * n, request_ids=[f"r{j}" for j in range(n)],
                        infos=[], splits={"images": rows}, args=[None] * len(rows))


def test_flow_times():
    assert [round(step_time(k, 10), 6) for k in range(10)] == [1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1]
    assert step_time(3, 10) == float(torch.tensor(1.0 + 3 * -0.1, dtype=torch.float32))


# -- loader ------------------------------------------------------------------------------------------
def _llm_state(parts) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in parts[LLM].state_dict().items()}


def test_loader_accepts_model_prefix_and_old_time_mlp_names(fx, parts, tmp_path):
    renamed = {}
    for k, v in fx.weights.items():
        k = k.replace("time_mlp_", "action_time_mlp_")
        renamed["model." + k] = v
    comps = build_components(PI05_TINY, {LLM}, model_path=str(write_checkpoint(tmp_path, renamed)),
                             load_format="auto", dtype=torch.float32, seed=0)
    for k, v in _llm_state(parts).items():
        assert torch.equal(comps[LLM].state_dict()[k], v), k


def test_loader_takes_embed_tokens_from_lm_head_and_drops_expert_lm_head(fx, parts):
    head = fx.weights["paligemma_with_expert.paligemma.lm_head.weight"]
    assert torch.equal(parts[LLM].prefix.embed_tokens.weight, head)
    assert "paligemma_with_expert.gemma_expert.lm_head.weight" in fx.weights
    assert not any("lm_head" in k for k in parts[LLM].state_dict())


def test_loader_reports_missing_mis_shaped_and_stray_keys(fx, tmp_path):
    missing = {k: v for k, v in fx.weights.items() if "layers.1.mlp.up_proj" not in k}
    path = write_checkpoint(tmp_path / "missing", missing)
    with pytest.raises(CheckpointError, match=r"missing: .*layers\.1\.mlp\.up_proj"):
        build_components(PI05_TINY, {LLM}, model_path=str(path), load_format="auto", dtype=torch.float32, seed=0)
    key = "paligemma_with_expert.gemma_expert.model.layers.0.self_attn.k_proj.weight"
    path = write_checkpoint(tmp_path / "shape", {**fx.weights, key: torch.zeros(8, 32)})
    with pytest.raises(CheckpointError, match=r"shape mismatch: expert\.layers\.0\.self_attn\.k_proj\.weight "
                                              r"\(checkpoint \(8, 32\), model \(16, 32\)\)"):
        build_components(PI05_TINY, {LLM}, model_path=str(path), load_format="auto", dtype=torch.float32, seed=0)
    stray = {**fx.weights, "state_proj.weight": torch.zeros(2, 2)}
    path = write_checkpoint(tmp_path / "stray", stray)
    with pytest.raises(CheckpointError, match="unexpected key 'state_proj.weight'"):
        build_components(PI05_TINY, {VISION}, model_path=str(path), load_format="auto", dtype=torch.float32, seed=0)
    with pytest.raises(CheckpointError, match="missing model.safetensors"):
        build_components(PI05_TINY, {LLM}, model_path=str(tmp_path / "none"), load_format="auto",
                         dtype=torch.float32, seed=0)


def test_config_from_lerobot_json(tmp_path):
    f = tmp_path / "config.json"
    f.write_text(json.dumps({"type": "pi05", "paligemma_variant": "gemma_2b", "action_expert_variant": "gemma_300m",
                             "chunk_size": 15, "max_action_dim": 32, "num_inference_steps": 10,
                             "image_resolution": [224, 224], "tokenizer_max_length": 200}))
    cfg = config_from_json(f)
    assert (cfg.horizon, cfg.num_steps, cfg.vision.tokens_per_image) == (15, 10, 256)
    assert cfg.prefix == PI05_BASE.prefix and cfg.expert == PI05_BASE.expert
    f.write_text(json.dumps({"type": "pi0"}))
    with pytest.raises(CheckpointError, match="not a pi0.5 config"):
        config_from_json(f)
    f.write_text(json.dumps({"type": "pi05", "action_expert_variant": "gemma_2b"}))
    with pytest.raises(CheckpointError, match="action_expert_variant"):
        config_from_json(f)


def test_normalization_mapping_is_read_not_assumed(tmp_path):
    """lerobot's default mapping loads (in any letter case); a fine-tune whose
    state or actions use another mode is refused naming it, not served with quantiles."""
    f = tmp_path / "config.json"
    ok = {"VISUAL": "IDENTITY", "STATE": "QUANTILES", "ACTION": "quantiles"}
    f.write_text(json.dumps({"type": "pi05", "normalization_mapping": ok}))
    assert config_from_json(f).horizon == PI05_BASE.horizon
    f.write_text(json.dumps({"type": "pi05", "normalization_mapping": {**ok, "STATE": "MEAN_STD"}}))
    with pytest.raises(CheckpointError, match="normalization_mapping STATE: MEAN_STD is not supported"):
        config_from_json(f)
    f.write_text(json.dumps({"type": "pi05", "normalization_mapping": ["QUANTILES"]}))
    with pytest.raises(CheckpointError, match="normalization_mapping must be an object"):
        config_from_json(f)


def test_model_needs_a_checkpoint_directory(tmp_path):
    from mstar.models.pi05.model import Pi05Model, Pi05Tiny

    with pytest.raises(ValueError, match="needs --model-path"):
        Pi05Model()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        Pi05Model(model_path=tmp_path).preflight()
    with pytest.raises(ValueError, match="has no checkpoint"):
        Pi05Tiny(model_path=tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "config.json").write_text(json.dumps({"type": "pi05", "chunk_size": 10}))
    model = Pi05Model(model_path=tmp_path)
    model.preflight()
    assert model.config.horizon == 10 and model.graph.node_names == {"vision", "prefix", "expert"}


def test_the_real_size_layout_has_pi05_base_shapes():
    """``PI05_BASE`` built on the meta device: pi05_base's 3617M unique parameters once the expert's
    dropped LM head (257152 x 1024) is counted, and the checkpoint's shapes under the loaded names."""
    from mstar.models.pi05.loader import llm_key, vision_key
    from mstar.models.pi05.nodes import Pi05LLMNode
    from mstar.models.pi05.vision import Pi05Vision

    with torch.device("meta"):
        llm, vision = Pi05LLMNode(PI05_BASE), Pi05Vision(PI05_BASE.vision, PI05_BASE.prefix.width)
    total = sum(p.numel() for m in (llm, vision) for p in m.parameters()) + 257_152 * 1024
    assert round(total / 1e6) == 3617
    sd = {**llm.state_dict(), **vision.state_dict()}
    e, pg = "paligemma_with_expert.gemma_expert.model.", "paligemma_with_expert.paligemma.model."
    shapes = {e + "layers.0.self_attn.q_proj.weight": (2048, 1024), e + "layers.17.self_attn.o_proj.weight": (1024, 2048),
              e + "layers.0.input_layernorm.dense.weight": (3072, 1024), e + "norm.dense.bias": (3072,),
              pg + "language_model.layers.17.mlp.gate_proj.weight": (16_384, 2048),
              pg + "language_model.layers.0.self_attn.k_proj.weight": (256, 2048),
              "paligemma_with_expert.paligemma.lm_head.weight": (257_152, 2048),
              pg + "vision_tower.vision_model.encoder.layers.26.mlp.fc1.weight": (4304, 1152),
              pg + "vision_tower.vision_model.embeddings.patch_embedding.weight": (1152, 3, 14, 14),
              pg + "multi_modal_projector.linear.weight": (2048, 1152), "time_mlp_in.weight": (1024, 1024),
              "action_in_proj.weight": (1024, 32), "action_out_proj.weight": (32, 1024)}
    for key, shape in shapes.items():
        name = vision_key(key) or llm_key(key)
        assert tuple(sd[name].shape) == shape, key


def test_graph_is_torch_free_and_walks_prefix_then_actions():
    import subprocess
    import sys

    code = "import sys, mstar.models.pi05.graph as g; g.build_graph(); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])
    from mstar.model.base import WalkState
    from mstar.models.pi05.graph import build_graph, next_walk

    graph = build_graph(num_steps=7)
    assert graph.node_names == {"vision", "prefix", "expert"}
    state = WalkState(request_id="r", partition="main", params={})
    order = []
    while (walk := next_walk(state)) is not None:
        order.append(walk)
        state.history.append(walk)
    assert order == ["prefix", "actions"]
    assert "max_iters=7" in graph.describe("actions")


@pytest.mark.parametrize("name", ["pi05_single.yaml", "pi05_vision_rank.yaml"])
def test_shipped_placements_validate(name):
    from mstar.model import resolve_model
    from mstar.placement import Placement

    placement = Placement.load(Path(__file__).resolve().parents[1] / "examples" / "placements" / name)
    placement.validate(resolve_model("pi05-tiny").graph)
