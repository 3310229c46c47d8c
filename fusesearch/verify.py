"""ONNX Runtime as the numerical oracle: valid inputs, runs, and output comparison.

Problem: a rewrite is trusted only once ONNX Runtime gives the same outputs before and after on
inputs the model accepts, without comparing a model with itself, crashing, or flooding logs.
Approach: `random_feeds` draws seeded valid inputs (Gather indices within range, masks of ones),
overridden by `--input-value` (`parse_input_values`); `run` executes an in-memory model with every
ORT optimization off (bfloat16 through `ir.precision.widened`). A verification checks memory
(`check_memory`), runs the reference (`reference_outputs`: a failure is the user's, exit 2), then
the candidate (`candidate_outputs`); `compare` reports per output the largest errors and whether
|a - b| <= atol + rtol * max(1, max finite |a|) (`ir.precision.prepared_tolerance`), NaN equal to
NaN (`difference`, the one element comparison of verify, run and measure).
Invariants: same model, seed and values give the same feeds; onnxruntime is imported only here
(`_ort`, logger silenced, errors as one line); external and >2 GiB weights reach ONNX Runtime
beside the proto, never through a path it resolves itself."""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx

from fusesearch.errors import BadInput
from fusesearch.ir.graph import Graph

MASK_WORDS = ("mask",)
ORT_LOG_SEVERITY = 4  # fatal only: ONNX Runtime's errors come back as exceptions, never as log lines
PROTO_LIMIT = (1 << 31) - (1 << 24)  # larger models pass their big weights beside the serialized proto
ASIDE_MIN_BYTES = 1 << 10  # weights at least this large go beside the proto then


# what ONNX Runtime's Python API hands back as numpy arrays (not float8, int4, strings; bfloat16
# through `session`'s widened copy, as ml_dtypes arrays)
REFERENCE_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64",
                              "uint8", "uint16", "uint32", "uint64", "bool"})


@dataclass(frozen=True)
class OutputDiff:
    name: str
    max_abs: float
    max_rel: float
    scale: float  # max(1, max finite |reference|)
    ok: bool
    why: str = ""  # an output that cannot be compared: "missing", or its shape and the expected one


class CandidateFailed(Exception):
    """ONNX Runtime cannot load or run the model under test; the caller says whose fault it is."""


# -- inputs -----------------------------------------------------------------------------------

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


def check_reference_dtypes(graph: Graph, label: str, plan, task: str) -> None:
    """BadInput naming the group, node, op and dtype when a tensor has a dtype ONNX Runtime cannot
    hand back to numpy (a string, a float8): no reference value, so nothing to run a kernel on or
    check it against (`task`: the command, "measure" or "run"). A tensor of unknown dtype (the
    output of an op shape inference does not know) is left to ONNX Runtime, which names the op
    when it has no kernel for it either."""
    for g in plan.groups:
        for node in (graph.nodes[i] for i in g.nodes):
            for t in (*node.inputs, *node.outputs):
                info = graph.tensors.get(t) if t else None
                if info is not None and info.dtype not in REFERENCE_DTYPES and info.dtype != "unknown":
                    dtype = "dtype string" if info.dtype == "object" else f"dtype {info.dtype}"
                    raise BadInput(f"{label} group g{g.id}: node '{node.name}' ({node.op_type}) "
                                   f"{'reads' if t in node.inputs else 'makes'} '{t}' of {dtype}, which ONNX "
                                   f"Runtime cannot hand back to numpy as a reference; {task} cannot execute "
                                   "this model")


def random_feeds(model: onnx.ModelProto, seed: int = 0,
                 values: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Seeded valid inputs for every graph input; `values` (from `parse_input_values`) replace
    the drawn ones."""
    rng = np.random.default_rng(seed)
    weights = {t.name for t in model.graph.initializer}
    rows = _gather_rows(model)
    feeds = {}
    for vi in model.graph.input:
        if vi.name in weights:
            continue
        if vi.type.WhichOneof("value") != "tensor_type":
            raise BadInput(f"input '{vi.name}' is a {vi.type.WhichOneof('value').removesuffix('_type')}, not a tensor: "
                           "ONNX Runtime is run here on tensor inputs only; give a model whose inputs are tensors")
        dtype = onnx.helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
        shape = _shape(vi)
        if any(w in vi.name.lower() for w in MASK_WORDS):
            feeds[vi.name] = np.ones(shape, dtype=dtype)
        elif np.issubdtype(dtype, np.integer):
            feeds[vi.name] = rng.integers(0, rows.get(vi.name, 2), size=shape).astype(dtype)
        elif dtype == np.bool_:
            feeds[vi.name] = rng.integers(0, 2, size=shape).astype(bool)
        elif dtype == np.object_:  # strings
            feeds[vi.name] = np.array(rng.choice(["a", "b", "c"], size=shape), dtype=object)
        else:
            feeds[vi.name] = rng.standard_normal(shape).astype(dtype)
    if values:
        feeds.update({k: v for k, v in values.items() if k in feeds})
    return feeds


def parse_input_values(flags: Sequence[str], graph: Graph) -> dict[str, np.ndarray]:
    """`--input-value NAME=V` flags → arrays of each input's dtype and shape (a scalar like
    `sr=16000`, or a JSON list like `x=[1,2,3]` with as many values as the input holds).
    BadInput naming the flag for a malformed value, an unknown input, a wrong dtype or size."""
    values: dict[str, np.ndarray] = {}
    for flag in flags:
        name, sep, text = flag.partition("=")
        name, text = name.strip(), text.strip()
        where = f"--input-value {flag}"
        if not sep or not name or not text:
            raise BadInput(f"{where}: give NAME=VALUE, e.g. --input-value sr=16000 or --input-value x=[1,2,3]")
        if name not in graph.inputs:
            raise BadInput(f"{where}: the model has no input '{name}'; its inputs are "
                           f"{', '.join(graph.inputs) or 'none'}")
        if name in values:
            raise BadInput(f"{where}: input '{name}' is given twice; give each input once")
        info = graph.tensors[name]
        array = _parse_value(where, name, text, info.dtype)
        shape = tuple(info.shape or ())
        want = int(np.prod(shape, dtype=np.int64))
        if array.size != want:
            holds = "is a scalar (1 value)" if not shape else f"has shape {'x'.join(map(str, shape))} ({want} values)"
            raise BadInput(f"{where}: {array.size} value{'s' if array.size != 1 else ''}, but input '{name}' {holds}")
        values[name] = array.reshape(shape)
    return values


def _parse_value(where: str, name: str, text: str, dtype: str) -> np.ndarray:
    if dtype in ("string", "object"):  # a string input
        try:
            raw = json.loads(text)
        except json.JSONDecodeError:
            raw = text
        return np.array(raw, dtype=object)
    try:
        array = np.array(json.loads(text))
    except (json.JSONDecodeError, ValueError):
        array = np.array([], dtype=object)
    if array.dtype.kind not in "biuf":
        raise BadInput(f"{where}: not a number or a [list] of numbers (e.g. 16000, 0.5, [1,2,3])")
    try:
        target = np.dtype(dtype)
    except TypeError:
        raise BadInput(f"{where}: input '{name}' is {dtype}, which --input-value cannot give; "
                       "give values of numeric, bool or string inputs only") from None
    if target.kind in "iub" and array.dtype.kind == "f" and not np.all(np.equal(np.mod(array, 1), 0)):
        raise BadInput(f"{where}: input '{name}' is {dtype}; give whole numbers")
    if target.kind in "iu":
        info = np.iinfo(target)
        if array.size and (array.min() < info.min or array.max() > info.max):
            raise BadInput(f"{where}: out of range for input '{name}' ({dtype}: {info.min}..{info.max})")
    if target.kind == "b" and not np.all(np.isin(array, (0, 1))):
        raise BadInput(f"{where}: input '{name}' is bool; give 0/1 or false/true")
    return array.astype(target)


# -- running ----------------------------------------------------------------------------------

@functools.cache
def _ort():
    import onnxruntime as ort

    ort.set_default_logger_severity(ORT_LOG_SEVERITY)
    return ort


@functools.cache
def ort_errors() -> tuple[type[BaseException], ...]:
    """What ONNX Runtime raises for a model it cannot load or a feed it cannot run."""
    from onnxruntime.capi import onnxruntime_pybind11_state as state

    _ort()
    found = [v for v in vars(state).values() if isinstance(v, type) and issubclass(v, Exception)]
    return (*found, RuntimeError, ValueError, TypeError)


def runnable_ir_version(model: onnx.ModelProto) -> int:
    """The lowest IR version the model's opsets allow (never above its own): ONNX Runtime lags
    onnx's newest IR version, and a model loaded in memory does not need it."""
    from fusesearch.ir.canonicalize import ir_version_for

    lowest = ir_version_for({o.domain: o.version for o in model.opset_import}, bool(model.functions))
    return min(model.ir_version, lowest) if model.ir_version else lowest


def omp_threads() -> int:
    """OMP_NUM_THREADS when set (the thread count of the generated CPU kernels), else 0: ONNX
    Runtime's default, one thread per physical core."""
    value = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(value) if value.isdigit() else 0


# ONNX Runtime's intra-op threads spin while waiting for work, inside a Run and after it; with
# several threads, a pool spinning after its Run takes the cores from the program timed next in
# the same round (the OpenMP kernels: `probes.OPENMP_WAIT`). Every session stops spinning as its Run
# returns (it still spins between the parallel sections inside one Run, so its time is its own).
NO_SPINNING_AFTER_RUN = {"session.force_spinning_stop": "1"}


ORT_LEVELS = {"none": "ORT_DISABLE_ALL", "extended": "ORT_ENABLE_EXTENDED", "all": "ORT_ENABLE_ALL"}


def session(model: onnx.ModelProto | str, *, threads: int | None = None, optimize: bool | str = False,
            providers: list | None = None):
    """A CPU session of `model` (a path is read into memory first) with graph optimizations off
    (`optimize`: True or "all" ORT_ENABLE_ALL, ONNX Runtime as users run it, for timing it;
    "extended" ORT_ENABLE_EXTENDED, its fusions without the layout transformer: `ORT_LEVELS`) and `threads`
    intra-op threads (default: the generated kernels' OpenMP thread count, `omp_threads`), whose
    threads stop spinning when a Run returns (`NO_SPINNING_AFTER_RUN`); `providers`: ONNX
    Runtime's execution providers instead (the CUDA program's)."""
    from fusesearch.ir.precision import model_dtype, widened

    ort = _ort()
    if not isinstance(model, onnx.ModelProto):
        model = onnx.load(str(model))
    back: dict[str, np.dtype] = {}
    if model_dtype(model) == "bfloat16":  # ONNX Runtime's CPU provider has almost no bfloat16 kernels
        model, back = widened(model)
    opts = ort.SessionOptions()
    level = ort.GraphOptimizationLevel
    name = "all" if optimize is True else "none" if optimize is False else optimize
    opts.graph_optimization_level = getattr(level, ORT_LEVELS[name])
    opts.log_severity_level = ORT_LOG_SEVERITY
    opts.intra_op_num_threads = omp_threads() if threads is None else threads
    for key, value in NO_SPINNING_AFTER_RUN.items():
        opts.add_session_config_entry(key, value)
    aside: list[np.ndarray] = []
    model = _weights_aside(model, opts, aside)
    saved = model.ir_version
    model.ir_version = runnable_ir_version(model)
    try:
        data = model.SerializeToString()
    finally:
        model.ir_version = saved
    sess = ort.InferenceSession(data, opts, providers=providers or ["CPUExecutionProvider"])
    sess.fusesearch_weights = aside  # ONNX Runtime reads them in place: they live as long as the session
    sess.fusesearch_dtypes = back  # outputs handed back in the model's own dtype (bfloat16)
    return sess


def _weights_aside(model: onnx.ModelProto, opts, arrays: list[np.ndarray]) -> onnx.ModelProto:
    """`model`, or a copy of it whose main-graph weights ONNX Runtime takes from `opts` instead of
    the proto: every weight in a data file, memory-mapped (not copied; ONNX Runtime would resolve
    a relative location against the working folder and refuses an absolute one: `to_proto` names
    a mapped weight's file absolutely), and above protobuf's 2 GiB the large ones the proto holds
    (it cannot serialize them); `arrays` keeps their memory as long as the session."""
    from fusesearch.ir.canonicalize import data_file, weight_array

    ort = _ort()
    big = model.ByteSize() > PROTO_LIMIT
    picked = [i for i, t in enumerate(model.graph.initializer)
              if data_file(t) or (big and t.data_location != onnx.TensorProto.EXTERNAL
                                   and len(t.raw_data) >= ASIDE_MIN_BYTES)]
    if not picked:
        return model
    slim = onnx.ModelProto()
    slim.CopyFrom(model)
    names, values = [], []
    for t in (slim.graph.initializer[i] for i in picked):
        names.append(t.name)
        arrays.append(weight_array(t))
        values.append(ort.OrtValue.ortvalue_from_numpy(arrays[-1]))
        t.ClearField("raw_data")
        t.data_location = onnx.TensorProto.EXTERNAL
        del t.external_data[:]
        t.external_data.add(key="location", value="in-memory")
    opts.add_external_initializers(names, values)
    return slim


def session_feeds(sess, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The feeds a session reads, bfloat16 ones widened to float32 for a widened model."""
    wanted = {i.name: i.type for i in sess.get_inputs()}
    return {k: (v.astype(np.float32) if wanted[k] == "tensor(float)" and v.dtype.name == "bfloat16" else v)
            for k, v in feeds.items() if k in wanted}


def _run_session(sess, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    names = [o.name for o in sess.get_outputs()]
    back = getattr(sess, "fusesearch_dtypes", {})
    got = sess.run(names, session_feeds(sess, feeds))
    return {n: (v.astype(back[n]) if n in back else v) for n, v in zip(names, got, strict=True)}


def run(model: onnx.ModelProto | str, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return _run_session(session(model), feeds)


def _first_line(exc: BaseException) -> str:
    """ONNX Runtime's error in one short line: the innermost node and its status message."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    text = re.sub(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ", "", text)
    nodes = re.findall(r"running (\w+) node\. Name:'([^']*)' Status Message: ", text)
    if nodes:
        op, name = nodes[-1]
        text = f"{op} node '{name}': {text.rsplit('Status Message: ', 1)[-1]}"
    return text if len(text) <= 300 else text[:297] + "..."


# -- verification -----------------------------------------------------------------------------

def available_memory() -> int | None:
    """Bytes of memory this machine can still give (None when unknown)."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        import os

        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(graph: Graph, hint: str, task: str = "verify") -> None:
    """Refuse (exit 2) to run the model in ONNX Runtime (to verify or measure it) when its tensors
    cannot fit in the available memory, before anything is allocated: every activation of the
    graph plus its weights; `hint` says what to do instead."""
    from fusesearch.pipeline import activation_bytes, weight_bytes

    need = activation_bytes(graph) + weight_bytes(graph)
    have = available_memory()
    if have is not None and need > have:
        raise BadInput(f"cannot {task}: running the model in ONNX Runtime needs {need / (1 << 30):.1f} GiB "
                       f"(activations and weights), this machine has {have / (1 << 30):.1f} GiB available; "
                       f"{hint}")


def _no_kernel(model: onnx.ModelProto) -> str | None:
    """'op X (domain D) at node N' for the first main-graph node ONNX Runtime has no schema for."""
    from onnxruntime.capi import onnxruntime_pybind11_state as state

    known = {(s.domain, s.name) for s in state.get_all_operator_schema()}
    known |= {(f.domain, f.name) for f in model.functions}
    for node in model.graph.node:
        domain = "" if node.domain == "ai.onnx" else node.domain
        if (domain, node.op_type) not in known:
            return f"op {node.op_type} (domain {domain or 'ai.onnx'}) at node {node.name or '(unnamed)'}"
    return None


def reference_outputs(reference: onnx.ModelProto, feeds: Mapping[str, np.ndarray], *, given: Sequence[str],
                      skip: str | None) -> dict[str, np.ndarray]:
    """The original model's outputs; BadInput (one line, ending in the hint `skip` when given)
    when ONNX Runtime cannot load it or it fails on these inputs (`given`: the inputs the user
    set)."""
    try:
        sess = session(reference)
    except ort_errors() as exc:
        raise BadInput(f"cannot verify: {_cannot_load(reference, exc)}" + (f"; {skip}" if skip else "")) from None
    return _run_original(sess, feeds, given, skip, "cannot verify: the original model itself")


def _cannot_load(model: onnx.ModelProto, exc: BaseException) -> str:
    """Why ONNX Runtime refuses the model, naming the op (and node) it has no kernel for."""
    missing = _no_kernel(model)
    typed = re.search(r"Could not find an implementation for (\w+)\((\d+)\) node with name '([^']*)'", str(exc))
    if missing:
        return f"ONNX Runtime has no kernel for {missing}"
    if typed:
        op, version, name = typed.groups()
        return (f"ONNX Runtime has no CPU kernel for op {op} (opset {version}) at node {name or '(unnamed)'} "
                "for its input types")
    return f"ONNX Runtime cannot load the original model ({_first_line(exc)})"


def _run_original(sess, feeds: Mapping[str, np.ndarray], given: Sequence[str], skip: str | None,
                  subject: str) -> dict:
    try:
        return _run_session(sess, feeds)
    except ort_errors() as exc:
        inputs = "the --input-value values and generated ones" if given else "generated inputs"
        raise BadInput(f"{subject} fails in ONNX Runtime on {inputs} ({_first_line(exc)}); give inputs it "
                       f"accepts with --input-value NAME=V (e.g. --input-value {_example(feeds)})"
                       + (f", or {skip}" if skip else "")) from None


def _example(feeds: Mapping[str, np.ndarray]) -> str:
    """An --input-value example naming the smallest input (a flag, a sample rate, a length)."""
    return f"{min(feeds, key=lambda k: (feeds[k].size, k))}=V" if feeds else "NAME=V"


def candidate_outputs(candidate: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    try:
        return run(candidate, feeds)
    except ort_errors() as exc:
        raise CandidateFailed(_first_line(exc)) from None


def _numeric(a: np.ndarray) -> np.ndarray:
    """bfloat16 (ml_dtypes: numpy kind 'V') as float32, so it compares as a number."""
    return a.astype(np.float32) if a.dtype.name == "bfloat16" else a


def shape_text(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape)) if shape else "a scalar"


def difference(reference: np.ndarray, got: np.ndarray) -> tuple[np.ndarray, float]:
    """(|got - reference| per element as float64, flat, the scale max(1, max finite |reference|)): two
    equal values give 0, NaN and NaN included (a NaN where ONNX Runtime has one is equal), +inf and
    +inf too; NaN against anything else, or an infinity against another value, gives inf. Every
    comparison of ours (`compare`, `max_rel_err`: verify, run, measure) is this one."""
    a = _numeric(np.asarray(reference)).astype(np.float64).reshape(-1)
    b = _numeric(np.asarray(got)).astype(np.float64).reshape(-1)
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    with np.errstate(invalid="ignore", over="ignore"):
        err = np.abs(a - b)
    err[np.isnan(err)] = np.inf
    err[same] = 0.0
    finite = np.abs(a[np.isfinite(a)])
    return err, max(1.0, float(finite.max())) if finite.size else 1.0


def max_rel_err(outputs: Mapping[str, np.ndarray], values: Mapping[str, np.ndarray]) -> float:
    """Largest |got - ref| / max(1, max|ref|) over the outputs (ref: ONNX Runtime's `values`), by
    `difference`."""
    worst = 0.0
    for name, got in outputs.items():
        err, scale = difference(values[name], got)
        if err.size:
            worst = max(worst, float(err.max()) / scale)
    return worst


def compare(reference: dict[str, np.ndarray], candidate: dict[str, np.ndarray],
            rtol: float = 1e-4, atol: float = 0.0) -> list[OutputDiff]:
    """Per output of `reference`: its largest absolute and relative error in `candidate`
    (`difference`) and whether |a - b| <= atol + rtol * scale everywhere; a missing output, or
    one of another shape (both named in `why`), differs."""
    diffs = []
    for name, ref in reference.items():
        if name not in candidate:
            diffs.append(OutputDiff(name, float("inf"), float("inf"), 1.0, False, "missing"))
            continue
        ref, got = np.asarray(ref), np.asarray(candidate[name])
        if ref.shape != got.shape:
            diffs.append(OutputDiff(name, float("inf"), float("inf"), 1.0, False,
                                    f"shape {shape_text(got.shape)}, expected {shape_text(ref.shape)}"))
            continue
        if _numeric(ref).dtype.kind not in "biufc" or _numeric(got).dtype.kind not in "biufc":  # strings
            same = bool(np.array_equal(ref, got))
            diffs.append(OutputDiff(name, 0.0 if same else float("inf"), 0.0 if same else float("inf"), 1.0, same))
            continue
        err, scale = difference(ref, got)
        if not err.size:
            diffs.append(OutputDiff(name, 0.0, 0.0, scale, True))
            continue
        with np.errstate(invalid="ignore", over="ignore"):
            rel = np.where(err == 0, 0.0, err / np.maximum(np.abs(_numeric(ref).astype(np.float64).reshape(-1)), 1e-12))
        rel[np.isnan(rel)] = np.inf  # an infinite error at an infinite or NaN reference value
        ok = bool(np.all(err <= atol + rtol * scale))
        diffs.append(OutputDiff(name, float(err.max()), float(rel.max()), scale, ok))
    return diffs


def all_values(model: onnx.ModelProto, feeds: dict[str, np.ndarray],
               given: Sequence[str] = ()) -> dict[str, np.ndarray]:
    """Every tensor of the main graph on these inputs: ONNX Runtime's outputs for all values
    (listed in value_info) plus the initializers — the reference for each kernel's inputs and
    outputs. BadInput when the model fails on them (`given`: the inputs the user set)."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    known = {o.name for o in probe.graph.output}
    produced = {t for n in probe.graph.node for t in n.output if t}
    for vi in model.graph.value_info:
        if vi.name in produced and vi.name not in known:
            probe.graph.output.append(vi)
            known.add(vi.name)
    try:
        sess = session(probe)
    except ort_errors() as exc:  # e.g. a --dtype model with an op ONNX Runtime has no kernel for
        raise BadInput(f"cannot compute the reference values: {_cannot_load(model, exc)}") from None
    values = _run_original(sess, feeds, given, None, "the model")
    from fusesearch.ir.canonicalize import weight_array

    for t in model.graph.initializer:
        values[t.name] = weight_array(t)
    values.update(feeds)
    return values

