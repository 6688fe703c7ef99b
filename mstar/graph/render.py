"""Human-readable views of a compiled walk: a text description and a Graphviz DOT drawing."""

from __future__ import annotations

from mstar.graph.plan import InputKind, RouteKind, WalkPlan
from mstar.graph.sections import GraphNode, Loop, Parallel, Section, Sequential


def describe_plan(plan: WalkPlan) -> str:
    lines = [f"walk {plan.walk} (partition {plan.partition})",
             f"  inputs: {', '.join(plan.inputs) or '-'}",
             f"  entry nodes: {', '.join(plan.entry_nodes) or '-'}"]
    if plan.join_nodes:
        lines.append(f"  join nodes: {', '.join(plan.join_nodes)}")
    for lp in plan.loops.values():
        kind = "dynamic loop" if lp.dynamic else "loop"
        extra = f", stops when {lp.stop_node}.{lp.stop_signal}" if lp.dynamic else ""
        if lp.defer_stop_check:
            extra += " (stop check deferred one iteration)"
        lines.append(f"  {kind} {lp.name}: max_iters={lp.max_iters}{extra}; parent={lp.parent or 'top'}; "
                     f"body={list(lp.body_nodes)}" + (f"; inner loops={list(lp.inner_loops)}" if lp.inner_loops else ""))
        for ex in lp.exits:
            acc = " (accumulated over iterations)" if ex.accumulate else ""
            lines.append(f"    exit {ex.name} from {ex.producer}: {ex.route.describe()}{acc}")
    for node in plan.nodes.values():
        where = f"in {node.frame}" if node.frame else "top level"
        lines.append(f"  node {node.name} [{where}, rank {node.rank}]")
        for name, b in node.inputs.items():
            lines.append(f"    <- {name}: {b.describe()}")
        for r in node.routes:
            lines.append(f"    -> {r.describe()}")
        if node.stop_signal:
            lines.append(f"    -> {node.stop_signal}: stop flag of its loop")
    return "\n".join(lines)


def _q(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def plan_to_dot(plan: WalkPlan, section: Section) -> str:
    """Graphviz DOT: loops and Parallel blocks as clusters, feedback edges dashed."""
    out = [f"digraph {_q(plan.walk)} {{", "  rankdir=LR;", "  node [shape=box, style=rounded];",
           f"  label={_q(f'walk {plan.walk}')}; labelloc=t;"]
    counter = [0]

    def emit(sec: Section, indent: str) -> None:
        if isinstance(sec, GraphNode):
            out.append(f"{indent}{_q(sec.name)};")
        elif isinstance(sec, Sequential):
            for s in sec.sections:
                emit(s, indent)
        else:
            counter[0] += 1
            label = sec.label if isinstance(sec, Loop) else "Parallel"
            style = "dashed" if isinstance(sec, Parallel) else "solid"
            out.append(f"{indent}subgraph cluster_{counter[0]} {{ label={_q(label)}; style={style};")
            for s in (sec.sections if isinstance(sec, Parallel) else [sec.section]):
                emit(s, indent + "  ")
            out.append(f"{indent}}}")

    emit(section, "  ")
    if plan.inputs:
        out.append(f"  {_q('walk inputs')} [shape=note];")
    sinks: set[str] = set()
    for node in plan.nodes.values():
        for name, b in node.inputs.items():
            base = b.initial if b.kind is InputKind.CARRIED else b
            if base.kind is InputKind.WALK_INPUT:
                out.append(f"  {_q('walk inputs')} -> {_q(node.name)} [label={_q(name)}];")
            elif base.kind is InputKind.STREAM:
                src = f"stream from {base.partition}"
                sinks.add(src)
                out.append(f"  {_q(src)} -> {_q(node.name)} [label={_q(name)}, style=bold];")
        for r in node.routes:
            if r.kind is RouteKind.EMIT:
                dest = "client"
            elif r.kind is RouteKind.STATE:
                dest = "request state"
            elif r.kind is RouteKind.STREAM:
                dest = f"stream to {r.partition}"
            else:
                dest = r.dest
            if r.kind in (RouteKind.EMIT, RouteKind.STATE, RouteKind.STREAM):
                sinks.add(dest)
            attrs = [f"label={_q(r.edge_name)}"]
            if r.kind is RouteKind.FEEDBACK:
                attrs.append("style=dashed, constraint=false")
            if r.kind is RouteKind.STREAM:
                attrs.append("style=bold")
            out.append(f"  {_q(node.name)} -> {_q(dest)} [{', '.join(attrs)}];")
    for lp in plan.loops.values():
        for ex in lp.exits:
            r = ex.route
            dest = {RouteKind.EMIT: "client", RouteKind.STATE: "request state"}.get(r.kind, r.dest)
            if r.kind in (RouteKind.EMIT, RouteKind.STATE):
                sinks.add(dest)
            out.append(f"  {_q(ex.producer.name)} -> {_q(dest)} "
                       f"[label={_q(f'{ex.name} (exit {lp.name})')}, color=blue];")
    for s in sorted(sinks):
        out.append(f"  {_q(s)} [shape=ellipse, style=dotted];")
    out.append("}")
    return "\n".join(out) + "\n"


def _lines(*lines: str) -> str:
    """A quoted DOT label of several lines."""
    return '"' + "\\n".join(_q(line)[1:-1] for line in lines) + '"'


def _walk_figures(traces: list[dict]) -> tuple[dict[str, dict], list[list[tuple[str, str]]]]:
    """Per walk taken: times taken and wall ms in all, and per node its runs, iterations, compute ms,
    ranks and largest batch; and per request its walks in order as (partition, walk)."""
    walks: dict[str, dict] = {}
    orders = []
    for t in traces:
        orders.append([(w["partition"], w["walk"]) for w in t.get("walks", [])])
        for w in t.get("walks", []):
            fig = walks.setdefault(w["walk"], {"taken": 0, "ms": 0.0, "nodes": {}})
            fig["taken"] += 1
            if w.get("end") is not None and w.get("start") is not None:
                fig["ms"] += 1e3 * (w["end"] - w["start"])
            for run in w.get("nodes", []):
                n = fig["nodes"].setdefault(run["node"], {"runs": 0, "iterations": set(), "ms": 0.0, "ranks": set(),
                                                          "batch": 0})
                n["runs"] += 1
                n["iterations"].add(tuple(run.get("iteration", ())))
                n["ms"] += run.get("compute_ms", 0.0)
                n["ranks"].add(run.get("rank"))
                n["batch"] = max(n["batch"], run.get("batch", 0))
    return walks, orders


def trace_to_dot(graph, traces: list[dict]) -> str:
    """Graphviz DOT of ``graph`` (a ``WalkGraph``) with request traces over it (``traces``: the
    ``requests`` of ``GET /v1/requests/{id}/trace``, or ``Runtime.trace``'s list): every walk a
    cluster, grouped by partition; a walk the requests took is drawn bold with how often and how long
    (wall ms, dispatch to end), each of its nodes with its runs, distinct iterations, compute ms, ranks
    and largest batch; walks not taken are grey; dotted arrows follow each request's walks in order
    within a partition."""
    figures, orders = _walk_figures(traces)
    out = ["digraph trace {", "  rankdir=LR; compound=true;", "  node [shape=box, style=rounded, fontsize=10];",
           "  label=" + _q(f"{len(traces)} request(s) over the walk graph") + "; labelloc=t;"]
    first: dict[str, str] = {}
    for p_i, partition in enumerate(graph.partitions):
        out.append(f"  subgraph cluster_p{p_i} {{ label={_q(f'partition {partition}')}; style=dotted;")
        for w_i, walk in enumerate(graph.walks_of(partition)):
            plan, fig = graph.plans[walk], figures.get(walk)
            taken = fig is not None
            label = f"{walk}: {fig['taken']}x, {fig['ms']:.1f} ms" if taken else f"{walk} (not taken)"
            style = "style=bold; color=blue" if taken else "style=solid; color=gray; fontcolor=gray"
            out.append(f"    subgraph cluster_p{p_i}_w{w_i} {{ label={_q(label)}; {style};")
            for name in plan.nodes:
                node_id = f"{walk}/{name}"
                first.setdefault(walk, node_id)
                runs = fig["nodes"].get(name) if taken else None
                if runs:
                    ranks = ",".join(str(r) for r in sorted(r for r in runs["ranks"] if r is not None))
                    text = _lines(name, f"{runs['runs']} runs, {len(runs['iterations'])} iterations",
                                  f"{runs['ms']:.1f} ms compute; rank {ranks}; batch <= {runs['batch']}")
                    out.append(f"      {_q(node_id)} [label={text}, penwidth=2];")
                else:
                    out.append(f"      {_q(node_id)} [label={_q(name)}{', color=gray, fontcolor=gray' if taken is False else ''}];")
            out.append("    }")
            for name, node in plan.nodes.items():
                for r in node.routes:
                    if r.kind in (RouteKind.LOCAL, RouteKind.ENTER, RouteKind.FEEDBACK) and r.dest in plan.nodes and r.dest != name:
                        attrs = "style=dashed" if r.kind is RouteKind.FEEDBACK else ""
                        out.append(f"    {_q(f'{walk}/{name}')} -> {_q(f'{walk}/{r.dest}')} [{attrs}];")
        out.append("  }")
    seen: set[tuple[str, str]] = set()
    for order in orders:
        last: dict[str, str] = {}
        for partition, walk in order:
            prev = last.get(partition)
            if prev is not None and prev != walk and (prev, walk) not in seen and prev in first and walk in first:
                seen.add((prev, walk))
                out.append(f"  {_q(first[prev])} -> {_q(first[walk])} [style=dotted, color=blue, label=\"then\"];")
            last[partition] = walk
    out.append("}")
    return "\n".join(out) + "\n"
