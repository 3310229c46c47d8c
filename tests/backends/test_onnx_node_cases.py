"""ONNX's own backend node test cases, each a single-node group, on the CPU backend.

Problem: the code generator's per-op formulas are checked elsewhere on a few hand-built graphs
only; an attribute default it ignores or an edge case it gets wrong (negative indices, NaN, an
omitted optional input) would go unnoticed. ONNX ships a test case per op and edge case.
Approach: collect every node test case whose model is one node of an op the generator lowers
(the keys of its op tables, so this stays in sync) — from `onnx/backend/test/data/node` when the
installed onnx has that folder, else generated in memory by `onnx.backend.test.case.node` (the
code that writes that folder). Each case is prepared like a user's model, lowered as one group,
generated, compiled and run on its inputs, and compared with its expected outputs.
The inputs an op reads as parameters (Slice starts, Reshape shape, Clip bounds, Reduce axes, ...)
become initializers first: fusesearch needs static shapes and constant parameters, as exported
models have them; the data inputs stay graph inputs.
Invariants: a case passes, or skips with a reason that names why (a dtype without a C type, a
refusal outside the generator's scope, a folded constant); a wrong value or a crash fails.
`test_summary` lists the covered ops and every skip, whatever order the tests run in.
"""

from __future__ import annotations

import re
import tempfile
import warnings
from collections import Counter, defaultdict
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from fusesearch.backends import cpu
from fusesearch.backends.codegen import (
    _BINARY,
    _HANDLERS,
    _UNARY,
    _VARIADIC,
    CTYPES,
    CodegenRefused,
    generate,
)
from fusesearch.candidates.group import FusionGroup
from fusesearch.ir.canonicalize import to_proto
from fusesearch.ir.load import MIN_OPSET, TARGET_OPSET
from fusesearch.lowering import _lower_checked, lower, reduced_rows
from fusesearch.pipeline import prepare
from fusesearch.verify import all_values

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C compiler")

ROW_OPS = frozenset({"ReduceMean", "ReduceSum", "ReduceMax", "GlobalAveragePool", "Softmax", "LogSoftmax",
                     "LayerNormalization"})
COVERED_OPS = frozenset(_UNARY) | frozenset(_BINARY) | frozenset(_VARIADIC) | frozenset(_HANDLERS) | ROW_OPS
DATA_DIR = Path(onnx.__file__).parent / "backend" / "test" / "data" / "node"

# inputs read as parameters (constants in exported models): made initializers before `prepare`
PARAMETER_INPUTS = {"Clip": (1, 2), "Slice": (1, 2, 3, 4), "Reshape": (1,), "Expand": (1,), "Split": (1,),
                    "Squeeze": (1,), "Unsqueeze": (1,), "Resize": (1, 2, 3), "ReduceMean": (1,),
                    "ReduceSum": (1,), "ReduceMax": (1,)}

# refusals outside the generator's scope (a skip); any other refusal is a failure
OUT_OF_SCOPE = (r"\(Resize\) mode (linear|cubic) has no code generator yet",
                r"\(Resize\) coordinate mode \w+ has no code generator yet",
                r"\(ConvTranspose\) auto_pad SAME_(UPPER|LOWER) is not generated yet")

TOLERANCE = 1e-4  # |a - b| <= TOLERANCE * max(1, max|ref|), as tests/backends/test_codegen_cpu.py


@dataclass(frozen=True)
class NodeCase:
    name: str
    model: onnx.ModelProto
    data_sets: tuple[tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]], ...]

    @property
    def op(self) -> str:
        return self.model.graph.node[0].op_type


# -- discovery --------------------------------------------------------------------------------

def _is_covered(model: onnx.ModelProto) -> bool:
    nodes = model.graph.node
    return len(nodes) == 1 and nodes[0].domain in ("", "ai.onnx") and nodes[0].op_type in COVERED_OPS


def _read_tensor(path: Path) -> np.ndarray:
    tensor = onnx.TensorProto()
    tensor.ParseFromString(path.read_bytes())
    return numpy_helper.to_array(tensor)


def _cases_on_disk() -> list[NodeCase]:
    cases = []
    for folder in sorted(DATA_DIR.glob("test_*")):
        model = onnx.load(str(folder / "model.onnx"))
        if not _is_covered(model):
            continue
        sets = tuple((tuple(_read_tensor(p) for p in sorted(d.glob("input_*.pb"), key=_pb_index)),
                      tuple(_read_tensor(p) for p in sorted(d.glob("output_*.pb"), key=_pb_index)))
                     for d in sorted(folder.glob("test_data_set_*")))
        cases.append(NodeCase(folder.name, model, sets))
    return cases


def _pb_index(path: Path) -> int:
    return int(path.stem.rsplit("_", 1)[1])


def _as_array(x) -> np.ndarray:
    return numpy_helper.to_array(x) if isinstance(x, onnx.TensorProto) else np.asarray(x)


def _cases_generated() -> list[NodeCase]:
    from onnx.backend.test.case import node

    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        generated = node.collect_testcases()
    return [NodeCase(c.name, c.model, tuple((tuple(map(_as_array, i)), tuple(map(_as_array, o)))
                                            for i, o in c.data_sets))
            for c in generated if c.kind == "node" and _is_covered(c.model)]


@cache
def node_cases() -> tuple[NodeCase, ...]:
    cases = _cases_on_disk() if DATA_DIR.is_dir() else _cases_generated()
    return tuple(sorted(cases, key=lambda c: c.name))


# -- one case ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Outcome:
    status: str  # "passed" | "skipped" | "failed"
    detail: str = ""


class Skip(Exception):
    pass


def _check_inputs(model: onnx.ModelProto) -> None:
    """Static, non-empty tensor inputs only (what `prepare` accepts without --input-shape)."""
    for vi in model.graph.input:
        dims = vi.type.tensor_type.shape.dim
        if not vi.type.HasField("tensor_type") or any(not d.HasField("dim_value") for d in dims):
            raise Skip(f"input '{vi.name}' is dynamic (not a tensor of static shape)")
        if any(d.dim_value == 0 for d in dims):
            raise Skip(f"zero-size input '{vi.name}': the loader reads a 0 dim as an unbound one")


def _loadable(model: onnx.ModelProto) -> onnx.ModelProto:
    """Models older than the loader's minimum opset, upgraded by onnx's version converter."""
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), TARGET_OPSET)
    if opset >= MIN_OPSET:
        return model
    try:
        return onnx.version_converter.convert_version(model, TARGET_OPSET)
    except Exception as exc:  # the converter raises bare RuntimeError/ConvertError
        raise Skip(f"opset {opset} is below the loader's {MIN_OPSET} and does not convert: {exc}") from None


def _with_parameters_constant(case: NodeCase, inputs: tuple[np.ndarray, ...]) -> tuple[onnx.ModelProto, dict]:
    """The case's model with its parameter inputs as initializers, and the feeds for the rest."""
    model = onnx.ModelProto()
    model.CopyFrom(_loadable(case.model))
    graph, node = model.graph, model.graph.node[0]
    wanted = {node.input[k] for k in PARAMETER_INPUTS.get(node.op_type, ()) if k < len(node.input)} - {""}
    values = dict(zip([vi.name for vi in graph.input], inputs, strict=True))
    feeds, keep = {}, []
    for vi in graph.input:
        if vi.name in wanted:
            graph.initializer.append(numpy_helper.from_array(values[vi.name], vi.name))
        else:
            keep.append(vi)
            feeds[vi.name] = values[vi.name]
    del graph.input[:]
    graph.input.extend(keep)
    _check_inputs(model)
    return model, feeds


def _check_graph(prep) -> None:
    graph = prep.graph
    if len(graph.nodes) == 0:
        raise Skip("folded to a constant")
    if len(graph.nodes) != 1:
        raise Skip(f"canonicalized to {len(graph.nodes)} nodes, not one")
    node = graph.nodes[0]
    for t in (x for x in node.inputs + node.outputs if x):
        info = graph.tensors[t]
        if info.shape is None:
            raise Skip(f"dynamic shape of '{t}'")
        if info.dtype not in CTYPES:
            raise Skip(f"dtype {info.dtype} has no C type in the generator")
    if node.kind.name == "REDUCE":
        rows = reduced_rows(graph, node)
        if not isinstance(rows, tuple):
            raise Skip(f"not supported yet: {rows.reason}")


def _compare(name: str, got: np.ndarray, ref: np.ndarray) -> None:
    """Exact for integers and bools; floats within TOLERANCE, NaN and infinities where expected."""
    if got.shape != ref.shape or got.dtype != ref.dtype:
        raise AssertionError(f"{name}: {got.dtype}{got.shape}, expected {ref.dtype}{ref.shape}")
    if ref.dtype.kind in "biu":
        np.testing.assert_array_equal(got, ref, err_msg=name)
        return
    a, b = got.astype(np.float64), ref.astype(np.float64)
    nan = np.isnan(b)
    np.testing.assert_array_equal(np.isnan(a), nan, err_msg=f"{name}: NaN positions differ")
    same = (a == b) | nan
    err = np.where(same, 0.0, np.abs(a - b))
    finite = b[np.isfinite(b)]
    scale = max(1.0, float(np.max(np.abs(finite)))) if finite.size else 1.0
    if not np.all(err <= TOLERANCE * scale):
        worst = int(np.nanargmax(err))
        raise AssertionError(f"{name}: max error {err.flat[worst]:.3g} at {worst} (got {a.flat[worst]!r}, "
                             f"expected {b.flat[worst]!r}, tolerance {TOLERANCE * scale:.3g})")


def _run_data_set(case: NodeCase, inputs, outputs, folder: Path) -> None:
    model, feeds = _with_parameters_constant(case, inputs)
    path = folder / f"{case.name}.onnx"
    path.write_bytes(model.SerializeToString())
    prep = prepare(str(path))
    _check_graph(prep)
    kernel = lower(prep.graph, FusionGroup(frozenset({prep.graph.nodes[0].id})))
    if kernel.template == "opaque":
        refused = _lower_checked(prep.graph, list(prep.graph.nodes))
        raise Skip(f"not supported yet: lowered as a library call ({refused.reason})")
    try:
        gk = generate(prep.graph, kernel)
    except CodegenRefused as exc:
        if any(re.search(p, exc.decision.reason) for p in OUT_OF_SCOPE):
            raise Skip(f"generator refuses: {exc.decision.reason}") from None
        raise
    values = all_values(to_proto(prep.canonical), feeds)
    got = cpu.run(gk, {a.tensor: values[a.tensor] for a in gk.inputs})
    names = [vi.name for vi in case.model.graph.output]
    for name, ref in zip(names, outputs, strict=True):
        _compare(name, got[name], ref)


@cache
def outcome(name: str) -> Outcome:
    case = next(c for c in node_cases() if c.name == name)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for inputs, outputs in case.data_sets:
                _run_data_set(case, inputs, outputs, Path(tmp))
    except Skip as exc:
        return Outcome("skipped", str(exc))
    except Exception as exc:  # a crash or a wrong value: reported by the case's test
        return Outcome("failed", f"{type(exc).__name__}: {exc}")
    return Outcome("passed")


# -- tests ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", [c.name for c in node_cases()])
def test_node_case(name):
    result = outcome(name)
    if result.status == "skipped":
        pytest.skip(result.detail)
    assert result.status == "passed", result.detail


def test_summary():
    cases = node_cases()
    ops = sorted({c.op for c in cases})
    results = {c.name: outcome(c.name) for c in cases}
    counts: dict[str, Counter] = defaultdict(Counter)
    for c in cases:
        counts[c.op][results[c.name].status] += 1
    print(f"\ncovered ops ({len(ops)}): {', '.join(ops)}")
    for op in ops:
        print(f"  {op:20s} " + " ".join(f"{k}={v}" for k, v in sorted(counts[op].items())))
    for status in ("skipped", "failed"):
        print(f"{status} cases:")
        for c in cases:
            if results[c.name].status == status:
                print(f"  {c.name}: {results[c.name].detail}")
    assert ops, "no ONNX node test case for any op the generator lowers"
    assert set(ops) == set(COVERED_OPS), f"ops without a node test case: {sorted(COVERED_OPS - set(ops))}"
