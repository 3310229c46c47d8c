"""Fitting a cost model to measured kernels, and judging it: metrics, the fit, the register fit.

Problem: `RooflineParams` start as guesses; measured kernels should set them, judged by the error
on kernels the fit did not see.
Approach: `fit` is least squares on log(predicted) - log(measured) over `free_parameters`, in
log/logit coordinates (bounds hold) with a weak pull to the start: a coordinate search, then
Levenberg-Marquardt on `RooflineModel.cost` itself, from three starts. `fit_staged` fits shared
terms on anchor-free kernels, then each anchor template's. `cross_validate` (k folds by group)
says whether a part's fit predicts left-out kernels worse (`error_factor`, |log(pred/meas)|, not
APE) than its start, so the caller keeps it (`keep_shared`, `keep_start`); a part (`part_of`) is a
template's generated kernels or its library calls. `fit_registers` fits registers to ptxas;
`accuracy` gives MAPE, median APE, Spearman and Kendall.
Invariants: pure and deterministic (numpy only; no graphs, no files); fitted parameters pass
RooflineParams validation, efficiencies within (0, 1] of their peak."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from costmodels.devices import DeviceSpec
from costmodels.kernel import CPU_PRODUCTS, TEMPLATE_PRODUCTS, KernelSpec
from costmodels.resources import estimate_registers
from costmodels.roofline import RooflineModel, RooflineParams

PRIOR_WEIGHT = 1e-3  # pull (per parameter, in log / logit units) to the starting value
REGISTER_ARCH = "sm_90"

CV_FOLDS = 3

# Parameter coordinates: log for positive values, logit for those in (0, 1). An efficiency is a
# fraction of its peak (tensor-core or scalar FLOP/s, DRAM bytes/s): never above 1.
_UNIT_INTERVAL = ("overlap", "occupancy_knee")
_EFFICIENCY = (1e-4, 1.0)
_OWN = ("tc_efficiency", "library_efficiency", "mma_efficiency", "mma_sync_efficiency", "scalar_efficiency",
        "memory_efficiency",
        "occupancy_knee")  # per template
_BOUNDS = {"tc_efficiency": _EFFICIENCY, "library_efficiency": _EFFICIENCY, "mma_efficiency": _EFFICIENCY,
           "mma_sync_efficiency": _EFFICIENCY,
           "scalar_efficiency": _EFFICIENCY,
           "memory_efficiency": _EFFICIENCY,
           "launch_overhead_scale": (1e-3, 1e3),
           "index_division_flops": (1e-3, 1e3), "staging_load_flops": (1e-2, 1e3), "read_traffic_factor": (1e-2, 2.0), "division_flops": (1e-2, 1e3),
           "transcendental_flops": (0.1, 1e4), "overlap": (1e-3, 1 - 1e-3),
           "occupancy_knee": (1e-3, 1.0), "product_efficiency": (1e-2, 1e2)}


# -- metrics ----------------------------------------------------------------------------------

def _ranks(x: np.ndarray) -> np.ndarray:
    """Ranks (1..n) with ties averaged."""
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x), dtype=np.float64)
    sorted_x = x[order]
    i = 0
    while i < len(x):
        j = i
        while j + 1 < len(x) and sorted_x[j + 1] == sorted_x[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if len(a) < 2:
        return math.nan
    ra, rb = _ranks(a), _ranks(b)
    if ra.std() == 0 or rb.std() == 0:
        return math.nan
    return float(np.corrcoef(ra, rb)[0, 1])


def kendall(a: Sequence[float], b: Sequence[float]) -> float:
    """Kendall's tau-b (ties in either variable accounted for)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    n = len(a)
    if n < 2:
        return math.nan
    da = np.sign(a[:, None] - a[None, :])
    db = np.sign(b[:, None] - b[None, :])
    iu = np.triu_indices(n, 1)
    da, db = da[iu], db[iu]
    concordant_minus_discordant = float(np.sum(da * db))
    denom = math.sqrt(float(np.sum(da != 0)) * float(np.sum(db != 0)))
    return concordant_minus_discordant / denom if denom else math.nan


def accuracy(predicted: Sequence[float], measured: Sequence[float]) -> dict:
    """{"n", "mape", "median_ape", "error_factor", "spearman", "kendall"}: APE = |pred - meas| /
    meas; `error_factor` the factor off either way that the fit and its guard judge by."""
    p, m = np.asarray(predicted, dtype=np.float64), np.asarray(measured, dtype=np.float64)
    if len(p) == 0:
        return {"n": 0, "mape": math.nan, "median_ape": math.nan, "error_factor": math.nan, "spearman": math.nan,
                "kendall": math.nan}
    ape = np.abs(p - m) / m
    return {"n": int(len(p)), "mape": float(np.mean(ape)), "median_ape": float(np.median(ape)),
            "error_factor": error_factor(p, m), "spearman": spearman(p, m), "kendall": kendall(p, m)}


def error_factor(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """exp(mean |log(predicted / measured)|): the factor (>= 1) a prediction is typically off by,
    too fast or too slow alike (1 = exact; nan for no kernels)."""
    p, m = np.asarray(predicted, dtype=np.float64), np.asarray(measured, dtype=np.float64)
    return float(np.exp(np.mean(np.abs(np.log(p / m))))) if len(p) else math.nan


# -- fitting ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class FitResult:
    params: RooflineParams
    fitted: tuple[str, ...]  # the dotted parameter names that were free
    train_loss_before: float  # mean squared log residual
    train_loss_after: float
    iterations: int


def predict(specs: Sequence[KernelSpec], device: DeviceSpec, params: RooflineParams) -> np.ndarray:
    model = RooflineModel(params)
    return np.array([model.cost(s, device).time_s for s in specs], dtype=np.float64)


def free_parameters(specs: Sequence[KernelSpec], device: DeviceSpec) -> list[str]:
    """The dotted names of the parameters the fit moves: the efficiencies of the templates
    present (the main loop's where its FLOPs exist, the generated kernels' and the library
    calls' apart, scalar where scalar or
    transcendental FLOPs exist), overlap, launch overhead, the transcendental weight when
    transcendentals occur, and the occupancy knees on a GPU; on a CPU, where a template's generated
    kernels ran two or more products (`KernelSpec.product`), each product's factor but the most
    sampled one's (which the template's efficiency carries: `product_factors`)."""
    present = sorted({s.template for s in specs})
    names = []
    for t in present:
        rows = [s for s in specs if s.template == t]
        if device.kind != "gpu":
            names += product_factors(rows)
        if any(s.tc_flops > 0 and s.impl == "generated" and s.main_unit != "tensor-core" for s in rows):
            names.append(f"tc_efficiency.{t}")
        for sync, table in ((False, "mma_efficiency"), (True, "mma_sync_efficiency")):
            if any(s.tc_flops > 0 and s.impl == "generated" and s.main_unit == "tensor-core" and s.mma_sync == sync
                   for s in rows):
                names.append(f"{table}.{t}")
        if any(s.tc_flops > 0 and s.impl == "library" for s in rows):  # fitted apart: another kernel
            names.append(f"library_efficiency.{t}")
        if any(s.scalar_flops + s.transcendentals > 0 for s in rows):
            names.append(f"scalar_efficiency.{t}")
        names.append(f"memory_efficiency.{t}")
        if device.kind == "gpu":
            names.append(f"occupancy_knee.{t}")
    names += ["overlap", "launch_overhead_scale", "index_division_flops", "read_traffic_factor"]
    if any(s.divisions > 0 for s in specs):
        names.append("division_flops")
    if any(s.staged_loads > 0 for s in specs):
        names.append("staging_load_flops")
    if any(s.transcendentals > 0 for s in specs):
        names.append("transcendental_flops")
    return names


def product_factors(specs: Sequence[KernelSpec]) -> list[str]:
    """The `product_efficiency` names a fit can see in one template's kernels: every product its
    generated kernels ran but the most sampled (ties: the first in CPU_PRODUCTS), whose factor stays
    put so that the template's efficiency and the factors are not one degree of freedom."""
    counts: dict[str, int] = {}
    for s in specs:
        if s.impl == "generated" and s.tc_flops > 0 and s.product:
            counts[s.product] = counts.get(s.product, 0) + 1
    if len(counts) < 2:
        return []
    ordered = sorted(counts, key=lambda p: (-counts[p], CPU_PRODUCTS.index(p)))
    return [f"product_efficiency.{p}" for p in ordered[1:]]


def _coord(name: str) -> tuple[str, float, float]:
    """(transform, low, high) of a dotted parameter: 'logit' for (0, 1) values, else 'log'."""
    base = name.split(".")[0]
    if base in _UNIT_INTERVAL:
        low, high = _BOUNDS[base]
        return "logit", low, high
    low, high = _BOUNDS[base]
    return "log", low, high


def _to_z(name: str, value: float) -> float:
    kind, low, high = _coord(name)
    value = min(max(value, low), high)
    if kind == "log":
        return math.log(value)
    value = min(value, 1 - 1e-6)
    return math.log(value / (1 - value))


def _from_z(name: str, z: float) -> float:
    kind, low, high = _coord(name)
    value = math.exp(z) if kind == "log" else 1 / (1 + math.exp(-z))
    return min(max(value, low), high)


def fit(specs: Sequence[KernelSpec], measured_s: Sequence[float], device: DeviceSpec,
        start: RooflineParams | None = None, *, names: Sequence[str] | None = None,
        max_iter: int = 60, prior_weight: float = PRIOR_WEIGHT) -> FitResult:
    """Least squares on log time (Levenberg-Marquardt, forward-difference Jacobian of the real
    RooflineModel) over `names` (default: `free_parameters`)."""
    start = start or RooflineParams()
    measured = np.asarray(measured_s, dtype=np.float64)
    if len(specs) == 0 or len(specs) != len(measured) or np.any(measured <= 0):
        raise ValueError("fit needs one positive measured time per spec")
    names = list(names if names is not None else free_parameters(specs, device))
    flat = start.flat()
    # a parameter that starts at 0 (a term the datasheet model leaves out) starts the search at 1
    z0 = np.array([_to_z(n, flat[n] if flat[n] > 0 else 1.0) for n in names])
    log_m = np.log(measured)

    def params_at(z: np.ndarray) -> RooflineParams:
        return start.with_updates(**{n: _from_z(n, float(v)) for n, v in zip(names, z, strict=True)})

    def residual(z: np.ndarray) -> np.ndarray:
        pred = predict(specs, device, params_at(z))
        return np.log(np.maximum(pred, 1e-15)) - log_m

    def loss(r: np.ndarray, z: np.ndarray) -> float:
        return float(r @ r) / len(r) + prior_weight * float((z - z0) @ (z - z0))

    before = loss(residual(z0), z0)
    total = lambda zz: loss(residual(zz), zz)  # noqa: E731
    ranges = [_z_range(n) for n in names]
    # the max() of the roofline hides a parameter whose side is not the bound one (zero
    # gradient): from a few starts (efficiencies x 1, 0.1, 0.01), a coarse coordinate search over
    # each parameter's range, then Levenberg-Marquardt; the best end point wins
    efficiency = np.array([n.split(".")[0].endswith("efficiency") for n in names])
    best = None
    for factor in (1.0, 0.1, 0.01):
        start_z = np.clip(np.where(efficiency, z0 + math.log(factor), z0), *np.array(ranges).T)
        z = _coordinate_search(total, start_z, ranges)
        z, current, iterations = _levenberg_marquardt(residual, loss, z, z0, prior_weight, max_iter, ranges)
        if best is None or current < best[1]:
            best = (z, current, iterations)
    z, current, iterations = best
    return FitResult(params_at(z), tuple(names), float(before), float(current), iterations)


SHARED = ("overlap", "launch_overhead_scale", "index_division_flops", "read_traffic_factor", "division_flops",
          "transcendental_flops", "staging_load_flops")
ANCHOR_FREE = ("pointwise", "rowwise")


def fit_staged(specs: Sequence[KernelSpec], measured_s: Sequence[float], device: DeviceSpec,
               start: RooflineParams | None = None) -> FitResult:
    """Two stages: the terms every kernel shares (launch overhead, overlap, index arithmetic,
    transcendental weight) and the anchor-free templates' efficiencies on the anchor-free kernels,
    where those terms dominate; then each anchor template's own parameters with the shared ones
    fixed. So a template the roofline describes poorly (naive CPU loop nests for gemm) cannot bend
    what every kernel shares. On a CPU the anchor templates' scalar efficiency (their prologue and
    epilogue loops) is the pointwise one, not fitted apart. One stage over everything when either
    side has too few kernels."""
    start = start or RooflineParams()
    measured = np.asarray(measured_s, dtype=np.float64)
    simple = np.array([s.template in ANCHOR_FREE for s in specs])
    if simple.sum() < 8 or (~simple).sum() < 2:
        return fit(specs, measured, device, start)
    first_specs = [s for s, k in zip(specs, simple, strict=True) if k]
    first = fit(first_specs, measured[simple], device, start)
    rest_specs = [s for s, k in zip(specs, simple, strict=True) if not k]
    names = [n for n in free_parameters(rest_specs, device) if n not in SHARED]
    first_params = first.params
    if device.kind != "gpu":  # on a CPU a prologue or epilogue is the same vectorized C loop as a
        # pointwise kernel, and too small a part of an anchor kernel's time to fit its own rate
        tied = {f"scalar_efficiency.{t}": first_params.get("scalar_efficiency", "pointwise")
                for t in sorted({s.template for s in rest_specs})}
        first_params = first_params.with_updates(**tied)
        names = [n for n in names if n not in tied]
    second = fit(rest_specs, measured[~simple], device, first_params, names=names)
    total = lambda p: float(np.mean((np.log(predict(specs, device, p)) - np.log(measured)) ** 2))  # noqa: E731
    return FitResult(second.params, tuple(dict.fromkeys(first.fitted + second.fitted)), total(start),
                     total(second.params), first.iterations + second.iterations)


LIBRARY_PART = "/library"  # a part's suffix for a template's library calls


def part_of(spec: KernelSpec) -> str:
    """The part of the parameters a kernel is judged in: `template`, or `template/library` for a
    library call (a vendor kernel priced by `library_efficiency`, not our generated code)."""
    return spec.template + (LIBRARY_PART if spec.impl == "library" else "")


def keep_start(params: RooflineParams, start: RooflineParams, part: str) -> RooflineParams:
    """`params` with the part's own parameters set back to their values in `start`: a template's
    (`part_of`) efficiencies, occupancy knee and its C products' factors (`TEMPLATE_PRODUCTS`) but
    its library efficiency, or for
    `template/library` that library efficiency alone; the shared terms stay as fitted."""
    template = part.removesuffix(LIBRARY_PART)
    tables = (("library_efficiency",) if part.endswith(LIBRARY_PART)
              else tuple(t for t in _OWN if t != "library_efficiency"))
    products = () if part.endswith(LIBRARY_PART) else TEMPLATE_PRODUCTS.get(template, ())
    return params.with_updates(**{f"{table}.{template}": start.get(table, template) for table in tables},
                               **{f"product_efficiency.{p}": start.get("product_efficiency", p) for p in products})


def keep_shared(params: RooflineParams, start: RooflineParams) -> RooflineParams:
    """`params` with the first stage of `fit_staged` set back to `start`: the shared terms and the
    anchor-free templates' own parameters (the anchor templates' own stay as fitted)."""
    updates = {name: getattr(start, name) for name in SHARED}
    updates.update({f"{table}.{t}": start.get(table, t) for t in ANCHOR_FREE for table in _OWN})
    return params.with_updates(**updates)


def group_folds(groups: Sequence[str], k: int, seed: int) -> np.ndarray:
    """Fold index (0..k-1) of each row: the distinct groups shuffled (seeded) and dealt round-robin,
    so a group's rows share a fold."""
    keys = sorted(set(groups))
    order = np.random.default_rng([seed, k]).permutation(len(keys))
    fold_of = {keys[j]: i % k for i, j in enumerate(order)}
    return np.array([fold_of[g] for g in groups], dtype=np.int64)


SHARED_TERMS = "shared terms"  # cross_validate's key for the first stage kept or fitted as a whole


def cross_validate(specs: Sequence[KernelSpec], measured_s: Sequence[float], groups: Sequence[str],
                   device: DeviceSpec, start: RooflineParams, seed: int, *, k: int = CV_FOLDS) -> dict[str, dict]:
    """The `error_factor` on left-out folds, each fold predicted by `fit_staged` run on the other
    k-1: first under SHARED_TERMS, over every kernel, of the fold's fitted parameters
    ("fitted_error") and of them with the first stage back at `start` (`keep_shared`:
    "kept_error"); then per part (`part_of`), on that part's kernels, of the better of those two
    ("fitted_error") and of it with the part's own parameters at `start` ("kept_error"). Empty
    when there are fewer than k groups."""
    measured = np.asarray(measured_s, dtype=np.float64)
    if len(set(groups)) < k:
        return {}
    folds = group_folds(groups, k, seed)
    fits = [fit_staged([s for s, i in zip(specs, folds != f, strict=True) if i], measured[folds != f], device,
                       start).params for f in range(k)]

    def left_out(params_of, rows_of) -> tuple[np.ndarray, np.ndarray]:
        """(predicted, measured) of the kernels `rows_of` takes, each by its own fold's fit."""
        pred: list[float] = []
        meas: list[float] = []
        for f, fitted in enumerate(fits):
            rows = [s for s, i in zip(specs, folds == f, strict=True) if i and rows_of(s)]
            if rows:
                pred.extend(predict(rows, device, params_of(fitted)))
                meas.extend(measured[folds == f][[rows_of(s) for s, i in zip(specs, folds == f, strict=True) if i]])
        return np.array(pred), np.array(meas)

    every = lambda s: True  # noqa: E731
    fitted_all, kept_all = left_out(lambda p: p, every), left_out(lambda p: keep_shared(p, start), every)
    shared = {"n": len(fitted_all[0]), "fitted_error": error_factor(*fitted_all), "kept_error": error_factor(*kept_all)}
    base = (lambda p: keep_shared(p, start)) if shared["kept_error"] < shared["fitted_error"] else (lambda p: p)
    out = {SHARED_TERMS: shared}
    for t in sorted({part_of(s) for s in specs}):
        mine = lambda s, t=t: part_of(s) == t  # noqa: E731
        fitted = left_out(base, mine)
        kept = left_out(lambda p, t=t: keep_start(base(p), start, t), mine)
        out[t] = {"n": len(fitted[0]), "fitted_error": error_factor(*fitted), "kept_error": error_factor(*kept)}
    return out


def _levenberg_marquardt(residual, loss, z: np.ndarray, z0: np.ndarray, prior_weight: float,
                         max_iter: int, ranges: Sequence[tuple[float, float]]) -> tuple[np.ndarray, float, int]:
    low, high = np.array([r[0] for r in ranges]), np.array([r[1] for r in ranges])
    r = residual(z)
    current = loss(r, z)
    lam, iterations = 1e-2, 0
    n = len(r)
    while iterations < max_iter:
        iterations += 1
        jac = _jacobian(residual, z, r)
        a = jac.T @ jac / n + prior_weight * np.eye(len(z))
        g = jac.T @ r / n + prior_weight * (z - z0)
        improved = False
        while lam < 1e8:
            step = np.linalg.solve(a + lam * np.diag(np.diag(a) + 1e-12), -g)
            z_new = np.clip(z + step, low, high)  # a step past a bound stops at it
            r_new = residual(z_new)
            new = loss(r_new, z_new)
            if new < current:
                improved = current - new > 1e-10 * max(1.0, current)
                z, r, current = z_new, r_new, new
                lam = max(lam / 3, 1e-7)
                break
            lam *= 4
        if not improved:
            break
    return z, current, iterations


def _z_range(name: str) -> tuple[float, float]:
    _, low, high = _coord(name)
    return _to_z(name, low), _to_z(name, high)


def _coordinate_search(loss: Callable[[np.ndarray], float], z: np.ndarray,
                       ranges: Sequence[tuple[float, float]], sweeps: int = 3, points: int = 25) -> np.ndarray:
    """Each coordinate in turn set to the best of `points` values across its range (the others
    held), `sweeps` times over all coordinates; returns the best point found."""
    z = z.copy()
    best = loss(z)
    for _ in range(sweeps):
        moved = False
        for j, (low, high) in enumerate(ranges):
            for value in np.linspace(low, high, points):
                trial = z.copy()
                trial[j] = value
                value_loss = loss(trial)
                if value_loss < best - 1e-12:
                    z, best, moved = trial, value_loss, True
        if not moved:
            break
    return z


def _jacobian(residual: Callable[[np.ndarray], np.ndarray], z: np.ndarray, r: np.ndarray,
              h: float = 1e-3) -> np.ndarray:
    jac = np.empty((len(r), len(z)))
    for j in range(len(z)):
        zj = z.copy()
        zj[j] += h
        jac[:, j] = (residual(zj) - r) / h
    return jac


# -- register model ---------------------------------------------------------------------------

def fit_registers(live_values: Sequence[int], dtype_bytes: Sequence[int], ptxas: Sequence[int],
                  heldout: Sequence[bool], start: RooflineParams, regs_max: int = 255,
                  arch: str = REGISTER_ARCH) -> dict:
    """Fit regs_base / regs_per_live_value (least squares on relative error — rows weighted by
    1 / ptxas registers — over the training rows below the cap, both kept >= 0) and report MAE /
    MAPE before and after on held-out rows."""
    live = np.asarray(live_values, dtype=np.float64)
    words = np.maximum(1, np.ceil(np.asarray(dtype_bytes, dtype=np.float64) / 4))
    regs = np.asarray(ptxas, dtype=np.float64)
    held = np.asarray(heldout, dtype=bool)
    x = live * words
    train = (~held) & (regs < regs_max)
    base, per = start.regs_base, start.regs_per_live_value
    if train.sum() >= 2 and np.ptp(x[train]) > 0:
        w = 1.0 / np.maximum(regs[train], 1.0)
        a = np.column_stack([np.ones(train.sum()), x[train]]) * w[:, None]
        (b, p), *_ = np.linalg.lstsq(a, regs[train] * w, rcond=None)
        if p < 0:
            b, p = float(np.mean(regs[train])), 0.0
        if b < 0:
            b, p = 0.0, float(max(0.0, (x[train] @ regs[train]) / (x[train] @ x[train])))
        base, per = float(b), float(p)

    def estimate(b: float, p: float) -> np.ndarray:
        return np.array([estimate_registers(int(v), int(d), regs_max, base=b, per_value=p).regs_per_thread
                         for v, d in zip(live, dtype_bytes, strict=True)], dtype=np.float64)

    def errors(est: np.ndarray, mask: np.ndarray) -> dict:
        if not mask.any():
            return {"n": 0, "mae": math.nan, "mape": math.nan, "spearman": math.nan}
        diff = np.abs(est[mask] - regs[mask])
        return {"n": int(mask.sum()), "mae": float(diff.mean()),
                "mape": float(np.mean(diff / regs[mask])), "spearman": spearman(est[mask], regs[mask])}

    before, after = estimate(start.regs_base, start.regs_per_live_value), estimate(base, per)
    return {"arch": arch, "n_train": int(train.sum()), "n_heldout": int(held.sum()),
            "params_before": {"regs_base": start.regs_base, "regs_per_live_value": start.regs_per_live_value},
            "params_after": {"regs_base": base, "regs_per_live_value": per},
            "heldout": {"before": errors(before, held), "after": errors(after, held)},
            "train": {"before": errors(before, ~held), "after": errors(after, ~held)}}
