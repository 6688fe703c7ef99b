"""Automatic prefix caching: prompts sharing leading full blocks reuse an earlier request's KV
blocks; outputs are the same as without it, under pressure too, and nothing stays in use."""

import random

import torch

from mstar import Runtime
from mstar.placement import Placement
from tests.helpers import kv_blocks_in_use


def tokens(out):
    return [int(t) for t in out.tensors("token")]


def prefix_stats(rt) -> tuple[int, int, int]:
    """(prompt tokens looked up, reused, cached blocks) over every rank and KV module."""
    kvs = [kv for r in rt.stats()["ranks"] for kv in r["kv"].values()]
    return (sum(kv["prefix_query_tokens"] for kv in kvs), sum(kv["prefix_hit_tokens"] for kv in kvs),
            sum(kv["blocks_cached"] for kv in kvs))


def placement(blocks: int, prefix_caching: bool, block_size: int = 4) -> Placement:
    return Placement.from_dict({"model": "llama-tiny", "node_groups": [{"node_names": ["LLM"], "ranks": [0]}],
                                "runtime": {"kv_cache_blocks": blocks, "kv_block_size": block_size,
                                            "prefix_caching": prefix_caching}})


def shared_prefix_requests(n: int, seed: int) -> list[tuple[list[int], int]]:
    """Chats sharing one of two system prompts (some a whole multiple of the block size), with
    their own user turns; a few repeat exactly."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 250) for _ in range(13)], [rng.randrange(1, 250) for _ in range(8)]]
    out = []
    for _ in range(n):
        user = [rng.randrange(1, 250) for _ in range(rng.randrange(0, 7))]
        out.append((rng.choice(systems) + user, rng.randrange(2, 9)))
    out.append(out[0])
    return out


def run_all(rt, reqs, one_at_a_time: bool) -> list[list[int]]:
    ins = [{"input_ids": torch.tensor(p)} for p, _ in reqs]
    params = [{"max_tokens": m, "sampling": {"ignore_eos": True}} for _, m in reqs]
    if one_at_a_time:
        return [tokens(rt.generate(i, p)[0]) for i, p in zip(ins, params)]
    return [tokens(o) for o in rt.generate(ins, params)]


def test_shared_prompts_hit_the_cache_and_give_the_same_tokens():
    from mstar.models.llama.model import LlamaTiny

    reqs = shared_prefix_requests(10, seed=1)
    with Runtime(LlamaTiny(), placement(256, prefix_caching=False)) as rt:
        plain = run_all(rt, reqs, one_at_a_time=True)
        assert prefix_stats(rt)[1] == 0
    with Runtime(LlamaTiny(), placement(256, prefix_caching=True)) as rt:
        cached = run_all(rt, reqs, one_at_a_time=True)
        queried, hits, kept = prefix_stats(rt)
        assert cached == plain
        assert queried == sum(len(p) for p, _ in reqs)
        assert hits >= 4 * (len(reqs) - 2)  # every request after the first of its system prompt reuses >= 1 block
        assert kept > 0 and kv_blocks_in_use(rt) == 0
        again = run_all(rt, reqs, one_at_a_time=False)  # batched, all hits: same tokens
        assert again == plain and kv_blocks_in_use(rt) == 0


def test_prefix_caching_under_pressure_keeps_outputs_and_frees_everything():
    """A cache far smaller than the load: cached blocks are evicted as needed, preempted requests
    come back, and every request still gets its own tokens."""
    from mstar.models.llama.model import LlamaTiny

    reqs = shared_prefix_requests(12, seed=2)
    with Runtime(LlamaTiny(), placement(256, prefix_caching=False)) as rt:
        plain = run_all(rt, reqs, one_at_a_time=True)
    with Runtime(LlamaTiny(), placement(10, prefix_caching=True)) as rt:
        assert run_all(rt, reqs, one_at_a_time=False) == plain
        assert kv_blocks_in_use(rt) == 0
        assert prefix_stats(rt)[1] > 0


def test_prefix_caching_with_prefill_and_decode_on_different_ranks():
    """The prompt's blocks are cached on the prefill rank; the decode rank imports its own copy."""
    from mstar.models.llama.model import LlamaTiny

    reqs = shared_prefix_requests(4, seed=3)
    split = Placement.from_dict({"model": "llama-tiny", "node_groups": [
        {"node_names": ["LLM"], "ranks": [0], "graph_walks": ["prefill"]},
        {"node_names": ["LLM"], "ranks": [1], "graph_walks": ["decode"]}],
        "runtime": {"kv_block_size": 4}})
    with Runtime(LlamaTiny()) as rt:
        plain = run_all(rt, reqs, one_at_a_time=True)
    with Runtime(LlamaTiny(), split) as rt:
        assert run_all(rt, reqs, one_at_a_time=True) == plain
        assert prefix_stats(rt)[1] > 0 and kv_blocks_in_use(rt) == 0


def test_chats_sharing_a_system_prompt_show_hits_in_metrics():
    import openai

    from mstar.model import resolve_model
    from tests.server_utils import get, running_server

    system = {"role": "system", "content": "You are a terse assistant. Answer in one short line, please. " * 2}
    with running_server(resolve_model("llama-tiny"), "llama-tiny") as (url, engine):
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        answers = [c.chat.completions.create(model="llama-tiny", max_tokens=3, temperature=0,
                                             messages=[system, {"role": "user", "content": q}]).choices[0].message.content
                   for q in ("first question", "second question", "first question")]
        assert answers[0] == answers[2]
        text = get(url, "/metrics").text
        labels = '{model="llama-tiny",node="LLM",rank="0"}'
        hits = float(text.split(f"mstar_prefix_cache_hits_total{labels} ")[1].split()[0])
        queried = float(text.split(f"mstar_prefix_cache_queries_total{labels} ")[1].split()[0])
        assert 0 < hits < queried
        assert kv_blocks_in_use(engine.runtime) == 0
