"""`--explain`: one grep-able line per fusion accepted or refused, with its cost delta and reason.

Problem: a user wants to know why each fusion happened and why neighbours were not fused.
Approach: per multi-node group a `[fuse]` line with the time saved; per anchor group an `[impl]`
line (generated kernel vs library anchor + the rest apart); per quotient edge `[refuse]`
(legality reason or the cycle) or `[skip]` (legal, no gain); per blocked group `[layout]` (its
price beside its NCHW form's) and per copied tensor `[reorder]` (the copy's price):

    [fuse] conv_23(Conv)+relu_24(Relu) -> g12: -4.1 us
    [impl] g12: generated (fp32-cuda-core) 41.0 us vs library conv_23 (tf32-tensor-core) 30.2 us + ...
    [refuse] g7+g8: smem 72.0 KiB > 64.0 KiB per block on t4
    [skip] g3+g4: +0.8 us (no gain)
    [layout] g5 in NCHW16c (reads NCHW16c): -21.3 us (blocked 14.2 us vs NCHW 35.5 us)
    [reorder] 'clip_4' NCHW -> NCHW16c after g4: +6.1 us
Invariants: lines are deterministic and in group order; deltas are predicted microseconds."""

from __future__ import annotations

from fusesearch.candidates.rules import Legality
from fusesearch.ir.op_kind import OpKind
from fusesearch.plans import Plan
from fusesearch.schedule import CHAIN


def _label(plan: Plan, nodes) -> str:
    names = [f"{plan.graph.nodes[i].name}({plan.graph.nodes[i].op_type})" for i in sorted(nodes)]
    return "+".join(names) if len(names) <= 6 else "+".join(names[:5]) + f"+...({len(names)} ops)"


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:+.1f} us"


def explain_lines(plan: Plan, legality: Legality) -> list[str]:
    lines = []
    for g in plan.groups:
        if len(g.nodes) > 1:
            apart = sum(legality.time_s([v]) for v in g.nodes)
            lines.append(f"[fuse] {_label(plan, g.nodes)} -> g{g.id}: {_us(g.cost.time_s - apart)}")
            if g.kernel.anchor is not None:
                lines.append(_impl_line(plan, legality, g))
    lines.extend(_pair_lines(plan, legality))
    lines.extend(_layout_lines(plan, legality))
    return lines


def _layout_lines(plan: Plan, legality: Legality) -> list[str]:
    """Per group the plan runs in another layout (a CPU's NCHWc, a GPU's NHWC), its price beside its
    NCHW form's; per tensor the plan copies to another layout, the reorder's price and where it runs."""
    lines = []
    for g in plan.groups:
        schedule = g.kernel.schedule
        if schedule.layout_out.blocked and schedule.product == CHAIN:  # no NCHW form to compare with
            parts = " + ".join(_label(plan, [i]) for i in g.nodes if plan.graph.nodes[i].kind == OpKind.ANCHOR)
            lines.append(f"[layout] g{g.id} in {schedule.layout_out.name} (reads {schedule.layout_in.name}): {parts} "
                         f"in one kernel, its middle tensor never in memory, {g.cost.time_s * 1e6:.1f} us "
                         "(no NCHW form)")
        elif schedule.layout_out.blocked:
            nchw = legality.check(frozenset(g.nodes)).time_s
            lines.append(f"[layout] g{g.id} in {schedule.layout_out.name} (reads {schedule.layout_in.name}): "
                         f"{_us(g.cost.time_s - nchw)} ({schedule.layout_out.name} {g.cost.time_s * 1e6:.1f} us vs NCHW "
                         f"{nchw * 1e6:.1f} us)")
    for r in plan.reorders:
        where = f"after g{r.after}" if r.after >= 0 else "before the first group (a graph input)"
        lines.append(f"[reorder] '{r.tensor}' {r.source.name} -> {r.target.name} {where}: {_us(r.cost.time_s)}")
    return lines


def _impl_line(plan: Plan, legality: Legality, g) -> str:
    anchor = g.kernel.anchor
    library = legality.check(frozenset({anchor}))
    rest = sum(legality.time_s([v]) for v in g.nodes if v != anchor)
    unit = library.cost.compute_unit if library.cost is not None else "?"
    node = plan.graph.nodes[anchor]
    return (f"[impl] g{g.id}: generated ({g.cost.compute_unit}) {g.cost.time_s * 1e6:.1f} us vs library "
            f"{node.name}({node.op_type}) ({unit}) {library.time_s * 1e6:.1f} us + the rest apart "
            f"{rest * 1e6:.1f} us = {(library.time_s + rest) * 1e6:.1f} us")


def _pair_lines(plan: Plan, legality: Legality) -> list[str]:
    owner = {v: g.id for g in plan.groups for v in g.nodes}
    members = {g.id: frozenset(g.nodes) for g in plan.groups}
    edges = sorted({(owner[u], owner[w]) for u in owner for w in plan.graph.successors(u) if owner[u] != owner[w]})
    succ: dict[int, set[int]] = {}
    for a, b in edges:
        succ.setdefault(a, set()).add(b)
    lines = []
    for a, b in edges:
        prefix = f"g{a}+g{b}"
        verdict = legality.check(members[a] | members[b])
        if not verdict.decision:
            lines.append(f"[refuse] {prefix}: {verdict.decision.reason}")
        elif _other_path(succ, a, b):
            lines.append(f"[refuse] {prefix}: merging would close a cycle through another group")
        else:
            delta = verdict.time_s - legality.time_s(members[a]) - legality.time_s(members[b])
            why = "no gain" if delta >= 0 else f"not chosen by {plan.strategy}"
            lines.append(f"[skip] {prefix}: {_us(delta)} ({why})")
    return lines


def _other_path(succ: dict[int, set[int]], a: int, b: int) -> bool:
    stack = [c for c in succ.get(a, ()) if c != b]
    seen = set(stack)
    while stack:
        c = stack.pop()
        if c == b:
            return True
        for d in succ.get(c, ()):
            if d not in seen:
                seen.add(d)
                stack.append(d)
    return False
