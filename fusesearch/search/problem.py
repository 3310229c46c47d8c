"""The search problem, the Solver protocol and what a solver returns.

Problem: four strategies (none, rules, greedy, cpsat) must be interchangeable behind one call and
compared on the same costs.
Approach: a `SearchProblem` bundles the graph, the legality rules bound to a device, a cost model
and what the code generator writes (`codegen.CAPABILITIES`; with their memo of verdicts), and the configuration (time limit, seed, workers, max group
size, enumeration budget, whether a plan may choose layouts: `plan_layout`;
`SearchProblem.plan_time_s` prices a plan's layouts). A solver returns a `SolveResult`: a partition of the nodes into groups,
its predicted time, a status and, for exact solvers, a bound.
Invariants: a SolveResult's groups partition the graph's nodes (checked by `validate_plan`
before any plan leaves `search()`); times are seconds.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from costmodels import DeviceSpec, RooflineModel
from fusesearch.backends import cpu
from fusesearch.candidates.enumerate import DEFAULT_BUDGET_PER_SEED
from fusesearch.candidates.rules import DEFAULT_MAX_GROUP_SIZE, Legality, Measurer
from fusesearch.costing import device_layout
from fusesearch.errors import BadInput
from fusesearch.ir.graph import Graph
from fusesearch.layout import NCHW, Layout
from fusesearch.lowering import reorders

DECOMPOSE = ("auto", "always", "never")
"""How the exact search treats a deep graph: "auto" cuts it into pieces from a size on
(`cpsat.DECOMPOSE_FROM_NODES`), "always" and "never" whatever its size."""


def check_decompose(value: object, named: str = "decompose =") -> str:
    """The one check of a decompose value (the API's keyword, the sweep file's `params.decompose`)."""
    if value not in DECOMPOSE:
        raise BadInput(f"{named} {value!r}: choose one of {', '.join(DECOMPOSE)}")
    return value


LAYOUTS = ("auto", "nchw")
"""Whether a plan chooses its tensors' layouts (`plan_layout`): "auto" lets the exact search run a
group in the device's other layout (a CPU's blocked NCHWc, a GPU's NHWC for tensor-core convs)
where that and its reorders pay, "nchw" keeps the model's."""


def check_layouts(value: object, named: str = "--layouts") -> str:
    """The one check of a layouts value (the CLI's option, the API's keyword)."""
    if value not in LAYOUTS:
        raise BadInput(f"{named} {value!r}: choose one of {', '.join(LAYOUTS)}")
    return value


def plan_layout(graph: Graph, device: DeviceSpec, layouts: str) -> Layout:
    """The layout other than the model's a plan of `graph` may choose on `device`
    (`costing.device_layout`: a CPU's NCHWc of its float32 lanes, 16 with AVX-512, 8 with AVX2; a
    GPU's NHWC) where `layouts` is "auto" and the graph has a conv over 4-D activations (with
    measured costs too: a measurer times the groups' forms in that layout as in NCHW); else NCHW
    (every tensor as in the model)."""
    convs = any(n.op_type == "Conv" and len(graph.tensors[n.inputs[0]].shape or ()) == 4 for n in graph.nodes)
    if layouts != "auto" or not convs:
        return NCHW
    return device_layout(device)


def layouts_record(choice: str, layout: Layout) -> dict:
    """What a plan records of its layout choice (plan.json's "layouts", `export` reads it back):
    the choice (LAYOUTS) and the other layout's channel block (NCHWc's; 0 and the layout's name
    "NHWC" for a GPU's channels last)."""
    return {"choice": choice, "block": layout.block, **({"layout": layout.name} if layout.channels_last else {})}


def default_workers() -> int:
    return max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


@dataclass(frozen=True)
class SearchConfig:
    time_limit_s: float = 60.0
    seed: int = 0
    workers: int = field(default_factory=default_workers)
    max_group_size: int = DEFAULT_MAX_GROUP_SIZE
    budget_per_seed: int = DEFAULT_BUDGET_PER_SEED
    lone_anchors: str = "priced"  # how a lone gemm/conv may run (`rules.LONE_ANCHORS`)
    decompose: str = "auto"  # DECOMPOSE: whether cpsat cuts the graph into pieces
    layouts: str = "auto"  # LAYOUTS: whether a CPU plan may run groups in the blocked layout


@dataclass
class SearchProblem:
    graph: Graph
    legality: Legality
    config: SearchConfig

    @classmethod
    def build(cls, graph: Graph, device: DeviceSpec, model: RooflineModel,
              config: SearchConfig | None = None, measurer: Measurer | None = None) -> SearchProblem:
        """`measurer`: the groups' choices priced by their measured times (`autotune`), else
        by the cost model."""
        config = config or SearchConfig()
        layout = plan_layout(graph, device, config.layouts)
        return cls(graph, Legality(graph, device, model, cpu.capabilities(), config.max_group_size,
                                   lone_anchors=config.lone_anchors, measurer=measurer, layout=layout), config)

    def time_s(self, nodes: Iterable[int]) -> float:
        return self.legality.time_s(nodes)

    def candidate_time_s(self, nodes: Iterable[int]) -> float:
        """A candidate's price as the exact solver takes it: its NCHW form's, or for a group with
        a blocked form alone (`Legality.blocked_only`) that form's."""
        if self.legality.blocked_only(nodes):
            return self.legality.blocked(nodes).time_s
        return self.time_s(nodes)

    def partition_time_s(self, groups: Iterable[Iterable[int]]) -> float:
        return sum(self.time_s(g) for g in groups)

    def plan_time_s(self, groups: Sequence[frozenset[int]], blocked: Collection[frozenset[int]] = ()) -> float:
        """The price of a plan whose `blocked` groups run in the other layout: its groups' and its
        reorders' (`lowering.reorders`); with none blocked, `partition_time_s`."""
        if not blocked:
            return self.partition_time_s(groups)
        verdicts = [self.legality.blocked(g) if g in blocked else self.legality.check(g) for g in groups]
        copies = reorders(self.graph, [v.kernel for v in verdicts])
        return sum(v.time_s for v in verdicts) + sum(self.legality.reorder(*r)[1].time_s for r in copies)


@dataclass(frozen=True)
class SolveResult:
    groups: tuple[frozenset[int], ...]
    status: str  # OPTIMAL | FEASIBLE (cpsat), HEURISTIC (greedy, rules), BASELINE (none)
    objective_s: float
    bound_s: float | None = None
    wall_s: float = 0.0
    stats: Mapping[str, Any] = field(default_factory=dict)
    blocked: frozenset[frozenset[int]] = frozenset()  # groups run in the blocked layout (cpsat only)


class Solver(Protocol):
    name: str

    def solve(self, problem: SearchProblem, *, time_limit_s: float, seed: int) -> SolveResult: ...


def singletons(graph: Graph) -> tuple[frozenset[int], ...]:
    return tuple(frozenset({i}) for i in range(len(graph)))
