"""Reading walk traces for the planner's profile: forwards, gaps, hops, wake-ups, client overheads.

Each function takes ``Runtime.trace`` documents (a request's walks with their node runs); those of
requests run alone carry the client's clock under ``"client"`` (``profiling._Runner.spaced``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from mstar.planner.costs import Forward, ForwardCost, percentiles
from mstar.planner.profile import FINAL, IDLE_LEVELS_S, IDLE_S, AfterIdle, cost_key

__all__ = ["after_idle_in", "forwards_in", "gaps_in", "hops_in", "median", "overheads_in", "stream_gaps_in",
           "wake_penalties_in"]


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
    """From traces of requests run alone: the gaps (ms) between a walk's consecutive runs on one rank
    past the first one's compute (``hops_in`` has those across ranks), and per walk boundary of the
    root partition (the first walk's: the KV tokens the request held, the ms from the last run's end
    to the next walk's first run)."""
    steps, bounds = [], []
    for t in traces:
        prev_end, held = None, 0
        root = t["walks"][0]["partition"] if t["walks"] else None
        for w in t["walks"]:
            runs = w["nodes"]
            if not runs:
                continue
            for a, b in zip(runs, runs[1:]):
                # not two rows of one forward (a request's parallel branches), nor a hop to another rank
                if b["start"] != a["start"] and a.get("rank") == b.get("rank"):
                    steps.append((b["start"] - a["start"]) * 1e3 - a["compute_ms"])
            if w["partition"] != root:
                continue
            if prev_end is not None:
                bounds.append((held, (runs[0]["start"] - prev_end) * 1e3))
            last = runs[-1]
            prev_end = last["start"] + last["compute_ms"] / 1e3
            held = max(held, max(r["batch_context"] for r in runs))
    return steps, bounds


def _forwards_by_rank(traces: Sequence[dict[str, Any]]) -> dict[int, list[tuple[float, dict[str, Any]]]]:
    """Each rank's forwards (one run per forward), by start."""
    out: dict[int, dict[float, dict[str, Any]]] = {}
    for t in traces:
        for w in t["walks"]:
            for r in w["nodes"]:
                out.setdefault(r["rank"], {})[r["start"]] = r
    return {rank: sorted(runs.items()) for rank, runs in out.items()}


def _idle_before(by_rank: dict[int, list[tuple[float, dict[str, Any]]]], rank: int, at: float) -> float | None:
    """How long ``rank`` had been idle at ``at`` (s): since its last forward ending by then; None
    before its first forward in the traces."""
    ends = [s + r["compute_ms"] / 1e3 for s, r in by_rank.get(rank, ()) if s + r["compute_ms"] / 1e3 <= at]
    return at - max(ends) if ends else None


def wake_penalties_in(traces: Sequence[dict[str, Any]], costs: dict[str, ForwardCost], threads: int,
                      module_of: Callable[[str], str]) -> list[tuple[float, float]]:
    """From traces of requests run one after another: per forward that followed more than ``IDLE_S``
    of its rank's idleness, that idle time (s) and its ms past what its module's cost predicts."""
    out = []
    for runs in _forwards_by_rank(traces).values():
        for (start, r), (prev_start, prev) in zip(runs[1:], runs):
            idle = start - prev_start - prev["compute_ms"] / 1e3
            key = cost_key(module_of(r["node"]), 1, threads)
            if idle > IDLE_S and key in costs:
                out.append((idle, r["compute_ms"] - costs[key].ms(r["batch"], r["batch_tokens"], r["batch_attention"])))
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
    the producer run that pushed the chunk's last item (or, were it later, of the last forward its
    consumer's rank ran before the consumer: the simulator keeps a rank busy on its own) to the
    consumer walk's first run."""
    from mstar.planner.programs import stream_producers

    producers, gaps, by_rank = stream_producers(graph), [], _forwards_by_rank(traces)
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
                busy = _idle_before(by_rank, run["rank"], run["start"])
                free = run["start"] - busy if busy is not None else end
                gaps.append((run["start"] - max(end, free)) * 1e3)
    return gaps


def overheads_in(traces: Sequence[dict[str, Any]], emitting: set[tuple[str, str]]) -> list[tuple[float, dict[str, float]]]:
    """Per request run alone (``profiling._Runner.spaced``'s traces), how long its first rank had been
    idle when the client submitted it (s) and its overheads (ms): ``submit``, from the client's submit
    to the first run's start, ``emit``, from the first emitting run's end to the client's first item,
    and ``end``, from the last run's end to the client seeing the request end. A request before
    which its rank ran nothing in the traces is left out (its idle time unknown)."""
    by_rank, out = _forwards_by_rank(traces), []
    for t in traces:
        c, runs = t["client"], [(w["walk"], r) for w in t["walks"] for r in w["nodes"]]
        idle = _idle_before(by_rank, runs[0][1]["rank"], c["sent"]) if runs else None
        if idle is None:
            continue
        seen = {"submit": (runs[0][1]["start"] - c["sent"]) * 1e3}
        emits = [r for walk, r in runs if (walk, r["node"]) in emitting]
        if emits:
            seen["emit"] = (c["first"] - emits[0]["start"]) * 1e3 - emits[0]["compute_ms"]
        last = max((r for _, r in runs), key=lambda r: r["start"] + r["compute_ms"] / 1e3)
        seen["end"] = (c["end"] - last["start"]) * 1e3 - last["compute_ms"]
        out.append((max(0.0, idle), seen))
    return out


def after_idle_in(wakes: Sequence[tuple[float, float]], overheads: Sequence[tuple[float, dict[str, float]]],
                  levels: Sequence[float] = IDLE_LEVELS_S) -> tuple[AfterIdle, ...]:
    """``wake_penalties_in``'s and ``overheads_in``'s readings, each at the idle level nearest its
    idle time (geometrically): one ``AfterIdle`` per level that has any."""
    def level(idle: float) -> int:
        return min(range(len(levels)), key=lambda i: abs(np.log(max(idle, 1e-4) / levels[i])))

    bins: dict[int, tuple[list[float], list[float], dict[str, list[float]]]] = {}
    for idle, ms in wakes:
        b = bins.setdefault(level(idle), ([], [], {}))
        b[0].append(idle)
        b[1].append(ms)
    for idle, seen in overheads:
        b = bins.setdefault(level(idle), ([], [], {}))
        b[0].append(idle)
        for k, ms in seen.items():
            b[2].setdefault(k, []).append(ms)
    out = [AfterIdle(round(median(idles), 5), percentiles(ms, floor=0.0) if ms else (0.0,),
                     {k: percentiles(v, floor=0.0) for k, v in client.items()})
           for _, (idles, ms, client) in sorted(bins.items())]
    return tuple(out) or (AfterIdle(0.0, (0.0,), {}),)


def median(values: Sequence[float], default: float = 0.0) -> float:
    return float(np.median(values)) if len(values) else default


# -- running the model ----------------------------------------------------------------------------------
