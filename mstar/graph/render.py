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
