"""`fusesearch` command line (the stable contract of DESIGN.md, "Command line").

Problem: scripts and people both drive the tool; scripts need `--json` documents and exit codes,
people need readable tables, and nobody wants a traceback for a typo.
Approach: typer commands that call the library and render with rich; `main()` runs the app in
non-standalone mode and maps every failure to one line on stderr:
  exit 0 ok · exit 1 internal error · exit 2 bad usage or bad input (with the fix) · 141 stdout's
  reader gone (`| head`, as a shell reports SIGPIPE) · 130 Ctrl-C.
Numeric options are checked while the command line is parsed, by one validator per kind of value
(seconds, tolerance, count, seed) attached to the option in every command that has it.
Invariants: with `--json`, stdout carries exactly one JSON document; logs go to stderr. No file the
user has is overwritten unless they pass `--force`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from fusesearch import values as rules
from fusesearch.__main__ import INTERRUPTED, interrupted
from fusesearch.errors import BadInput, FusesearchError, check_output_path, check_outputs, writing

try:  # typer >= 0.20 vendors click
    from typer._click import exceptions as click_errors
except ImportError:  # pragma: no cover
    from click import exceptions as click_errors

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Find the best way to fuse an ONNX graph's operators into GPU kernels.")
zoo_app = typer.Typer(no_args_is_help=True, help="Built-in models (zoo:NAME).")
app.add_typer(zoo_app, name="zoo")


def _version(value: bool) -> None:
    if value:
        from fusesearch import __version__

        print(f"fusesearch {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="Print the version and exit.")] = False) -> None:
    """Find the best way to fuse an ONNX graph's operators into GPU kernels."""



class StdoutClosed(Exception):
    """stdout's reader closed it (`| head -1`): not an OSError, which click turns into a silent exit 1."""


class _Stdout(Console):
    def on_broken_pipe(self) -> None:
        raise StdoutClosed


out = _Stdout(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 140)
err = Console(stderr=True, highlight=False, soft_wrap=True)  # one line per message: a path is never broken

InputShape = Annotated[list[str], typer.Option("--input-shape", help="NAME=1x3x224x224 (repeatable)")]
Dim = Annotated[list[str], typer.Option("--dim", help="DIM=V binds a named dynamic dim (repeatable)")]
PlanDim = Annotated[list[str], typer.Option(
    "--dim", help="DIM=V binds a named dynamic dim (repeatable); DIM=LO..HI or DIM=V1,V2,... plans one grouping "
                  "for all those values (the ends and the powers of two between them)")]
RunDim = Annotated[list[str], typer.Option(
    "--dim", help="DIM=V binds a named dynamic dim (repeatable); DIM=LO..HI or DIM=V1,V2,... runs one plan over "
                  "those values: each value's program checked against ONNX Runtime (and timed but on emulate)")]
DimWeights = Annotated[list[str], typer.Option(
    "--dim-weights", help="DIM=W1,W2,...: how often each value of a --dim range or list is served (default equal)")]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")]
InputValue = Annotated[list[str], typer.Option("--input-value", help="NAME=V: the value of an input instead of "
                                               "a random one, e.g. sr=16000 or x=[1,2,3] (repeatable)")]
NO_VERIFY = "--no-verify"
Dump = Annotated[Path | None, typer.Option("--dump", help="Write each group's C and CUDA source, its schedule "
                                           "(JSON) and launch configuration into this folder, named by group "
                                           "(g7.c, g7.cu, g7.json), and each layout reorder the program runs by "
                                           "index, tensor and direction (r0.x.NCHW-NCHW16c.c, .json), with an "
                                           "index.json; a folder with files in it needs --force.")]
NoTf32 = Annotated[bool, typer.Option("--no-tf32", help="float32 GEMMs and convs without TF32 tensor cores: "
                                      "generated kernels accumulate with fmaf on CUDA cores and library calls "
                                      "are priced at FP32 (TF32 is ONNX Runtime's CUDA default).")]


def _dtype_option(_ctx, _param, value):
    from fusesearch.ir.precision import check_dtype

    return check_dtype(value)


DType = Annotated[str, typer.Option("--dtype", callback=_dtype_option, help="float32 (as loaded) | float16 | "
                                    "bfloat16: convert the model's weights and activations first (LayerNorm, "
                                    "Softmax and reductions stay float32).")]


# -- option checks: one validator per kind of value, attached to the option in every command -----

def _checked(rule):
    """A typer callback that refuses (exit 2, naming the option) a value `rule` (`fusesearch.values`)
    says is wrong; None (an option left unset) passes. Runs while the command line is parsed,
    before any work."""
    def callback(ctx, param, value):
        problem = None if value is None else rule(value)
        if problem:
            shown = f"{value:g}" if isinstance(value, float) else value  # as typed: 0, nan, inf
            raise BadInput(f"{max(param.opts, key=len)} {shown}: give {problem}")
        return value
    return callback


SECONDS = _checked(rules.seconds)
TOLERANCE = _checked(rules.tolerance)
COUNT = _checked(rules.count)
CPUS = _checked(rules.cpus)
SEED = _checked(rules.seed)
MIN_SAMPLES = 4
SAMPLES = _checked(lambda v: None if v >= MIN_SAMPLES else f"at least {MIN_SAMPLES} (a few hundred for a useful fit)")


def _bindings(input_shape: list[str] | None, dim: list[str] | None):
    from fusesearch.ir.shapes import ShapeBindings

    return ShapeBindings.parse(input_shape or [], dim or [])


def _reads(*paths, device: str | None = None) -> list[tuple[str, str]]:
    """(path, what) of every file a command reads, for `check_outputs`: its model (a zoo model is
    no file), plan, and device profiles (`--device`: a device name is no file)."""
    found = [(str(p), what) for p, what in paths if p is not None and not str(p).startswith("zoo:")]
    devices = [device, *device.split(",")] if device else []
    return found + [(d, "device profile") for d in dict.fromkeys(d.strip() for d in devices) if os.path.isfile(d)]


def _plan_file(_ctx, param, value):
    """A plan.json argument or option must be a file (exit 2 for a folder or a missing path)."""
    if value is not None and not value.is_file():
        flag = f"{max(param.opts, key=len)} " if param.param_type_name == "option" else ""
        problem = "is a folder" if value.is_dir() else "no such file"
        raise BadInput(f"{flag}{value}: {problem}; give a plan.json written by `fusesearch plan -o`")
    return value


def _input_values(flags: list[str] | None, prep) -> dict:
    from fusesearch.verify import parse_input_values

    return parse_input_values(flags or [], prep.graph)


def _emit_json(doc: dict) -> None:
    try:
        sys.stdout.write(json.dumps(_finite(doc), indent=2, sort_keys=False, allow_nan=False) + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        raise StdoutClosed from None


def _finite(value):
    """JSON has no Infinity or NaN: a non-finite number is written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _fmt_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:g}"


# -- inspect ----------------------------------------------------------------------------------

@app.command()
def inspect(
    model: Annotated[str, typer.Argument(help="path/to/model.onnx or zoo:NAME")],
    input_shape: InputShape = None,
    dim: Dim = None,
    canonical: Annotated[Path | None, typer.Option("--canonical", help="Write the canonical model here.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing --canonical file.")] = False,
    device: Annotated[str | None, typer.Option("--device", help="Also predict unfused time and the lower "
                                               "bound on these devices (NAME[,NAME...] or profile.json).")] = None,
    json_out: JsonFlag = False,
) -> None:
    """Load and canonicalize a model; print its nodes, ops, FLOPs, bytes and what each pass did."""
    from fusesearch.pipeline import prepare, summarize, write_canonical

    devices = _devices(device) if device else []
    check_outputs([(canonical, "--canonical")], force, _reads((model, "model"), device=device))
    prep = prepare(model, _bindings(input_shape, dim))
    summary = summarize(prep)
    if devices:
        summary["devices"] = [_figures(prep.graph, name, spec, params) for name, spec, params in devices]
    if canonical is not None:
        with writing(canonical, "--canonical"):
            summary["canonical_path"] = str(write_canonical(prep, canonical, overwrite=force))
    if json_out:
        _emit_json(summary)
        return
    _print_inspect(summary)


def _print_inspect(s: dict) -> None:
    out.print(f"[bold]{s['model']}[/bold]  ({s['source']}, opset {s['opset']} → {s['canonical_opset']})")
    out.print(f"nodes {s['nodes']} → {s['canonical_nodes']} after canonicalization   "
              f"FLOPs {_fmt_count(s['flops'])}   weights {_fmt_bytes(s['weight_bytes'])}   "
              f"activations {_fmt_bytes(s['activation_bytes'])}")
    if s["bindings"]:
        out.print("bindings: " + " ".join(s["bindings"]))
    io = Table(title="inputs / outputs", title_justify="left")
    for col in ("", "name", "shape", "dtype"):
        io.add_column(col)
    for role in ("inputs", "outputs"):
        for t in s[role]:
            shape = "x".join(map(str, t["shape"])) if t["shape"] is not None else "?"
            io.add_row(role[:-1], t["name"], shape, t["dtype"])
    out.print(io)
    ops = Table(title="ops (canonical)", title_justify="left")
    ops.add_column("op")
    ops.add_column("count", justify="right")
    for op, count in s["ops"].items():
        ops.add_row(op, str(count))
    out.print(ops)
    out.print("kinds: " + ", ".join(f"{k} {v}" for k, v in s["kinds"].items()))
    out.print("passes: " + ", ".join(f"{k} {v}" for k, v in s["passes"].items()))
    if s.get("devices"):
        table = Table(title="predicted (roofline, default efficiencies)", title_justify="left")
        for col in ("device", "unfused kernels", "unfused", "lower bound", "unfused / bound"):
            table.add_column(col, justify="right" if col != "device" else "left")
        for d in s["devices"]:
            table.add_row(d["device"], str(d["unfused_kernels"]), _fmt_time(d["unfused_time_s"]),
                          _fmt_time(d["lower_bound_s"]), f"{d['unfused_time_s'] / d['lower_bound_s']:.1f}x")
        out.print(table)
    if "canonical_path" in s:
        out.print(f"canonical model written to {s['canonical_path']}")


def _fmt_time(seconds: float) -> str:
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e6:.1f} us"


def _devices(arg: str):
    """NAME[,NAME...] or a profile.json → [(label, DeviceSpec, RooflineParams)]; bad names exit 2."""
    from costmodels import CostModelError, load_device

    found = []
    for name in [n.strip() for n in arg.split(",") if n.strip()]:
        try:
            spec, params = load_device(name)
        except CostModelError as exc:
            raise BadInput(f"--device {name}: {exc}") from None
        found.append((name, spec, params))
    if not found:
        raise BadInput("--device: give a device name (see `fusesearch devices`) or a profile.json")
    return found


def _figures(graph, label, spec, params) -> dict:
    from costmodels import RooflineModel
    from fusesearch.costing import graph_figures

    f = graph_figures(graph, spec, RooflineModel(params))
    return {"device": label, "unfused_time_s": f.unfused_time_s, "unfused_kernels": f.unfused_kernels,
            "lower_bound_s": f.lower_bound_s, "min_dram_bytes": f.min_dram_bytes,
            "tc_flops": f.tc_flops, "scalar_flops": f.scalar_flops}


# -- plan / compare ---------------------------------------------------------------------------

Strategy = Annotated[str, typer.Option("--strategy", help="none | rules | greedy | cpsat")]
TimeLimit = Annotated[float, typer.Option("--time-limit", callback=SECONDS,
                                           help="Solver time limit in seconds (cpsat).")]
MaxGroup = Annotated[int, typer.Option("--max-group-size", callback=COUNT, help="Most ops in one kernel.")]
Seed = Annotated[int, typer.Option("--seed", callback=SEED, help="Solver seed.")]
Workers = Annotated[int | None, typer.Option("--workers", callback=CPUS,
                                             help="CP-SAT workers (default: cores, at most 8).")]
Threads = Annotated[int, typer.Option("--threads", callback=CPUS, help="OpenMP threads of the generated kernels "
                                      "(and ONNX Runtime's intra-op threads where it is timed beside them); a "
                                      "host plan is priced for this count and plan.json records it.")]
Costs = Annotated[str, typer.Option("--costs", help="What prices each group's choices: predicted (the cost model), "
                                    "measured (each timed on this machine's CPU for host, its GPU for a GPU "
                                    "device; kept in the timing database), or hybrid (the model's plan, then "
                                    "the choices of the groups each plan uses, searched again until the plan "
                                    "uses only measured groups).")]


def check_costs(costs: str) -> None:
    """`--costs`: checked before anything is loaded (`autotune.check_costs`)."""
    from fusesearch.autotune import check_costs as check

    check(costs)


Layouts = Annotated[str, typer.Option("--layouts", help="auto: on a CPU with 8 or 16 float32 lanes a CNN's plan "
                                      "may run groups in channel blocks (NCHWc), on a GPU its tensor-core convs "
                                      "channels last (NHWC), where that and the reorders it needs pay, as priced "
                                      "or measured (strategy cpsat; plan.json records it); nchw: every tensor as "
                                      "in the model.")]


def _config(time_limit: float, max_group_size: int, seed: int, workers: int | None, decompose: str = "auto",
            layouts: str = "auto"):
    from fusesearch.search.problem import SearchConfig, check_decompose, check_layouts

    return SearchConfig(time_limit_s=time_limit, seed=seed, max_group_size=max_group_size,
                        decompose=check_decompose(decompose, "--decompose"), layouts=check_layouts(layouts),
                        **({"workers": workers} if workers else {}))


@app.command()
def plan(
    model: Annotated[str, typer.Argument(help="path/to/model.onnx or zoo:NAME")],
    device: Annotated[str, typer.Option("--device", help="GPU name (see `fusesearch devices`) or profile.json")],
    input_shape: InputShape = None,
    dim: PlanDim = None,
    dim_weights: DimWeights = None,
    strategy: Strategy = "cpsat",
    time_limit: TimeLimit = 60.0,
    max_group_size: MaxGroup = 16,
    seed: Seed = 0,
    workers: Workers = None,
    decompose: Annotated[str, typer.Option("--decompose", help="cpsat: cut the graph into pieces solved apart and "
                                           "joined exactly: auto (from 1,000 nodes), always or never.")] = "auto",
    output: Annotated[Path | None, typer.Option("-o", "--output", help="Write plan.json here.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite existing output files (and a --dump).")] = False,
    explain: Annotated[bool, typer.Option("--explain", help="Log every fusion accepted or refused.")] = False,
    emit: Annotated[Path | None, typer.Option("--emit", help="Write the fused ONNX model here.")] = None,
    no_verify: Annotated[bool, typer.Option("--no-verify", help="Skip checking --emit in ONNX Runtime.")] = False,
    svg: Annotated[Path | None, typer.Option("--svg", help="Draw the plan as SVG here.")] = None,
    html_out: Annotated[Path | None, typer.Option("--html", help="Write an offline HTML page of the plan.")] = None,
    input_value: InputValue = None,
    dtype: DType = "float32",
    no_tf32: NoTf32 = False,
    costs: Costs = "predicted",
    threads: Threads = 1,
    layouts: Layouts = "auto",
    dump: Dump = None,
    json_out: JsonFlag = False,
) -> None:
    """Find a fusion plan for MODEL on a device and print its summary (or write plan.json)."""
    from fusesearch.buckets import plan_buckets, split_dims
    from fusesearch.pipeline import prepare
    from fusesearch.search import STRATEGIES

    if strategy not in STRATEGIES:
        raise BadInput(f"--strategy {strategy}: unknown; choose one of {', '.join(STRATEGIES)}")
    check_costs(costs)
    check_outputs([(output, "-o"), (emit, "--emit"), (svg, "--svg"), (html_out, "--html")], force,
                  _reads((model, "model"), device=device))
    _check_dump(dump, force)
    config = _config(time_limit, max_group_size, seed, workers, decompose, layouts)
    fixed, buckets = split_dims(dim or [], dim_weights or [])
    if buckets is not None:
        preps = _bucket_preps(model, input_shape, fixed, buckets, dtype, no_tf32, "plan", (
            (f"--costs {costs}", costs != "predicted"), ("--input-value", input_value), ("--explain", explain)))
        result, figures, _ = plan_buckets(preps, buckets, device, strategy, config, threads)
        verified = None
        if emit is not None:
            verified = _emit_dynamic(preps, result, buckets, emit, force, seed, None if no_verify else
                                     lambda v: prepare(model, _bindings(input_shape, [*fixed, f"{buckets.dim}={v}"]),
                                                       keep_original=True, dtype=dtype, tf32=not no_tf32))
        _draw(result, svg, html_out)
        _dump(result, dump, force)
        if output is not None:
            with writing(output, "-o"):
                output.write_text(result.to_json())
        if json_out:
            _emit_json({**result.to_dict(), "run": {"wall_s": round(result.solver.wall_s, 3), "verified": verified,
                                                    "output": str(output) if output else None,
                                                    "emit": str(emit) if emit else None}})
            return
        _print_plan(result, output)
        _print_buckets(buckets, figures, result.time_s)
        if emit is not None:
            out.print(f"fused model written to {emit}, {buckets.dim} dynamic")
        for report in verified or ():
            out.print(f"at {buckets.dim}={report['at']}: {_verified_line(report)}")
        return
    verifying = emit is not None and not no_verify
    with _stage(f"loading {model}"):
        prep = prepare(model, _bindings(input_shape, dim), keep_original=verifying, dtype=dtype, tf32=not no_tf32)
    values = _input_values(input_value, prep)
    if verifying:
        _check_verify_memory(prep, True)
    with _stage(f"planning {len(prep.graph.nodes)} nodes for {device} ({strategy})"):
        result, legality, prep = _run_plan(model, None, device, strategy, config, prep, costs, threads)
    verified = None
    if emit is not None:
        with _stage(f"writing {emit}" + (", verified in ONNX Runtime first" if verifying else "")):
            verified = _emit_fused(prep, [g.nodes for g in result.groups], emit, force, verifying, seed, values)
    _draw(result, svg, html_out)
    _dump(result, dump, force)
    if explain:
        from fusesearch.explain import explain_lines

        for line in explain_lines(result, legality):
            print(line, file=sys.stderr)
    if output is not None:
        with writing(output, "-o"):
            output.write_text(result.to_json())
    if json_out:
        doc = result.to_dict()
        doc["run"] = {"wall_s": round(result.solver.wall_s, 3), "stats": dict(result.solver.stats),
                      "output": str(output) if output else None, "emit": str(emit) if emit else None,
                      "verified": verified, "opaque_ops": [name for _, name in _opaque_ops(result.graph)],
                      **_tuned(legality)}
        _emit_json(doc)
        return
    _print_plan(result, output)
    for path, what in ((emit, "fused model"), (svg, "picture"), (html_out, "page")):
        if path is not None:
            out.print(f"{what} written to {path}")
    if verified is not None:
        out.print(_verified_line(verified))


BUCKET_REASONS = 3  # refusals shown per bucket
BUCKET_NOTE = 0.05  # a bucket paying more than this over its own plan says why


def _print_buckets(buckets, figures, plan_time_s: float) -> None:
    """Each bucket's time under the one plan beside its own optimal plan's (the price of one plan)."""
    table = Table(title=f"one plan for {buckets.dim} = {', '.join(map(str, buckets.values))} "
                        f"(times above: weighted by how often each is served)", title_justify="left")
    from fusesearch.buckets import plan_changes

    for col in (buckets.dim, "weight", "one plan", "own plan", "own kernels", "price of one plan",
                "own plan vs the one below"):
        table.add_column(col, justify="right")
    changes = ["", *(change_text(c) for c in plan_changes(figures))]
    for f, change in zip(figures, changes, strict=True):
        table.add_row(str(f.value), f"{f.weight:.2f}", _fmt_time(f.time_s), _fmt_time(f.own_time_s),
                      str(f.own_kernels), f"{f.price:.3f}x", change)
    out.print(table)
    worst = max(figures, key=lambda f: f.price)
    out.print(f"worst bucket {buckets.dim}={worst.value}: {100 * (worst.price - 1):.1f}% over its own plan")
    for f in figures:
        for line in f.why[:BUCKET_REASONS]:
            out.print(f"  {buckets.dim}={f.value}'s own groups refused {line}")
        if f.own_weighted_s is not None and f.price > 1 + BUCKET_NOTE:
            out.print(f"  {buckets.dim}={f.value}'s own plan, served at every bucket: {_fmt_time(f.own_weighted_s)} "
                      f"weighted, against the one plan's {_fmt_time(plan_time_s)}")


def change_text(change) -> str:
    """A `buckets.PlanChange` in a cell: fused groups gained / lost, and what keeping the plan below costs."""
    if not change.gone and not change.new:
        return "same groups"
    kept = "refused here" if change.price is None else f"{change.price:.3f}x"
    return f"+{len(change.new)} / -{len(change.gone)} groups; the plan below here {kept}"


def _emit_dynamic(preps, plan_, buckets, path: Path, force: bool, seed: int, prepare_at) -> list[dict] | None:
    """The plan over buckets as one fused model that keeps the dim dynamic (`dynamic.dynamic_model`),
    verified against the original at the smallest, a middle, the largest bucket and a value
    between buckets (`prepare_at(value)` prepares the model there; None: --no-verify), then written."""
    from fusesearch.dynamic import check_values, dynamic_model
    from fusesearch.export import fused_model, save_model
    from fusesearch.ir.canonicalize import to_proto
    from fusesearch.ir.precision import prepared_tolerance

    canonicals = [to_proto(p.canonical) for p in preps]
    fused = fused_model(canonicals[-1], preps[-1].graph, [g.nodes for g in plan_.groups])
    dynamic = dynamic_model(fused, canonicals, buckets.values, buckets.dim)
    reports = None
    if prepare_at is not None:
        reports = []
        for value in check_values(buckets.values, seed):
            prep = prepare_at(value)
            report = _verify(prep, dynamic, seed, prepared_tolerance(prep), 0.0, {},
                             label=f"--emit {path} at {buckets.dim}={value}")
            if not report["ok"]:
                raise FusesearchError(f"--emit {path}: at {buckets.dim}={value} the fused model differs from the "
                                      f"original, so it was not written: {_verified_line(report)}; please report "
                                      f"this plan")
            reports.append({"at": value, **report})
    with writing(path, "--emit"):
        save_model(dynamic, path, overwrite=force)
    return reports


def _check_dump(dump: Path | None, force: bool) -> None:
    """--dump: checked before any work (`dump.check_dump_dir`)."""
    from fusesearch.dump import check_dump_dir

    if dump is not None:
        check_dump_dir(dump, force)


def _dump(plan_, dump: Path | None, force: bool) -> None:
    """--dump: the plan's sources, schedules and launches, one file each per group and per reorder
    (stderr says where)."""
    from fusesearch.dump import write_dump

    if dump is not None:
        written = write_dump(plan_, dump, force)
        n = len(plan_.reorders)
        reorders = f" and {n} reorder{'s' * (n > 1)}" if n else ""
        print(f"fusesearch: {len(written)} files of {len(plan_.groups)} groups{reorders} written to {dump}",
              file=sys.stderr)


def _emit_fused(prep, groups, path: Path, force: bool, verify: bool, seed: int, values: dict) -> dict | None:
    """Build the fused model, verify it in memory against the original (`prep.original`), and
    only then write it: a model that failed verification never reaches the disk."""
    from fusesearch.export import fused_model, save_model
    from fusesearch.ir.canonicalize import to_proto
    from fusesearch.ir.precision import prepared_tolerance

    fused = fused_model(to_proto(prep.canonical), prep.graph, groups)
    report = None
    if verify:
        report = _verify(prep, fused, seed, prepared_tolerance(prep), 0.0, values, label=f"--emit {path}")
        if not report["ok"]:
            raise FusesearchError(f"--emit {path}: the fused model differs from the original, so it was not "
                                  f"written: {_verified_line(report)}; please report this plan")
    with writing(path, "--emit"):
        save_model(fused, path, overwrite=force)
    return report


def _draw(plan_, svg: Path | None, html_out: Path | None) -> None:
    from fusesearch.pictures import plan_html, plan_svg

    if svg is not None:
        with writing(svg, "--svg"):
            svg.write_text(plan_svg(plan_))
    if html_out is not None:
        with writing(html_out, "--html"):
            html_out.write_text(plan_html(plan_))


def _check_verify_memory(prep, can_skip: bool) -> None:
    """Before any work: refuse a verification that cannot fit in memory (`can_skip`: the command
    has --no-verify)."""
    from fusesearch.verify import check_memory

    check_memory(prep.graph, f"use {NO_VERIFY} or a smaller --dim" if can_skip else
                 "give a smaller --dim or --input-shape")


def _verify(prep, candidate, seed: int, rtol: float, atol: float, values: dict, *, label: str,
            ours: bool = True) -> dict:
    """Run the original (`prep.original`, held in memory) and CANDIDATE in ONNX Runtime on the
    same valid inputs. `ours`: the candidate is a fused model made now (its failure is a bug:
    exit 1), else a file the user gave (exit 2)."""
    from fusesearch.verify import (
        CandidateFailed,
        candidate_outputs,
        compare,
        random_feeds,
        reference_outputs,
    )

    feeds = random_feeds(prep.original, seed, values)
    skip = f"use {NO_VERIFY}" if ours else None
    reference = reference_outputs(prep.original, feeds, given=list(values), skip=skip)
    try:
        candidate_out = candidate_outputs(candidate, feeds)
    except CandidateFailed as exc:
        if ours:
            raise FusesearchError(f"{label}: ONNX Runtime cannot run the fused model ({exc}); please report "
                                  "this plan") from None
        raise BadInput(f"{label}: ONNX Runtime cannot run it ({exc}); give a model written by "
                       "`fusesearch plan --emit` or `export`, with the same --dim/--input-shape") from None
    diffs = compare(reference, candidate_out, rtol=rtol, atol=atol)
    return {"ok": all(d.ok for d in diffs) and bool(diffs), "seed": seed, "rtol": rtol, "atol": atol,
            "outputs": [{"name": d.name, "max_abs": d.max_abs, "max_rel": d.max_rel, "ok": d.ok,
                         **({"why": d.why} if d.why else {})} for d in diffs]}


def _read_fused(path: Path):
    import onnx
    from google.protobuf.message import DecodeError

    try:
        return onnx.load(str(path))
    except (DecodeError, OSError, ValueError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise BadInput(f"{path}: not a readable ONNX model ({first}); give the fused .onnx written by "
                       "`fusesearch plan --emit`") from None


def _verified_line(report: dict) -> str:
    outs = report["outputs"]
    worst_abs = max((o["max_abs"] for o in outs), default=0.0)
    worst_rel = max((o["max_rel"] for o in outs), default=0.0)
    verdict = "equal" if report["ok"] else "DIFFERENT"
    bad = [o["name"] + (f" ({o['why']})" if o.get("why") else "") for o in outs if not o["ok"]]
    return (f"verified in ONNX Runtime: {len(outs)} outputs {verdict} (max abs err {worst_abs:.3g}, "
            f"max rel err {worst_rel:.3g}, seed {report['seed']})" + (f"; differing: {', '.join(bad)}" if bad else ""))


# -- verify / export --------------------------------------------------------------------------

@app.command()
def verify(
    original: Annotated[str, typer.Argument(help="the original model: path or zoo:NAME")],
    fused: Annotated[Path, typer.Argument(help="the fused model (from plan --emit or export)")],
    input_shape: InputShape = None,
    dim: Dim = None,
    seed: Annotated[int, typer.Option("--seed", callback=SEED, help="Seed of the random inputs.")] = 0,
    rtol: Annotated[float | None, typer.Option("--rtol", callback=TOLERANCE,
                                               help="Tolerance relative to max(1, max|original|) (default: "
                                               "1e-4, float16 1e-2, bfloat16 5e-2).")] = None,
    atol: Annotated[float, typer.Option("--atol", callback=TOLERANCE, help="Absolute tolerance.")] = 0.0,
    input_value: InputValue = None,
    dtype: Annotated[str, typer.Option("--dtype", callback=_dtype_option, help="The precision FUSED was planned "
                                       "in (`plan --dtype`): ORIGINAL is converted the same way.")] = "float32",
    json_out: JsonFlag = False,
) -> None:
    """Prove FUSED equal to ORIGINAL in ONNX Runtime on seeded, valid random inputs (exit 1 if not)."""
    from fusesearch.pipeline import prepare

    if not fused.is_file():
        raise BadInput(f"{fused}: no such file; give the fused .onnx written by `fusesearch plan --emit`")
    if _reads((original, "ORIGINAL")) and os.path.isfile(original) and os.path.samefile(original, fused):
        raise BadInput(f"{fused}: is ORIGINAL itself; give the fused .onnx written by `fusesearch plan --emit`")
    from fusesearch.ir.precision import prepared_tolerance

    prep = prepare(original, _bindings(input_shape, dim), keep_original=True, dtype=dtype)
    values = _input_values(input_value, prep)
    _check_verify_memory(prep, False)
    rtol = prepared_tolerance(prep) if rtol is None else rtol
    report = _verify(prep, _read_fused(fused), seed, rtol, atol, values, label=str(fused), ours=False)
    if json_out:
        _emit_json(report)
    else:
        for o in report["outputs"]:
            out.print(f"{o['name']}: " + (o["why"] if o.get("why") else
                                          f"max abs err {o['max_abs']:.3g}, max rel err {o['max_rel']:.3g}")
                      + f" {'ok' if o['ok'] else 'MISMATCH'}")
        out.print(_verified_line(report))
    if not report["ok"]:
        raise typer.Exit(1)


@app.command()
def export(
    plan_json: Annotated[Path, typer.Argument(help="plan.json written by `fusesearch plan -o`",
                                              callback=_plan_file)],
    model: Annotated[str, typer.Argument(help="the model it plans: path or zoo:NAME")],
    emit: Annotated[Path, typer.Option("--emit", help="Write the fused ONNX model here.")],
    input_shape: InputShape = None,
    dim: Dim = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing --emit file.")] = False,
    no_verify: Annotated[bool, typer.Option("--no-verify", help="Skip checking it in ONNX Runtime.")] = False,
    input_value: InputValue = None,
    dtype: DType = "float32",
    json_out: JsonFlag = False,
) -> None:
    """Rebuild the fused model from a saved plan (refusing a plan that does not fit the model)."""
    from fusesearch.export import plan_groups_from_json
    from fusesearch.pipeline import prepare

    check_outputs([(emit, "--emit")], force, _reads((model, "model"), (plan_json, "plan")))
    prep = prepare(model, _bindings(input_shape, dim), keep_original=not no_verify, dtype=dtype)
    values = _input_values(input_value, prep)
    groups = plan_groups_from_json(plan_json, prep.graph)
    if not no_verify:
        _check_verify_memory(prep, True)
    report = _emit_fused(prep, groups, emit, force, not no_verify, 0, values)
    functions = sum(len(g) > 1 for g in groups)
    if json_out:
        _emit_json({"plan": str(plan_json), "model": prep.loaded.name, "emit": str(emit), "nodes": len(groups),
                    "functions": functions, "verified": report})
        return
    out.print(f"fused model written to {emit} ({len(groups)} nodes, {functions} functions)")
    if report is not None:
        out.print(_verified_line(report))


def _run_plan(model: str, bindings, device: str, strategy: str, config, prep=None, costs: str = "predicted",
              threads: int = 1):
    """(plan, legality, prep), a CPU's plan priced for `threads` OpenMP threads; `costs` other than
    predicted also prints what measuring cost (stderr)."""
    from fusesearch.api import search_prepared
    from fusesearch.pipeline import prepare

    result, legality, prep, tuner = search_prepared(prep or prepare(model, bindings), device, strategy, config, costs,
                                                    threads)
    if tuner is not None:
        _say(tuner.stats.line())
    return result, legality, prep


@contextmanager
def _stage(what: str):
    """A spinner saying `what` on stderr while a slow step runs (loading, searching, verifying), on a
    terminal only: a pipe, a log or a test sees nothing, and the line is gone when the step ends."""
    if not err.is_terminal:
        yield
        return
    with err.status(f"{what} ...", spinner="line"):
        yield


def _say(line: str) -> None:
    """A line of progress or cost on stderr (never stdout: --json keeps it one document)."""
    print(f"fusesearch: {line}", file=sys.stderr)


def _tuned(legality) -> dict:
    """What measuring the choices cost, for a --json document ({} with predicted costs)."""
    return {} if legality.measurer is None else {"costs": legality.measurer.stats.to_dict()}


OPAQUE_SHOWN = 5


def _opaque_ops(graph) -> list[tuple[str, str]]:
    """The ops no template fuses or prices by its work (control flow, unknown ops, an Einsum that is
    not a matrix product): each runs alone, priced as a library call."""
    from fusesearch.ir.op_kind import OpKind

    return [(n.op_type, n.name) for n in graph.nodes if n.kind == OpKind.OPAQUE]


def _print_plan(p, output: Path | None) -> None:
    s = p.solver
    status = s.status + (f", bound {_fmt_time(s.bound_s)}, gap {s.gap:.2%}" if s.bound_s is not None else "")
    threads = p.priced.get("threads")
    at = f" at {threads} thread{'s' if threads != 1 else ''} (--threads)" if threads else ""
    out.print(f"[bold]{p.model.name}[/bold] on [bold]{p.device}[/bold]{at}, strategy {p.strategy} "
              f"({status}; {s.wall_s:.2f} s)")
    if s.summary():
        out.print(f"solver: {s.summary()}", markup=False)
    # the bound is the model's roofline; under measured costs the plan's time is the sum of timed
    # kernels, which a low peak in the model can put below it: the ratio would compare two sources
    bound = (f"lower bound {_fmt_time(p.lower_bound_s)} ({p.time_s / p.lower_bound_s:.1f}x above it)"
             if p.costs == "predicted" else f"model's lower bound {_fmt_time(p.lower_bound_s)}")
    label = "predicted" if p.costs == "predicted" else f"{p.costs} (sum of kernels)"
    out.print(f"kernels {p.kernels} (canonical nodes {len(p.graph)})"
              f"   {label} {_fmt_time(p.time_s)}   unfused {_fmt_time(p.unfused_time_s)}"
              f"   speedup {p.speedup:.2f}x   {bound}")
    blocked = sum(g.kernel.schedule.layout_out.blocked for g in p.groups)
    if p.layouts is not None and (p.layouts["block"] or blocked):  # a GPU plan: where it runs a group NHWC
        copies = sum(r.cost.time_s for r in p.reorders)
        other = p.layouts.get("layout", f"NCHW{p.layouts['block']}c")
        out.print(f"layouts (--layouts {p.layouts['choice']}): {blocked} group{'s' if blocked != 1 else ''} in "
                  f"{other}, {len(p.reorders)} reorder{'s' if len(p.reorders) != 1 else ''} "
                  f"({_fmt_time(copies)})", markup=False)
    if opaque := _opaque_ops(p.graph):
        shown = ", ".join(f"{op} {name!r}" for op, name in opaque[:OPAQUE_SHOWN])
        more = f" and {len(opaque) - OPAQUE_SHOWN} more" if len(opaque) > OPAQUE_SHOWN else ""
        out.print(f"{len(opaque)} opaque op{'s' if len(opaque) > 1 else ''} priced as library calls: {shown}{more}")
    table = Table(title="slowest kernels", title_justify="left")
    for col in ("group", "template", "ops", "runs as", "time", "bound", "occupancy"):
        table.add_column(col, justify="right" if col in ("time", "occupancy") else "left")
    for g in sorted(p.groups, key=lambda g: -g.cost.time_s)[:10]:
        ops = "+".join(p.graph.nodes[i].op_type for i in g.nodes)
        runs = "alias" if g.kernel.alias else f"{g.kernel.impl} ({g.cost.compute_unit})"
        table.add_row(f"g{g.id}", "alias" if g.kernel.alias else g.kernel.template, ops, runs,
                      _fmt_time(g.cost.time_s), g.cost.bound, f"{g.cost.occupancy:.2f}")
    out.print(table)
    if output is not None:
        out.print(f"plan written to {output}")


@app.command()
def compare(
    model: Annotated[str, typer.Argument(help="path/to/model.onnx or zoo:NAME")],
    device: Annotated[str, typer.Option("--device", help="D[,D2...]: GPU names or profile.json files")],
    input_shape: InputShape = None,
    dim: Dim = None,
    strategies: Annotated[str, typer.Option("--strategy", "--strategies", help="Comma-separated strategies (none "
                                            "| rules | greedy | cpsat), like --device.")] = "none,rules,greedy,cpsat",
    time_limit: TimeLimit = 60.0,
    max_group_size: MaxGroup = 16,
    seed: Seed = 0,
    workers: Workers = None,
    json_out: JsonFlag = False,
) -> None:
    """Run strategies side by side on one or more devices; show where the plans differ."""
    from fusesearch.api import compare as compare_plans

    doc = compare_plans(model, device, strategies, time_limit_s=time_limit, max_group_size=max_group_size, seed=seed,
                        workers=workers, shape_bindings=_bindings(input_shape, dim)).to_dict()
    if json_out:
        _emit_json(doc)
        return
    _print_compare(doc)


def _print_compare(doc: dict) -> None:
    out.print(f"[bold]{doc['model']}[/bold] ({doc['canonical_nodes']} canonical nodes)")
    table = Table()
    for col in ("device", "strategy", "kernels", "predicted", "speedup", "x lower bound", "status", "wall"):
        table.add_column(col, justify="left" if col in ("device", "strategy", "status") else "right")
    for r in doc["results"]:
        table.add_row(r["device"], r["strategy"], str(r["kernels"]), _fmt_time(r["time_s"]),
                      f"{r['speedup']:.2f}x", f"{r['time_s'] / r['lower_bound_s']:.1f}x", r["status"],
                      f"{r['wall_s']:.2f} s")
    out.print(table)
    for d in doc["differences"]:
        a, b = d["devices"]
        if d["same"]:
            out.print(f"{d['strategy']}: same plan on {a} and {b}")
            continue
        out.print(f"{d['strategy']}: plans differ between {a} and {b}: "
                  f"{len(d['only_in_a'])} fused groups only on {a}, {len(d['only_in_b'])} only on {b}")
        for g in d["only_in_a"][:3]:
            out.print(f"  only on {a}: {g}")
        for g in d["only_in_b"][:3]:
            out.print(f"  only on {b}: {g}")


# -- measure ----------------------------------------------------------------------------------

@app.command()
def measure(
    model: Annotated[str, typer.Argument(help="path/to/model.onnx or zoo:NAME")],
    backend: Annotated[str, typer.Option("--backend", help="cpu (generated C) or cupy (generated CUDA)")] = "cpu",
    plan_json: Annotated[Path | None, typer.Option("--plan", callback=_plan_file,
                                                   help="Measure this plan.json (default: plan now).")] = None,
    device: Annotated[str | None, typer.Option("--device", help="Cost model device (default: host on cpu, "
                                               "h200 on cupy) or profile.json.")] = None,
    strategy: Strategy = "cpsat",
    input_shape: InputShape = None,
    dim: Dim = None,
    time_limit: TimeLimit = 60.0,
    budget: Annotated[float, typer.Option("--budget", callback=SECONDS,
                                          help="Timing budget per kernel, seconds.")] = 0.2,
    seed: Seed = 0,
    output: Annotated[Path | None, typer.Option("-o", "--output", help="Write the measurements (Parquet): a row per kernel; with --end-to-end also "
                                                "the run's figures as end_to_end_* columns.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite existing output files (and a --dump).")] = False,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="Re-time kernels even if cached.")] = False,
    ptxas: Annotated[bool | None, typer.Option("--ptxas/--no-ptxas", help="Record ptxas registers/spills/smem "
                                               "of each CUDA kernel (default: on for cupy).")] = None,
    flush_l2: Annotated[bool, typer.Option("--flush-l2", help="Evict L2 before every GPU launch (a flush kernel in the timing graph); else warm.")] = False,
    baseline: Annotated[str, typer.Option("--baseline", help="How the unfused graph's lone anchors (MatMul, Gemm, "
                                          "Conv) run: library (ONNX Runtime on cpu, cuBLAS/CuPy on "
                                          "cupy) or generated (ours); the plan runs as priced.")] = "library",
    input_value: Annotated[list[str], typer.Option("--input-value", help="NAME=V: the value of an input in "
                                                   "the data measured on, e.g. sr=16000 or x=[1,2,3] "
                                                   "(repeatable)")] = None,
    end_to_end: Annotated[bool, typer.Option("--end-to-end", help="Also run the plan and the unfused graph "
                                             "as whole programs beside ONNX Runtime (as `run`; cpu).")] = False,
    dtype: DType = "float32",
    no_tf32: NoTf32 = False,
    costs: Costs = "predicted",
    threads: Threads = 1,
    dump: Dump = None,
    json_out: JsonFlag = False,
) -> None:
    """Run every kernel of a plan and of the unfused graph on real data: measured vs predicted,
    and each fused anchor group vs its library anchor plus separate kernels."""
    from rich.progress import Progress

    from fusesearch.api import backend_device, check_measure, measure_planned, plans_for

    runs_on = check_measure(backend, baseline, end_to_end, costs)
    check_outputs([(output, "-o")], force, _reads((model, "model"), (plan_json, "plan"), device=device))
    _check_dump(dump, force)
    device = backend_device(device, runs_on, threads)
    planned = plans_for(model, device, strategy, command="measure", plan_file=plan_json,
                        shape_bindings=_bindings(input_shape, dim), value_flags=input_value or (), dtype=dtype,
                        tf32=not no_tf32, time_limit_s=time_limit, seed=seed, lone_anchors=baseline, costs=costs,
                        threads=threads, say=_say)
    _dump(planned.plan, dump, force)
    with Progress(console=err, transient=True, disable=not err.is_terminal) as bar:  # no bar, no blank line
        task = bar.add_task(f"measuring on {backend}", total=None)
        result = measure_planned(planned, runs_on, device, budget_s=budget, seed=seed, cache=not no_cache, ptxas=ptxas,
                                 flush_l2=flush_l2, baseline=baseline, end_to_end=end_to_end, threads=threads,
                                 progress=lambda done, total: bar.update(task, completed=done, total=total))
    if output is not None:
        rows = result.to_pandas()  # with --end-to-end the run's figures, the same on every row
        with writing(output, "-o"):
            rows.to_parquet(output, index=False)
    if json_out:
        _emit_json(result.to_dict())
        return
    _print_measure(result.report, output, None if runs_on.cuda else threads)
    if result.end_to_end is not None:
        _print_run(result.end_to_end, None)


def _print_measure(report, output, threads: int | None) -> None:
    t = report.totals()
    versus = report.library_comparison()
    at = f", {threads} thread{'s' if threads != 1 else ''}" if threads else ""
    table = Table(title=f"measured on {report.backend} ({report.device}{at}), each kernel alone, median of n "
                        f"samples; the unfused graph's lone anchors: {report.baseline}",
                  title_justify="left")
    for col in ("group", "template", "how", "predicted", "measured", "p20-p80", "n", "max rel err", "library+rest"):
        table.add_column(col, justify="left" if col in ("group", "template", "how") else "right")
    for m in report.plan:
        spread = f"{_fmt_time(m.timing.p20_s)}-{_fmt_time(m.timing.p80_s)}" if m.timing else "-"
        table.add_row(f"g{m.group}", m.template, m.how, _fmt_time(m.predicted_s),
                      _fmt_time(m.measured_s) if m.timing else "-", spread, str(m.timing.n) if m.timing else "-",
                      f"{m.max_rel_err:.2g}",
                      _fmt_versus(versus.get(m.group)))
    out.print(table)
    same = ", not distinguishable" if t["speedup_verdict"] == "not distinguishable" else ""
    out.print(f"sums of kernels, each timed alone (median; sums of p20-p80): plan predicted "
              f"{_fmt_time(t['predicted_s'])}, measured {_fmt_time(t['measured_s'])} "
              f"({_fmt_time(t['measured_p20_s'])}-{_fmt_time(t['measured_p80_s'])})   unfused predicted "
              f"{_fmt_time(t['unfused_predicted_s'])}, measured {_fmt_time(t['unfused_measured_s'])} "
              f"({_fmt_time(t['unfused_measured_p20_s'])}-{_fmt_time(t['unfused_measured_p80_s'])})"
              f"   speedup of the sums {t['speedup']:.2f}x{same}" + (f"   ({t['not_measured']} kernels not measured)"
                                                                     if t["not_measured"] else ""))
    out.print("a sum of kernels is not the program's time: `fusesearch run` (or measure --end-to-end) times the "
              "plan end to end beside ONNX Runtime")
    for m in [*report.plan, *report.unfused]:
        if m.reason:
            how = "not measured" if m.timing is None else m.how
            out.print(f"{how}: {m.plan} g{m.group} ({m.row.get('op_types', m.template)}): {m.reason}")
    _print_versus(versus, report.baseline)
    if output is not None:
        out.print(f"measurements written to {output}")


def _fmt_versus(v: dict | None) -> str:
    """A fused anchor group's library baseline (anchor via the library + the rest separately), or
    a lone anchor's own call through the library where the plan ran it as our kernel."""
    if v is None:
        return ""
    loses = v["ours_loses"] if v["alone"] else v["fused_loses"]
    if loses is None:
        return "-"
    return _fmt_time(v["library_baseline_s"]) + (" LOSES" if loses else "")


def _print_versus(versus: dict, baseline: str) -> None:
    lone = {g: v for g, v in versus.items() if v["alone"] and v["ours_loses"] is not None}
    if lone:
        slower = sorted(g for g, v in lone.items() if v["ours_loses"])
        out.print(f"lone anchors the plan runs as our kernel vs the same call through the library: ours is slower in "
                  f"{len(slower)} of {len(lone)} (ours {_fmt_time(sum(v['measured_s'] for v in lone.values()))} vs "
                  f"library {_fmt_time(sum(v['library_baseline_s'] for v in lone.values()))})"
                  + (f": {', '.join(f'g{g}' for g in slower[:12])}{' ...' if len(slower) > 12 else ''}" if slower else ""))
    versus = {g: v for g, v in versus.items() if not v["alone"]}
    compared = {g: v for g, v in versus.items() if v["fused_loses"] is not None}
    if not versus:
        return
    if not compared:
        why = ("use --baseline library to time the unfused graph's lone anchors through the library"
               if baseline != "library"
               else "none ran as one generated kernel, or a part was not measured")
        out.print(f"{len(versus)} fused anchor groups, none compared with the library ({why})")
        return
    losers = sorted(g for g, v in compared.items() if v["fused_loses"])
    fused = sum(v["measured_s"] for v in compared.values())
    library = sum(v["library_baseline_s"] for v in compared.values())
    out.print(f"fused anchor groups vs library anchor + the rest as separate kernels: the fused kernel loses in "
              f"{len(losers)} of {len(compared)} (fused {_fmt_time(fused)} vs library+rest {_fmt_time(library)})"
              + (f": {', '.join(f'g{g}' for g in losers[:12])}{' ...' if len(losers) > 12 else ''}" if losers else ""))


# -- run --------------------------------------------------------------------------------------

@app.command()
def run(
    model: Annotated[str, typer.Argument(help="path/to/model.onnx or zoo:NAME")],
    plan_json: Annotated[Path | None, typer.Option("--plan", callback=_plan_file,
                                                   help="Run this plan.json (default: plan now).")] = None,
    strategy: Strategy = "cpsat",
    device: Annotated[str | None, typer.Option("--device", help="Cost model device the plan is made for, "
                                               "or profile.json (default: host for --backend cpu, else "
                                               "h200).")] = None,
    backend: Annotated[str, typer.Option("--backend", help="cpu (generated C in one shared library), cupy "
                                         "(one CUDA module on one stream, a CUDA graph when no library "
                                         "step splits it; timed with CUDA events), or emulate (the CUDA program "
                                         "through the CUDA emulator on the CPU: correctness only, the plan "
                                         "checked against ONNX Runtime, no timing).")] = "cpu",
    input_shape: InputShape = None,
    dim: RunDim = None,
    repeat: Annotated[int, typer.Option("--repeat", callback=COUNT, help="Timed runs of each program.")] = 20,
    warmup: Annotated[int, typer.Option("--warmup", callback=_checked(lambda v: None if v >= 0 else "0 or more runs"),
                                        help="Untimed runs before them.")] = 3,
    threads: Threads = 1,
    time_limit: TimeLimit = 60.0,
    seed: Annotated[int, typer.Option("--seed", callback=SEED, help="Seed of the solver and of the random "
                                      "inputs.")] = 0,
    rtol: Annotated[float | None, typer.Option("--rtol", callback=TOLERANCE, help="Tolerance relative to "
                                               "max(1, max|ONNX Runtime|) (default: 1e-4, float16 1e-2, "
                                               "bfloat16 5e-2; 2e-3 at least with TF32 kernels in the plan).")] = None,
    check_each: Annotated[bool, typer.Option("--check-each", help="Compare every intermediate tensor with "
                                             "ONNX Runtime's, not only the outputs.")] = False,
    input_value: InputValue = None,
    output: Annotated[Path | None, typer.Option("-o", "--output", help="Write the timings (Parquet).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite existing output files (and a --dump).")] = False,
    dtype: DType = "float32",
    no_tf32: NoTf32 = False,
    costs: Costs = "predicted",
    layouts: Layouts = "auto",
    baselines: Annotated[list[str] | None, typer.Option("--baselines", help="Also time these beside the plan, "
                                                        "each checked equal to ONNX Runtime first: torch (PyTorch "
                                                        "eager and torch.compile, default and max-autotune, over the "
                                                        "same model; always with --backend cupy). Needs the torch "
                                                        "extra; without it the report says 'not installed'.")] = None,
    dump: Dump = None,
    trace: Annotated[Path | None, typer.Option("--trace", help="Also run the plan step by step for --repeat rounds "
                                               "and write a Chrome trace (JSON) of every kernel and library "
                                               "step in each round, for Perfetto or chrome://tracing.")] = None,
    json_out: JsonFlag = False,
) -> None:
    """Run a plan end to end as one program (and the unfused graph the same way), check it equals
    ONNX Runtime, and time both beside ONNX Runtime at ENABLE_ALL, ENABLE_EXTENDED and DISABLE_ALL (exit 1 if
    not equal)."""
    from fusesearch.api import backend_device, check_run, plans_for, run_planned, run_tolerance
    from fusesearch.buckets import split_dims
    from fusesearch.verify import check_memory

    runs_on = check_run(backend, baselines or (), costs)
    _config(time_limit, 16, seed, None, layouts=layouts)  # --layouts checked before any loading
    emulated = not runs_on.timed  # the CUDA program checked, not timed
    check_outputs([(output, "-o"), (trace, "--trace")], force,
                  _reads((model, "model"), (plan_json, "plan"), device=device))
    _check_dump(dump, force)
    for path, flag in ((output, "-o"), (trace, "--trace")):
        if emulated and path is not None:
            raise BadInput(f"{flag}: --backend {backend} checks correctness only and has no timings to write; "
                           f"drop {flag}")
    device = backend_device(device, runs_on, threads, program=True)
    fixed, buckets = split_dims(dim or [])
    if buckets is not None:
        preps = _bucket_preps(model, input_shape, fixed, buckets, dtype, no_tf32, "run", (
            ("--plan", plan_json), (f"--costs {costs}", costs != "predicted"), ("--input-value", input_value),
            ("-o", output), ("--baselines", baselines), ("--dump", dump), ("--trace", trace)))
        for prep in preps:
            check_memory(prep.graph, "give a smaller --dim or --input-shape", "run")
        _run_buckets(preps, buckets, device, strategy, _config(time_limit, 16, seed, None, layouts=layouts), runs_on,
                     threads, repeat, warmup, seed, rtol, check_each, json_out)
        return
    planned = plans_for(model, device, strategy, command="run", plan_file=plan_json,
                        shape_bindings=_bindings(input_shape, dim), value_flags=input_value or (), dtype=dtype,
                        tf32=not no_tf32, time_limit_s=time_limit, seed=seed, costs=costs, threads=threads, say=_say,
                        layouts=layouts)
    _dump(planned.plan, dump, force)
    if emulated:
        _run_emulated(planned, seed, run_tolerance(planned, rtol), check_each, json_out)
        return
    with err.status("running", spinner="dots") if err.is_terminal else _nothing() as status:
        report = run_planned(planned, runs_on, threads=threads, repeat=repeat, warmup=warmup, seed=seed, rtol=rtol,
                             check_each=check_each, baselines=baselines or (),
                             progress=status.update if status else None).report
    if output is not None:
        with writing(output, "-o"):
            report.to_pandas().to_parquet(output, index=False)
    if trace is not None:
        _trace(planned, trace, runs_on, threads, repeat, warmup, seed)
    if json_out:
        _emit_json(report.to_dict())
        return
    _print_run(report, output)


def _trace(planned, path: Path, backend, threads: int, repeat: int, warmup: int, seed: int) -> None:
    """`run --trace`: the plan run step by step (`fusesearch.trace`), written as a Chrome trace."""
    from fusesearch.trace import trace_plan, write_trace

    doc = trace_plan(planned.prep, planned.plan, backend=backend, threads=threads, rounds=repeat, warmup=warmup,
                     seed=seed, input_values=planned.values)
    with writing(path, "--trace"):
        write_trace(doc, path)
    print(f"fusesearch: trace of {repeat} rounds written to {path}", file=sys.stderr)


def _bucket_preps(model, input_shape, fixed, buckets, dtype, no_tf32, command: str, options) -> list:
    """Each bucket's prepared model for `plan`/`run --dim` over several values, after refusing the
    first of `options` ((flag, given) pairs) given, which take one value only."""
    from fusesearch.pipeline import prepare

    refused = [flag for flag, given in options if given]
    if refused:
        raise BadInput(f"{refused[0]} with --dim {buckets.dim} over several values: not available for a {command} "
                       f"over buckets; give --dim {buckets.dim} one value to use it")
    return [prepare(model, _bindings(input_shape, [*fixed, f"{buckets.dim}={v}"]), dtype=dtype, tf32=not no_tf32)
            for v in buckets.values]


def _run_buckets(preps, buckets, device, strategy, config, runs_on, threads, repeat, warmup, seed, rtol, check_each,
                 json_out) -> None:
    """`run --dim seq=LO..HI`: one plan over the buckets, then each bucket's program (the same
    groups, kernels specialized to its shapes) run as one shape's is on `runs_on`: checked against
    ONNX Runtime and timed beside it (cpu, cupy), or its CUDA program checked through the emulator."""
    from fusesearch.api import Planned, run_planned, run_tolerance
    from fusesearch.buckets import bucket_programs, plan_buckets
    from fusesearch.run import Mismatch

    plan_, _, problems = plan_buckets(preps, buckets, device, strategy, config, threads)
    runs = []
    for value, (prep, ours, unfused) in zip(buckets.values, bucket_programs(problems, plan_, device, threads),
                                            strict=True):
        planned = Planned(prep, {}, ours, unfused)
        try:
            if runs_on.timed:
                runs.append((value, run_planned(planned, runs_on, threads=threads, repeat=repeat, warmup=warmup,
                                                seed=seed, rtol=rtol, check_each=check_each).report))
            else:
                runs.append((value, _emulated(planned, seed, run_tolerance(planned, rtol), check_each)))
        except Mismatch as e:
            raise Mismatch(f"at {buckets.dim}={value}: {e}") from None
    if json_out:
        _emit_json({"model": preps[0].loaded.name, "strategy": plan_.strategy, "buckets": plan_.buckets,
                    "runs": [{buckets.dim: value, **(run if isinstance(run, dict) else run.to_dict())}
                             for value, run in runs]})
        return
    title = (f"{preps[0].loaded.name}: one plan ({plan_.strategy}, {plan_.kernels} kernels) for "
             f"{buckets.dim} = {', '.join(map(str, buckets.values))}, each bucket's program ")
    (_print_timed_buckets if runs_on.timed else _print_emulated_buckets)(title, buckets.dim, runs)


def _print_timed_buckets(title: str, dim: str, reports) -> None:
    first = reports[0][1]
    where = first.backend if first.cuda_graph is None else f"{first.backend} (CUDA events)"
    table = Table(title=f"{title}end to end on {where}, {first.threads} thread{'s' if first.threads != 1 else ''}, "
                        f"median of n={first.repeat}", title_justify="left")
    for col in (dim, "plan", "unfused", "ONNX Runtime", "plan vs ORT", "max rel err"):
        table.add_column(col, justify="right")
    for value, report in reports:
        base = report.ort_baseline()
        table.add_row(str(value), _fmt_time(report.timings["plan"].median_s),
                      _fmt_time(report.timings["unfused"].median_s), _fmt_time(report.timings[base].median_s),
                      _versus(report, "plan", "ort_enable_all"), f"{report.max_rel_err:.2g}")
    out.print(table)
    out.print("ONNX Runtime: its faster ENABLE_ALL figure (the model as given or the canonical one), timed in the "
              "same rounds; every bucket's program equals ONNX Runtime")


def _print_emulated_buckets(title: str, dim: str, docs) -> None:
    table = Table(title=f"{title}(CUDA) through the CUDA emulator (correctness only, not timed)",
                  title_justify="left")
    for col in (dim, "kernels", "ORT nodes", "CUDA graph", "arena", "max rel err", "rtol"):
        table.add_column(col, justify="right")
    for value, doc in docs:
        table.add_row(str(value), str(doc["kernels"]), str(doc["library_steps"]), "yes" if doc["cuda_graph"] else "no",
                      _fmt_bytes(doc["arena_peak_bytes"]), f"{doc['max_rel_err']:.2g}", f"{doc['rtol']:g}")
    out.print(table)
    out.print("every bucket's CUDA program equals ONNX Runtime")


def _emulated(planned, seed: int, rtol: float, check_each: bool) -> dict:
    """The plan's CUDA program through the emulator, checked against ONNX Runtime: `run --json`'s
    emulated document."""
    from fusesearch.backends.registry import EMULATE
    from fusesearch.pipeline import activation_bytes
    from fusesearch.run import run_emulated

    prep, plan_ = planned.prep, planned.plan
    result = run_emulated(prep, plan_, seed=seed, rtol=rtol, check_each=check_each, input_values=planned.values)
    return {"model": prep.loaded.name, "strategy": plan_.strategy, "backend": EMULATE.name, **result, "rtol": rtol,
            "activation_bytes": activation_bytes(prep.graph)}


def _run_emulated(planned, seed: int, rtol: float, check_each: bool, json_out: bool) -> None:
    """`run --backend emulate`: the plan's CUDA program through the emulator, checked only."""
    doc = _emulated(planned, seed, rtol, check_each)
    if json_out:
        _emit_json(doc)
        return
    seg = doc["segments"]
    out.print(f"{doc['model']}: the CUDA program of plan ({doc['strategy']}) through the CUDA emulator "
              f"(correctness only, not timed): {doc['kernels']} generated kernels in {seg['generated']} segments, "
              f"{doc['library_steps']} ONNX Runtime nodes in {seg['library']} segments, "
              f"{'one CUDA graph' if doc['cuda_graph'] else 'launched one by one (no CUDA graph)'}; arena "
              f"{_fmt_bytes(doc['arena_peak_bytes'])} of {_fmt_bytes(doc['activation_bytes'])} activations")
    out.print(f"equal to ONNX Runtime: max rel err {doc['max_rel_err']:.2g}, rtol {rtol:g}")


def _nothing():
    from contextlib import nullcontext

    return nullcontext()


RUN_NAMES = {"plan": "plan", "unfused": "unfused (none)", "ort_enable_all": "ONNX Runtime ENABLE_ALL",
             "ort_enable_all_canonical": "ONNX Runtime ENABLE_ALL, canonical model",
             "ort_enable_extended": "ONNX Runtime ENABLE_EXTENDED",
             "ort_disable_all": "ONNX Runtime DISABLE_ALL, canonical model", "torch_eager": "PyTorch eager",
             "torch_compile": "torch.compile (Inductor, frozen)",
             "torch_compile_max_autotune": "torch.compile max-autotune"}


def _versus(report, key: str, base: str, short: bool = False) -> str:
    """'0.82x (per round 0.81x, 0.80-0.83)': the medians' ratio and the ratio round by round with
    its p20-p80 (`RunReport.paired`), ', not distinguishable' where that range holds 1; `short`
    (a table's cell): the ratio round by round alone, '0.81x (0.80-0.83)', '~' where it holds 1."""
    ratio = report.ratio(key, base)
    base = report.ort_baseline() if base == "ort_enable_all" else base
    pair = None if key == base else report.paired(key, base)
    if pair is None:
        return f"{ratio:.2f}x"
    if short:
        return pair.text() + ("" if pair.distinguishable else " ~")
    return (f"{ratio:.2f}x (per round {pair.median:.2f}x, {pair.p20:.2f}-{pair.p80:.2f})"
            + ("" if pair.distinguishable else ", not distinguishable"))


def _print_run(report, output: Path | None) -> None:
    where = report.backend if report.cuda_graph is None else (  # a host C program, or a CUDA program
        f"{report.backend} ({'one CUDA graph' if report.cuda_graph else 'kernels launched one by one'}, CUDA events; "
        f"ONNX Runtime on {report.ort_provider})")
    table = Table(title=f"{report.model}: end to end on {where}, {report.threads} thread"
                        f"{'s' if report.threads != 1 else ''}, median of n={report.repeat} runs each",
                  title_justify="left")
    for col in ("program", "median", "p20-p80", "vs ORT ENABLE_ALL", "vs ORT DISABLE_ALL"):
        table.add_column(col, justify="left" if col == "program" else "right")
    names = {**RUN_NAMES, "plan": f"plan ({report.strategy})"}
    if "ort_enable_all_canonical" in report.timings:
        for key in ("ort_enable_all", "ort_enable_extended"):
            names[key] = f"{RUN_NAMES[key]}, model as given"
    for key, t in report.timings.items():
        table.add_row(names[key], _fmt_time(t.median_s), f"{_fmt_time(t.p20_s)}-{_fmt_time(t.p80_s)}",
                      _versus(report, key, "ort_enable_all", True), _versus(report, key, "ort_disable_all", True))
    out.print(table)
    out.print("vs ORT: each program's time over ONNX Runtime's in the same round, median (p20-p80) over the rounds; "
              "'~' where that range holds 1 (not distinguishable)")
    if "ort_enable_all_canonical" in report.timings:
        which = "model as given" if report.ort_baseline() == "ort_enable_all" else "canonical model"
        out.print(f"vs ORT ENABLE_ALL: against ONNX Runtime's faster ENABLE_ALL figure, the {which}'s")
    elif report.timings:
        out.print("vs ORT ENABLE_ALL: ONNX Runtime on the canonical model (the plan's model is another precision "
                  "than the model as given)")
    seg = report.segments
    out.print(f"plan: {report.kernels} generated kernels in {seg['generated']} segments, {report.library_steps} "
              f"ONNX Runtime nodes in {seg['library']} segments; arena {_fmt_bytes(report.arena_peak_bytes)} of "
              f"{_fmt_bytes(report.activation_bytes)} activations "
              f"({report.arena_peak_bytes / max(1, report.activation_bytes):.0%}); plan vs unfused "
              f"{_versus(report, 'plan', 'unfused')}; plan vs ORT ENABLE_EXTENDED "
              f"{_versus(report, 'plan', 'ort_enable_extended')}")
    out.print(f"equal to ONNX Runtime: max rel err {report.max_rel_err:.2g} (unfused {report.unfused_max_rel_err:.2g}), "
              f"rtol {report.rtol:g}")
    _print_torch(report.torch)
    if output is not None:
        out.print(f"timings written to {output}")


def _print_torch(info) -> None:
    """The PyTorch baselines' versions, or why they (or some of them) were not timed."""
    if info is None:
        return
    if isinstance(info, str):
        out.print(f"PyTorch: {info} (install the torch extra to time it beside the plan)")
        return
    out.print(f"PyTorch {info['torch']} on {info['device']}, converted by {info['converter']}")
    if "refused" in info:
        out.print(f"PyTorch not timed: {info['refused']}")
    for name, why in info.get("failed", {}).items():
        out.print(f"{name} not timed: {why}")


# -- regret -----------------------------------------------------------------------------------

@app.command()
def regret(
    model: Annotated[str, typer.Argument(help="path/to/model.onnx or zoo:NAME")],
    device: Annotated[str, typer.Option("--device", help="The CPU device the plans are made for (host or a "
                                        "host profile.json).")] = "host",
    strategy: Strategy = "cpsat",
    input_shape: InputShape = None,
    dim: Dim = None,
    repeat: Annotated[int, typer.Option("--repeat", callback=COUNT, help="Timed runs of each program.")] = 20,
    threads: Threads = 1,
    time_limit: TimeLimit = 60.0,
    seed: Seed = 0,
    json_out: JsonFlag = False,
) -> None:
    """What the cost model's error costs: the plan chosen by predicted costs and the one chosen by
    measured costs, each run end to end on this CPU (interleaved), their difference and its noise."""
    from fusesearch.pipeline import prepare
    from fusesearch.regret import regret as find_regret

    prep = prepare(model, _bindings(input_shape, dim))
    with err.status("planning and running", spinner="dots") if err.is_terminal else _nothing():
        result = find_regret(model, device, strategy, prepared=prep, threads=threads, repeat=repeat, seed=seed,
                             time_limit_s=time_limit)
    doc = result.to_dict()
    if json_out:
        _emit_json(doc)
        return
    table = Table(title=f"{doc['model']} on {doc['device']}, strategy {doc['strategy']}: end to end, "
                        f"{doc['threads']} thread{'s' if doc['threads'] != 1 else ''}, {doc['repeat']} runs",
                  title_justify="left")
    for col in ("costs", "kernels", "groups measured", "plan's own time", "median", "p20-p80"):
        table.add_column(col, justify="left" if col == "costs" else "right")
    for label, p in doc["plans"].items():
        table.add_row(label, str(p["kernels"]), str(p["measured_groups"]), _fmt_time(p["model_s"]),
                      _fmt_time(p["median_s"]), f"{_fmt_time(p['p20_s'])}-{_fmt_time(p['p80_s'])}")
    out.print(table)
    same = " (the same plan)" if doc["same_plan"] else ""
    from fusesearch.backends.timing import Paired

    rounds = f", per round {Paired(**doc['paired']).text(3)}" if doc["paired"] else ""
    out.print(f"regret (predicted - measured): {_fmt_time(doc['regret_s'])} ({doc['regret_ratio']:.3f}x{rounds}), "
              f"noise {_fmt_time(doc['noise_s'])}: {doc['verdict']}{same}")


# -- sweep / report ---------------------------------------------------------------------------

@app.command()
def sweep(
    config: Annotated[Path, typer.Argument(help="the sweep's TOML config (see experiments/*.toml)")],
    workers: Annotated[int | None, typer.Option("--workers", callback=CPUS, help="Local Dask worker processes "
                                                "(default: one per core).")] = None,
    scheduler: Annotated[str | None, typer.Option("--scheduler", help="Address of a running Dask "
                                                  "scheduler, e.g. tcp://HOST:8786.")] = None,
    out_dir: Annotated[Path | None, typer.Option("--out", help="Results folder (default: beside CONFIG, "
                                                 "named after it).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Discard the results of a different sweep in --out.")] = False,
    threads: Annotated[int | None, typer.Option("--threads", callback=CPUS, help="OpenMP threads a CPU device's "
                                                "cells are priced for and run with (default: the config's "
                                                "threads, else 1).")] = None,
    json_out: JsonFlag = False,
) -> None:
    """Run a TOML grid of models × devices × strategies × parameters on Dask; resumable."""
    import dataclasses

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from fusesearch.api import Swept
    from fusesearch.sweep import load_config, run_sweep

    cfg = load_config(config)
    if threads is not None:
        cfg = dataclasses.replace(cfg, threads=threads)
    out_dir = out_dir or config.parent / config.stem
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.fields[last]}"))
    bar = Progress(*columns, console=err, transient=False)
    task = bar.add_task(f"sweep {cfg.name}", total=None, last="")

    def progress(done: int, total: int, row: dict | None) -> None:  # the bar starts once --out is checked
        if row is None:
            bar.start()
        last = "" if row is None else f"{row['model']} {row['device']} {row['strategy']}: {row['status']}"
        bar.update(task, completed=done, total=total, last=last)

    try:
        summary = run_sweep(cfg, out_dir, workers=workers, scheduler=scheduler, force=force, progress=progress)
    finally:
        if bar.live.is_started:
            bar.stop()
    doc = Swept(cfg.name, cfg.threads, summary).to_dict()
    if json_out:
        _emit_json(doc)
    else:
        out.print(f"sweep {cfg.name} ({cfg.threads} thread{'s' if cfg.threads != 1 else ''} on a CPU): "
                  f"{summary.cells} cells ({summary.skipped} already done, {summary.ran} run, "
                  f"{summary.failed} failed) in {summary.wall_s:.1f} s; results in {summary.results}")
        if summary.failed and not summary.all_failed:
            out.print(f"{summary.failed} cells failed (see the error column); run the same command again to retry them")
    if summary.all_failed:
        raise FusesearchError(f"sweep {cfg.name}: every cell failed ({summary.cells}); the first: "
                              f"{summary.first_error}; see the error column of {summary.results}")


@app.command()
def report(
    results_dir: Annotated[Path, typer.Argument(help="the --out folder of a `fusesearch sweep` run")],
    output: Annotated[Path | None, typer.Option("-o", "--output", help="Markdown report (default: "
                                                "DIR/report.md); PNG plots go beside it.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing report and its plots.")] = False,
) -> None:
    """Markdown tables and PNG plots of a sweep's results."""
    from fusesearch.report import rank_correlations, rank_sentence, write_report
    from fusesearch.sweep import load_results

    written = write_report(results_dir, output, overwrite=force)
    out.print(f"report written to {written[0]}" + (f" with {len(written) - 1} plots" if len(written) > 1 else ""))
    ranks = rank_correlations(load_results(results_dir))
    if ranks:  # a sweep run end to end: does the cost model rank plans as the machine does?
        out.print(rank_sentence(ranks))


# -- calibrate --------------------------------------------------------------------------------

@app.command()
def calibrate(
    backend: Annotated[str, typer.Option("--backend", help="cpu (this machine, generated C) or cupy "
                                         "(the visible GPU, generated CUDA)")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Write profile.json here (and "
                                         "measurements.parquet, calibration.png beside it).")],
    device: Annotated[str | None, typer.Option("--device", help="The measured device's name (host on "
                                               "cpu) or a profile of it to start from.")] = None,
    models: Annotated[str | None, typer.Option("--models", help="Comma-separated models (zoo names or "
                                               ".onnx paths; bind dynamic dims with --input-shape/--dim).")] = None,
    input_shape: Annotated[list[str], typer.Option("--input-shape", help="NAME=1x3x224x224, for every "
                                                   "--models model (repeatable)")] = None,
    dim: Annotated[list[str], typer.Option("--dim", help="DIM=V binds a named dynamic dim of every --models "
                                           "model (repeatable)")] = None,
    samples: Annotated[int, typer.Option("--samples", callback=SAMPLES, help="Groups to sample and measure.")] = 240,
    seed: Annotated[int, typer.Option("--seed", callback=SEED, help="Seed of sampling, inputs and the split.")] = 0,
    budget: Annotated[float | None, typer.Option("--budget", callback=SECONDS, help="Timing budget per kernel "
                                                 "and round, seconds.")] = None,
    rounds: Annotated[int | None, typer.Option("--rounds", callback=COUNT, help="Timing rounds per kernel (the "
                                               "quietest round's median counts).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite existing output files.")] = False,
    json_out: JsonFlag = False,
) -> None:
    """Measure sampled candidate kernels, fit the cost model, report held-out accuracy."""
    from rich.progress import Progress

    from fusesearch import calibrate as cal
    from fusesearch.backends.registry import get_backend

    get_backend(backend)
    names = [m.strip().removeprefix("zoo:") for m in (models or "").split(",") if m.strip()] or None
    if models is not None and not names:
        raise BadInput(f"--models {models!r}: names no model; give zoo names or .onnx paths, comma-separated "
                       "(or leave --models out for the default set)")
    model_files = [(m, "model") for m in names or () if m.endswith(".onnx")]  # calibrate's rule: else a zoo name
    check_outputs([(output, "-o"), (output.parent / "measurements.parquet", "-o (beside it)"),
                   (output.parent / "calibration.png", "-o (beside it)")], force,
                  _reads(*model_files, device=device))
    bindings = _bindings(input_shape, dim)
    bar = Progress(console=err, transient=True, disable=not err.is_terminal)  # no bar, no blank line
    tasks: list = []

    def progress(stage: str, done: int, total: int) -> None:  # the bar starts once sampling is done
        if not tasks:
            bar.start()
            tasks.append(bar.add_task(f"{stage} on {backend}", total=total))
        bar.update(tasks[0], completed=done, total=total, description=f"{stage} on {backend}")

    try:
        result = cal.calibrate(backend, device=device, models=names, samples=samples, seed=seed,
                               budget_s=budget, rounds=rounds, bindings=bindings, progress=progress)
    finally:
        if tasks:
            bar.stop()
    with writing(output, "-o"):
        paths = cal.write_outputs(result, output)
    if json_out:
        _emit_json({"profile": str(paths["profile"]), "measurements": str(paths["measurements"]),
                    "plot": str(paths["plot"]), "fit": result.profile.to_dict()["fit"],
                    "params": result.profile.params.to_dict()})
        return
    r = result.report
    out.print(f"calibrated {r['device']} ({backend}): {r['measured']} kernels measured of {r['sampled']} "
              f"sampled from {', '.join(r['models'])}; skipped {r['skipped'] or 'none'}")
    for line in cal.report_lines(r):
        out.print(line)
    out.print(f"profile written to {paths['profile']}; measurements to {paths['measurements']}; "
              f"plot to {paths['plot']}")


# -- devices ----------------------------------------------------------------------------------

@app.command()
def devices(json_out: JsonFlag = False) -> None:
    """The built-in GPU table (and this machine's CPU as `host`)."""
    from costmodels import DEVICES, device_table_rows, host_cpu
    from costmodels.devices import host_cache_path

    if json_out:
        _emit_json({"devices": [spec.to_dict() for spec in list(DEVICES.values()) + [host_cpu()]]})
        return
    host = host_cpu()
    rows = device_table_rows({**DEVICES, "host": host})
    headers = {"name": "name", "arch": "arch", "sms": "SMs", "fp32_tflops": "FP32 TFLOP/s",
               "fp16_tc_tflops": "FP16 TC TFLOP/s", "dram_gb_per_s": "DRAM GB/s", "l2_mib": "L2 MiB",
               "smem_per_block_kib": "smem/block KiB", "launch_us": "launch us"}
    table = Table()
    for col in rows[0]:
        table.add_column(headers.get(col, col), justify="left" if col in ("name", "arch") else "right")
    for r in rows:
        table.add_row(*[f"{v:g}" if isinstance(v, float) else str(v) for v in r.values()])
    out.print(table)
    cache = ("caches " + ", ".join(f"{rate / 1e9:.1f} GB/s at {size / 2**20:g} MiB" for size, rate in host.cache_curve)
             + " (a kernel's bytes read + written)" if host.cache_curve else "no cache faster than DRAM")
    out.print(f"host, measured once on this machine: FP32 {host.fp32_flops_per_s / 1e9:.1f} GFLOP/s, "
              f"DRAM {host.dram_bytes_per_s / 1e9:.1f} GB/s, {cache} (delete {_home_relative(host_cache_path())} to measure again)")


def _home_relative(path: Path) -> str:
    """A path under the user's home folder as '~/...', any other as given."""
    try:
        return str(Path("~") / path.relative_to(Path.home()))
    except ValueError:
        return str(path)


# -- zoo --------------------------------------------------------------------------------------

@zoo_app.command("list")
def zoo_list(json_out: JsonFlag = False) -> None:
    """List the built-in models."""
    from fusesearch import zoo

    rows = [{"name": e.name, "description": e.description, "default_dims": dict(e.default_dims),
             "sizes": [f"--{p.replace('_', '-')}" for p in e.params()]} for e in zoo.list_models()]
    if json_out:
        _emit_json({"models": rows})
        return
    table = Table()
    for col in ("name", "default dims", "description"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["name"], " ".join(f"{k}={v}" for k, v in r["default_dims"].items()), r["description"])
    out.print(table)


def _zoo_size(option: str, what: str):
    return Annotated[int | None, typer.Option(option, callback=COUNT, help=f"{what}; default: the model's "
                                              "(`zoo list --json` names each model's sizes).")]


ZOO_SIZES = ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab", "n_positions", "max_positions",
             "weights")  # the builders' parameters


@zoo_app.command("export")
def zoo_export(
    name: Annotated[str, typer.Argument(help="zoo model name (see `fusesearch zoo list`)")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Where to write the .onnx file.")],
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing file.")] = False,
    layers: _zoo_size("--layers", "Transformer layers") = None,
    hidden: _zoo_size("--hidden", "Hidden size (a multiple of --heads)") = None,
    heads: _zoo_size("--heads", "Attention heads") = None,
    intermediate: _zoo_size("--intermediate", "Feed-forward size (BERT)") = None,
    vocab: _zoo_size("--vocab", "Vocabulary size") = None,
    n_positions: _zoo_size("--n-positions", "Positions of the position embedding (GPT-2)") = None,
    kv_heads: _zoo_size("--kv-heads", "Key/value heads of grouped-query attention (LLaMA)") = None,
    max_positions: _zoo_size("--max-positions", "Positions of the rotary tables (LLaMA)") = None,
    weights: Annotated[int | None, typer.Option("--weights", callback=_checked(
        lambda v: None if v in (None, 0, 1) else "0 (shapes only) or 1 (drawn)"),
        help="LLaMA: 1 draws the weights, 0 keeps them as shaped inputs; default: drawn up to 64M values")] = None,
) -> None:
    """Write a zoo model (dynamic dims kept) to an .onnx file, at its builder's sizes or those given."""
    from fusesearch import zoo

    check_output_path(output, force, "-o")
    name = name.removeprefix("zoo:")
    given = dict(zip(ZOO_SIZES, (layers, hidden, heads, kv_heads, intermediate, vocab, n_positions, max_positions,
                                 weights), strict=True))
    sizes = {k: v for k, v in given.items() if v is not None}
    if name in zoo.ZOO:
        takes = zoo.ZOO[name].params()
        for k, v in sizes.items():
            if k not in takes:
                options = ", ".join(f"--{p.replace('_', '-')}" for p in takes) or "none"
                raise BadInput(f"--{k.replace('_', '-')} {v}: zoo model {name} has no such size; its sizes: {options}")
    proto = zoo.build_model(name, **sizes)
    with writing(output, "-o"):
        output.write_bytes(proto.SerializeToString())
    err.print(f"wrote {output} ({len(proto.graph.node)} nodes, {_fmt_bytes(output.stat().st_size)})")


# -- entry point ------------------------------------------------------------------------------

class _HeldWarnings(logging.Handler):
    """Warnings (a kept opset, an op that stays opaque) wait until the command ends: printed to
    stderr after a command that succeeds, dropped after one that fails (its error is one line,
    which names what is wrong and the fix); other records pass at once."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        self.held: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING:
            self.held.append(record)
        else:
            print(self.format(record), file=sys.stderr)

    def end(self, succeeded: bool) -> None:
        held, self.held = self.held, []
        for line in dict.fromkeys(self.format(record) for record in held) if succeeded else ():  # each once
            print(line, file=sys.stderr)


_HELD = _HeldWarnings()


STDOUT_CLOSED = 141  # 128 + SIGPIPE, as shells report a writer whose reader closed the pipe


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=os.environ.get("FUSESEARCH_LOG", "WARNING").upper(), handlers=[_HELD])
    code = _main(argv)
    _HELD.end(succeeded=code == 0)
    return code


def _main(argv: list[str] | None) -> int:
    try:
        code = app(args=argv, prog_name="fusesearch", standalone_mode=False)
        if code == INTERRUPTED:  # typer turns Ctrl-C in a command into Exit(130), returned here
            return interrupted()
        if isinstance(code, int):  # click returns Exit's code instead of raising it here
            return code
    except FusesearchError as exc:
        print(f"fusesearch: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except click_errors.NoArgsIsHelpError:  # typer already printed the help
        return 2
    except click_errors.UsageError as exc:
        cmd = exc.ctx.command_path if exc.ctx else "fusesearch"
        print(f"fusesearch: error: {exc.format_message()} (see `{cmd} --help`)", file=sys.stderr)
        return 2
    except typer.Exit as exc:
        return exc.exit_code
    except typer.Abort:
        print("fusesearch: aborted", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return interrupted()
    except StdoutClosed:  # nothing more to say, to anyone
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the interpreter's last flush
        return STDOUT_CLOSED
    except Exception as exc:  # an internal error: one line, the traceback only on request
        from costmodels.errors import CacheFolderError

        if isinstance(exc, CacheFolderError):  # $FUSESEARCH_CACHE, met wherever a cache is first used
            print(f"fusesearch: error: {exc}", file=sys.stderr)
            return BadInput.exit_code
        if os.environ.get("FUSESEARCH_DEBUG"):
            raise
        first = str(exc).splitlines()[0] if str(exc) else ""
        print(f"fusesearch: internal error: {type(exc).__name__}: {first} "
              "(set FUSESEARCH_DEBUG=1 for the traceback and report it)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    from fusesearch.__main__ import entry

    entry()
