"""NCHWc conv kernels beside our NCHW ones and ONNX Runtime's, per conv shape of zoo CNNs (figures printed, never asserted).

For each distinct conv of the models (its geometry and the activation after it, fused as a plan
fuses it: Conv + Relu/Clip/... as one group), timed interleaved on the threads OMP_NUM_THREADS
gives (default 1):
  - nchw: our generated kernel as the plan's choices list it first (`lowering.choices`, the
    measured default product), input and output in NCHW;
  - nchwc: the group's NCHWc form (`lowering.nchwc_choices`), input and output already blocked
    (a chain of blocked kernels pays no reorder between them);
  - +reorders: nchwc plus our reorders of its input and output (what a lone blocked conv in an
    NCHW plan would pay);
  - ort: ONNX Runtime ENABLE_ALL on the group as a model, which its NCHWc transformer runs in
    blocks (its own reorders at the model's edges included).
Medians with their p20-p80 spread (ms), the ratios nchwc/nchw and nchwc/ort, a verdict where the
p20-p80 ranges of nchw and nchwc are apart, and the load average before and after. `--callgrind`
also counts each kernel's instructions under valgrind (one call each, deterministic: where a
shared machine makes the timings too noisy to compare our two layouts).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_nchwc.py [--models mobilenetv2,resnet50]
        [--budget 0.3] [--rounds 5] [--limit N] [--callgrind]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from onnx import numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchutil import CALLGRIND_CHILD, callgrind_entry, machine, spread  # noqa: E402

from costmodels import host_cpu  # noqa: E402
from fusesearch.backends import cpu  # noqa: E402
from fusesearch.backends.codegen import generate  # noqa: E402
from fusesearch.backends.codegen.cpu_conv_nchwc import reorder_kernel  # noqa: E402
from fusesearch.backends.library import host_binding, node_model  # noqa: E402
from fusesearch.backends.timing import measure_interleaved  # noqa: E402
from fusesearch.groups import FusionGroup  # noqa: E402
from fusesearch.ir.canonicalize import to_proto  # noqa: E402
from fusesearch.layout import NCHW, to_blocked  # noqa: E402
from fusesearch.lowering import choices, nchwc_choices  # noqa: E402
from fusesearch.pipeline import prepare  # noqa: E402
from fusesearch.schedule import CpuTarget  # noqa: E402
from fusesearch.verify import session  # noqa: E402

ACTIVATIONS = frozenset({"Relu", "Clip", "Sigmoid", "LeakyRelu", "HardSigmoid"})


def conv_groups(graph) -> list[tuple[str, FusionGroup]]:
    """One group per distinct conv (input shape, filters, attributes, activation): the Conv and
    the activation that alone reads it."""
    seen, groups = set(), []
    for n in graph.nodes:
        if n.op_type != "Conv":
            continue
        users = graph.consumers(n.outputs[0])
        act = graph.nodes[users[0]] if len(users) == 1 and graph.nodes[users[0]].op_type in ACTIVATIONS else None
        xs, ws = graph.tensors[n.inputs[0]].shape, graph.tensors[n.inputs[1]].shape
        key = (xs, ws, tuple(sorted((k, str(v)) for k, v in n.attrs.items())), act.op_type if act else "")
        if key in seen:
            continue
        seen.add(key)
        label = (f"{xs[1]}x{xs[2]}x{xs[3]}->{ws[0]} k{ws[2]}s{(n.attrs.get('strides') or [1])[0]}"
                 f"{' dw' if int(n.attrs.get('group', 1)) > 1 else ''}{'+' + act.op_type if act else ''}")
        groups.append((label, FusionGroup(frozenset({n.id} | ({act.id} if act else set())))))
    return groups


def conv_kind(graph, conv) -> str:
    """The class a conv is summarized in: "stem" (its input an image's few channels, read in
    NCHW), "depthwise", else its kernel ("1x1", "3x3")."""
    xs, ws = graph.tensors[conv.inputs[0]].shape, graph.tensors[conv.inputs[1]].shape
    if int(conv.attrs.get("group", 1)) > 1:
        return "depthwise"
    return "stem" if xs[1] < 8 else f"{ws[2]}x{ws[3]}"


def runner(gk, feeds: dict[str, np.ndarray]):
    go = cpu.runner(gk, feeds)
    return go


def kernels_for(graph, group, target: CpuTarget, xv: np.ndarray, weights: dict, names=("nchw_k", "nchwc_k")):
    """(our NCHW kernel, the NCHWc one, their feeds, the NCHWc Kernel, the NCHW one's product) of a
    conv group for `target`, fed `xv` and the model's `weights` (its initializers: filters, bias
    and the constants the canonical model holds); None where the group has no NCHWc form."""
    blocked = nchwc_choices(graph, group, target)
    if not blocked:
        return None
    ours = next(k for k in choices(graph, group, host=target) if k.impl == "generated")
    kb = blocked[0]  # the form on all the threads (above one thread the one-thread form follows it)
    x = graph.nodes[kb.anchor].inputs[0]
    g_nchw, g_nchwc = generate(graph, ours, names[0]), generate(graph, kb, names[1])
    feeds = {t: (xv if t == x else weights[t] if t in weights else graph.constant_value(t)) for t in ours.inputs}
    bfeeds = {a.tensor: (to_blocked(xv, kb.schedule.layout_in) if a.tensor == x else feeds[a.tensor])
              for a in g_nchwc.inputs}
    return g_nchw, g_nchwc, feeds, bfeeds, kb, ours.schedule.product


def bench_model(name: str, target: CpuTarget, args) -> list[dict]:
    prep = prepare(f"zoo:{name}")
    graph, canonical = prep.graph, to_proto(prep.canonical)
    weights = {t.name: numpy_helper.to_array(t) for t in canonical.graph.initializer}
    rows = []
    rng = np.random.default_rng(0)
    for label, group in conv_groups(graph)[: args.limit or None]:
        anchor = graph.nodes[min(group.nodes)]
        x = anchor.inputs[0]
        xv = rng.standard_normal(graph.tensors[x].shape).astype(np.float32)
        found = kernels_for(graph, group, target, xv, weights)
        if found is None:
            rows.append({"model": name, "conv": label, "skip": "no NCHWc form"})
            continue
        g_nchw, g_nchwc, feeds, bfeeds, kb, product = found
        out = kb.outputs[0]
        reorders = [cpu.runner(reorder_kernel(out, graph.tensors[out].shape, kb.schedule.layout_out, NCHW),
                               {out: np.zeros(kb.schedule.layout_out.shape(graph.tensors[out].shape), np.float32)})]
        if kb.schedule.layout_in.blocked:  # an image's conv reads it in NCHW: nothing to reorder
            reorders.append(cpu.runner(reorder_kernel(x, graph.tensors[x].shape, NCHW, kb.schedule.layout_in), {x: xv}))
        sess = session(node_model(canonical, graph, kb), threads=target.threads, optimize=True)
        ort_out = np.empty(graph.tensors[out].shape, np.float32)
        runs = [cpu.runner(g_nchw, feeds), cpu.runner(g_nchwc, bfeeds),
                host_binding(sess, [(x, xv)], [(out, ort_out)]), *reorders]
        t = measure_interleaved(runs, budget_s=args.budget, rounds=args.rounds)
        rows.append({"model": name, "conv": label, "product": product, "kind": conv_kind(graph, anchor),
                     "nchw": t[0], "nchwc": t[1], "ort": t[2], "reorders": t[3:], "at": (graph, group, xv, weights)})
    return rows


def verdict(a, b) -> str:
    if a.p80_s < b.p20_s:
        return "nchwc slower"
    if b.p80_s < a.p20_s:
        return "nchwc faster"
    return "not distinguishable"


def _callgrind_counts(entries: list[dict], tmp: Path) -> dict[str, int | str]:
    """Instructions of each entry's parallel region under callgrind; an entry whose run dies is
    "died" and the rest run again without it."""
    counts: dict[str, int | str] = {}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    todo = list(entries)
    while todo:
        (tmp / "entries.json").write_text(json.dumps(todo))
        out = tmp / "cg.out"
        done = subprocess.run(["valgrind", "--tool=callgrind", "--collect-atstart=no", f"--callgrind-out-file={out}",
                               "--toggle-collect=GOMP_parallel", sys.executable, str(tmp / "child.py"),
                               str(tmp / "entries.json")], capture_output=True, text=True, env=env)
        text = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--threshold=100", str(out)],
                              capture_output=True, text=True).stdout
        for line in text.splitlines():
            m = re.match(r"\s*([\d,]+)\s.*?\b((?:nchw|nchwc)_\d+)\._omp_fn", line)
            if m:
                counts.setdefault(m.group(2), int(m.group(1).replace(",", "")))
        if done.returncode == 0:
            break
        started = [int(x) for x in re.findall(r"^start (\d+)$", done.stdout, re.M)]
        last = started[-1] if started else 0
        counts[todo[last]["name"]] = "died"
        todo = todo[last + 1:]
    return counts


def callgrind(rows, tmp: Path) -> None:
    """Each row's two kernels, built for AVX2 (valgrind 3.19 decodes no AVX-512: `-mno-avx512f`,
    block 8, the BLAS and vector math dispatching on the CPUID valgrind reports), run once under
    callgrind, counted within their parallel region (inclusive: the runtime's calls too):
    instructions per call (`ir_nchw`, `ir_nchwc`)."""
    cpu.CFLAGS = (*cpu.CFLAGS, "-mno-avx512f")  # after every timing: a runtime and kernels of their own
    avx2 = CpuTarget(lanes=8)
    entries = []
    for i, r in enumerate(rows):
        if "at" not in r:
            continue
        g_nchw, g_nchwc, feeds, bfeeds, _, _ = kernels_for(r["at"][0], r["at"][1], avx2, *r["at"][2:],
                                                     names=(f"nchw_{i}", f"nchwc_{i}"))
        for tag, gk, given in (("nchw", g_nchw, feeds), ("nchwc", g_nchwc, bfeeds)):
            entries.append({**callgrind_entry(gk, given, tmp, f"{tag}_{i}"), "row": i, "tag": tag})
    (tmp / "child.py").write_text(CALLGRIND_CHILD)
    counts = _callgrind_counts(entries, tmp)
    for e in entries:
        rows[e["row"]][f"ir_{e['tag']}"] = counts.get(e["name"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mobilenetv2,resnet50")
    parser.add_argument("--budget", type=float, default=0.3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--limit", type=int, default=0, help="convs per model (0: all)")
    parser.add_argument("--callgrind", action="store_true")
    args = parser.parse_args()
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    lanes = host_cpu().warp_size
    target = CpuTarget(lanes=lanes, threads=threads)
    print(f"Machine: {machine()}; float32 lanes {lanes}, NCHWc block {target.channel_block}")
    print(f"load average before: {os.getloadavg()}")
    if not target.channel_block:
        print("no blocked layout on this CPU (fewer than 8 float32 lanes)")
        return
    rows = [r for m in args.models.split(",") for r in bench_model(m, target, args)]
    print(f"load average after: {os.getloadavg()}")
    print_timings(rows)
    if args.callgrind:
        with tempfile.TemporaryDirectory() as tmp:
            callgrind(rows, Path(tmp))
        print_counts(rows)
    print_classes(rows)


def print_classes(rows: list[dict]) -> None:
    """Per model and conv class: geometric means (and ranges) of nchwc/nchw and nchwc/ort over the
    medians, of the callgrind instructions nchwc/nchw where counted, and the sums of the medians
    (nchwc alone and with its reorders)."""
    print(f"\n{'model, class':24} {'convs':>5} {'nchwc/nchw':>18} {'nchwc/ort':>18} {'Ir nchwc/nchw':>18} "
          f"{'sum nchw':>9} {'sum nchwc':>9} {'+reorders':>9} {'sum ort':>9}")
    classes: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        if "skip" not in r:
            classes.setdefault((r["model"], r["kind"]), []).append(r)

    def ranged(v: list[float]) -> str:
        return f"{geomean(v):.2f} ({min(v):.2f}-{max(v):.2f})" if v else "-"
    for (model, kind), rs in classes.items():
        ir = [r["ir_nchwc"] / r["ir_nchw"] for r in rs if isinstance(r.get("ir_nchw"), int)
              and isinstance(r.get("ir_nchwc"), int)]
        sums = [sum(r[k].median_s for r in rs) * 1e3 for k in ("nchw", "nchwc", "ort")]
        reordered = sum(r["nchwc"].median_s + sum(t.median_s for t in r["reorders"]) for r in rs) * 1e3
        print(f"{model + ' ' + kind:24} {len(rs):5} {ranged([r['nchwc'].median_s / r['nchw'].median_s for r in rs]):>18} "
              f"{ranged([r['nchwc'].median_s / r['ort'].median_s for r in rs]):>18} {ranged(ir):>18} "
              f"{sums[0]:9.3f} {sums[1]:9.3f} {reordered:9.3f} {sums[2]:9.3f}")


def geomean(ratios: list[float]) -> float:
    return math.exp(sum(map(math.log, ratios)) / len(ratios))


def print_timings(rows: list[dict]) -> None:
    print(f"{'model':12} {'conv':34} {'nchw (ms)':>24} {'nchwc (ms)':>24} {'+reorders':>9} {'ort ALL (ms)':>24}"
          f" {'nchwc/nchw':>10} {'nchwc/ort':>9}  verdict (nchw product)")
    ratios = {"nchwc/nchw": [], "nchwc/ort": [], "nchw/ort": []}
    for r in rows:
        if "skip" in r:
            print(f"{r['model']:12} {r['conv']:34} {r['skip']}")
            continue
        a, b, o = r["nchw"], r["nchwc"], r["ort"]
        with_reorders = b.median_s + sum(t.median_s for t in r["reorders"])
        ratios["nchwc/nchw"].append(b.median_s / a.median_s)
        ratios["nchwc/ort"].append(b.median_s / o.median_s)
        ratios["nchw/ort"].append(a.median_s / o.median_s)
        print(f"{r['model']:12} {r['conv']:34} {spread(a.median_s, a.p20_s, a.p80_s):>24} "
              f"{spread(b.median_s, b.p20_s, b.p80_s):>24} {with_reorders * 1e3:9.3f} "
              f"{spread(o.median_s, o.p20_s, o.p80_s):>24} {b.median_s / a.median_s:10.2f} "
              f"{b.median_s / o.median_s:9.2f}  {verdict(a, b)} ({r['product']})")
    for k, v in ratios.items():
        if v:
            print(f"geometric mean {k}: {geomean(v):.3f} over {len(v)} convs")
    sums = {k: sum(r[k].median_s for r in rows if k in r) for k in ("nchw", "nchwc", "ort")}
    print("sum of medians (ms): " + ", ".join(f"{k} {v * 1e3:.3f}" for k, v in sums.items()))


def print_counts(rows: list[dict]) -> None:
    print(f"\ncallgrind, AVX2 builds (block 8), instructions per call\n{'model':12} {'conv':34} {'Ir nchw':>14} "
          f"{'Ir nchwc':>14} {'nchwc/nchw':>10}")
    ratios = []
    for r in rows:
        if "skip" in r:
            continue
        a, b = r.get("ir_nchw"), r.get("ir_nchwc")
        both = isinstance(a, int) and isinstance(b, int)
        if both:
            ratios.append(b / a)
        print(f"{r['model']:12} {r['conv']:34} {a!s:>14} {b!s:>14} {(f'{b / a:.2f}' if both else '-'):>10}")
    if ratios:
        print(f"geometric mean Ir nchwc/nchw: {geomean(ratios):.3f} over {len(ratios)} convs")
    sums = [sum(r[k] for r in rows if isinstance(r.get("ir_nchw"), int) and isinstance(r.get("ir_nchwc"), int))
            for k in ("ir_nchw", "ir_nchwc")]
    print(f"sum of Ir: nchw {sums[0]:,}, nchwc {sums[1]:,}")


if __name__ == "__main__":
    main()
