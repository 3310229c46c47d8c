"""`fusesearch` command line (the stable contract of DESIGN.md, "Command line").

Problem: scripts and people both drive the tool; scripts need `--json` documents and exit codes,
people need readable tables, and nobody wants a traceback for a typo.
Approach: typer commands that call the library and render with rich; `main()` runs the app in
non-standalone mode and maps every failure to one line on stderr:
  exit 0 ok · exit 1 internal error · exit 2 bad usage or bad input (with the fix).
Invariants: with `--json`, stdout carries exactly one JSON document; logs go to stderr. No file the
user has is overwritten unless they pass `--force`.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from fusesearch.errors import BadInput, FusesearchError

try:  # typer >= 0.20 vendors click
    from typer._click import exceptions as click_errors
except ImportError:  # pragma: no cover
    from click import exceptions as click_errors

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Find the best way to fuse an ONNX graph's operators into GPU kernels.")
zoo_app = typer.Typer(no_args_is_help=True, help="Built-in models (zoo:NAME).")
app.add_typer(zoo_app, name="zoo")

out = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 140)
err = Console(stderr=True, highlight=False)

InputShape = Annotated[list[str], typer.Option("--input-shape", help="NAME=1x3x224x224 (repeatable)")]
Dim = Annotated[list[str], typer.Option("--dim", help="DIM=V binds a named dynamic dim (repeatable)")]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")]


def _bindings(input_shape: list[str] | None, dim: list[str] | None):
    from fusesearch.ir.shapes import ShapeBindings

    return ShapeBindings.parse(input_shape or [], dim or [])


def _emit_json(doc: dict) -> None:
    sys.stdout.write(json.dumps(doc, indent=2, sort_keys=False) + "\n")


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
    prep = prepare(model, _bindings(input_shape, dim))
    summary = summarize(prep)
    if devices:
        summary["devices"] = [_figures(prep.graph, name, spec, params) for name, spec, params in devices]
    if canonical is not None:
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


# -- devices ----------------------------------------------------------------------------------

@app.command()
def devices(json_out: JsonFlag = False) -> None:
    """The built-in GPU table (and this machine's CPU as `host`)."""
    from costmodels import DEVICES, device_table_rows, host_cpu

    if json_out:
        _emit_json({"devices": [spec.to_dict() for spec in list(DEVICES.values()) + [host_cpu()]]})
        return
    rows = device_table_rows({**DEVICES, "host": host_cpu()})
    headers = {"name": "name", "arch": "arch", "sms": "SMs", "fp32_tflops": "FP32 TFLOP/s",
               "fp16_tc_tflops": "FP16 TC TFLOP/s", "dram_gb_per_s": "DRAM GB/s", "l2_mib": "L2 MiB",
               "smem_per_block_kib": "smem/block KiB", "launch_us": "launch us"}
    table = Table()
    for col in rows[0]:
        table.add_column(headers.get(col, col), justify="left" if col in ("name", "arch") else "right")
    for r in rows:
        table.add_row(*[f"{v:g}" if isinstance(v, float) else str(v) for v in r.values()])
    out.print(table)


# -- zoo --------------------------------------------------------------------------------------

@zoo_app.command("list")
def zoo_list(json_out: JsonFlag = False) -> None:
    """List the built-in models."""
    from fusesearch import zoo

    rows = [{"name": e.name, "description": e.description, "default_dims": dict(e.default_dims)}
            for e in zoo.list_models()]
    if json_out:
        _emit_json({"models": rows})
        return
    table = Table()
    for col in ("name", "default dims", "description"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["name"], " ".join(f"{k}={v}" for k, v in r["default_dims"].items()), r["description"])
    out.print(table)


@zoo_app.command("export")
def zoo_export(
    name: Annotated[str, typer.Argument(help="zoo model name (see `fusesearch zoo list`)")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Where to write the .onnx file.")],
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing file.")] = False,
) -> None:
    """Write a zoo model (dynamic dims kept) to an .onnx file."""
    from fusesearch import zoo

    if output.exists() and not force:
        raise BadInput(f"-o {output}: file exists; remove it or pass --force to overwrite")
    if not output.parent.exists():
        raise BadInput(f"-o {output}: folder {output.parent} does not exist; create it first")
    proto = zoo.build_model(name.removeprefix("zoo:"))
    output.write_bytes(proto.SerializeToString())
    err.print(f"wrote {output} ({len(proto.graph.node)} nodes, {_fmt_bytes(output.stat().st_size)})")


# -- entry point ------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=os.environ.get("FUSESEARCH_LOG", "WARNING").upper(),
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        app(args=argv, prog_name="fusesearch", standalone_mode=False)
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
        return 130
    except Exception as exc:  # an internal error: one line, the traceback only on request
        if os.environ.get("FUSESEARCH_DEBUG"):
            raise
        first = str(exc).splitlines()[0] if str(exc) else ""
        print(f"fusesearch: internal error: {type(exc).__name__}: {first} "
              "(set FUSESEARCH_DEBUG=1 for the traceback and report it)", file=sys.stderr)
        return 1
    return 0


def _entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    _entry()
