"""ONNX Runtime as the numerical oracle: valid random inputs, runs, and output comparison.

Problem: a rewrite (canonicalization, a fused model) is only trusted once ONNX Runtime gives the
same outputs before and after, on inputs the model accepts.
Approach: `random_feeds` draws seeded inputs that are valid for the model — integer inputs that
index a Gather get ids below that table's row count, inputs named like a mask get ones, floats
are standard normal; `run` executes with every graph optimization off (so ORT's own fusions
cannot hide a difference); `compare` reports, per output, the largest absolute and relative
error and whether |a - b| <= atol + rtol * max(1, max|a|).
Invariants: the same model and seed give the same feeds; onnxruntime is imported here only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

MASK_WORDS = ("mask",)


@dataclass(frozen=True)
class OutputDiff:
    name: str
    max_abs: float
    max_rel: float
    scale: float  # max(1, max|reference|)
    ok: bool


def _shape(vi: onnx.ValueInfoProto) -> tuple[int, ...]:
    dims = vi.type.tensor_type.shape.dim
    shape = tuple(d.dim_value for d in dims)
    if any(d <= 0 for d in shape) and shape:
        raise ValueError(f"input '{vi.name}' has a dynamic shape; bind it first")
    return shape


def _gather_rows(model: onnx.ModelProto) -> dict[str, int]:
    """Graph input name → row count of the table it indexes through Gather (axis 0)."""
    dims = {t.name: tuple(t.dims) for t in model.graph.initializer}
    rows: dict[str, int] = {}
    for node in model.graph.node:
        if node.op_type == "Gather" and len(node.input) == 2 and node.input[0] in dims:
            axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
            table = dims[node.input[0]]
            if table:
                rows[node.input[1]] = min(rows.get(node.input[1], 1 << 62), table[axis])
    return rows


def random_feeds(model: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    weights = {t.name for t in model.graph.initializer}
    rows = _gather_rows(model)
    feeds = {}
    for vi in model.graph.input:
        if vi.name in weights:
            continue
        dtype = onnx.helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
        shape = _shape(vi)
        if any(w in vi.name.lower() for w in MASK_WORDS):
            feeds[vi.name] = np.ones(shape, dtype=dtype)
        elif np.issubdtype(dtype, np.integer):
            feeds[vi.name] = rng.integers(0, rows.get(vi.name, 2), size=shape).astype(dtype)
        elif dtype == np.bool_:
            feeds[vi.name] = rng.integers(0, 2, size=shape).astype(bool)
        else:
            feeds[vi.name] = rng.standard_normal(shape).astype(dtype)
    return feeds


def session(model: onnx.ModelProto | str):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.log_severity_level = 3
    source = model if isinstance(model, str) else model.SerializeToString()
    return ort.InferenceSession(source, opts, providers=["CPUExecutionProvider"])


def run(model: onnx.ModelProto | str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    sess = session(model)
    names = [o.name for o in sess.get_outputs()]
    wanted = {i.name for i in sess.get_inputs()}
    return dict(zip(names, sess.run(names, {k: v for k, v in feeds.items() if k in wanted}), strict=True))


def compare(reference: dict[str, np.ndarray], candidate: dict[str, np.ndarray],
            rtol: float = 1e-4, atol: float = 0.0) -> list[OutputDiff]:
    diffs = []
    for name, ref in reference.items():
        if name not in candidate:
            diffs.append(OutputDiff(name, float("inf"), float("inf"), 1.0, False))
            continue
        a, b = np.asarray(ref, dtype=np.float64), np.asarray(candidate[name], dtype=np.float64)
        if a.shape != b.shape:
            diffs.append(OutputDiff(name, float("inf"), float("inf"), 1.0, False))
            continue
        scale = max(1.0, float(np.max(np.abs(a)))) if a.size else 1.0
        err = np.abs(a - b)
        max_abs = float(np.max(err)) if a.size else 0.0
        max_rel = float(np.max(err / np.maximum(np.abs(a), 1e-12))) if a.size else 0.0
        same_nan = bool(np.array_equal(np.isnan(a), np.isnan(b)))
        finite = np.nan_to_num(err, nan=0.0)
        ok = same_nan and bool(np.all(finite <= atol + rtol * scale))
        diffs.append(OutputDiff(name, max_abs, max_rel, scale, ok))
    return diffs


def all_values(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every tensor of the main graph on these inputs: ONNX Runtime's outputs for all values
    (listed in value_info) plus the initializers — the reference for each kernel's inputs and
    outputs."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    known = {o.name for o in probe.graph.output}
    produced = {t for n in probe.graph.node for t in n.output if t}
    for vi in model.graph.value_info:
        if vi.name in produced and vi.name not in known:
            probe.graph.output.append(vi)
            known.add(vi.name)
    values = run(probe, feeds)
    for t in model.graph.initializer:
        values[t.name] = onnx.numpy_helper.to_array(t)
    values.update(feeds)
    return values


def timing_session(model: onnx.ModelProto, *, threads: int, optimize: bool):
    """A CPU session for timing: `threads` intra-op threads (one inter-op), graph optimizations
    at ORT_ENABLE_ALL (`optimize`) or ORT_DISABLE_ALL."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    level = ort.GraphOptimizationLevel
    opts.graph_optimization_level = level.ORT_ENABLE_ALL if optimize else level.ORT_DISABLE_ALL
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
