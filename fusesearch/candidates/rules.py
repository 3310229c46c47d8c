"""Legality rules: may this set of nodes be one kernel on this device? Every answer has a reason.

Problem: enumeration, the greedy merger, the pattern baseline and plan validation must agree on
what one kernel may hold, and `--explain` must show why two ops were not fused, not a bare False.
Approach: as onnxscript's rewriter, a failed check returns its reason. `DEFAULT_RULES`, cheapest
first: `MaxGroupSize` (default 16), `Lowerable` (lowering's checks), `Generatable` (a fused group
has code for every op, from `Legality.capabilities`: legality never imports the generator) and
`FitsDevice` (the cost model accepts it; `Legality.choose` is the one place a form is chosen,
cheapest predicted or, with a `Measurer`, fastest measured). `Legality.check` memoizes per node
set; `Legality.outcome` also shares decisions between groups of the same `structure`, so repeated
blocks are lowered once per block shape (not with a `Measurer`). `Legality.blocked` is a group's
form in the other layout where plans may choose layouts (`layout`), `Legality.reorder` a copy
between layouts, both priced by the model.
Invariants: a refusal always has a non-empty reason; the verdict for a node set is the same
whichever caller asks."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from costmodels import DeviceSpec, KernelCost, RooflineModel
from fusesearch.candidates.capabilities import Capabilities
from fusesearch.costing import (
    blocked_choices,
    cheapest,
    device_choices,
    kernel_cost,
    reorder_options,
)
from fusesearch.groups import FusionDecision, FusionGroup
from fusesearch.ir.graph import Graph
from fusesearch.ir.structure import Structures
from fusesearch.layout import NCHW, Layout
from fusesearch.lowering import Kernel, choices, lower_as_library
from fusesearch.schedule import CHAIN

DEFAULT_MAX_GROUP_SIZE = 16


@dataclass(frozen=True)
class Verdict:
    """What a group is: legal or not (and why), its kernel and predicted cost when legal."""

    decision: FusionDecision
    kernel: Kernel | None = None
    cost: KernelCost | None = None
    source: str = "predicted"  # what priced the cost: "predicted" (the model) or "measured"
    note: str = ""  # why a measured search kept the predicted cost (not measurable, out of band)

    @property
    def time_s(self) -> float:
        return self.cost.time_s if self.cost is not None else float("inf")


class Measurer(Protocol):
    """Times a group's choices (`--costs measured|hybrid`), handed to `Legality` as data (legality
    never imports a backend): for each choice its measured seconds, or None and why it keeps its
    predicted cost (out of the error band, codegen refused, no library kernel), or math.inf and
    why it is refused (its outputs differ from ONNX Runtime's)."""

    mode: str  # "measured" | "hybrid"

    def scale(self, kernel: Kernel) -> float:
        """What puts the kernel's predicted cost on the measured clock (a measured/predicted median)."""
        ...

    def times(self, kernels: Sequence[Kernel], costs: Sequence[KernelCost]) -> list[tuple[float | None, str]]: ...


class FusionRule(Protocol):
    """A rule sees the node set and what the earlier rules produced (the lowered kernel, if any)."""

    name: str

    def check(self, legality: Legality, nodes: frozenset[int], kernel: Kernel | None) -> FusionDecision | Verdict: ...


@dataclass(frozen=True)
class MaxGroupSize:
    name: str = "max-group-size"

    def check(self, legality: Legality, nodes: frozenset[int], kernel: Kernel | None) -> FusionDecision:
        if len(nodes) > legality.max_group_size:
            return FusionDecision.refuse(f"{len(nodes)} ops > max group size {legality.max_group_size}")
        return FusionDecision.accept()


@dataclass(frozen=True)
class Lowerable:
    name: str = "lowerable"

    def check(self, legality: Legality, nodes: frozenset[int], kernel: Kernel | None) -> FusionDecision | Verdict:
        result = legality.lowered(nodes)  # the group's choices, lowered once for every rule
        if isinstance(result, FusionDecision):
            return result
        return Verdict(FusionDecision.accept(), result[0])


@dataclass(frozen=True)
class Generatable:
    """A fused group is one generated kernel, so the generator must have code for each of its ops
    and a C type for each of its tensors (`Capabilities.generatable`), and on a CPU be a group the
    C backend writes well (`Capabilities.cpu_fusable`): both read from `legality.capabilities`,
    the generator's own description; a lone op stays a candidate whatever it is (it runs as a
    library call where it is not generated)."""

    name: str = "generatable"

    def check(self, legality: Legality, nodes: frozenset[int], kernel: Kernel | None) -> FusionDecision:
        if len(nodes) == 1:
            return FusionDecision.accept()
        if legality.device.kind == "cpu":
            decision = legality.capabilities.cpu_fusable(legality.graph, kernel)
            if not decision:
                return decision
        return legality.capabilities.generatable(legality.graph, kernel)


LONE_ANCHORS = ("priced", "library", "generated")
"""How a lone gemm/conv may run: "priced" (the library call or our kernel, whichever is cheaper),
"library" (the unfused reference as a user of ONNX Runtime runs it: `measure --baseline library`),
"generated" (our kernel, priced as itself: `measure --baseline generated`)."""


@dataclass(frozen=True)
class FitsDevice:
    """The cost model accepts the kernel on the device (shared memory, registers, threads, the
    architecture its code needs), and the group runs as its cheapest choice there
    (`costing.cheapest` over `costing.device_choices`: each tile, tensor or CUDA cores; a lone
    anchor the library call or, where the generator writes it (`cpu_fusable` on a CPU and
    `generatable`, as for a fused group), our kernel, as `Legality.lone_anchors` allows). A lone
    op that does not fit runs as a library call instead: every single node stays a candidate."""

    name: str = "fits-device"

    def check(self, legality: Legality, nodes: frozenset[int], kernel: Kernel | None) -> FusionDecision | Verdict:
        options = legality.options(nodes, kernel)
        if isinstance(options, FusionDecision):
            return options
        verdict = legality.choose(options)
        if not (verdict.decision and verdict.cost.feasible) and len(nodes) == 1:
            kernel = lower_as_library(legality.graph, FusionGroup(nodes))
            verdict = Verdict(FusionDecision.accept(), kernel, kernel_cost(kernel, legality.device, legality.model))
        if not verdict.decision:
            return verdict
        if not verdict.cost.feasible:
            return replace(verdict, decision=FusionDecision.refuse(verdict.cost.reason))
        return verdict


def _lone_anchor_choices(legality: Legality, options: tuple[Kernel, ...]) -> tuple[Kernel, ...]:
    """A lone anchor's choices as `legality.lone_anchors` allows: our kernels only where the
    generator writes them well (else, and under "library", the library call alone)."""
    graph, kernel = legality.graph, options[0]
    able = legality.capabilities
    ours_ok = (legality.lone_anchors != "library" and bool(able.generatable(graph, kernel))
               and (legality.device.kind == "gpu" or bool(able.cpu_fusable(graph, kernel))))
    ours = tuple(k for k in options if k.impl == "generated")
    library = tuple(k for k in options if k.impl == "library")
    if not ours_ok or not ours:
        return library or options
    return ours if legality.lone_anchors == "generated" else options


DEFAULT_RULES: tuple[FusionRule, ...] = (MaxGroupSize(), Lowerable(), Generatable(), FitsDevice())


@dataclass
class Legality:
    """The rules bound to one graph, device, cost model and code generator (what it writes:
    `codegen.CAPABILITIES`), with a memo of every verdict."""

    graph: Graph
    device: DeviceSpec
    model: RooflineModel
    capabilities: Capabilities
    max_group_size: int = DEFAULT_MAX_GROUP_SIZE
    rules: tuple[FusionRule, ...] = DEFAULT_RULES
    lone_anchors: str = "priced"  # LONE_ANCHORS: how a lone gemm/conv may run
    measurer: Measurer | None = None  # None: predicted costs; else the choices' measured times
    layout: Layout = NCHW  # the other layout plans may choose (`blocked`: NCHWc, NHWC); NCHW: the model's only
    _blocked: dict[frozenset[int], Verdict | None] = field(default_factory=dict, repr=False)
    _reorders: dict[tuple, tuple[Kernel, KernelCost]] = field(default_factory=dict, repr=False)
    _memo: dict[frozenset[int], Verdict] = field(default_factory=dict, repr=False)
    _last: tuple = field(default=(), repr=False)  # (node set, its choices): the set being checked
    _twins: dict[tuple, Verdict] = field(default_factory=dict, repr=False)  # structure → verdict
    _shared: dict[frozenset[int], Verdict] = field(default_factory=dict, repr=False)  # node set → its twin's
    _structures: Structures | None = field(default=None, repr=False)

    def check(self, nodes: Iterable[int]) -> Verdict:
        key = frozenset(nodes)
        verdict = self._memo.get(key)
        if verdict is None:
            verdict = self._memo[key] = self._check(key)
        return verdict

    def outcome(self, nodes: Iterable[int]) -> Verdict:
        """The group's decision and cost, shared with an earlier group of the same `structure` (its
        kernel may be that group's: read a group's kernel through `check`)."""
        key = frozenset(nodes)
        verdict = self._memo.get(key) or self._shared.get(key)
        if verdict is not None or self.measurer is not None:
            return verdict or self.check(key)
        if self._structures is None:
            self._structures = Structures(self.graph)
        shape = self._structures(key)
        verdict = self._twins.get(shape)
        if verdict is None:
            verdict = self._twins[shape] = self.check(key)
        self._shared[key] = verdict
        return verdict

    def _check(self, nodes: frozenset[int]) -> Verdict:
        verdict = Verdict(FusionDecision.accept())
        for rule in self.rules:
            result = rule.check(self, nodes, verdict.kernel)
            if isinstance(result, FusionDecision):
                if not result:
                    return Verdict(result, verdict.kernel, verdict.cost)
                continue
            if not result.decision:
                return result
            verdict = replace(result, cost=result.cost if result.cost else verdict.cost)
        return verdict

    def lowered(self, nodes: frozenset[int]) -> tuple[Kernel, ...] | FusionDecision:
        """Every choice of the group on the device (`costing.device_choices`; without a device,
        lowering's), or why it has none; kept for the node set being checked, so the rules lower
        it once."""
        if not self._last or self._last[0] != nodes:
            group = FusionGroup(nodes)
            self._last = (nodes, choices(self.graph, group) if self.device is None else
                          device_choices(self.graph, group, self.device, self.capabilities.blas))
        return self._last[1]

    def options(self, nodes: frozenset[int], kernel: Kernel | None) -> tuple[Kernel, ...] | FusionDecision:
        """The group's choices on the device (`lowered`; a lone anchor's as `lone_anchors`
        allows), or why it has none."""
        options = self.lowered(nodes)
        if isinstance(options, FusionDecision) or not (len(nodes) == 1 and kernel.anchor is not None):
            return options
        return _lone_anchor_choices(self, options)

    def choose(self, options: Sequence[Kernel]) -> Verdict:
        """The choice the group runs as: the cheapest predicted (`costing.cheapest`) or, with a
        measurer, the fastest of the feasible choices at their measured times (a choice not
        measured at its predicted one times the measurer's scale, so both are on one clock; one
        that computed wrongly refused), ties the earlier; the verdict says what priced it."""
        kernel, cost = cheapest(options, self.device, self.model)
        if self.measurer is None or not cost.feasible:
            return Verdict(FusionDecision.accept(), kernel, cost)
        fits = self.priced(options)
        timed = self.measurer.times([k for k, _ in fits], [c for _, c in fits])
        verdicts = [Verdict(FusionDecision.refuse(why), k, c, "measured", why) if t == math.inf
                    else Verdict(FusionDecision.accept(), k, replace(c, time_s=t), "measured") if t is not None
                    else Verdict(FusionDecision.accept(), k, replace(c, time_s=c.time_s * self.measurer.scale(k)),
                                 "predicted", why)
                    for (k, c), (t, why) in zip(fits, timed, strict=True)]
        usable = [v for v in verdicts if v.decision]
        return min(usable, key=lambda v: v.time_s) if usable else verdicts[0]

    def priced(self, options: Sequence[Kernel]) -> list[tuple[Kernel, KernelCost]]:
        """The choices that fit the device, each with its predicted cost (what a measurer times)."""
        return [(k, c) for k in options if (c := kernel_cost(k, self.device, self.model)).feasible]

    @property
    def costs(self) -> str:
        """What prices the choices: "predicted", or the measurer's mode."""
        return "predicted" if self.measurer is None else self.measurer.mode

    def time_s(self, nodes: Iterable[int]) -> float:
        return self.outcome(nodes).time_s

    def blocked(self, nodes: Iterable[int]) -> Verdict | None:
        """A legal group's form in the other layout (`blocked_options`) as `choose` prices it (the
        cheapest predicted, or with a measurer the fastest measured), where plans may choose
        layouts (`layout`) and it has one that fits; else None (the group runs in NCHW)."""
        key = frozenset(nodes)
        if not self.layout.blocked:
            return None
        if key not in self._blocked:
            options = self.blocked_options(key)
            legal = bool(options) and (bool(self.check(key).decision) or self._alone(key, options))
            verdict = self.choose(options) if legal else None
            fits = verdict is not None and bool(verdict.decision) and verdict.cost.feasible
            self._blocked[key] = verdict if fits else None
        return self._blocked[key]

    def blocked_only(self, nodes: Iterable[int]) -> bool:
        """Whether a group runs in the blocked layout or not at all: it has a blocked form
        (`blocked`) and no NCHW one (a chain of anchors, `schedule.anchor_chain`)."""
        key = frozenset(nodes)
        return self.layout.blocked and not self.check(key).decision and self.blocked(key) is not None

    def _alone(self, nodes: frozenset[int], options: Sequence[Kernel]) -> bool:
        """A group whose forms are all chains (`schedule.CHAIN`: lowering refuses two anchors in
        NCHW) as the rules but lowering's take it: within the group size, generated."""
        return all(k.schedule.product == CHAIN for k in options) and all(
            rule.check(self, nodes, options[0]) for rule in (MaxGroupSize(), Generatable()))

    def blocked_options(self, nodes: Iterable[int]) -> tuple[Kernel, ...]:
        """The group's forms in the other layout (`costing.blocked_choices`); () where it has none."""
        return blocked_choices(self.graph, FusionGroup(frozenset(nodes)), self.device, self.capabilities.blas)

    def reorder(self, tensor: str, source: Layout, target: Layout) -> tuple[Kernel, KernelCost]:
        """The copy of `tensor` from one layout to the other, its cheapest predicted form
        (`costing.reorder_options`: above one thread also on one thread), priced; with a measurer
        on the measured clock (its prediction times the measurer's scale: a reorder is not timed
        alone, as a group's unmeasured choice is not)."""
        key = (tensor, source, target)
        if key not in self._reorders:
            options = reorder_options(self.graph, tensor, source, target, self.device, self.capabilities.blas)
            kernel, cost = cheapest(options, self.device, self.model)
            if self.measurer is not None:
                cost = replace(cost, time_s=cost.time_s * self.measurer.scale(kernel))
            self._reorders[key] = (kernel, cost)
        return self._reorders[key]

    @property
    def evaluated(self) -> int:
        return len(self._memo)
