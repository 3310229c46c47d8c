"""Reports of a sweep: Markdown tables and PNG plots from a results folder.

Problem: a sweep leaves one row per cell; a researcher wants the comparisons (strategy by model and
GPU, solver scaling, plans across GPUs, measured against predicted) as tables and pictures.
Approach: `load_results` (cell files, else results.parquet) → a pandas frame in grid order → one
Markdown section and one matplotlib figure (Agg) per question the data can answer. End-to-end
cells get their own section: predicted and measured speedup over strategy none, latency over ONNX
Runtime's, and Spearman's rank correlation of predicted and measured plan times.
Invariants: reads only the results folder, writes only `report.md` and its PNGs (all checked
before any is written; nothing overwritten unless asked); every figure is a number from the rows,
a cost-model prediction unless a column says measured."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path

from fusesearch.errors import BadInput, check_outputs, writing

STRATEGY_ORDER = ("none", "rules", "greedy", "cpsat")
PLOTS = ("speedup", "solver_time", "devices", "measured")


# -- figures from rows --------------------------------------------------------------------------

def fmt_time(seconds) -> str:
    if seconds is None or (isinstance(seconds, float) and math.isnan(seconds)):
        return "-"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e6:.1f} us"


def geomean(values: Iterable[float]) -> float:
    values = [v for v in values if v and v > 0 and not math.isnan(v)]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else math.nan


def _ordered(frame, column: str) -> list:
    """Values of `column` in the order they first appear in the grid."""
    return list(dict.fromkeys(frame.sort_values("cell_index")[column]))


def _strategies(frame) -> list[str]:
    present = set(frame["strategy"])
    return [s for s in STRATEGY_ORDER if s in present] + sorted(present - set(STRATEGY_ORDER))


def _ok(frame):
    return frame[frame["status"] == "ok"] if "status" in frame else frame


def _decompositions(frame) -> list[str]:
    """The cpsat cells' `decompose` values in grid order, where a sweep varied it (else [])."""
    exact = frame[frame["strategy"] == "cpsat"] if "decompose" in frame else frame.iloc[0:0]
    found = [d for d in _ordered(exact, "decompose") if isinstance(d, str)] if len(exact) else []
    return found if len(found) > 1 else []


def _variants(frame) -> list[tuple[str, object]]:
    """(label, rows) per strategy, cpsat once per `decompose` value where a sweep varied it."""
    out = []
    for s in _strategies(frame):
        sub = frame[frame["strategy"] == s]
        if s == "cpsat" and _decompositions(frame):
            out += [(f"cpsat, decompose {d}", sub[sub["decompose"] == d]) for d in _decompositions(frame)]
        else:
            out.append((s, sub))
    return out


def _best_strategy(frame) -> str:
    strategies = _strategies(frame)
    return "cpsat" if "cpsat" in strategies else strategies[-1]


def _groups(row) -> set[str]:
    return set(json.loads(row["fused_groups"])) if isinstance(row.get("fused_groups"), str) else set()


def plan_distance(a: set[str], b: set[str]) -> float:
    """Share of fused groups that are in one plan but not the other (Jaccard distance)."""
    union = a | b
    return len(a ^ b) / len(union) if union else 0.0


def _table(headers: list[str], rows: list[list], right: Iterable[int] = ()) -> list[str]:
    right = set(right)
    align = ["---:" if i in right else "---" for i in range(len(headers))]
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return lines


# -- markdown sections --------------------------------------------------------------------------

def summary_section(frame) -> list[str]:
    ok = _ok(frame)
    lines = ["## Summary by strategy", "",
             "Geometric means over every model × device cell (predicted by the roofline cost model). "
             "Speedup = unfused time / plan time; x bound = plan time / physical lower bound.", ""]
    rows = []
    for label, sub in _variants(ok):
        exact = label.startswith("cpsat")
        gaps = sub[sub["bound_s"] > 0]["gap"].dropna() if "gap" in sub else []
        optimal = int((sub["solver_status"] == "OPTIMAL").sum())
        rows.append([label, len(sub), f"{sub['kernels'].sum() / max(1, sub['canonical_nodes'].sum()):.2f}",
                     f"{geomean(sub['speedup']):.2f}x", f"{geomean(sub['x_lower_bound']):.2f}x",
                     f"{sub['wall_s'].median():.2f} s", f"{sub['wall_s'].max():.2f} s",
                     f"{optimal}/{len(sub)}" if exact else "-",
                     f"{100 * max(gaps):.2f}%" if len(gaps) and exact else "-"])
    lines += _table(["strategy", "cells", "kernels / node", "speedup", "x bound", "median wall",
                     "max wall", "optimal", "max gap"], rows, right=range(1, 9))
    strategies = _strategies(ok)
    if "cpsat" in strategies and len(strategies) > 1:
        lines += ["", _cpsat_vs(ok)]
    return lines + [""]


def _cpsat_vs(ok) -> str:
    key = ["model", "device", "max_group_size"]
    exact = ok[ok["strategy"] == "cpsat"].groupby(key)["time_s"].min()
    parts = []
    for s in ("greedy", "rules"):
        other = ok[ok["strategy"] == s].set_index(key)["time_s"]
        joined = other.to_frame("h").join(exact.to_frame("x"), how="inner")
        if joined.empty:
            continue
        better = joined[joined["x"] < joined["h"] * (1 - 1e-3)]
        gain = (1 - (better["x"] / better["h"])).max() if len(better) else 0.0
        parts.append(f"cpsat is faster than {s} (by more than 0.1%) in {len(better)} of {len(joined)} "
                     f"model × device pairs (at most {gain:.1%} faster)")
    return "; ".join(parts) + "." if parts else ""


def model_section(frame) -> list[str]:
    ok = _ok(frame)
    if ok["device"].nunique() < 2:
        return []
    strategies = _strategies(ok)
    lines = ["## Per model (over devices)", "",
             "Each strategy cell: kernels (median over devices) · geometric-mean predicted speedup over "
             "unfused · geometric-mean x lower bound.", ""]
    rows = []
    for model in _ordered(ok, "model"):
        sub = ok[ok["model"] == model]
        row = [model, int(sub["canonical_nodes"].iloc[0]), sub["device"].nunique()]
        for s in strategies:
            part = sub[sub["strategy"] == s]
            row.append("-" if part.empty else f"{part['kernels'].median():g} · {geomean(part['speedup']):.2f}x · "
                       f"{geomean(part['x_lower_bound']):.1f}x")
        rows.append(row)
    lines += _table(["model", "nodes", "devices", *strategies], rows, right=(1, 2))
    return lines + [""]


def model_device_section(frame) -> list[str]:
    ok = _ok(frame)
    strategies = _strategies(ok)
    lines = ["## Per model and device", "",
             "Each strategy cell: kernels · predicted time · speedup over unfused · x lower bound.", ""]
    rows = []
    for model in _ordered(ok, "model"):
        for device in _ordered(ok[ok["model"] == model], "device"):
            sub = ok[(ok["model"] == model) & (ok["device"] == device)]
            first = sub.iloc[0]
            row = [model, device, f"{int(first['canonical_nodes'])}", fmt_time(first["unfused_time_s"]),
                   fmt_time(first["lower_bound_s"])]
            for s in strategies:
                cell = sub[sub["strategy"] == s].sort_values("time_s").head(1)
                if cell.empty:
                    row.append("-")
                    continue
                c = cell.iloc[0]
                row.append(f"{int(c['kernels'])} · {fmt_time(c['time_s'])} · {c['speedup']:.2f}x · "
                           f"{c['x_lower_bound']:.1f}x")
            rows.append(row)
    lines += _table(["model", "device", "nodes", "unfused", "lower bound", *strategies], rows, right=(2, 3, 4))
    return lines + [""]


def solver_section(frame) -> list[str]:
    ok = _ok(frame)
    exact = ok[ok["strategy"] == "cpsat"]
    if exact.empty:
        return []
    greedy = ok[ok["strategy"] == "greedy"].set_index(["model", "device", "max_group_size"])
    lines = ["## The exact solver (cpsat)", "",
             "Candidates = enumerated legal groups; enumeration and CP-SAT times in seconds; gap = "
             "(plan − bound) / plan at the end of the solve; vs greedy = cpsat time / greedy time.", ""]
    varied = bool(_decompositions(ok))
    if "pieces" in exact:
        lines[-2] += (" Pieces = the pieces a decomposed search cut the graph into (distinct subproblems "
                      "solved); - where it solved the graph whole.")
    rows = []
    for _, c in exact.iterrows():
        key = (c["model"], c["device"], c["max_group_size"])
        vs = f"{c['time_s'] / greedy.loc[key, 'time_s']:.4f}" if key in greedy.index else "-"
        rows.append([c["model"], c["device"], *([c["decompose"]] if varied else []), int(c["canonical_nodes"]),
                     _int(c.get("candidates")), *([_pieces(c)] if "pieces" in exact else []),
                     _num(c.get("enumeration_s")), _num(c.get("solve_s")), f"{c['wall_s']:.2f}",
                     f"{c['time_limit_s']:g}", c["solver_status"], _gap(c), vs])
    headers = ["model", "device", *(["decompose"] if varied else []), "nodes", "candidates",
               *(["pieces"] if "pieces" in exact else []), "enumeration s", "cp-sat s", "wall s", "limit s",
               "status", "gap", "vs greedy"]
    text = {"model", "device", "decompose", "status"}
    lines += _table(headers, rows, right=[i for i, h in enumerate(headers) if h not in text])
    return lines + [""]


def _pieces(c) -> str:
    return "-" if _int(c.get("pieces")) == "-" else f"{_int(c['pieces'])} ({_int(c.get('distinct'))})"


def depth_section(frame) -> list[str]:
    """cpsat's wall time per model (a zoo model's depths in grid order) beside each other for every
    `decompose` value a sweep set: what cutting the graph into pieces buys as it deepens."""
    ok = _ok(frame)
    ways = _decompositions(ok)
    if not ways:
        return []
    exact = ok[ok["strategy"] == "cpsat"]
    lines = ["## Solve time against depth, with and without decomposition", "",
             "cpsat's wall time (enumeration included) · status (gap where it stopped) per model, one column "
             "per `decompose` value (auto: decomposed from the size the solver switches at; always; never).", ""]
    rows = []
    for model in _ordered(exact, "model"):
        for device in _ordered(exact[exact["model"] == model], "device"):
            sub = exact[(exact["model"] == model) & (exact["device"] == device)]
            row = [model, device, int(sub["canonical_nodes"].iloc[0])]
            for way in ways:
                cell = sub[sub["decompose"] == way]
                c = cell.iloc[0] if len(cell) else None
                row.append("-" if c is None else f"{c['wall_s']:.2f} s · {c['solver_status']}"
                           + ("" if c["solver_status"] == "OPTIMAL" else f" ({_gap(c)})"))
            rows.append(row)
    lines += _table(["model", "device", "nodes", *ways], rows, right=(2,))
    return lines + [""]


def _gap(c) -> str:
    """The gap, or 'no bound' when the solver stopped before it had a lower bound above zero."""
    bound = c.get("bound_s")
    if bound is not None and not (isinstance(bound, float) and math.isnan(bound)) and bound <= 0:
        return "no bound"
    return _pct(c.get("gap"))


def _int(v) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else str(int(v))


def _num(v) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.2f}"


def _pct(v) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{100 * v:.2f}%"


def device_rows(frame) -> list[dict]:
    """Per model and device (best strategy): figures and the distance to the first device's plan."""
    ok = _ok(frame)
    best = _best_strategy(ok)
    sub = ok[ok["strategy"] == best]
    devices = _ordered(sub, "device")
    out = []
    for model in _ordered(sub, "model"):
        cells = sub[sub["model"] == model].sort_values("time_s").drop_duplicates("device").set_index("device")
        ref = _groups(cells.loc[devices[0]]) if devices[0] in cells.index else None
        for device in devices:
            if device not in cells.index:
                continue
            c = cells.loc[device]
            bound_time = json.loads(c["bound_time_s"]) if isinstance(c.get("bound_time_s"), str) else {}
            total = sum(bound_time.values()) or 1.0
            groups = _groups(c)
            out.append({"model": model, "device": device, "strategy": best, "kernels": int(c["kernels"]),
                        "time_s": c["time_s"], "speedup": c["speedup"], "x_lower_bound": c["x_lower_bound"],
                        "memory_share": bound_time.get("memory", 0.0) / total,
                        "compute_share": bound_time.get("compute", 0.0) / total,
                        "launch_share": bound_time.get("launch", 0.0) / total,
                        "distance": plan_distance(groups, ref) if ref is not None else math.nan,
                        "only_here": len(groups - ref) if ref is not None else 0,
                        "only_ref": len(ref - groups) if ref is not None else 0})
    return out


def devices_section(frame) -> list[str]:
    ok = _ok(frame)
    devices = _ordered(ok, "device")
    if len(devices) < 2:
        return []
    rows = device_rows(frame)
    best = _best_strategy(ok)
    lines = ["## How the plan changes across devices", "",
             f"Strategy {best}. Time split: share of the plan's predicted time in memory- / compute- / "
             f"launch-bound kernels. Differs from {devices[0]}: fused groups only in this plan / only in "
             f"the {devices[0]} plan, and their share of all fused groups of the two plans.", ""]
    table = [[r["model"], r["device"], r["kernels"], fmt_time(r["time_s"]), f"{r['speedup']:.2f}x",
              f"{r['x_lower_bound']:.1f}x",
              f"{r['memory_share']:.0%} / {r['compute_share']:.0%} / {r['launch_share']:.0%}",
              f"+{r['only_here']} / -{r['only_ref']} ({r['distance']:.0%})"] for r in rows]
    lines += _table(["model", "device", "kernels", "predicted", "speedup", "x bound",
                     "mem / compute / launch", f"differs from {devices[0]}"], table, right=(2, 3, 4, 5))
    lines += ["", f"Plans identical to {devices[0]}'s: " + ", ".join(
        f"{m} {sum(1 for r in rows if r['model'] == m and r['distance'] == 0)}/{len(devices)}"
        for m in _ordered(ok, "model")), ""]
    return lines


def measured_section(frame) -> list[str]:
    ok = _ok(frame)
    if "measured_s" not in ok or ok["measured_s"].dropna().empty:
        return []
    sub = ok.dropna(subset=["measured_s"])
    lines = ["## Predicted against measured", "",
             "Measured on the sweep's backend (generated kernels, real data); predicted for the cell's "
             "device by the roofline model, so the two differ by the gap between that device and the "
             "measuring machine.", ""]
    rows = [[c["model"], c["device"], c["strategy"], c.get("measured_on", "-"), fmt_time(c["time_s"]),
             fmt_time(c["measured_s"]), fmt_time(c["unfused_measured_s"]), f"{c['speedup']:.2f}x",
             f"{c['measured_speedup']:.2f}x"] for _, c in sub.iterrows()]
    lines += _table(["model", "device", "strategy", "measured on", "predicted", "measured", "unfused measured",
                     "predicted speedup", "measured speedup"], rows, right=range(4, 9))
    return lines + [""]


E2E = "end_to_end_"  # the columns of a cell run end to end (`RunReport.columns`)


def _end_to_end(frame):
    """The ok cells that ran end to end, with measured_speedup_e2e (unfused program / plan
    program, the same run), ort_median_s (ONNX Runtime's faster ENABLE_ALL figure: the model as
    given or its canonical form, as `run` takes it), plan_vs_ort (plan / that), and
    speedup_distinguishable (the plan's and the unfused program's p20-p80 ranges apart:
    `timing.distinguishable`)."""
    from fusesearch.backends.timing import distinguishable

    ok = _ok(frame)
    column = f"{E2E}plan_median_s"
    if column not in ok or ok[column].dropna().empty:
        return None
    sub = ok.dropna(subset=[column]).copy()
    sub["measured_speedup_e2e"] = sub[f"{E2E}unfused_median_s"] / sub[column]
    ort = [f"{E2E}{k}_median_s" for k in ("ort_enable_all", "ort_enable_all_canonical") if f"{E2E}{k}_median_s" in sub]
    sub["ort_median_s"] = sub[ort].min(axis=1)
    sub["plan_vs_ort"] = sub[column] / sub["ort_median_s"]
    sub["speedup_distinguishable"] = [
        distinguishable((c[f"{E2E}plan_p20_s"], c[f"{E2E}plan_p80_s"]), (c[f"{E2E}unfused_p20_s"], c[f"{E2E}unfused_p80_s"]))
        for _, c in sub.iterrows()]
    return sub


def noise_floor(sub) -> dict:
    """From the cells of strategy none, whose plan and unfused program are the same program timed
    twice in one run: `n` cells and the largest and median |plan / unfused - 1|, the difference
    the machine's noise alone makes ({} without such cells)."""
    none = sub[sub["strategy"] == "none"] if sub is not None else []
    if len(none) == 0:
        return {}
    gaps = sorted(abs(c[f"{E2E}plan_median_s"] / c[f"{E2E}unfused_median_s"] - 1) for _, c in none.iterrows())
    return {"n": len(gaps), "max": gaps[-1], "median": gaps[len(gaps) // 2] if len(gaps) % 2 else
            (gaps[len(gaps) // 2 - 1] + gaps[len(gaps) // 2]) / 2}


def rank_correlations(frame) -> dict:
    """Spearman's rank correlation (ties averaged) between predicted and measured end to end,
    each with its sample size: `times` of the plans across the `cells`; `speedups` over strategy
    none across cells (the models' sizes factored out); `within_models`: per model, (model, ρ of
    its strategies' plan times, n), models where either side ties throughout left out — never
    averaged, as a mean of +1 and -1 would read as no correlation; `noise` (`noise_floor`)."""
    from costmodels.calibration import spearman

    sub = _end_to_end(frame)
    if sub is None:
        return {}
    within = [(str(model), spearman(part["time_s"], part[f"{E2E}plan_median_s"]), len(part))
              for model, part in sub.groupby("model", sort=False)]
    return {"cells": len(sub), "times": spearman(sub["time_s"], sub[f"{E2E}plan_median_s"]),
            "speedups": spearman(sub["speedup"], sub["measured_speedup_e2e"]),
            "within_models": [w for w in within if not math.isnan(w[1])], "noise": noise_floor(sub)}


def end_to_end_section(frame) -> list[str]:
    sub = _end_to_end(frame)
    if sub is None:
        return []
    threads = sorted({int(t) for t in sub[f"{E2E}threads"].dropna()})
    on = sorted({str(m) for m in sub.get("measured_on", []) if isinstance(m, str)})
    lines = ["## End to end against ONNX Runtime", "",
             f"Each plan compiled into one program and run whole ({', '.join(map(str, threads))} thread"
             f"{'s' if threads != [1] else ''}{', on ' + ', '.join(on) if on else ''}), beside the unfused "
             "program (strategy none, every node its own kernel) and ONNX Runtime at ENABLE_ALL, timed in "
             "turn in the same run; medians with p20–p80 and n. Predicted: the roofline model for the cell's "
             "device. Speedups are over strategy none (\"not distinguishable\" where the plan's and the unfused "
             "program's p20–p80 overlap); plan / ORT = plan latency / ONNX Runtime ENABLE_ALL, the faster of "
             "the model as given and its canonical form.", ""]
    rows = []
    for s in _strategies(sub):
        part = sub[sub["strategy"] == s]
        rows.append([s, len(part), f"{geomean(part['speedup']):.2f}x", f"{geomean(part['measured_speedup_e2e']):.2f}x",
                     f"{geomean(part['plan_vs_ort']):.2f}x",
                     f"{geomean(part[f'{E2E}plan_median_s'] / part[f'{E2E}ort_disable_all_median_s']):.2f}x",
                     f"{part[f'{E2E}max_rel_err'].max():.1g}"])
    lines += _table(["strategy", "cells", "predicted speedup", "measured speedup", "plan / ORT",
                     "plan / ORT DISABLE_ALL", "max rel err"], rows, right=range(1, 7))
    lines += ["", rank_sentence(rank_correlations(frame)), ""]
    rows = []
    for model in _ordered(sub, "model"):
        for s in _strategies(sub[sub["model"] == model]):
            for _, c in sub[(sub["model"] == model) & (sub["strategy"] == s)].iterrows():
                same = "" if c["speedup_distinguishable"] else ", not distinguishable"
                rows.append([model, s, int(c["kernels"]), fmt_time(c["time_s"]), fmt_time(c[f"{E2E}plan_median_s"]),
                             f"{fmt_time(c[f'{E2E}plan_p20_s'])}–{fmt_time(c[f'{E2E}plan_p80_s'])}",
                             _int(c.get(f"{E2E}plan_n")), fmt_time(c["ort_median_s"]), f"{c['speedup']:.2f}x",
                             f"{c['measured_speedup_e2e']:.2f}x{same}", f"{c['plan_vs_ort']:.2f}x"])
    lines += _table(["model", "strategy", "kernels", "predicted", "measured", "p20–p80", "n", "ORT ENABLE_ALL",
                     "predicted speedup", "measured speedup", "plan / ORT"], rows, right=range(2, 11))
    return lines + [""]


def rank_sentence(r: dict) -> str:
    """`rank_correlations` in words, each ρ with its n (the report's line, and what `fusesearch
    report` prints), then the noise floor."""
    within = "; ".join(f"{model} {_rho(rho)} (n = {n})" for model, rho, n in r["within_models"]) or "-"
    return (f"Spearman rank correlation, predicted against measured end to end: plan times across the "
            f"{r['cells']} cells {_rho(r['times'])} (n = {r['cells']}); speedups over strategy none across cells "
            f"{_rho(r['speedups'])} (n = {r['cells']}); the strategies' plan times within each model: {within}. "
            + noise_sentence(r["noise"]))


def noise_sentence(noise: dict) -> str:
    if not noise:
        return "Noise floor: no strategy-none cell ran end to end, so the machine's noise is not known."
    return (f"Noise floor: strategy none's plan and unfused program are the same program, yet their medians "
            f"differ by up to {noise['max']:.1%} (median {noise['median']:.1%}, n = {noise['n']} cells); "
            "a measured speedup within that is not distinguishable from noise.")


def _rho(value: float) -> str:
    return "-" if math.isnan(value) else f"ρ = {value:.2f}"


CHANGED_SHOWN = 4  # fused groups named per change between neighbouring buckets


def _bucket_cells(frame):
    """The ok cells planned over buckets (their `bucket_figures` set), in grid order."""
    ok = _ok(frame)
    if "bucket_figures" not in ok:
        return []
    return [c for _, c in ok.sort_values("cell_index").iterrows() if isinstance(c.get("bucket_figures"), str)]


def buckets_section(frame) -> list[str]:
    """Per cell planned over buckets: each bucket under the one plan beside its own optimal plan (the
    price of one plan), and where the own plans change between neighbouring buckets and by how much."""
    cells = _bucket_cells(frame)
    if not cells:
        return []
    lines = ["## How the best plan changes across buckets", "",
             "One plan per cell for every value of the dim (its time above: weighted by how often each is "
             "served). Per bucket: its time under the one plan and under its own optimal plan, the price "
             "of one plan (one / own), and its own plan against the bucket below's: fused groups only in "
             "this one / only in the one below (their share of both plans' fused groups) and the plan "
             "below served here over this bucket's own (what the change is worth).", ""]
    for c in cells:
        dim, figures = c["bucket_dim"], json.loads(c["bucket_figures"])
        changes = [None, *json.loads(c["bucket_changes"])]
        lines += [f"### {c['model']} on {c['device']}, {c['strategy']}", ""]
        rows = [[f"{dim}={f['value']}", f"{f['weight']:.2f}", fmt_time(f["time_s"]), fmt_time(f["own_time_s"]),
                 f"{f['price']:.3f}x", f["own_kernels"], _change_cell(ch)] for f, ch in zip(figures, changes, strict=True)]
        lines += _table(["bucket", "weight", "one plan", "own plan", "price", "own kernels", "vs the bucket below"],
                        rows, right=(1, 2, 3, 4, 5))
        worst = max(figures, key=lambda f: f["price"])
        lines += ["", f"Worst bucket {dim}={worst['value']}: {100 * (worst['price'] - 1):.1f}% over its own plan."]
        for ch in changes[1:]:
            if ch["gone"] or ch["new"]:
                lines.append(f"- {dim} {ch['low']} → {ch['high']}: new {_names(ch['new'])}; gone {_names(ch['gone'])}")
        lines.append("")
    return lines


def _change_cell(change) -> str:
    if change is None:
        return "-"
    if not change["gone"] and not change["new"]:
        return "same groups"
    kept = "refused" if change["price"] is None else f"{change['price']:.3f}x"
    return f"+{len(change['new'])} / -{len(change['gone'])} ({change['distance']:.0%}); the plan below here {kept}"


def _names(groups: list[str]) -> str:
    if not groups:
        return "none"
    more = f" and {len(groups) - CHANGED_SHOWN} more" if len(groups) > CHANGED_SHOWN else ""
    return ", ".join(f"`{g}`" for g in groups[:CHANGED_SHOWN]) + more


def failed_section(frame) -> list[str]:
    if "status" not in frame:
        return []
    bad = frame[frame["status"] != "ok"]
    if bad.empty:
        return []
    lines = ["## Failed cells", "", "Run the same `fusesearch sweep` command again to retry them.", ""]
    rows = [[c["model"], c["device"], c["strategy"], str(c.get("error", "")).replace("|", "\\|")]
            for _, c in bad.iterrows()]
    return lines + _table(["model", "device", "strategy", "error"], rows) + [""]


def header(frame, name: str) -> list[str]:
    ok = _ok(frame)
    revs = sorted({r for r in frame.get("git_rev", []) if isinstance(r, str)})
    stamps = sorted(t for t in frame.get("timestamp", []) if isinstance(t, str))
    versions = json.loads(frame["versions"].iloc[0]) if "versions" in frame and len(frame) else {}
    lines = [f"# Sweep `{name}`", "",
             f"{len(frame)} cells: {len(ok)} ok, {len(frame) - len(ok)} failed; "
             f"{frame['model'].nunique()} models × {frame['device'].nunique()} devices × "
             f"{frame['strategy'].nunique()} strategies. All times are roofline predictions unless "
             "marked measured."]
    if stamps:
        lines.append(f"Run {stamps[0]} to {stamps[-1]}; summed cell wall time "
                     f"{frame['cell_wall_s'].sum():.0f} s." if "cell_wall_s" in frame else
                     f"Run {stamps[0]} to {stamps[-1]}.")
    if revs:
        lines.append("git " + ", ".join(r[:12] for r in revs) + "; " +
                     ", ".join(f"{k} {v}" for k, v in versions.items() if v))
    return lines + [""]


# -- plots --------------------------------------------------------------------------------------

def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_speedup(frame, path: Path) -> bool:
    ok = _ok(frame)
    if ok.empty:
        return False
    plt = _pyplot()
    models, strategies = _ordered(ok, "model"), _strategies(ok)
    width = 0.8 / len(strategies)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.7 * len(models) * max(1, len(strategies)) / 2), 4.2))
    for i, s in enumerate(strategies):
        values = [geomean(ok[(ok["model"] == m) & (ok["strategy"] == s)]["speedup"]) for m in models]
        ax.bar([x + (i - (len(strategies) - 1) / 2) * width for x in range(len(models))], values, width, label=s)
    ax.set_xticks(range(len(models)), models, rotation=35, ha="right", fontsize=8)
    ax.axhline(1.0, color="black", linewidth=0.6)
    ax.set_ylabel("predicted speedup over unfused\n(geomean over devices)")
    ax.set_title("Speedup per strategy")
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def plot_solver_time(frame, path: Path) -> bool:
    ok = _ok(frame)
    if ok.empty:
        return False
    plt = _pyplot()
    exact = ok[ok["strategy"] == "cpsat"]
    fig, axes = plt.subplots(1, 2 if not exact.empty else 1, figsize=(11 if not exact.empty else 6, 4.2),
                             squeeze=False)
    ax = axes[0][0]
    for label, sub in _variants(ok):
        ax.scatter(sub["canonical_nodes"], sub["wall_s"].clip(lower=1e-4), label=label, s=14, alpha=0.75)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("canonical nodes")
    ax.set_ylabel("solver wall time (s)")
    ax.set_title("Solver time against graph size")
    ax.legend(fontsize=8)
    if not exact.empty:
        ax = axes[0][1]
        sub = exact.sort_values("canonical_nodes")
        ax.plot(sub["canonical_nodes"], sub["candidates"], "o", label="candidates", markersize=4)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("canonical nodes")
        ax.set_ylabel("enumerated candidates")
        twin = ax.twinx()
        bounded = sub[sub["bound_s"] > 0]  # a stop before any bound has no meaningful gap
        twin.plot(bounded["canonical_nodes"], 100 * bounded["gap"].fillna(0), "s", color="tab:red",
                  markersize=4, label="gap %")
        twin.set_ylabel("cpsat gap at the end (%)", color="tab:red")
        twin.set_ylim(0, max(1.0, 110 * bounded["gap"].fillna(0).max()))
        ax.set_title("cpsat: candidates and gap")
    return _save(plt, fig, path)


def plot_devices(frame, path: Path) -> bool:
    ok = _ok(frame)
    devices = _ordered(ok, "device")
    if len(devices) < 2:
        return False
    rows = device_rows(frame)
    models = list(dict.fromkeys(r["model"] for r in rows))
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(max(10.0, 1.1 * len(devices) + 4), 0.45 * len(models) + 2.2))
    for ax, key, title, fmt in ((axes[0], "speedup", "predicted speedup", "{:.2f}"),
                                (axes[1], "distance", f"fused groups differing from {devices[0]}", "{:.0%}")):
        grid = [[next((r[key] for r in rows if r["model"] == m and r["device"] == d), math.nan)
                 for d in devices] for m in models]
        image = ax.imshow(grid, aspect="auto", cmap="viridis")
        ax.set_xticks(range(len(devices)), devices, rotation=45, ha="right", fontsize=8)
        ax.set_yticks(range(len(models)), models, fontsize=8)
        values = [v for line in grid for v in line if not math.isnan(v)]
        middle = (min(values) + max(values)) / 2 if values else 0.0
        for i, line in enumerate(grid):
            for j, v in enumerate(line):
                if not math.isnan(v):
                    ax.text(j, i, fmt.format(v), ha="center", va="center", fontsize=6,
                            color="black" if v > middle else "white")
        ax.set_title(title)
        fig.colorbar(image, ax=ax, fraction=0.046)
    return _save(plt, fig, path)


def plot_measured(frame, path: Path) -> bool:
    """Predicted against measured plan time: end to end where the cells ran so, else the sum of
    the kernels each timed alone."""
    ok = _ok(frame)
    column = next((c for c in (f"{E2E}plan_median_s", "measured_s") if c in ok and not ok[c].dropna().empty), None)
    if column is None:
        return False
    sub = ok.dropna(subset=[column])
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 5))
    for s in _strategies(sub):
        part = sub[sub["strategy"] == s]
        ax.scatter(part["time_s"], part[column], label=s, s=18)
    lo = min(sub["time_s"].min(), sub[column].min())
    hi = max(sub["time_s"].max(), sub[column].max())
    ax.plot([lo, hi], [lo, hi], color="black", linewidth=0.6, label="measured = predicted")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("predicted plan time (s)")
    ax.set_ylabel("measured plan time (s), " + ("end to end" if column != "measured_s" else "sum of kernels"))
    ax.set_title("Predicted against measured")
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def _save(plt, fig, path: Path) -> bool:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


PLOTTERS = {"speedup": plot_speedup, "solver_time": plot_solver_time, "devices": plot_devices,
            "measured": plot_measured}


# -- the report -------------------------------------------------------------------------------

def render(frame, name: str, plots: Iterable[str] = ()) -> str:
    lines = header(frame, name)
    lines += [f"![{p}]({p}.png)" for p in plots] + ([""] if plots else [])
    for section in (summary_section, model_section, model_device_section, solver_section, depth_section,
                    devices_section, buckets_section, measured_section, end_to_end_section, failed_section):
        lines += section(frame)
    return "\n".join(lines).rstrip() + "\n"


def write_report(results_dir: str | Path, output: str | Path | None = None, *, overwrite: bool = False) -> list[Path]:
    """Write report.md (`output`, else DIR/report.md) and its PNGs (beside it); returns [report, *plots]."""
    from fusesearch.sweep import RESULTS, load_results, read_manifest, results_reads

    flag = "-o" if output is not None else "report"  # what a refusal names: -o only where it was given
    results_dir = Path(results_dir)
    output = Path(output) if output is not None else results_dir / "report.md"
    if results_dir.is_file():  # e.g. its results.parquet: the report reads the whole folder
        raise BadInput(f"{results_dir}: is a file, not a folder; give the --out folder of a `fusesearch sweep` "
                       f"run{f' ({results_dir.parent})' if results_dir.name == RESULTS else ''}")
    frame = load_results(results_dir)
    if frame.empty or "model" not in frame:
        raise BadInput(f"{results_dir}: the sweep has no finished cells yet; run it first")
    targets = [(output, flag)] + [(output.parent / f"{p}.png", f"{flag} (plot)") for p in PLOTS]
    check_outputs(targets, overwrite, results_reads(results_dir))
    name = (read_manifest(results_dir) or {}).get("name", results_dir.name)
    with writing(output, flag):
        made = [p for p in PLOTS if PLOTTERS[p](frame, output.parent / f"{p}.png")]
        output.write_text(render(frame, name, made))
    return [output] + [output.parent / f"{p}.png" for p in made]
