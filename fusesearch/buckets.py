"""One plan for a range of shapes: a dim served at several values (buckets), planned together.

Problem: a plan for seq 128 says nothing about seq 512; a server sees both and wants one grouping
that holds across them, and its price against each shape's own best.
Approach: `--dim seq=16..512` (ends and powers of two between) or `--dim seq=32,128,512`, weighted
by `--dim-weights` (equal by default). The model is prepared per bucket; all must give the same
canonical graph. `BucketLegality` holds a `Legality` per bucket: a group is legal where legal at
every bucket and costs the weighted sum of each bucket's cheapest choice, so any strategy minimises
it unchanged; it asks the heaviest bucket first, the others through their memo of twins (so each
bucket's own search finds its groups lowered), up to the first refusal. `plan_buckets` prices the
plan at each bucket beside that bucket's own optimum; `plan_changes` says where the own plans
change between neighbouring buckets (groups gained and lost) and what keeping the plan below costs.
Invariants: one varying dim; 2 to MAX_BUCKETS ascending positive values; weights positive,
normalised to sum 1; the plan's kernels (plan.json's schedules) are those of the heaviest bucket."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from fusesearch.candidates.rules import Legality, Verdict
from fusesearch.errors import BadInput
from fusesearch.ir.graph import Graph

MAX_BUCKETS = 16


@dataclass(frozen=True)
class Buckets:
    """The varying dim, its values (ascending) and how often each is served (sum 1)."""

    dim: str
    values: tuple[int, ...]
    weights: tuple[float, ...]

    @property
    def heaviest(self) -> int:
        """The index of the bucket served most (the first of equals): its kernels are the plan's."""
        return max(range(len(self.values)), key=lambda i: (self.weights[i], -i))

    def to_dict(self) -> dict:
        return {"dim": self.dim, "values": list(self.values), "weights": [round(w, 6) for w in self.weights]}


@dataclass(frozen=True)
class Spelling:
    """How the user wrote a range and its weights, for messages: the CLI's flags or a config's keys.
    Each is a format string of {name} (the dim) and {value} (as written)."""

    dim: str = "--dim {name}"
    dim_value: str = "--dim {name}={value}"
    weights: str = "--dim-weights {name}"
    weights_value: str = "--dim-weights {name}={value}"


FLAGS = Spelling()


def split_dims(dims: Iterable[str], weights: Iterable[str] = (),
               spelling: Spelling = FLAGS) -> tuple[list[str], Buckets | None]:
    """`--dim` flags as (the fixed ones, the one range or list of values as Buckets, or None);
    messages name the flags as `spelling` writes them."""
    fixed, ranged = [], []
    for flag in dims:
        name, sep, value = flag.partition("=")
        (ranged if sep and (".." in value or "," in value) else fixed).append((flag, name, value))
    weight_flags = {name: value for name, _, value in (w.partition("=") for w in weights)}
    sp = spelling
    if len(ranged) > 1:
        raise BadInput(f"{sp.dim.format(name=ranged[0][1])} and {sp.dim.format(name=ranged[1][1])} both give "
                       f"several values; vary one dim per plan and bind the other with one value")
    for name in weight_flags:
        if not ranged or name != ranged[0][1]:
            raise BadInput(f"{sp.weights.format(name=name)}: '{name}' is not a dim given as a range or list; "
                           f"give {sp.dim_value.format(name=name, value='LO..HI')} or "
                           f"{sp.dim_value.format(name=name, value='V1,V2,...')}")
    if not ranged:
        return [flag for flag, _, _ in fixed], None
    _, name, value = ranged[0]
    values = _values(name, value, sp)
    return [flag for flag, _, _ in fixed], Buckets(name, values, _weights(name, weight_flags.get(name), len(values), sp))


def _values(name: str, spec: str, sp: Spelling) -> tuple[int, ...]:
    given = sp.dim_value.format(name=name, value=spec)
    fix = (f"give {sp.dim_value.format(name=name, value='LO..HI')} (e.g. 16..512) or "
           f"{sp.dim_value.format(name=name, value='V1,V2,...')} with positive integers")
    try:
        if ".." in spec:
            lo, hi = (int(v) for v in spec.split(".."))
            if lo <= 0 or hi <= lo:
                raise BadInput(f"{given}: the range must go up from a positive value; {fix}")
            values = tuple(sorted({lo, hi, *(1 << p for p in range(hi.bit_length()) if lo < 1 << p < hi)}))
        else:
            values = tuple(int(v) for v in spec.split(","))
    except ValueError:
        raise BadInput(f"{given}: not a range or a list of integers; {fix}") from None
    if any(v <= 0 for v in values) or list(values) != sorted(set(values)) or len(values) < 2:
        raise BadInput(f"{given}: values must be positive, distinct and ascending; {fix}")
    if len(values) > MAX_BUCKETS:
        raise BadInput(f"{given}: {len(values)} buckets, at most {MAX_BUCKETS}; give a narrower range or a list")
    return values


def _weights(name: str, spec: str | None, count: int, sp: Spelling) -> tuple[float, ...]:
    if spec is None:
        return (1.0 / count,) * count
    try:
        weights = tuple(float(w) for w in spec.split(","))
    except ValueError:
        weights = ()
    if len(weights) != count or any(not w >= 0 for w in weights) or sum(weights) <= 0:
        raise BadInput(f"{sp.weights_value.format(name=name, value=spec)}: give {count} non-negative numbers, "
                       f"one per bucket of {sp.dim.format(name=name)}, not all 0")
    total = sum(weights)
    return tuple(w / total for w in weights)


def check_same_graph(graphs: Sequence[Graph], buckets: Buckets) -> None:
    """Every bucket must canonicalize to the same nodes (a shape may change only the shapes)."""
    first = [(n.name, n.op_type) for n in graphs[0].nodes]
    for value, graph in zip(buckets.values[1:], graphs[1:], strict=True):
        nodes = [(n.name, n.op_type) for n in graph.nodes]
        if nodes != first:
            where = next((f"node {a[0]!r} ({a[1]}) against {b[0]!r} ({b[1]})"
                          for a, b in zip(first, nodes, strict=False) if a != b),
                         f"{len(first)} nodes against {len(nodes)}")
            raise BadInput(f"--dim {buckets.dim}: at {buckets.dim}={value} the canonical graph differs from "
                           f"{buckets.dim}={buckets.values[0]} ({where}); plan those values apart")


@dataclass
class BucketLegality(Legality):
    """The rules at every bucket: legal where every bucket's legality accepts; the cost is the
    heaviest bucket's kernel with the weighted sum of every bucket's time."""

    buckets: tuple[Legality, ...] = ()
    weights: tuple[float, ...] = ()
    primary: int = 0

    @classmethod
    def over(cls, legalities: Sequence[Legality], buckets: Buckets) -> BucketLegality:
        main = legalities[buckets.heaviest]
        return cls(main.graph, main.device, main.model, main.capabilities, main.max_group_size,
                   main.rules, main.lone_anchors, main.measurer, buckets=tuple(legalities),
                   weights=buckets.weights, primary=buckets.heaviest)

    def _check(self, nodes: frozenset[int]) -> Verdict:
        """The heaviest bucket first (its kernel is the verdict's), then the others' decisions and
        times, through each bucket's memo of twins (a group of the same structure priced there
        before: that bucket's own search finds it too); the first refusal ends it."""
        primary = self.buckets[self.primary]
        primary.outcome(nodes)  # in its memo of twins too, for that bucket's own search
        main = primary.check(nodes)
        if not main.decision:
            return main
        weighted = 0.0
        for i, (weight, legality) in enumerate(zip(self.weights, self.buckets, strict=True)):
            verdict = main if i == self.primary else legality.outcome(nodes)
            if not verdict.decision:
                return verdict
            weighted += weight * verdict.time_s
        return replace(main, cost=replace(main.cost, time_s=weighted))

    def bucket_times(self, groups: Iterable[Iterable[int]]) -> list[float]:
        """Each bucket's time of a partition, each group at that bucket's cheapest choice."""
        groups = [frozenset(g) for g in groups]
        return [sum(legality.time_s(g) for g in groups) for legality in self.buckets]


@dataclass(frozen=True)
class BucketFigure:
    """One bucket's time under the one plan and under its own optimal plan (the same strategy)."""

    value: int
    weight: float
    time_s: float
    own_time_s: float
    own_kernels: int
    # why the bucket's own groups are not in the one plan: "at DIM=V: reason" for each of its own
    # groups another bucket refuses (the first refusal of each, distinct, in plan order)
    why: tuple[str, ...] = ()
    # the bucket's own plan served at every bucket, weighted as the one plan is (None: a bucket
    # refuses one of its groups): above the one plan's weighted time, it says the one plan is a trade
    own_weighted_s: float | None = None
    # the fused groups (more than one node) of its own plan, each its node names joined by "+"
    own_groups: tuple[str, ...] = ()
    # the bucket below's own plan served at this bucket, over this bucket's own plan (None: the
    # lowest bucket, or this bucket refuses one of those groups): what the change of plan is worth
    previous_price: float | None = None

    @property
    def price(self) -> float:
        """What serving this bucket with the one plan costs over its own plan (1.0: nothing)."""
        return self.time_s / self.own_time_s if self.own_time_s else 1.0

    def to_dict(self) -> dict:
        return {"value": self.value, "weight": round(self.weight, 6), "time_s": _r(self.time_s),
                "own_time_s": _r(self.own_time_s), "own_kernels": self.own_kernels, "price": round(self.price, 6),
                "why": list(self.why),
                "own_weighted_s": None if self.own_weighted_s is None else _r(self.own_weighted_s),
                "own_groups": list(self.own_groups),
                "previous_price": None if self.previous_price is None else round(self.previous_price, 6)}


@dataclass(frozen=True)
class PlanChange:
    """How the best grouping changes from one bucket's own plan to the next bucket's."""

    low: int
    high: int
    gone: tuple[str, ...]  # fused groups of the lower bucket's own plan not in the higher's
    new: tuple[str, ...]  # and the other way
    # the lower bucket's own plan served at the higher bucket, over the higher's own plan (None: refused)
    price: float | None

    @property
    def distance(self) -> float:
        """Share of the two plans' fused groups that are in one only (0: the same plan)."""
        union = len(self.gone) + len(self.new) + self.kept
        return (len(self.gone) + len(self.new)) / union if union else 0.0

    kept: int = 0  # fused groups in both

    def to_dict(self) -> dict:
        return {"low": self.low, "high": self.high, "gone": list(self.gone), "new": list(self.new),
                "kept": self.kept, "distance": round(self.distance, 6),
                "price": None if self.price is None else round(self.price, 6)}


def plan_changes(figures: Sequence[BucketFigure]) -> list[PlanChange]:
    """Each pair of neighbouring buckets' own plans: the fused groups in one only, and the price of
    keeping the lower bucket's plan at the higher one (how much the change of plan is worth)."""
    out = []
    for low, high in zip(figures, figures[1:], strict=False):
        a, b = set(low.own_groups), set(high.own_groups)
        out.append(PlanChange(low.value, high.value, tuple(g for g in low.own_groups if g not in b),
                              tuple(g for g in high.own_groups if g not in a), high.previous_price, len(a & b)))
    return out


def changes_dict(figures: Sequence[BucketFigure]) -> dict:
    """The plan changes between neighbouring buckets as plan.json's `buckets.changes`."""
    return {"changes": [c.to_dict() for c in plan_changes(figures)]}


def _r(x: float) -> float:
    return float(f"{x:.6g}")


def refusals(legality: BucketLegality, buckets: Buckets, groups: Iterable[frozenset[int]]) -> tuple[str, ...]:
    """Why groups of one bucket's own plan cannot be in a plan for all buckets: for each group some
    bucket refuses, that bucket and its reason (distinct reasons, in the groups' order)."""
    found: dict[str, None] = {}
    for group in groups:
        for value, bucket in zip(buckets.values, legality.buckets, strict=True):
            verdict = bucket.check(group)
            if not verdict.decision:
                found.setdefault(f"at {buckets.dim}={value}: {verdict.decision.reason}")
                break
    return tuple(found)


def fused_names(graph: Graph, groups: Iterable[Iterable[int]]) -> tuple[str, ...]:
    """The fused groups (more than one node) as their node names in graph order joined by "+", sorted."""
    return tuple(sorted("+".join(graph.nodes[v].name for v in sorted(g)) for g in groups if len(g) > 1))


def plan_buckets(preps: Sequence, buckets: Buckets, device: str, strategy: str, config, threads: int = 1):
    """(the one plan over every bucket, each bucket's figure, each bucket's (prepared model, search
    problem) for `bucket_programs`); each prepared model is one bucket's. The plan's time is the
    weighted sum of the buckets' times; its lower bound likewise. A CPU is priced at `threads`
    OpenMP threads (`--threads`)."""
    from costmodels import RooflineModel
    from fusesearch.api import for_device, model_info, resolve_device
    from fusesearch.costing import graph_figures
    from fusesearch.search import search
    from fusesearch.search.problem import SearchProblem

    label, spec, params, profile = resolve_device(device, threads)
    problems = []
    for prep in preps:
        prep, bucket_params = for_device(prep, spec, params)
        problems.append((prep, SearchProblem.build(prep.graph, spec, RooflineModel(bucket_params), config)))
    check_same_graph([prep.graph for prep, _ in problems], buckets)
    legality = BucketLegality.over([problem.legality for _, problem in problems], buckets)
    main_prep, main_problem = problems[buckets.heaviest]
    joint = SearchProblem(main_prep.graph, legality, config)
    plan = search(main_prep.graph, spec, main_problem.legality.model, strategy, config=config,
                  device_label=label, profile=profile, model_info=model_info(main_prep), problem=joint)
    times = legality.bucket_times(g.nodes for g in plan.groups)
    figures, previous = [], None
    for value, weight, time_s, (prep, problem) in zip(buckets.values, buckets.weights, times, problems, strict=True):
        own = search(prep.graph, spec, problem.legality.model, strategy, config=config, problem=problem)
        groups = [g.nodes for g in own.groups]
        why = refusals(legality, buckets, groups)
        served = sum(legality.time_s(g) for g in groups)
        kept = sum(problem.legality.time_s(g) for g in previous) if previous is not None else math.inf
        figures.append(BucketFigure(value, weight, time_s, own.time_s, own.kernels, why,
                                    served if math.isfinite(served) else None, fused_names(prep.graph, groups),
                                    kept / own.time_s if math.isfinite(kept) and own.time_s else None))
        previous = groups
    bound = sum(w * graph_figures(prep.graph, spec, problem.legality.model).lower_bound_s
                for w, (prep, problem) in zip(buckets.weights, problems, strict=True))
    report = {**buckets.to_dict(), "figures": [f.to_dict() for f in figures], **changes_dict(figures)}
    return replace(plan, lower_bound_s=bound, buckets=report), figures, problems


def bucket_programs(problems: Sequence, plan, device: str, threads: int = 1) -> list:
    """The one plan on each bucket's graph, with that bucket's unfused graph: [(prep, plan, unfused)]
    from `plan_buckets`' per-bucket (prepared model, search problem) pairs. The groups are the one
    plan's; each bucket's kernels are its own cheapest choices, specialized to its shapes (a program
    per bucket, picked by the input's shape)."""
    from fusesearch.api import model_info, resolve_device
    from fusesearch.plans import Plan
    from fusesearch.search import search

    label, spec, _, profile = resolve_device(device, threads)
    groups = [frozenset(g.nodes) for g in plan.groups]
    programs = []
    for prep, problem in problems:
        unfused = search(prep.graph, spec, problem.legality.model, "none", config=problem.config, device_label=label,
                         profile=profile, model_info=model_info(prep), problem=problem)
        ours = Plan.build(problem.legality, groups, strategy=plan.strategy, device=label, profile=profile,
                          solver=plan.solver, model=model_info(prep), unfused_time_s=unfused.time_s,
                          lower_bound_s=unfused.lower_bound_s, priced=unfused.priced)
        programs.append((prep, ours, unfused))
    return programs
