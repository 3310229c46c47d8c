"""The front of the pipeline: MODEL + shape flags → loaded, canonical model → Graph → summary.

Problem: every command (inspect, plan, compare, measure, ...) starts the same way and must report
the same figures.
Approach: `prepare()` runs load → canonicalize → (a check that the canonical model computes at the
bound dims, `ir.shapes.check_static_model`) → (with `dtype` float16/bfloat16: the half
conversion of `ir.precision`, on the canonical model) → Graph once and keeps each stage's result
(and, for verification, the loaded model serialized before canonicalization rewrites it in place,
or for a half model the converted one: the reference is the model the plan is for);
`summarize()` turns a `Prepared` into the JSON document `fusesearch inspect --json` prints.
Invariants: `prepare` never writes files and refuses a graph with no node left to fuse; the summary is deterministic (sorted keys, stable order).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import onnx
import onnx_ir as ir

from fusesearch.errors import UnsupportedModel
from fusesearch.ir._from_ir import graph_from_ir
from fusesearch.ir.canonicalize import canonicalize, lowest_ir_version, to_proto
from fusesearch.ir.graph import Graph
from fusesearch.ir.load import LoadedModel, load_model
from fusesearch.ir.op_kind import node_flops
from fusesearch.ir.shapes import ShapeBindings, check_static_model

log = logging.getLogger(__name__)

LARGE_MODEL_BYTES = 1 << 30  # above this --canonical writes weights to an external data file


@dataclass(frozen=True)
class Prepared:
    loaded: LoadedModel
    canonical: ir.Model
    passes: dict[str, int]
    graph: Graph
    original: onnx.ModelProto | None = None  # the loaded model before canonicalization (keep_original)
    dtype: str = "float32"  # the precision the model was converted to (--dtype)


def prepare(model: str, bindings: ShapeBindings | None = None, *, keep_original: bool = False,
            dtype: str | None = None, tf32: bool = True) -> Prepared:
    """`keep_original`: also keep the loaded model as a proto, the reference `verify` runs (the
    file on disk may be gone or overwritten by then, and may carry an IR version ONNX Runtime
    does not read). `dtype`: float16 / bfloat16 converts the canonical model (`--dtype`); the
    reference is then the converted model. `tf32`: float32 GEMMs and convs may use TF32 tensor
    cores (`Graph.allow_tf32`; False is `--no-tf32`)."""
    from fusesearch.ir.precision import check_dtype, to_half

    dtype = check_dtype(dtype)
    loaded = load_model(model, bindings)
    original = to_proto(loaded.model) if keep_original and dtype == "float32" else None
    canonical, passes = canonicalize(loaded.model)
    check_static_model(canonical, model, loaded.bindings)
    if dtype != "float32":
        converted, casts = to_half(to_proto(canonical), dtype)
        canonical = ir.serde.deserialize_model(converted)
        passes = {**passes, f"{dtype}_casts": casts}
        original = converted if keep_original else None
    graph = graph_from_ir(canonical)
    if not tf32:
        graph = replace(graph, allow_tf32=False)
    if not graph.nodes:
        raise UnsupportedModel(f"{model}: the graph has no nodes (every output is an input or a constant); "
                               "there is nothing to fuse: give a model that computes something")
    return Prepared(loaded, canonical, passes, graph, original, dtype)


def summarize(prep: Prepared) -> dict:
    g = prep.graph
    ops = Counter(n.op_type for n in g.nodes)
    kinds = Counter(n.kind.name.lower() for n in g.nodes)
    return {
        "model": prep.loaded.name,
        "source": prep.loaded.source,
        "sha256": prep.loaded.sha256,
        "opset": prep.loaded.opset,
        "canonical_opset": prep.canonical.opset_imports.get("", prep.loaded.opset),
        "nodes": prep.loaded.nodes,
        "canonical_nodes": len(g.nodes),
        "ops": dict(sorted(ops.items(), key=lambda kv: (-kv[1], kv[0]))),
        "kinds": dict(sorted(kinds.items())),
        "flops": graph_flops(g),
        "weight_bytes": weight_bytes(g),
        "activation_bytes": activation_bytes(g),
        "inputs": [_io(g, t) for t in g.inputs],
        "outputs": [_io(g, t) for t in g.outputs],
        "passes": dict(sorted(prep.passes.items())),
        "bindings": prep.loaded.bindings.to_flags(),
    }


def _io(g: Graph, name: str) -> dict:
    info = g.tensors[name]
    return {"name": name, "shape": list(info.shape) if info.shape is not None else None, "dtype": info.dtype}


def graph_flops(g: Graph) -> int:
    return sum(node_flops(n.op_type, n.attrs, g.node_inputs(n), g.node_outputs(n)) for n in g.nodes)


def weight_bytes(g: Graph) -> int:
    used = {t for n in g.nodes for t in n.inputs if t}
    return sum(info.nbytes for name, info in g.tensors.items() if info.constant and name in used)


def activation_bytes(g: Graph) -> int:
    produced = {t for n in g.nodes for t in n.outputs if t}
    return sum(g.tensors[t].nbytes for t in produced)


def write_canonical(prep: Prepared, path: str | Path, *, overwrite: bool = False) -> Path:
    """Write the canonical model (weights external above 1 GiB) and return the path."""
    from fusesearch.errors import check_output_path
    from fusesearch.export import save_model

    path = Path(path)
    if weight_bytes(prep.graph) <= LARGE_MODEL_BYTES:
        return save_model(to_proto(prep.canonical), path, overwrite=overwrite, flag="--canonical")
    check_output_path(path, overwrite, "--canonical")  # weights stream from the IR, never one proto
    data = path.with_name(path.name + ".data")
    check_output_path(data, overwrite, "--canonical (its weights)")
    prep.canonical.ir_version = lowest_ir_version(prep.canonical)
    ir.save(prep.canonical, path, external_data=data.name)
    return path
