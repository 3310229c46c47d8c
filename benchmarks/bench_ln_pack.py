"""A LayerNorm and its projection as one kernel in each row-prologue form, beside the two kernels a
plan ran before the packed form existed (figures printed, never asserted).

For zoo shapes of LayerNorm -> MatMul (+ bias, + GELU where the model has it) on OMP_NUM_THREADS
threads (default 1), each a tiny graph built here, lowered for this CPU (`lowering.choices`):
  - split: the LayerNorm's row kernel, then the projection's kernel (what a plan ran where the
    normalised rows are not an output: GPT-2's and ViT's pre-LN projections);
  - stored: one kernel, every row normalised and stored, then the blocks read them back (where the
    normalised rows are an output: BERT's post-LN residual);
  - packed: one kernel, each block normalising its rows into the A panel its product reads next.
Timed interleaved (`measure_interleaved`): medians with p20-p80 (ms), and the load average before
and after. `--callgrind` also counts each form's instructions and, through valgrind's cache
simulation (the host's L1), its L1 data misses (one call each, after the other forms' calls:
last-level misses there say which ran first, not what a form costs; AVX2 build: valgrind decodes
no AVX-512), repeatable where the timings are too noisy to compare.

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python benchmarks/bench_ln_pack.py [--budget 0.3] [--rounds 7]
        [--callgrind] [--only bert-small]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from onnx import helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchutil import CALLGRIND_CHILD, callgrind_entry, machine, spread  # noqa: E402

from costmodels import host_cpu  # noqa: E402
from fusesearch.backends import cpu  # noqa: E402
from fusesearch.backends.codegen import generate  # noqa: E402
from fusesearch.backends.timing import measure_interleaved  # noqa: E402
from fusesearch.groups import FusionGroup  # noqa: E402
from fusesearch.ir.canonicalize import to_proto  # noqa: E402
from fusesearch.lowering import choices  # noqa: E402
from fusesearch.pipeline import prepare  # noqa: E402
from fusesearch.schedule import ONE_THREAD, CpuTarget  # noqa: E402
from fusesearch.verify import all_values, random_feeds  # noqa: E402

# (name, rows, K, N, GELU after the bias, the normalised rows an output, the LayerNormalization op)
CASES = (("bert-small FFN-up", 128, 128, 512, True, True, False),
         ("bert-small QKV", 128, 128, 128, False, True, False),
         ("bert-base FFN-up", 128, 768, 3072, True, True, False),
         ("vit-small FFN-up", 197, 384, 1536, True, False, True),
         ("gpt2 QKV (128 rows)", 128, 768, 2304, False, False, True))


def _w(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 0.3


def case_model(rows, k, n, gelu, normalised_out, op):
    """LayerNorm (the op or as BERT exports it) -> MatMul -> + bias (-> GELU)."""
    inits = [("gamma", _w([k], 1) + 1), ("beta", _w([k], 2)), ("w", _w([k, n], 3)), ("bias", _w([n], 4))]
    if op:
        nodes = [helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["ln"], axis=-1, epsilon=1e-5)]
    else:
        nodes = [helper.make_node("ReduceMean", ["x"], ["mean"], axes=[-1]), helper.make_node("Sub", ["x", "mean"], ["d"]),
                 helper.make_node("Pow", ["d", "two"], ["sq"]), helper.make_node("ReduceMean", ["sq"], ["var"], axes=[-1]),
                 helper.make_node("Add", ["var", "eps"], ["ve"]), helper.make_node("Sqrt", ["ve"], ["sd"]),
                 helper.make_node("Div", ["d", "sd"], ["nd"]), helper.make_node("Mul", ["nd", "gamma"], ["ng"]),
                 helper.make_node("Add", ["ng", "beta"], ["ln"])]
        inits += [("two", np.float32(2.0)), ("eps", np.float32(1e-12))]
    nodes += [helper.make_node("MatMul", ["ln", "w"], ["p"]), helper.make_node("Add", ["p", "bias"], ["h"])]
    out = "h"
    if gelu:
        nodes += [helper.make_node("Div", ["h", "sqrt2"], ["hd"]), helper.make_node("Erf", ["hd"], ["he"]),
                  helper.make_node("Add", ["he", "one"], ["h1"]), helper.make_node("Mul", ["h", "h1"], ["hg"]),
                  helper.make_node("Mul", ["hg", "half"], ["y"])]
        inits += [("sqrt2", np.float32(1.4142135)), ("one", np.float32(1.0)), ("half", np.float32(0.5))]
        out = "y"
    graph = helper.make_graph(nodes, "ln_pack", [helper.make_tensor_value_info("x", 1, [rows, k])],
                              [helper.make_tensor_value_info(t, 1, None) for t in [out] + (["ln"] if normalised_out else [])],
                              [numpy_helper.from_array(np.asarray(a), name) for name, a in inits])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def forms(case, target: CpuTarget, tag: str):
    """(prepared model, the ONNX Runtime values, {form: [generated kernels]}) of one case."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.onnx"
        path.write_bytes(case_model(*case[1:]).SerializeToString())
        prep = prepare(str(path))
    graph = prep.graph
    values = all_values(to_proto(prep.canonical), random_feeds(to_proto(prep.canonical), 0))
    anchor = next(nd.id for nd in graph.nodes if nd.op_type in ("MatMul", "Gemm"))
    options = choices(graph, FusionGroup(frozenset(range(len(graph)))), host=target)  # refused: the split alone
    whole = [kn for kn in (options if isinstance(options, tuple) else ())
             if kn.schedule.split in ("", "rows") and kn.schedule.product == "own"]
    out = {}
    for kn in whole:  # (a tree from before the forms: its one form is the stored one)
        form = getattr(kn.schedule, "prologue", "stored")
        out.setdefault(form, [generate(graph, kn, f"{tag}_{form}")])
    before = [i for i in range(len(graph)) if i < anchor and graph.nodes[i].op_type != "MatMul"]
    parts = [choices(graph, FusionGroup(frozenset(p)), host=target) for p in (before, range(before[-1] + 1, len(graph)))]
    out["split"] = [generate(graph, next(kn for kn in p if kn.impl == "generated" and kn.schedule.split != ONE_THREAD),
                             f"{tag}_split{i}") for i, p in enumerate(parts)]
    return prep, values, out


def runners(kernels, values):
    """One callable running the form's kernels in order, each on its own buffers; checked against
    ONNX Runtime's values of every output first."""
    runs = [cpu.runner(gk, {a.tensor: values[a.tensor] for a in gk.inputs}) for gk in kernels]
    for gk, go in zip(kernels, runs, strict=True):
        go()
        for a, got in zip(gk.outputs, go.buffers[len(gk.inputs):], strict=True):
            ref = values[a.tensor].astype(np.float64)
            err = float(np.max(np.abs(got - ref))) / max(1.0, float(np.max(np.abs(ref))))
            assert err < 1e-4, f"{gk.name} {a.tensor}: max rel err {err:.2e}"

    def go() -> None:
        for r in runs:
            r()
    return go


EVENTS = ("Ir", "D1mr", "D1mw")


def callgrind(cases, tmp: Path) -> dict[str, tuple[int, ...]]:
    """EVENTS of each kernel's parallel region (inclusive), one call each under callgrind with its
    cache simulation, built for AVX2."""
    cpu.CFLAGS = (*cpu.CFLAGS, "-mno-avx512f")
    target = CpuTarget(lanes=8)
    entries = []
    for i, case in enumerate(cases):
        _, values, built = forms(case, target, f"c{i}")
        for kernels in built.values():
            entries += [callgrind_entry(gk, values, tmp, gk.name) for gk in kernels]
    (tmp / "child.py").write_text(CALLGRIND_CHILD)
    (tmp / "entries.json").write_text(json.dumps(entries))
    out = tmp / "cg.out"
    subprocess.run(["valgrind", "--tool=callgrind", "--cache-sim=yes", "--collect-atstart=no", f"--callgrind-out-file={out}",
                    "--toggle-collect=GOMP_parallel", sys.executable, str(tmp / "child.py"), str(tmp / "entries.json")],
                   capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True)
    text = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--threshold=100", f"--show={','.join(EVENTS)}",
                           "--show-percs=no", str(out)], capture_output=True, text=True, check=True).stdout
    counts: dict[str, tuple[int, ...]] = {}
    for line in text.splitlines():
        m = re.match(r"\s*((?:[\d,.]+\s+){" + str(len(EVENTS)) + r"}).*?\b(c\d+_\w+?)\._omp_fn", line)
        if m:  # "." is a zero
            counts.setdefault(m.group(2), tuple(int(x.replace(",", "").replace(".", "0")) for x in m.group(1).split()))
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=0.3)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--callgrind", action="store_true")
    parser.add_argument("--only", default="", help="cases whose name contains this")
    args = parser.parse_args()
    cases = [c for c in CASES if args.only in c[0]]
    target = CpuTarget(lanes=host_cpu().warp_size, threads=int(os.environ.get("OMP_NUM_THREADS", "1")))
    print(f"Machine: {machine()}; load average before: {os.getloadavg()}")
    print(f"{'case':22} {'form':7} {'ms (p20-p80)':>26} {'/ split':>8}")
    for i, case in enumerate(cases):
        _, values, built = forms(case, target, f"t{i}")
        names = list(built)
        timings = measure_interleaved([runners(built[f], values) for f in names], budget_s=args.budget, rounds=args.rounds)
        base = timings[names.index("split")].median_s
        for f, t in zip(names, timings, strict=True):
            print(f"{case[0]:22} {f:7} {spread(t.median_s, t.p20_s, t.p80_s):>26} {t.median_s / base:8.3f}")
    print(f"load average after: {os.getloadavg()}")
    if args.callgrind:
        with tempfile.TemporaryDirectory() as tmp:
            counts = callgrind(cases, Path(tmp))
        print(f"{'case':22} {'form':7} {'instructions':>14} {'/ split':>8} {'L1 misses':>11} {'/ split':>8}")
        for i, case in enumerate(cases):
            per: dict[str, list[int]] = {}
            for name, c in counts.items():
                if name.startswith(f"c{i}_"):
                    total = per.setdefault(re.sub(r"\d+$", "", name[len(f"c{i}_"):]), [0, 0])
                    total[0] += c[0]
                    total[1] += c[1] + c[2]
            base = per["split"]
            for form, (ir, l1) in per.items():
                print(f"{case[0]:22} {form:7} {ir:14,d} {ir / base[0]:8.3f} {l1:11,d} {l1 / base[1]:8.3f}")


if __name__ == "__main__":
    main()
