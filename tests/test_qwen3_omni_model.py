"""Qwen3-Omni's config, MoE block, interleaved M-RoPE, thinker, talker and code predictor against
transformers 5.x on a tiny random checkpoint (fp32, same weights), and the checkpoint loader (per-expert
weights fused, sharded safetensors with an index)."""

from __future__ import annotations

import copy

import pytest
import torch

from mstar.layers.paged_attention import AttentionMetadata, QueryMode
from mstar.model.checkpoint import CheckpointError
from mstar.model.submodule import EngineInputs
from mstar.models.qwen3_omni import loader
from mstar.models.qwen3_omni.codec_nodes import _PredictorArgs
from mstar.models.qwen3_omni.config import TINY_HF_CONFIG, Qwen3OmniConfig
from mstar.models.qwen3_omni.model import Qwen3Omni
from mstar.models.qwen3_omni.moe import SparseMoeBlock
from mstar.models.qwen3_omni.nodes import omni_token_ids
from mstar.models.qwen3_omni.prompt import build_talker_prompt, tts_embeds
from mstar.models.qwen3_omni.talker import empty_frame_cache
from mstar.models.qwen3_omni.thinker import MRotary, mrope_positions

transformers = pytest.importorskip("transformers")
MOD = pytest.importorskip("transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe")

PROMPT = torch.tensor([151644, 8948, 198, 100, 101, 151645, 198, 151644, 872, 198, 9707, 11, 1879, 151645, 198,
                       151644, 77091, 198])


@pytest.fixture(autouse=True)
def _torch_attention(monkeypatch):
    monkeypatch.setenv("MSTAR_KERNELS", "torch")  # the compiled kernels have their own tests


@pytest.fixture(scope="module")
def omni(tmp_path_factory):
    """(transformers model, checkpoint dir, our config) of the tiny configuration, seeded."""
    model = loader.hf_reference_model(TINY_HF_CONFIG, seed=0)
    path = tmp_path_factory.mktemp("omni")
    model.save_pretrained(path)
    return model, path, Qwen3OmniConfig.from_pretrained(path)


class Paged:
    """Minimal block bookkeeping to call a decoder directly over a paged cache."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, blocks: int = 64, block_size: int = 4) -> None:
        shape = (blocks, block_size, kv_heads, head_dim)
        self.caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(layers)]
        self.block_size, self.free, self.table, self.length = block_size, list(range(blocks)), [], 0

    def inputs(self, n: int) -> EngineInputs:
        slots, positions = [], []
        for pos in range(self.length, self.length + n):
            if pos // self.block_size >= len(self.table):
                self.table.append(self.free.pop(0))
            slots.append(self.table[pos // self.block_size] * self.block_size + pos % self.block_size)
            positions.append(pos)
        self.length += n
        meta = AttentionMetadata.build([n], [list(self.table)], [self.length], [QueryMode.CAUSAL_APPEND], slots)
        return EngineInputs(walks=[], nodes=[], request_ids=["r"], infos=[], splits={}, args=[None], attention=meta,
                            kv_caches=self.caches, positions=torch.tensor(positions), num_tokens=[n])


# -- config --------------------------------------------------------------------------------------------


def test_config_reads_the_checkpoint_quirks(omni):
    _, _, cfg = omni
    assert cfg.thinker.head_dim == 16 and cfg.thinker.mrope_section == (4, 2, 2)
    assert cfg.talker.text.num_experts == 4  # saved as num_local_experts
    assert cfg.talker.text.shared_expert_intermediate_size == 64
    assert cfg.talker.accept_hidden_layer == 1 and cfg.talker.codec_eos_id == 64 + 102
    assert cfg.talker.speaker_ids == {"chelsie": 317, "ethan": 318, "aiden": 319}
    assert cfg.tokens.audio == 151675 and cfg.tokens.tts_pad == 151671
    # the prompts' ids come from the same file: codec specials and speakers of the tiny talker
    assert cfg.tokens.codec_eos == 64 + 102 and cfg.tokens.codec_bos == 64 + 101
    assert cfg.tokens.speaker_id("Ethan") == 318 and cfg.tokens.vision_start == 151652
    assert cfg.talker.suppressed_from == 64


def test_config_older_rope_layout_and_errors():
    hf = copy.deepcopy(dict(TINY_HF_CONFIG))
    text = hf["thinker_config"]["text_config"]
    rope = text.pop("rope_parameters")
    text["rope_theta"], text["rope_scaling"] = 5e5, {k: v for k, v in rope.items() if k != "rope_theta"}
    hf["talker_config"]["speaker_id"] = {"Chelsie": 1}
    cfg = Qwen3OmniConfig.from_hf_dict(hf)
    assert cfg.thinker.rope_theta == 5e5 and cfg.thinker.mrope_section == (4, 2, 2)
    assert cfg.talker.speaker_ids == {"chelsie": 1}
    text["rope_scaling"]["mrope_section"] = [4, 4, 4]
    with pytest.raises(ValueError, match="mrope_section"):
        Qwen3OmniConfig.from_hf_dict(hf)
    hf = copy.deepcopy(dict(TINY_HF_CONFIG))
    hf["talker_config"]["accept_hidden_layer"] = 3
    with pytest.raises(ValueError, match="accept_hidden_layer"):
        Qwen3OmniConfig.from_hf_dict(hf)
    with pytest.raises(ValueError, match="thinker_config"):
        Qwen3OmniConfig.from_hf_dict({})


def test_model_needs_a_checkpoint_only_to_run():
    graph = Qwen3Omni().graph  # drawable without files
    walks = set(graph.walks_of("Talker") + graph.walks_of("Thinker"))
    assert {"talker_decode", "thinker_prefill_audio_in_image_in"} <= walks
    with pytest.raises(ValueError, match="--model-path"):
        Qwen3Omni().preflight()


# -- building blocks -------------------------------------------------------------------------------


def test_mrope_positions_match_get_rope_index(omni):
    """Text, two images (merged grids 2x3 and 2x2) and text again: 3-D ids and the decode delta."""
    model, _, _ = omni
    vs, img, ve = 151652, 151655, 151653
    ids = torch.tensor([151644, 872, 198, vs, *[img] * 6, ve, 5, 6, vs, *[img] * 4, ve, 7, 151645])
    grids = torch.tensor([[1, 4, 6], [1, 4, 4]])
    ref, ref_delta = model.thinker.model.get_rope_index(ids[None], grids, None, torch.ones(1, ids.numel(),
                                                                                           dtype=torch.long))
    positions, delta = mrope_positions(ids, grids, img, 2, 13)
    assert torch.equal(positions, ref[:, 0].long()) and delta == int(ref_delta) == -5
    text, zero = mrope_positions(ids[:3], None, img, 2, 13)
    assert torch.equal(text, torch.arange(3).expand(3, -1)) and zero == 0
    with pytest.raises(ValueError, match="more image placeholders"):
        mrope_positions(ids, grids[:1], img, 2, 13)


def test_interleaved_mrope_matches_transformers(omni):
    model, _, cfg = omni
    torch.manual_seed(1)
    positions = torch.randint(0, 50, (3, 11))  # distinct temporal / height / width ids
    ref = MOD.Qwen3OmniMoeThinkerTextRotaryEmbedding(model.config.thinker_config.text_config)
    cos_ref, sin_ref = ref(torch.zeros(1, 11, 4), positions[:, None, :])
    rotary = MRotary(cfg.thinker.head_dim, cfg.thinker.rope_theta, cfg.thinker.mrope_section)
    cos, sin = rotary(positions, torch.float32)
    torch.testing.assert_close(cos, cos_ref[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, sin_ref[0], rtol=0, atol=1e-6)
    text_cos, _ = MRotary(16, 1e6, (4, 2, 2))(positions[0], torch.float32)  # text: all axes equal
    torch.testing.assert_close(text_cos, MRotary(16, 1e6, (4, 2, 2))(positions[0].expand(3, -1), torch.float32)[0])


def test_mrope_text_positions_come_from_a_table_with_the_same_values():
    """Text positions (one id on all three axes, expanded or not) read a cos/sin table grown on demand;
    its rows are the bits of computing them directly. Image positions (axes differ) are computed."""
    rotary = MRotary(32, 1e6, (8, 4, 4))
    torch.manual_seed(0)
    for n in (1, 5, 40):
        ids = torch.randint(0, 3000, (n,))
        for positions in (ids.expand(3, -1), ids.expand(3, -1).contiguous(), ids):
            for dtype in (torch.float32, torch.bfloat16):
                got, want = rotary(positions, dtype), rotary._compute(ids.expand(3, -1).contiguous(), dtype)
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert rotary._tables[torch.device("cpu")][0].shape[0] >= 3000
    mixed = torch.tensor([[4, 4, 4], [4, 5, 5], [4, 5, 6]])
    table = rotary._tables[torch.device("cpu")]
    torch.testing.assert_close(rotary(mixed, torch.float32)[0], rotary._compute(mixed, torch.float32)[0], rtol=0, atol=0)
    assert not torch.equal(rotary(mixed, torch.float32)[0][1], table[0][5])  # not a text row


@pytest.mark.parametrize("part", ["thinker", "talker"])
def test_moe_block_matches_transformers(omni, part):
    model, _, cfg = omni
    ref = (model.thinker.model.language_model if part == "thinker" else model.talker.model).layers[0].mlp
    c = cfg.thinker if part == "thinker" else cfg.talker.text
    ours = SparseMoeBlock(c.hidden_size, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
                          c.norm_topk_prob, c.shared_expert_intermediate_size)
    ours.load_state_dict(ref.state_dict())
    torch.manual_seed(2)
    x = torch.randn(9, c.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x[None])[0], rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_experts_kernel_matches_the_per_expert_loop(dtype, monkeypatch):
    """The compiled ``moe_experts`` (one call for every expert) gives the bits of the per-expert loop
    over the same prepacked weights, for batches from one token to several row chunks per expert, k
    of 1 to 3 and sizes that are not multiples of a panel; a token's bits do not depend on its batch;
    bad expert ids are a clear error."""
    from mstar.layers.cpu_ops import ops
    from mstar.models.qwen3_omni import kernels
    from mstar.models.qwen3_omni.moe import Experts, route

    monkeypatch.delenv("MSTAR_KERNELS")
    if ops() is None or kernels.ops() is None:
        pytest.skip("the compiled CPU kernels are not available here")
    torch.manual_seed(0)
    for hidden, inter, n_experts, k in ((64, 32, 8, 2), (96, 48, 5, 3), (130, 70, 4, 1)):
        experts = Experts(n_experts, hidden, inter, dtype=dtype)
        with torch.no_grad():
            experts.gate_up_proj.normal_(0, 0.1)
            experts.down_proj.normal_(0, 0.1)
        assert experts.prepack() and experts._stacked is not None
        stacked = experts._stacked
        for tokens in (1, 7, 150):
            x = torch.randn(tokens, hidden, dtype=dtype)
            weights, ids = route(torch.randn(tokens, n_experts, dtype=dtype), k, True)
            fused = experts(x, weights, ids)
            experts._stacked = None  # the per-expert loop
            looped = experts(x, weights, ids)
            experts._stacked = stacked
            assert torch.equal(fused, looped), (hidden, tokens)
            assert torch.equal(experts(x[-1:], weights[-1:], ids[-1:]), fused[-1:])
        with pytest.raises(RuntimeError, match="expert id out of range"):
            experts(x[:1], weights[:1], torch.full_like(ids[:1], n_experts))


# -- decoders against transformers -------------------------------------------------------------------


def test_thinker_logits_and_greedy_tokens_match(omni):
    model, path, cfg = omni
    thinker = loader.build_thinker(cfg, path)
    c = cfg.thinker
    paged = Paged(c.num_hidden_layers, c.num_key_value_heads, c.head_dim)
    with torch.no_grad():
        out = thinker(thinker.embed(PROMPT), paged.inputs(PROMPT.numel()), capture=cfg.talker.accept_hidden_layer)
        ref = model.thinker(input_ids=PROMPT[None], output_hidden_states=True)
        torch.testing.assert_close(thinker.lm_head(out.hidden), ref.logits[0], rtol=0, atol=1e-5)
        accepted = ref.hidden_states[cfg.talker.accept_hidden_layer][0]
        torch.testing.assert_close(out.captured, accepted, rtol=0, atol=1e-5)
        tokens = [int(thinker.lm_head(out.hidden[-1]).argmax())]
        for _ in range(9):
            h = thinker(thinker.embed(torch.tensor(tokens[-1:])), paged.inputs(1)).hidden
            tokens.append(int(thinker.lm_head(h[-1]).argmax()))
        expected = model.thinker.generate(input_ids=PROMPT[None], max_new_tokens=10, do_sample=False)
    assert tokens == expected[0, PROMPT.numel():].tolist()


def test_talker_logits_match_on_the_talker_prompt(omni):
    model, path, cfg = omni
    talker = loader.build_talker(cfg, path)
    ids = omni_token_ids(cfg)
    hf_talker = model.talker
    with torch.no_grad():
        first = int(model.thinker(input_ids=PROMPT[None]).logits[0, -1].argmax())
        full = torch.cat([PROMPT, torch.tensor([first])])
        states = model.thinker(input_ids=full[None], output_hidden_states=True).hidden_states
        tts = tts_embeds(model.thinker.get_input_embeddings(), hf_talker.text_projection, ids)
        prompt = build_talker_prompt(PROMPT, states[0][0], states[cfg.talker.accept_hidden_layer][0],
                                     speaker=ids.speaker_id("ethan"), tts=tts,
                                     text_projection=hf_talker.text_projection,
                                     hidden_projection=hf_talker.hidden_projection,
                                     codec_embedding=hf_talker.get_input_embeddings(), ids=ids)
        ref = hf_talker(inputs_embeds=prompt.embeds[None], talker_input_ids=prompt.input_ids[None])
        c = cfg.talker.text
        out = talker(prompt.embeds, Paged(c.num_hidden_layers, c.num_key_value_heads, c.head_dim).inputs(
            prompt.embeds.shape[0]))
        torch.testing.assert_close(talker.codec_head(out.hidden), ref.logits[0], rtol=0, atol=1e-5)
        logits = talker.logits(out.hidden[-1:])
    assert torch.isinf(logits[0, 64:]).sum() == logits.shape[1] - 64 - 1  # all but codec EOS suppressed
    assert torch.isfinite(logits[0, cfg.talker.codec_eos_id])


def test_code_predictor_steps_match_a_full_forward(omni):
    """Our step-by-step predictor (fresh 2-token prefill + 14 one-token steps over its per-frame
    cache) against transformers' code predictor run on the whole frame sequence at once."""
    model, path, cfg = omni
    predictor = loader.build_code_predictor(cfg, path)
    ref = model.talker.code_predictor
    torch.manual_seed(3)
    seq = torch.randn(16, cfg.talker.text.hidden_size)  # [talker hidden, E(c0), 14 residual embeddings]
    with torch.no_grad():
        hidden = ref.model(inputs_embeds=seq[None]).last_hidden_state[0]
        cache, rows = empty_frame_cache(cfg.talker.code_predictor), seq[:2]
        for j in range(15):
            logits, (cache,) = predictor.step([rows], [j], [cache])
            torch.testing.assert_close(logits[0], ref.lm_head[j](hidden[j + 1]), rtol=0, atol=1e-5)
            rows = seq[j + 2:j + 3]
        assert cache.shape[2] == 16
        codes = torch.tensor([5])
        torch.testing.assert_close(predictor.embed(3, codes), ref.model.codec_embedding[3](codes))


def test_code_predictor_next_step_reuses_its_store_without_checking_each_cache(omni, monkeypatch):
    """The next step of the same batch, given the very cache views the last step returned, grows the
    same store with no per-cache check; other caches (a subset, copies) take the checked path. The
    logits and caches are the same either way."""
    import mstar.models.qwen3_omni.talker as talker_mod

    _, path, cfg = omni
    predictor = loader.build_code_predictor(cfg, path)
    checked: list[int] = []
    real_store_of = talker_mod._store_of

    def counting(caches, need):
        checked.append(len(caches))
        return real_store_of(caches, need)

    monkeypatch.setattr(talker_mod, "_store_of", counting)
    torch.manual_seed(5)
    hidden = cfg.talker.text.hidden_size
    empty = empty_frame_cache(cfg.talker.code_predictor)
    with torch.no_grad():
        _, caches = predictor.step([torch.randn(2, hidden) for _ in range(3)], [0, 0, 0], [empty] * 3)
        rows = [torch.randn(1, hidden) for _ in range(3)]
        logits, grown = predictor.step(rows, [1, 1, 1], caches)
        assert checked == []  # the usual next step: the store is known
        copies = [c.clone() for c in caches]
        want, want_caches = predictor.step(rows, [1, 1, 1], copies)
        assert checked == [3]  # not the returned views: checked (and copied into a new store)
        assert torch.equal(logits, want) and all(torch.equal(a, b) for a, b in zip(grown, want_caches))
        predictor.step(rows[:2], [2, 2], want_caches[:2])  # a subset of the last views
        assert checked == [3, 2]


@pytest.mark.parametrize("kernel", [True, False], ids=["compiled", "torch"])
def test_code_predictor_node_batches_match_each_request_alone(omni, monkeypatch, kernel):
    """``CodePredictorNode`` over 4 requests' frames: alone, all at the same step in one batch (the
    one-step path), and staggered so that batches mix steps 0..14 (the general path): the same codes;
    the same sums and caches bit for bit through the compiled kernels (batch-invariant), within 1e-5
    through PyTorch's."""
    from mstar.layers.cpu_ops import ops
    from mstar.layers.sampling import SamplingParams
    from mstar.models.qwen3_omni.codec_nodes import CodePredictorNode

    if kernel:
        monkeypatch.delenv("MSTAR_KERNELS")
        if ops() is None:
            pytest.skip("the compiled CPU kernels are not available here")
    _, path, cfg = omni
    node = CodePredictorNode(loader.build_code_predictor(cfg, path))
    assert (node.predictor.model.layers[0].self_attn.prepacked is not None) == kernel
    torch.manual_seed(5)
    hidden = [torch.randn(1, cfg.talker.text.hidden_size) for _ in range(4)]
    start = [{"code": torch.tensor([3 + r]), "cache": empty_frame_cache(cfg.talker.code_predictor),
              "sum": torch.randn(1, cfg.talker.text.hidden_size)} for r in range(4)]

    def run(schedule):  # schedule: per tick, the requests that take their next step together
        state, j, codes = [dict(s) for s in start], [0] * 4, [[] for _ in range(4)]
        for tick in schedule:
            args = [_PredictorArgs(j[r], j[r], SamplingParams(temperature=0.0), hidden[r], state[r]["code"],
                                   state[r]["cache"], state[r]["sum"]) for r in tick]
            ei = EngineInputs(walks=[], nodes=[], request_ids=[], infos=[], splits={}, args=args)
            with torch.inference_mode():  # as the engine calls it
                out = node.forward(None, ei)
            for k, r in enumerate(tick):
                state[r] = {"code": out["code"][k].reshape(-1), "cache": out["cp_cache"][k], "sum": out["cp_sum"][k]}
                codes[r].append(int(out["code"][k]))
                j[r] += 1
        assert j == [15] * 4
        return codes, state

    alone = run([[r] for r in range(4) for _ in range(15)])
    together = run([[0, 1, 2, 3]] * 15)
    staggered = run([[0, 1]] + [[0, 1, 2, 3]] * 14 + [[2, 3]])
    if kernel:  # the compiled decode steps agree with the PyTorch path
        monkeypatch.setenv("MSTAR_KERNELS", "torch")
        node = CodePredictorNode(loader.build_code_predictor(cfg, path))
        plain = run([[0, 1, 2, 3]] * 15)
        assert plain[0] == alone[0]
        for a, b in zip(alone[1], plain[1]):
            torch.testing.assert_close(a["cache"], b["cache"], rtol=0, atol=1e-5)
            torch.testing.assert_close(a["sum"], b["sum"], rtol=0, atol=1e-5)
    for other in (together, staggered):
        assert other[0] == alone[0]
        for a, b in zip(alone[1], other[1]):
            for name in ("sum", "cache"):
                if kernel:
                    assert torch.equal(a[name], b[name]), name
                else:
                    torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-5)
    assert alone[1][0]["cache"].shape[2] == 16


# -- loader --------------------------------------------------------------------------------------------


def test_loader_reads_sharded_checkpoints(omni, tmp_path):
    model, path, cfg = omni
    model.save_pretrained(tmp_path, max_shard_size="20MB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    a, b = loader.build_talker(cfg, path), loader.build_talker(cfg, tmp_path)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name
    experts = a.model.layers[1].mlp.experts
    ref = model.talker.model.layers[1].mlp.experts
    assert torch.equal(experts.gate_up_proj, ref.gate_up_proj) and torch.equal(experts.down_proj, ref.down_proj)


def test_fuse_expert_weights_layout_and_errors():
    gate, up, down = torch.randn(2, 3), torch.randn(2, 3), torch.randn(3, 2)
    state = {f"l.mlp.experts.{e}.{p}_proj.weight": t * (e + 1) for e in range(2)
             for p, t in (("gate", gate), ("up", up), ("down", down))}
    fused = loader.fuse_expert_weights({**state, "l.mlp.gate.weight": torch.zeros(2, 3)})
    assert fused["l.mlp.experts.gate_up_proj"].shape == (2, 4, 3)
    assert torch.equal(fused["l.mlp.experts.gate_up_proj"][1], torch.cat([gate, up]) * 2)
    assert torch.equal(fused["l.mlp.experts.down_proj"][0], down) and "l.mlp.gate.weight" in fused
    del state["l.mlp.experts.1.up_proj.weight"]
    with pytest.raises(CheckpointError, match="missing"):
        loader.fuse_expert_weights(state)


def test_loader_reports_mismatches(omni, tmp_path):
    _, path, cfg = omni
    bigger = copy.deepcopy(dict(TINY_HF_CONFIG))
    bigger["talker_config"]["text_config"]["num_hidden_layers"] = 3
    with pytest.raises(CheckpointError, match="missing"):
        loader.build_talker(Qwen3OmniConfig.from_hf_dict(bigger), path)
    with pytest.raises(FileNotFoundError):
        loader.build_thinker(cfg, tmp_path)


def test_the_audio_tower_runs_once_per_clip_and_keeps_its_embeddings():
    """Each clip is encoded alone (its embeddings do not depend on the batch) and kept: a clip seen
    again is not encoded again and gets the same embeddings; the store stays within its bytes."""
    import math

    from mstar.model.submodule import EngineInputs
    from mstar.models.qwen3_omni.encoders import audio_input
    from mstar.models.qwen3_omni.model import Qwen3OmniTiny

    model = Qwen3OmniTiny()
    node = model.build_submodules(["audio_encoder"])["audio_encoder"]
    t = torch.arange(12000) / 24000
    clips = [audio_input((0.3 * torch.sin(2 * math.pi * f * t) * 32767).to(torch.int16), 24000, model.audio_window,
                         model.media.audio).features for f in (300, 500)]
    calls = []
    tower = node.tower
    tower.register_forward_pre_hook(lambda _module, args: calls.append(len(args[0])))

    def run(per_request):
        ei = EngineInputs(walks=[], nodes=[], request_ids=[], infos=[], splits={}, args=per_request)
        with torch.inference_mode():
            return node.forward(None, ei)["audio_embeds"]

    alone = run([[clips[0]]])[0]
    both = run([[clips[0], clips[1]], [clips[1]]])
    assert calls == [1, 1]  # clip 0 once, clip 1 once (then from the store, in the same batch too)
    assert torch.equal(both[0][:alone.shape[0]], alone) and torch.equal(both[1], both[0][alone.shape[0]:])
    assert node.cache.hits == 2 and len(node.cache) == 2
    with torch.inference_mode():
        assert torch.equal(tower([clips[1]])[0], both[1])  # kept as computed
    node.cache = type(node.cache)(max_bytes=alone.numel() * alone.element_size())  # room for one clip
    run([[clips[0]], [clips[1]]])
    assert len(node.cache) == 1 and node.cache.bytes <= node.cache.max_bytes
