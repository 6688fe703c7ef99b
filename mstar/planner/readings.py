"""Reading walk traces for the planner's profile: forwards, gaps, hops, wake-ups, client overheads.

Each function takes ``Runtime.trace`` documents (a request's walks with their node runs); those of
requests run alone carry the client's clock under ``"client"`` (``profiling._Runner.spaced``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from mstar.planner.costs import Forward, ForwardCost, percentiles
from mstar.planner.profile import FINAL, IDLE_S, cost_key

__all__ = ["forwards_in", "gaps_in", "hops_in", "median", "overheads_in", "stream_gaps_in", "wake_penalties_in"]


def forwards_in(traces: Sequence[dict[str, Any]], module_of: Callable[[str], str]) -> list[Forward]:
    """Every forward the traces recorded, once (a batch appears in each of its requests' traces). A
    forward whose every row took its stream's final chunk counts as ``module#final`` (a consumer
    often does other work on the end of a stream: flushing, or nothing)."""
    seen: dict[tuple[int, float, str], tuple[dict, bool]] = {}
    for t in traces:
        for w in t["walks"]:
            for r in w["nodes"]:
                module = module_of(r["node"])
                key = (r["rank"], r["start"], module)
                final = bool(r.get("chunks")) and all(c.get("is_final") for c in r["chunks"].values())
                first, all_final = seen.get(key, (r, True))
                seen[key] = (first, all_final and final)
    return [Forward(module + (FINAL if final else ""), r["batch"], r["batch_tokens"], r["batch_attention"],
                    r["compute_ms"]) for (_, _, module), (r, final) in seen.items()]


def gaps_in(traces: Sequence[dict[str, Any]]) -> tuple[list[float], list[tuple[int, float]]]:
    """From traces of requests run alone: the gaps (ms) between a walk's consecutive runs past the
    first one's compute, and per walk boundary of the root partition (the first walk's: the KV
    tokens the request held, the ms from the last run's end to the next walk's first run)."""
    steps, bounds = [], []
    for t in traces:
        prev_end, held = None, 0
        root = t["walks"][0]["partition"] if t["walks"] else None
        for w in t["walks"]:
            runs = w["nodes"]
            if not runs:
                continue
            for a, b in zip(runs, runs[1:]):
                if b["start"] != a["start"]:  # not two rows of one forward (a request's parallel branches)
                    steps.append((b["start"] - a["start"]) * 1e3 - a["compute_ms"])
            if w["partition"] != root:
                continue
            if prev_end is not None:
                bounds.append((held, (runs[0]["start"] - prev_end) * 1e3))
            last = runs[-1]
            prev_end = last["start"] + last["compute_ms"] / 1e3
            held = max(held, max(r["batch_context"] for r in runs))
    return steps, bounds


def wake_penalties_in(traces: Sequence[dict[str, Any]], costs: dict[str, ForwardCost], threads: int,
                      module_of: Callable[[str], str]) -> list[float]:
    """From traces of requests run one after another: per forward that followed more than ``IDLE_S``
    of its rank's idleness, its ms past what its module's cost predicts."""
    forwards = {}
    for t in traces:
        for w in t["walks"]:
            for r in w["nodes"]:
                forwards[(r["rank"], r["start"])] = r
    out, last_end = [], {}
    for (rank, start), r in sorted(forwards.items()):
        end = last_end.get(rank)
        last_end[rank] = start + r["compute_ms"] / 1e3
        key = cost_key(module_of(r["node"]), 1, threads)
        if end is None or start - end <= IDLE_S or key not in costs:
            continue
        out.append(r["compute_ms"] - costs[key].ms(r["batch"], r["batch_tokens"], r["batch_attention"]))
    return out


def hops_in(traces: Sequence[dict[str, Any]]) -> list[float]:
    """The ms between a run and the next run of its walk that depends on it on another rank: per run
    whose latest-ending earlier run of the walk is on another rank, from that one's end to its start."""
    out = []
    for t in traces:
        for w in t["walks"]:
            done: list[tuple[float, int]] = []  # (end, rank) of the walk's runs so far
            for r in sorted(w["nodes"], key=lambda r: r["start"]):
                before = [d for d in done if d[0] <= r["start"]]
                if before:
                    end, rank = max(before)
                    if rank != r["rank"]:
                        out.append((r["start"] - end) * 1e3)
                done.append((r["start"] + r["compute_ms"] / 1e3, r["rank"]))
    return out


def stream_gaps_in(traces: Sequence[dict[str, Any]], graph: Any) -> list[float]:
    """From traces of requests run alone: per chunk a stream's policy fired, the ms from the end of
    the producer run that pushed the chunk's last item to the consumer walk's first run."""
    from mstar.planner.programs import stream_producers

    producers, gaps = stream_producers(graph), []
    for c in graph.topology.connections:
        for t in traces:
            pushes = [r for w in t["walks"] if w["partition"] == c.from_partition for r in w["nodes"]
                      if c.to_partition in producers.get((w["walk"], r["node"]), ())]
            pushes.sort(key=lambda r: r["start"])
            consumer = [w["nodes"][0] for w in t["walks"] if w["partition"] == c.to_partition and w["nodes"]]
            policy, fired = c.chunk_policy_factory(), []
            for i in range(len(pushes)):
                fired += [i] * len(policy.push([None]))
            for i, run in zip(fired, consumer):
                end = pushes[i]["start"] + pushes[i]["compute_ms"] / 1e3
                gaps.append((run["start"] - end) * 1e3)
    return gaps


def overheads_in(traces: Sequence[dict[str, Any]], emitting: set[tuple[str, str]]) -> dict[str, tuple[float, ...]]:
    """Over requests run alone (``profiling._Runner.spaced``'s traces), the 0, 5, ..., 100th percentiles (ms) of
    ``submit``, from the client's submit to the first run's start, ``emit``, from the first emitting
    run's end to the client's first item, and ``end``, from the last run's end to the client seeing
    the request end."""
    out: dict[str, list[float]] = {"submit": [], "emit": [], "end": []}
    for t in traces:
        c, runs = t["client"], [(w["walk"], r) for w in t["walks"] for r in w["nodes"]]
        if not runs:
            continue
        out["submit"].append((runs[0][1]["start"] - c["sent"]) * 1e3)
        emits = [r for walk, r in runs if (walk, r["node"]) in emitting]
        if emits:
            out["emit"].append((c["first"] - emits[0]["start"]) * 1e3 - emits[0]["compute_ms"])
        last = max((r for _, r in runs), key=lambda r: r["start"] + r["compute_ms"] / 1e3)
        out["end"].append((c["end"] - last["start"]) * 1e3 - last["compute_ms"])
    return {k: percentiles(v, floor=0.0) if v else (0.0,) for k, v in out.items()}


def median(values: Sequence[float], default: float = 0.0) -> float:
    return float(np.median(values)) if len(values) else default


# -- running the model ----------------------------------------------------------------------------------
