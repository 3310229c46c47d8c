"""Plans: validation, ordering, totals, and plan.json (schema `fusesearch.plan/1`).

Problem: a plan is only worth anything if it is provably a valid schedule of the graph — every
node in exactly one group, each group one connected convex kernel, and the groups runnable in
some order (acyclic quotient graph) — and if the same input always writes the same file.
Approach: `validate_plan` checks the three properties and names the first group that breaks one;
`order_groups` gives the quotient graph's topological order (Kahn's algorithm, ties by smallest
node id), which numbers the groups g0, g1, ...; `Plan` holds each group's kernel and cost and
writes plan.json with fixed key order and rounded floats; a plan whose groups run in channel
blocks holds their blocked kernels and its reorders (`PlannedReorder`, `lowering.reorders`),
priced into its time.
Invariants: every Plan has passed `validate_plan`; plan.json holds no wall-clock figure (run
times go to the CLI summary and `--json` output), so it is byte-identical across runs.
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from costmodels import KernelCost
from fusesearch.candidates.rules import Legality
from fusesearch.errors import FusesearchError
from fusesearch.groups import FusionDecision
from fusesearch.ir.graph import Graph
from fusesearch.layout import Layout
from fusesearch.lowering import Kernel, reorders

SCHEMA = "fusesearch.plan/1"
SIG_DIGITS = 6


class InvalidPlan(FusesearchError):
    """A partition that is not a valid schedule (internal: a solver bug, or a bad plan file)."""


def validate_plan(graph: Graph, groups: Sequence[Iterable[int]]) -> FusionDecision:
    groups = [frozenset(g) for g in groups]
    owner: dict[int, int] = {}
    for gi, group in enumerate(groups):
        for v in group:
            if not 0 <= v < len(graph):
                return FusionDecision.refuse(f"group {gi}: node id {v} is not in the graph")
            if v in owner:
                return FusionDecision.refuse(f"node {graph.nodes[v].name} is in groups {owner[v]} and {gi}")
            owner[v] = gi
    missing = [graph.nodes[v].name for v in range(len(graph)) if v not in owner]
    if missing:
        return FusionDecision.refuse(f"node {missing[0]} is in no group ({len(missing)} missing)")
    for gi, group in enumerate(groups):
        decision = _connected_convex(graph, group, gi)
        if not decision:
            return decision
    try:
        order_groups(graph, groups)
    except InvalidPlan as exc:
        return FusionDecision.refuse(str(exc))
    return FusionDecision.accept()


def _connected_convex(graph: Graph, group: frozenset[int], gi: int) -> FusionDecision:
    if len(group) > 1:
        seen, stack = set(), [min(group)]
        while stack:
            v = stack.pop()
            if v in seen:
                continue
            seen.add(v)
            stack.extend(u for u in (*graph.predecessors(v), *graph.successors(v)) if u in group)
        if seen != group:
            return FusionDecision.refuse(f"group {gi} is not connected")
    if not graph.is_convex(group):
        return FusionDecision.refuse(f"group {gi} is not convex: a path leaves it and comes back")
    return FusionDecision.accept()


def order_groups(graph: Graph, groups: Sequence[frozenset[int]], *, part: bool = False) -> list[int]:
    """Topological order of the quotient graph (indices into `groups`); InvalidPlan on a cycle.
    `part`: the groups cover only some nodes (a piece of the search); edges to others are left out."""
    owner = {v: gi for gi, g in enumerate(groups) for v in g}
    succ: list[set[int]] = [set() for _ in groups]
    indegree = [0] * len(groups)
    for gi, group in enumerate(groups):
        for v in group:
            for w in graph.successors(v):
                gj = owner.get(w, gi) if part else owner[w]
                if gj != gi and gj not in succ[gi]:
                    succ[gi].add(gj)
                    indegree[gj] += 1
    ready = [(min(g), gi) for gi, g in enumerate(groups) if indegree[gi] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, gi = heapq.heappop(ready)
        order.append(gi)
        for gj in succ[gi]:
            indegree[gj] -= 1
            if indegree[gj] == 0:
                heapq.heappush(ready, (min(groups[gj]), gj))
    if len(order) < len(groups):
        stuck = next(gi for gi in range(len(groups)) if indegree[gi] > 0)
        names = sorted(graph.nodes[v].name for v in groups[stuck])
        raise InvalidPlan(f"groups form a cycle through the group of {', '.join(names[:3])}")
    return order


@dataclass(frozen=True)
class PlannedGroup:
    id: int
    nodes: tuple[int, ...]
    kernel: Kernel
    cost: KernelCost
    source: str = "predicted"  # what priced it: "predicted" or "measured" (`Verdict.source`)
    note: str = ""  # why a measured plan kept its predicted cost


@dataclass(frozen=True)
class PlannedReorder:
    """A copy of `tensor` between layouts the plan makes (`lowering.reorders`): after its producer's
    group (`after`: its id; -1 for a graph input or a weight), before the first group reading it so."""

    tensor: str
    source: Layout
    target: Layout
    kernel: Kernel
    cost: KernelCost
    after: int


@dataclass(frozen=True)
class SolverInfo:
    status: str
    objective_s: float
    bound_s: float | None
    wall_s: float = 0.0
    stats: Mapping[str, Any] = field(default_factory=dict)

    @property
    def gap(self) -> float:
        """(objective - bound) / objective; 0 without a bound (a bound of 0 is a gap of 100%)."""
        if self.bound_s is None or not self.objective_s:
            return 0.0
        return max(0.0, (self.objective_s - self.bound_s) / self.objective_s)

    def outcome(self) -> dict[str, Any]:
        """How an exact search ended, beyond its status: the gap where it stopped at its limit, the
        greedy fallback and why, and how the graph was decomposed (empty for the heuristics)."""
        out: dict[str, Any] = {}
        if "stopped" in self.stats:
            out["stopped"] = self.stats["stopped"]
            out["gap"] = _r(self.gap) if self.bound_s is not None else None
        for key in ("fallback", "fallback_reason", "decomposition"):
            if key in self.stats:
                out[key] = self.stats[key]
        return out

    def summary(self) -> str:
        """One line for people: where the search stopped and what it returned ('' when proven)."""
        o = self.outcome()
        parts = []
        if "stopped" in o:
            bound = f"{self.bound_s * 1e6:.2f} us" if self.bound_s is not None else "none"
            gap = f"{self.gap:.2%}" if self.bound_s is not None else "unknown"
            parts.append(f"stopped at the {o['stopped']}: not proven optimal, gap {gap} to the bound {bound}")
        if "fallback" in o:
            parts.append(f"returned greedy's plan ({o['fallback_reason']})")
        if "decomposition" in o:
            d = o["decomposition"]
            parts.append(f"decomposed into {d['pieces']} pieces, {d['distinct']} distinct subproblems solved of "
                         f"{d['subproblems']}; optimum {'proven' if d['proven_whole'] else 'not proven'} "
                         "for the whole graph")
        return "; ".join(parts)


@dataclass(frozen=True)
class ModelInfo:
    name: str
    sha256: str
    nodes: int
    canonical_nodes: int


@dataclass(frozen=True)
class Plan:
    graph: Graph
    groups: tuple[PlannedGroup, ...]
    strategy: str
    device: str
    profile: str | None
    solver: SolverInfo
    model: ModelInfo
    unfused_time_s: float
    lower_bound_s: float
    costs: str = "predicted"  # what priced the choices: predicted | measured | hybrid (`--costs`)
    # what measuring the choices cost (`autotune.TuneStats.to_dict`: choices, how many timed, the
    # wall time; plan.json's "tuning"), None with predicted costs
    tuning: Mapping[str, Any] | None = field(default=None, compare=False)
    # a plan over several values of one dim (`buckets.plan_buckets`): the dim, values, weights and
    # each bucket's time beside its own optimum; None for a plan of one shape
    buckets: Mapping[str, Any] | None = None
    # what priced it beyond the device's name (`costmodels.profile.priced_by`: a CPU's threads and
    # measured figures, a profile's sha256), written under "device" in plan.json
    priced: Mapping[str, Any] = field(default_factory=dict, compare=False)
    # where plans of this graph may choose layouts (`Legality.layout`, `search.problem.layouts_record`):
    # {"choice": auto | nchw, "block": c} (a GPU's: block 0, "layout": "NHWC"), plan.json's "layouts" with the reorders; None where every tensor is NCHW by force
    layouts: Mapping[str, Any] | None = None
    reorders: tuple[PlannedReorder, ...] = ()

    @classmethod
    def build(cls, legality: Legality, partition: Sequence[frozenset[int]], *, strategy: str,
              device: str, profile: str | None, solver: SolverInfo, model: ModelInfo,
              unfused_time_s: float, lower_bound_s: float, priced: Mapping[str, Any] | None = None,
              blocked: Collection[frozenset[int]] = (), layouts: Mapping[str, Any] | None = None) -> Plan:
        """`blocked`: the groups that run in the blocked layout (`Legality.blocked`), their
        reorders (`lowering.reorders`) priced into the plan; `layouts`: as the field says."""
        decision = validate_plan(legality.graph, partition)
        if not decision:
            raise InvalidPlan(f"strategy {strategy} produced an invalid plan: {decision.reason}")
        order = order_groups(legality.graph, partition)
        groups = []
        for new_id, gi in enumerate(order):
            verdict = legality.check(partition[gi])
            if not verdict.decision and not (partition[gi] in blocked and legality.blocked_only(partition[gi])):
                raise InvalidPlan(f"strategy {strategy} chose an illegal group: {verdict.decision.reason}")
            if partition[gi] in blocked:
                verdict = legality.blocked(partition[gi])
                if verdict is None:
                    raise InvalidPlan(f"strategy {strategy} chose group {new_id} in a blocked layout it has no form in")
            groups.append(PlannedGroup(new_id, tuple(sorted(partition[gi])), verdict.kernel, verdict.cost,
                                       verdict.source, verdict.note))
        return cls(legality.graph, tuple(groups), strategy, device, profile, solver, model,
                   unfused_time_s, lower_bound_s, legality.costs, priced=dict(priced or {}),
                   layouts=layouts, reorders=_reorders(legality, groups))

    # -- figures --------------------------------------------------------------------------------

    @property
    def time_s(self) -> float:
        """Its groups' and its reorders' (the same as the groups' where every tensor is NCHW)."""
        return sum(g.cost.time_s for g in self.groups) + sum(r.cost.time_s for r in self.reorders)

    @property
    def kernels(self) -> int:
        """One per group: each is one node of the fused model (a lone view op is a zero-cost one)."""
        return len(self.groups)

    @property
    def dram_bytes(self) -> float:
        return sum(g.cost.dram_bytes for g in self.groups) + sum(r.cost.dram_bytes for r in self.reorders)

    @property
    def flops(self) -> float:
        return sum(g.cost.flops for g in self.groups)

    @property
    def speedup(self) -> float:
        """Unfused over fused time; 1.0 when the plan costs nothing (only view ops: nothing to gain)."""
        return self.unfused_time_s / self.time_s if self.time_s else 1.0

    def partition(self) -> list[frozenset[int]]:
        return [frozenset(g.nodes) for g in self.groups]

    # -- outputs --------------------------------------------------------------------------------

    def group_dict(self, g: PlannedGroup) -> dict[str, Any]:
        nodes = [self.graph.nodes[i] for i in g.nodes]
        return {
            "id": g.id, "nodes": [n.name for n in nodes], "ops": [n.op_type for n in nodes],
            "template": "alias" if g.kernel.alias else g.kernel.template,
            "time_s": _r(g.cost.time_s), "flops": _r(g.cost.flops), "dram_bytes": _r(g.cost.dram_bytes),
            "smem_bytes": int(g.cost.smem_bytes), "regs_per_thread": int(g.cost.regs_per_thread),
            "occupancy": _r(g.cost.occupancy), "bound": g.cost.bound,
            "impl": "alias" if g.kernel.alias else g.kernel.impl, "compute_unit": g.cost.compute_unit,
            "schedule": g.kernel.schedule.to_dict(), **self._source(g), **_library_note(g.kernel),
            **({"layout": {"in": g.kernel.schedule.layout_in.name, "out": g.kernel.schedule.layout_out.name}}
               if self.layouts is not None else {}),
        }

    @staticmethod
    def reorder_dict(r: PlannedReorder) -> dict[str, Any]:
        """A reorder as plan.json's `layouts.reorders` records it."""
        return {"tensor": r.tensor, "from": r.source.name, "to": r.target.name, "after": r.after,
                "time_s": _r(r.cost.time_s)}

    def _source(self, g: PlannedGroup) -> dict[str, str]:
        """A measured or hybrid plan says what priced each group (a predicted plan's are all the
        model's: nothing added, so its plan.json is what it was)."""
        if self.costs == "predicted":
            return {}
        return {"cost_source": g.source, **({"cost_note": g.note} if g.note else {})}

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "model": {"name": self.model.name, "sha256": self.model.sha256, "nodes": self.model.nodes,
                      "canonical_nodes": self.model.canonical_nodes},
            "device": {"name": self.device, "profile": self.profile, **self.priced},
            "strategy": self.strategy,
            **({"costs": self.costs} if self.costs != "predicted" else {}),
            **({"tuning": dict(self.tuning)} if self.tuning else {}),
            "solver": {"status": self.solver.status, "objective_s": _r(self.solver.objective_s),
                       "bound_s": _r(self.solver.bound_s) if self.solver.bound_s is not None else None,
                       **self.solver.outcome()},
            "groups": [self.group_dict(g) for g in self.groups],
            "totals": {"kernels": self.kernels, "time_s": _r(self.time_s),
                       "unfused_time_s": _r(self.unfused_time_s), "lower_bound_s": _r(self.lower_bound_s),
                       "dram_bytes": _r(self.dram_bytes), "flops": _r(self.flops)},
            **({"buckets": self.buckets} if self.buckets is not None else {}),
            **({"layouts": {**self.layouts, "reorders": [self.reorder_dict(r) for r in self.reorders]}}
               if self.layouts is not None else {}),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1) + "\n"

    def to_pandas(self):
        import pandas as pd

        rows = []
        for g in self.groups:
            row = self.group_dict(g)
            row["nodes"] = "+".join(row["nodes"])
            row["ops"] = "+".join(row["ops"])
            rows.append(row)
        return pd.DataFrame(rows).set_index("id")


def _reorders(legality: Legality, groups: Sequence[PlannedGroup]) -> tuple[PlannedReorder, ...]:
    """The plan's reorders (`lowering.reorders` over its groups' kernels), each priced
    (`Legality.reorder`) and placed after its tensor's producer's group."""
    graph = legality.graph
    owner = {v: g.id for g in groups for v in g.nodes}
    copies = reorders(graph, [g.kernel for g in groups])
    return tuple(PlannedReorder(t, source, target, *legality.reorder(t, source, target),
                                owner.get(graph.producer(t), -1)) for t, source, target in copies)


def _r(value: float | None) -> float | None:
    """Round to SIG_DIGITS significant digits: stable text, no float noise."""
    if value is None:
        return None
    value = float(value)
    if value == 0 or value != value or value in (float("inf"), float("-inf")):
        return value
    return float(f"{value:.{SIG_DIGITS}g}")


def plan_schema() -> dict:
    """The JSON Schema of plan.json shipped in the package."""
    from importlib import resources

    return json.loads(resources.files("fusesearch").joinpath("schemas/plan.schema.json").read_text())


def _library_note(kernel) -> dict[str, str]:
    """A conv the plan runs as the im2col fallback says why (`cudnn.conv_route`)."""
    if kernel.schedule.library != "im2col":
        return {}
    from fusesearch.backends.cudnn import conv_route

    return {"library_note": conv_route().reason}
