"""Toy models that exercise every Walk Graph primitive, each with a plain-PyTorch reference."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mstar.graph import (
    EMIT_TO_CLIENT,
    TO_STATE,
    Connection,
    DynamicLoop,
    FinishReason,
    GraphEdge,
    GraphNode,
    Loop,
    Parallel,
    PartitionTopology,
    Sequential,
    SlidingWindowChunkPolicy,
    StreamingGraphEdge,
    Walk,
    WalkGraph,
)
from mstar.layers.paged_attention import QueryMode, paged_attention
from mstar.layers.sampling import SamplingParams, sample
from mstar.model import KVSpec, ModelDef, NodeInputs, NodeSubmodule

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MAX_POS = 32, 16, 2, 1, 8, 256
EOS = 0
POISON = 31  # a prompt holding it makes the forward raise: failure isolation tests


@dataclass(slots=True)
class ToyArgs:
    """TinyAttentionLM's args: its sampling, the step it samples, its max_tokens."""

    sampling: SamplingParams
    step: int
    max_tokens: int


class TinyAttentionLM(NodeSubmodule):
    """One attention layer + MLP over the runtime's paged KV cache; samples the next token."""

    kv_spec = KVSpec(num_layers=1, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)

    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embed = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=g))
        self.pos = torch.nn.Parameter(torch.randn(MAX_POS, HIDDEN, generator=g) * 0.1)
        self.wq = torch.nn.Parameter(torch.randn(HIDDEN, HEADS * HEAD_DIM, generator=g) / 4)
        self.wk = torch.nn.Parameter(torch.randn(HIDDEN, KV_HEADS * HEAD_DIM, generator=g) / 4)
        self.wv = torch.nn.Parameter(torch.randn(HIDDEN, KV_HEADS * HEAD_DIM, generator=g) / 4)
        self.wo = torch.nn.Parameter(torch.randn(HEADS * HEAD_DIM, HIDDEN, generator=g) / 4)
        self.head = torch.nn.Parameter(torch.randn(HIDDEN, VOCAB, generator=g))

    def hidden_in(self, ids, positions):
        return self.embed[ids] + self.pos[positions]

    def prepare_inputs(self, graph_walk, fwd_info, inputs):
        ids = inputs["input_ids" if graph_walk == "prefill" else "token"][0].reshape(-1).long()
        step = fwd_info.iteration[0] + 1 if fwd_info.iteration else 0
        sp = SamplingParams.from_dict({"temperature": 0.0, **fwd_info.params.get("sampling", {})})
        return NodeInputs(tensor_inputs={"ids": ids}, num_tokens=ids.numel(),
                          args=ToyArgs(sp, step, fwd_info.params.get("max_tokens", 8)))

    def continue_batch(self, graph_walk, engine_inputs, tensors, outputs):
        """The next decode step of every row (the worker's running rows, runtime/running_rows.py)."""
        return ({"ids": torch.cat(outputs["token"]).long()},
                [ToyArgs(a.sampling, a.step + 1, a.max_tokens) for a in engine_inputs.args])

    def forward(self, graph_walk, engine_inputs, ids):
        ei = engine_inputs
        if bool((ids == POISON).any()):
            raise ValueError("poison token in batch")
        x = self.hidden_in(ids, ei.positions)
        q = (x @ self.wq).view(-1, HEADS, HEAD_DIM)
        k = (x @ self.wk).view(-1, KV_HEADS, HEAD_DIM)
        v = (x @ self.wv).view(-1, KV_HEADS, HEAD_DIM)
        k_cache, v_cache = ei.kv_caches[0]
        att = paged_attention(q, k, v, k_cache, v_cache, ei.attention)
        h = x + att.reshape(-1, HEADS * HEAD_DIM) @ self.wo
        logits = h[ei.last_token_rows()] @ self.head
        tokens = sample(logits, [a.sampling for a in ei.args], None, [a.step for a in ei.args])
        out = {"token": [t.view(1) for t in tokens]}
        # the loop's stop flag as the reason (other toys raise tensor flags)
        out["stop"] = [FinishReason.STOP if t == EOS else FinishReason.LENGTH if step + 1 >= mx else None
                       for t, step, mx in zip(tokens.tolist(), [a.step for a in ei.args], [a.max_tokens for a in ei.args])]
        return out

    def reference_generate(self, prompt: list[int], max_tokens: int) -> list[int]:
        """Greedy decoding with dense causal attention over the whole sequence, no cache."""
        ids = list(prompt)
        out = []
        for _ in range(max_tokens):
            t = torch.tensor(ids)
            x = self.hidden_in(t, torch.arange(len(ids)))
            q = (x @ self.wq).view(-1, HEADS, HEAD_DIM).transpose(0, 1)
            k = (x @ self.wk).view(-1, KV_HEADS, HEAD_DIM).transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, 0)
            v = (x @ self.wv).view(-1, KV_HEADS, HEAD_DIM).transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, 0)
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(len(ids), -1)
            h = x + att @ self.wo
            nxt = int((h[-1] @ self.head).argmax())
            out.append(nxt)
            ids.append(nxt)
            if nxt == EOS:
                break
        return out


class ToyLM(ModelDef):
    """prefill -> decode (DynamicLoop over a persistent KV cache)."""

    name = "toy-lm"

    def __init__(self, defer_stop_check: bool = False, seed: int = 0):
        self.defer = defer_stop_check
        self.seed = seed

    def build_graph(self):
        prefill = GraphNode("LLM", ["input_ids"], [GraphEdge(TO_STATE, "token"), GraphEdge(EMIT_TO_CLIENT, "token")])
        decode = DynamicLoop(GraphNode("LLM", ["token"], [GraphEdge("LLM", "token"), GraphEdge(EMIT_TO_CLIENT, "token")]),
                             max_iters=MAX_POS, defer_stop_check=self.defer)
        return WalkGraph([Walk("prefill", prefill, inputs=["input_ids"]), Walk("decode", decode, inputs=["token"])])

    def validate_request(self, inputs, params):
        if "input_ids" not in inputs:
            raise ValueError("input_ids is required")
        ids = inputs["input_ids"][0]
        if ids.numel() == 0 or int(ids.max()) >= VOCAB or int(ids.min()) < 0:
            raise ValueError(f"input_ids must be non-empty token ids in [0, {VOCAB})")
        if ids.numel() + params.get("max_tokens", 8) > MAX_POS:  # positions past the table do not exist
            raise ValueError(f"prompt ({ids.numel()} tokens) + max_tokens ({params.get('max_tokens', 8)}) exceeds "
                             f"the context of {MAX_POS} tokens")

    def max_kv_tokens(self, inputs, params):
        return {"LLM": inputs["input_ids"][0].numel() + params.get("max_tokens", 8)}

    def next_walk(self, state):
        if state.last_walk is None:
            return "prefill"
        if state.last_walk == "prefill":
            tok = state.tensors["token"][0]
            if int(tok) == EOS or state.params.get("max_tokens", 8) <= 1:
                return None
            return "decode"
        return None

    def finish_reason(self, state):
        if state.last_walk == "prefill":
            return FinishReason.STOP if int(state.tensors["token"][0]) == EOS else FinishReason.LENGTH
        return state.finish

    def build_submodules(self, node_names):
        return {"LLM": TinyAttentionLM(self.seed)}


# -- CFG flow: Parallel branches that are views of one module, read-only attention, forked cache --
FLOW_STEPS, LATENT_TOKENS, CFG_SCALE = 4, 2, 2.0


class FlowLLM(NodeSubmodule):
    kv_spec = KVSpec(num_layers=1, num_kv_heads=1, head_dim=HIDDEN)

    def __init__(self, uncond_prefix: int | None = 1):
        super().__init__()
        self.uncond_prefix = uncond_prefix
        g = torch.Generator().manual_seed(7)
        self.embed = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=g))
        self.wq = torch.nn.Parameter(torch.randn(HIDDEN, HIDDEN, generator=g) / 4)
        self.wk = torch.nn.Parameter(torch.randn(HIDDEN, HIDDEN, generator=g) / 4)
        self.wv = torch.nn.Parameter(torch.randn(HIDDEN, HIDDEN, generator=g) / 4)
        self.calls = []

    def prepare_inputs(self, graph_walk, fwd_info, inputs):
        if graph_walk == "prefill":
            ids = inputs["text_ids"][0].reshape(-1).long()
            return NodeInputs(tensor_inputs={"x": self.embed[ids]}, num_tokens=ids.numel())
        lat = inputs["latents"][0]
        # the unconditional branch sees a prefix of the main cache (a fork), or no context at all
        fork = ("LLM", self.uncond_prefix) if fwd_info.node == "LLM_uncond" and self.uncond_prefix else None
        return NodeInputs(tensor_inputs={"x": lat}, num_tokens=lat.shape[0], mode=QueryMode.READ_ONLY,
                          fork_from=fork, args=inputs["time_index"][0])

    def forward(self, graph_walk, engine_inputs, x):
        ei = engine_inputs
        self.calls.append(list(ei.nodes))
        q = (x @ self.wq).view(-1, 1, HIDDEN)
        k = (x @ self.wk).view(-1, 1, HIDDEN)
        v = (x @ self.wv).view(-1, 1, HIDDEN)
        out = paged_attention(q, k, v, *ei.kv_caches[0], ei.attention).view(-1, HIDDEN)
        pieces = ei.token_splits(out)
        if graph_walk == "prefill":
            return {}
        res = {"v_main": [], "v_uncond": [], "latents": [], "time_index": []}
        for node, p, xin, t in zip(ei.nodes, pieces, ei.split("x", x), ei.args):
            if node == "LLM":
                res["v_main"].append(p)
                res["latents"].append(xin)
                res["time_index"].append(t)
            else:
                res["v_uncond"].append(p)
        # every output list must have one entry per request of the batch: branches batch together, so
        # outputs a branch does not produce are padded with None and dropped by name below
        n = len(ei.nodes)
        return {k: _align(v, ei.nodes, k) if len(v) != n else v for k, v in res.items()}


def _align(values, nodes, name):
    it = iter(values)
    want = "LLM" if name in ("v_main", "latents", "time_index") else "LLM_uncond"
    return [next(it) if node == want else torch.empty(0) for node in nodes]


class Combine(NodeSubmodule):
    def forward(self, graph_walk, engine_inputs, v_main, v_uncond, latents, time_index):
        ei = engine_inputs
        vm, vu, lat = ei.split("v_main", v_main), ei.split("v_uncond", v_uncond), ei.split("latents", latents)
        ts = ei.split("time_index", time_index)
        new_lat = [la - (u + CFG_SCALE * (m - u)) / FLOW_STEPS for m, u, la in zip(vm, vu, lat)]
        return {"latents": new_lat, "time_index": [t + 1 for t in ts]}


class Decoder(NodeSubmodule):
    def forward(self, graph_walk, engine_inputs, latents):
        return {"image": [x.sum(0) for x in engine_inputs.split("latents", latents)]}


class ToyFlow(ModelDef):
    """``uncond_prefix=None``: the unconditional branch attends to no context, so it can run on
    another rank than the main branch (a fork needs the source cache on its own rank)."""

    name = "toy-flow"
    views = {"LLM_uncond": "LLM"}

    def __init__(self, uncond_prefix: int | None = 1):
        self.uncond_prefix = uncond_prefix

    def build_graph(self):
        branch_main = GraphNode("LLM", ["latents", "time_index"], [GraphEdge("combine", "v_main"),
                                                                   GraphEdge("combine", "latents"),
                                                                   GraphEdge("combine", "time_index")])
        branch_unc = GraphNode("LLM_uncond", ["latents", "time_index"], [GraphEdge("combine", "v_uncond")])
        fb = [GraphEdge(b, n) for b in ("LLM", "LLM_uncond") for n in ("latents", "time_index")]
        flow = Sequential([
            Loop(Sequential([Parallel([branch_main, branch_unc]),
                             GraphNode("combine", ["v_main", "v_uncond", "latents", "time_index"], fb)]),
                 max_iters=FLOW_STEPS, outputs=[GraphEdge("decoder", "latents")]),
            GraphNode("decoder", ["latents"], [GraphEdge(EMIT_TO_CLIENT, "image", output_modality="image")]),
        ])
        return WalkGraph([Walk("prefill", GraphNode("LLM", ["text_ids"]), inputs=["text_ids"]),
                          Walk("flow", flow, inputs=["latents", "time_index"])])

    def next_walk(self, state):
        return {None: "prefill", "prefill": "flow"}.get(state.last_walk)

    def build_submodules(self, node_names):
        llm = FlowLLM(self.uncond_prefix)
        mods = {"LLM": llm, "LLM_uncond": llm, "combine": Combine(), "decoder": Decoder()}
        return {n: mods[n] for n in node_names}


def flow_reference(llm: FlowLLM, text_ids: torch.Tensor, latents: torch.Tensor, uncond_prefix: int | None = 1
                   ) -> torch.Tensor:
    """Dense oracle: context K/V kept as plain tensors; the unconditional branch sees the first token."""
    ctx = llm.embed[text_ids]
    k_ctx, v_ctx = ctx @ llm.wk, ctx @ llm.wv

    def attend(x, kc, vc):
        q, k, v = x @ llm.wq, torch.cat([kc, x @ llm.wk]), torch.cat([vc, x @ llm.wv])
        w = torch.softmax(q @ k.T / HIDDEN ** 0.5, -1)
        return w @ v

    lat = latents
    for _ in range(FLOW_STEPS):
        vm = attend(lat, k_ctx, v_ctx)
        n = uncond_prefix or 0
        vu = attend(lat, k_ctx[:n], v_ctx[:n])
        lat = lat - (vu + CFG_SCALE * (vm - vu)) / FLOW_STEPS
    return lat.sum(0)


# -- streaming between partitions ---------------------------------------------------------------
STREAM_STEPS, WINDOW, STRIDE = 10, 4, 2


class Counter(NodeSubmodule):
    def forward(self, graph_walk, engine_inputs, x):
        xs = engine_inputs.split("x", x)
        return {"x": [v + 1 for v in xs], "item": [v * 10 for v in xs]}


class WindowSum(NodeSubmodule):
    def prepare_inputs(self, graph_walk, fwd_info, inputs):
        items = inputs["item"]
        chunk = fwd_info.stream_chunks["item"]
        return NodeInputs(tensor_inputs={"s": torch.stack(items).sum().view(1)} if items else
                          {"s": torch.zeros(1)}, args=chunk["start"])

    def forward(self, graph_walk, engine_inputs, s):
        return {"sum": [torch.stack([v[0], torch.tensor(float(st))]) for v, st in
                        zip(engine_inputs.split("s", s), engine_inputs.args)]}


class ToyStream(ModelDef):
    name = "toy-stream"

    def build_graph(self):
        gen = Loop(GraphNode("counter", ["x"], [GraphEdge("counter", "x"),
                                                StreamingGraphEdge("summer", "item", target_partition="cons")]),
                   max_iters=STREAM_STEPS)
        topo = PartitionTopology([Connection("prod", "cons", "item",
                                             lambda: SlidingWindowChunkPolicy(window=WINDOW, stride=STRIDE))])
        return WalkGraph([Walk("gen", gen, inputs=["x"], partition="prod"),
                          Walk("window", GraphNode("summer", ["item"], [GraphEdge(EMIT_TO_CLIENT, "sum")]),
                               partition="cons")], topology=topo)

    def next_walk(self, state):
        if state.partition == "prod":
            return "gen" if state.last_walk is None else None
        return None if state.stream_done else "window"

    def build_submodules(self, node_names):
        mods = {"counter": Counter(), "summer": WindowSum()}
        return {n: mods[n] for n in node_names}


# -- nested loops: a fixed inner Loop inside a DynamicLoop (Qwen3-Omni's talker + code predictor) ---
INNER_ITERS = 3


class Talker(NodeSubmodule):
    def prepare_inputs(self, graph_walk, fwd_info, inputs):
        return NodeInputs(tensor_inputs={"frame_codes": inputs["frame_codes"][0].reshape(1, -1)},
                          args=fwd_info.iteration[0] + 1 >= fwd_info.params["frames"])  # the last frame

    def forward(self, graph_walk, engine_inputs, frame_codes):
        h = frame_codes.sum(1, keepdim=True) + 1  # [B, 1]
        return {"hidden": list(h), "code": list(2 * h), "code0": list(2 * h),
                "stop": [torch.tensor(x) for x in engine_inputs.args]}


class Predictor(NodeSubmodule):
    def forward(self, graph_walk, engine_inputs, hidden, code):
        return {"code": engine_inputs.split("code", code + hidden)}


class Assembler(NodeSubmodule):
    def prepare_inputs(self, graph_walk, fwd_info, inputs):
        return NodeInputs(tensor_inputs={"frame": torch.cat([inputs["code0"][0], *inputs["code"]]).view(1, -1)})

    def forward(self, graph_walk, engine_inputs, frame):
        return {"frame_codes": list(frame), "frame": list(frame)}


class ToyNested(ModelDef):
    name = "toy-nested"

    def build_graph(self):
        body = Sequential([
            GraphNode("talker", ["frame_codes"], [GraphEdge("predictor", "hidden"), GraphEdge("predictor", "code"),
                                                  GraphEdge("assembler", "code0")]),
            Loop(GraphNode("predictor", ["hidden", "code"], [GraphEdge("predictor", "code")]),
                 max_iters=INNER_ITERS, outputs=[GraphEdge("assembler", "code")], accumulate=["code"],
                 name="inner"),
            GraphNode("assembler", ["code0", "code"], [GraphEdge("talker", "frame_codes"),
                                                       GraphEdge(EMIT_TO_CLIENT, "frame")]),
        ])
        loop = DynamicLoop(body, max_iters=64, stop_node="talker", name="outer")
        return WalkGraph([Walk("talk", loop, inputs=["frame_codes"])])

    def next_walk(self, state):
        return "talk" if state.last_walk is None else None

    def build_submodules(self, node_names):
        mods = {"talker": Talker(), "predictor": Predictor(), "assembler": Assembler()}
        return {n: mods[n] for n in node_names}


def nested_reference(init: torch.Tensor, frames: int) -> list[list[float]]:
    fc, out = init, []
    for _ in range(frames):
        h = fc.sum() + 1
        codes = [2 * h + h * (j + 1) for j in range(INNER_ITERS)]
        frame = torch.stack([2 * h, *codes])
        out.append(frame.tolist())
        fc = frame
    return out


# -- a stream consumed inside a loop, one item per iteration (Thinker -> Talker) ----------------------
class Echo(NodeSubmodule):
    """Producer: emits its input ids one per decode step into the stream."""

    def prepare_inputs(self, graph_walk, fwd_info, inputs):
        i = fwd_info.iteration[0]
        ids = inputs["ids"][0]
        return NodeInputs(tensor_inputs={"tok": ids[i].view(1)}, args=(i + 1 >= ids.numel(), ids))  # (last, ids)

    def forward(self, graph_walk, engine_inputs, tok):
        return {"ids": [ids for _, ids in engine_inputs.args], "item": engine_inputs.split("tok", tok),
                "stop": [torch.tensor(last) for last, _ in engine_inputs.args]}


class Accumulate(NodeSubmodule):
    """Consumer loop: adds each streamed item to a running sum; after the stream ends it runs
    ``extra`` more steps on empty chunks (continue_after_done) and then stops."""

    def prepare_inputs(self, graph_walk, fwd_info, inputs):
        items = inputs["item"]
        done = fwd_info.stream_chunks["item"]["is_final"] and not items
        val = torch.stack(items).sum().view(1).float() if items else torch.zeros(1)
        return NodeInputs(tensor_inputs={"total": inputs["total"][0].view(1), "val": val},
                          args=done)

    def forward(self, graph_walk, engine_inputs, total, val):
        new = total + val
        return {"total": engine_inputs.split("total", new), "running": engine_inputs.split("total", new),
                "stop": [torch.tensor(d) for d in engine_inputs.args]}


class ToyStreamLoop(ModelDef):
    name = "toy-stream-loop"

    def build_graph(self):
        from mstar.graph import FixedChunkPolicy

        prod = DynamicLoop(GraphNode("echo", ["ids"], [GraphEdge("echo", "ids"),
                                                       StreamingGraphEdge("acc", "item", target_partition="B")]),
                           max_iters=64)
        cons = DynamicLoop(GraphNode("acc", ["item", "total"], [GraphEdge("acc", "total"),
                                                                GraphEdge(EMIT_TO_CLIENT, "running")]),
                           max_iters=64)
        topo = PartitionTopology([Connection("A", "B", "item",
                                             lambda: FixedChunkPolicy(chunk_size=1, continue_after_done=True))])
        return WalkGraph([Walk("speak", prod, inputs=["ids"], partition="A"),
                          Walk("listen", cons, inputs=["total"], partition="B")], topology=topo)

    def next_walk(self, state):
        if state.partition == "A":
            return "speak" if state.last_walk is None else None
        return "listen" if state.last_walk is None else None

    def build_submodules(self, node_names):
        mods = {"echo": Echo(), "acc": Accumulate()}
        return {n: mods[n] for n in node_names}
