"""Regret: what the cost model's error costs a plan, measured end to end.

Problem: a plan chosen by predicted costs is only as good as the model; the figure a fusion
researcher asks for is how much faster the plan chosen by measured costs runs, and whether that
difference is larger than the machine's noise.
Approach: the same model and strategy planned twice, `--costs predicted` and `--costs measured`
(`autotune`: the timing database makes the second cheap when it was planned before), then both
plans run as whole programs on the CPU through `run.run_plan` (each checked against ONNX
Runtime, then timed one run of each in turn per round, beside ONNX Runtime), so both see the same
machine. The regret is predicted plan's median minus the measured plan's; it is "not
distinguishable" when the predicted plan's time over the measured one's, round by round
(`timing.paired`), has a p20-p80 range that holds 1 (without rounds: when the two programs'
p20-p80 ranges overlap).
Invariants: nothing is written but the timing database and the compile cache; a GPU device is
refused (the programs run on this CPU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fusesearch.errors import BadInput


@dataclass(frozen=True)
class Regret:
    model: str
    device: str
    strategy: str
    threads: int
    repeat: int
    plans: dict  # "predicted" | "measured" -> {"kernels", "model_s", "median_s", "p20_s", "p80_s", ...}
    same_plan: bool
    tuning: dict  # what measuring the choices cost (`autotune.TuneStats`)
    paired: dict | None = None  # the predicted plan's time over the measured one's, round by round (`Paired.to_dict`)

    @property
    def regret_s(self) -> float:
        """The predicted plan's median less the measured plan's (> 0: measured costs ran faster)."""
        return self.plans["predicted"]["median_s"] - self.plans["measured"]["median_s"]

    @property
    def noise_s(self) -> float:
        """The wider p20-p80 spread of the two programs."""
        return max(p["p80_s"] - p["p20_s"] for p in self.plans.values())

    @property
    def verdict(self) -> str:
        """From the ratio round by round (`paired`): which plan is faster where its p20-p80 range
        excludes 1; without it, `timing.compared` on the two programs' p20-p80 ranges."""
        from fusesearch.backends.timing import Paired, compared

        if self.paired is not None:
            return Paired(**self.paired).compared("predicted plan faster", "measured plan faster")
        a, b = ((p["p20_s"], p["p80_s"]) for p in (self.plans["predicted"], self.plans["measured"]))
        return compared(a, b, "predicted plan faster", "measured plan faster")

    def to_dict(self) -> dict:
        fast = self.plans["measured"]["median_s"]
        return {"model": self.model, "device": self.device, "strategy": self.strategy, "threads": self.threads,
                "repeat": self.repeat, "plans": self.plans, "same_plan": self.same_plan,
                "regret_s": self.regret_s, "regret_ratio": self.plans["predicted"]["median_s"] / fast if fast else math.nan,
                "noise_s": self.noise_s, "paired": self.paired, "verdict": self.verdict, "tuning": self.tuning}


def regret(model: str, device: str = "host", strategy: str = "cpsat", *, prepared=None, threads: int = 1,
           repeat: int = 20, warmup: int = 3, seed: int = 0, time_limit_s: float = 60.0) -> Regret:
    """Plan `model` with predicted and with measured costs and run both end to end (module note)."""
    from fusesearch.api import plan, resolve_device
    from fusesearch.backends.cpu import openmp_threads
    from fusesearch.pipeline import prepare
    from fusesearch.run import run_plan
    from fusesearch.search import STRATEGIES

    if strategy not in STRATEGIES:
        raise BadInput(f"--strategy {strategy}: unknown; choose one of {', '.join(STRATEGIES)}")
    spec = resolve_device(device)[1]
    if spec.kind == "gpu":
        raise BadInput(f"--device {device}: regret runs both plans as C programs on this CPU; give a CPU device "
                       "(--device host)")
    prep = prepared or prepare(model)
    kwargs = {"prepared": prep, "seed": seed, "time_limit_s": time_limit_s, "threads": threads}
    with openmp_threads(threads):  # priced, and the choices measured, at the programs' thread count
        predicted = plan(model, device, strategy, **kwargs)
        measured = plan(model, device, strategy, costs="measured", **kwargs)
    # run_plan's two programs: "plan" is the predicted-cost plan, "unfused" the measured-cost one
    report = run_plan(prep, predicted, measured, threads=threads, repeat=repeat, warmup=warmup, seed=seed,
                      names={"plan": "predicted-cost plan's", "unfused": "measured-cost plan's"})
    plans = {label: _figures(p, report.timings[key]) for label, p, key in
             (("predicted", predicted, "plan"), ("measured", measured, "unfused"))}
    pair = report.paired("plan", "unfused")
    return Regret(prep.loaded.name, predicted.device, strategy, threads, repeat, plans,
                  same_plan(predicted, measured), dict(measured.tuning or {}), None if pair is None else pair.to_dict())


def same_plan(a, b) -> bool:
    """Whether two plans run the same kernels: the same groups, each in the same form."""
    def choices(p) -> list:
        return [(g.nodes, g.kernel.impl, g.kernel.schedule) for g in p.groups]
    return choices(a) == choices(b)


def _figures(p, timing) -> dict:
    return {"kernels": p.kernels, "model_s": p.time_s, "measured_groups": sum(g.source == "measured" for g in p.groups),
            "median_s": timing.median_s, "p20_s": timing.p20_s, "p80_s": timing.p80_s, "n": timing.n}
