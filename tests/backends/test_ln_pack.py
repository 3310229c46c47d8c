"""A LayerNorm's rows as its projection's prologue, two priced forms (`Schedule.prologue`,
`schedule.prologue_forms`): "stored" (every row normalised and stored, then the product's blocks
read them back) and "packed" (each block computes its own rows, moments in one pass, into the A
panel its product reads next). Equal to ONNX Runtime at row widths on and off the vector width,
with the normalised rows an output or not, with a bias and a GELU epilogue, at 1 and 2 threads; the
source follows the schedule; the price counts what each form moves and recomputes."""

from __future__ import annotations

from dataclasses import replace as with_

import numpy as np
import pytest
from onnx import helper

from costmodels import DEVICES, RooflineModel
from costmodels.roofline import host_params
from fusesearch import schedule
from fusesearch.backends import cpu
from fusesearch.backends.codegen import generate
from fusesearch.backends.cpu import openmp_threads
from fusesearch.costing import cheapest, device_choices
from fusesearch.groups import FusionGroup
from fusesearch.ir.canonicalize import to_proto
from fusesearch.lowering import choices
from fusesearch.pipeline import prepare
from fusesearch.verify import all_values, random_feeds
from tests.backends.test_cpu_packed import _body, _w
from tests.conftest import make_model, save

needs_cc = pytest.mark.skipif(not cpu.available(), reason="no C compiler")
AVX512 = schedule.CpuTarget(lanes=16)
ROWS = 30  # at 2 threads two blocks of 15 rows: an odd count of rows per block


def _ln_projection(k: int, n: int, *, op: bool, normalised_out: bool, gelu: bool):
    """x + 1000 (a mean far above the spread), LayerNorm over its K-long rows (the op, or as BERT
    exports it), MatMul by a K x N constant, + bias, then GELU (erf form) where `gelu`; the
    normalised rows also an output where `normalised_out` (a residual reads them in BERT)."""
    nodes = [helper.make_node("Add", ["x", "offset"], ["xs"])]
    inits = [("offset", np.float32(1000.0)), ("gamma", _w([k], 1) + 1), ("beta", _w([k], 2))]
    if op:
        nodes.append(helper.make_node("LayerNormalization", ["xs", "gamma", "beta"], ["ln"], axis=-1, epsilon=1e-5))
    else:
        nodes += [helper.make_node("ReduceMean", ["xs"], ["mean"], axes=[-1]),
                  helper.make_node("Sub", ["xs", "mean"], ["d"]), helper.make_node("Pow", ["d", "two"], ["sq"]),
                  helper.make_node("ReduceMean", ["sq"], ["var"], axes=[-1]),
                  helper.make_node("Add", ["var", "eps"], ["ve"]), helper.make_node("Sqrt", ["ve"], ["sd"]),
                  helper.make_node("Div", ["d", "sd"], ["nd"]), helper.make_node("Mul", ["nd", "gamma"], ["ng"]),
                  helper.make_node("Add", ["ng", "beta"], ["ln"])]
        inits += [("two", np.float32(2.0)), ("eps", np.float32(1e-12))]
    nodes += [helper.make_node("MatMul", ["ln", "w"], ["p"]), helper.make_node("Add", ["p", "bias"], ["h"])]
    inits += [("w", _w([k, n], 3)), ("bias", _w([n], 4))]
    out = "h"
    if gelu:
        nodes += [helper.make_node("Div", ["h", "sqrt2"], ["hd"]), helper.make_node("Erf", ["hd"], ["he"]),
                  helper.make_node("Add", ["he", "one"], ["h1"]), helper.make_node("Mul", ["h", "h1"], ["hg"]),
                  helper.make_node("Mul", ["hg", "half"], ["y"])]
        inits += [("sqrt2", np.float32(1.4142135)), ("one", np.float32(1.0)), ("half", np.float32(0.5))]
        out = "y"
    outputs = [(out, None)] + ([("ln", None)] if normalised_out else [])
    return nodes, [("x", [ROWS, k])], outputs, inits


def _prepared(tmp_path, parts):
    return prepare(save(make_model(*parts), tmp_path / "m.onnx"))


def _whole(graph) -> FusionGroup:
    return FusionGroup(frozenset(range(len(graph))))


def _run_equal(prep, kernel, threads=(1,)):
    """Generate `kernel`, run it at each thread count and compare every output with ONNX Runtime."""
    canonical = to_proto(prep.canonical)
    values = all_values(canonical, random_feeds(canonical, 0))
    gk = generate(prep.graph, kernel)
    for t in threads:
        with openmp_threads(t):
            out = cpu.run(gk, {a.tensor: values[a.tensor] for a in gk.inputs})
        for a in gk.outputs:
            ref = values[a.tensor].astype(np.float64)
            np.testing.assert_allclose(out[a.tensor], ref, rtol=0, atol=1e-4 * max(1.0, float(np.abs(ref).max())),
                                       err_msg=f"{a.tensor}: {kernel.schedule} at {t} threads")
    return gk


@needs_cc
@pytest.mark.parametrize("k,n", [(96, 64), (100, 72), (100, 700)])  # K on / off the vectors; N past a column block
@pytest.mark.parametrize("normalised_out", [True, False])
@pytest.mark.parametrize("op,gelu", [(True, False), (False, True)])
def test_layernorm_projection_forms_equal_onnx_runtime(tmp_path, k, n, normalised_out, op, gelu):
    """Every form the group lists (both where the normalised rows are an output, "packed" alone
    where they are not), each split at 2 threads, generated and equal to ONNX Runtime at 1 and 2
    threads on rows of mean 1000: a row width a multiple of the vectors and not, a bias or a bias +
    GELU (the tile epilogue on registers) after the product."""
    prep = _prepared(tmp_path, _ln_projection(k, n, op=op, normalised_out=normalised_out, gelu=gelu))
    kernels = [kn for kn in choices(prep.graph, _whole(prep.graph), host=schedule.CpuTarget(lanes=16, threads=2))
               if kn.schedule.split != schedule.ONE_THREAD]
    forms = {kn.schedule.prologue for kn in kernels}
    assert forms == ({"stored", "packed"} if normalised_out else {"packed"})
    for kernel in kernels:
        _run_equal(prep, kernel, threads=(1, 2))


@needs_cc
@pytest.mark.parametrize("normalised_out", [True, False])
def test_the_packed_source_normalises_each_block_into_its_panel(tmp_path, normalised_out):
    """The packed form's source: one OpenMP region and one work-shared loop (the blocks: no pass over
    all rows before them), each block computing its rows' moments (one chunked pass per row, two
    rows at a time) and then the rows into its A panel: scratch `abuf` never stored where the
    normalised rows are not an output, the output's rows read in place where they are."""
    prep = _prepared(tmp_path, _ln_projection(96, 64, op=True, normalised_out=normalised_out, gelu=False))
    packed = next(kn for kn in choices(prep.graph, _whole(prep.graph), host=AVX512) if kn.schedule.prologue == "packed")
    body = _body(_run_equal(prep, packed))
    assert body.count("#pragma omp parallel") == 1 and body.count("#pragma omp for") == 1, body
    block = body[body.index("for (long long blk = 0;"):]
    rows, product = block.index("for (long long rp = 0; rp < (mc + 1) / 2; ++rp)"), block.index("fs_gemm_rows(")
    assert rows < product and block.count("for (long long j0 = 0;") == 2, block  # a moments pass per row of a pair
    ln = next(a.name for a in generate(prep.graph, packed).outputs if a.tensor == "ln") if normalised_out else None
    if normalised_out:
        assert "abuf" not in block and f"fs_gemm_rows(mc, 64LL, 96LL, {ln} + (" in block, block
    else:
        assert "abuf[(r_0 - rbase) * 96LL + j]" in block and "fs_gemm_rows(mc, 64LL, 96LL, abuf, 96LL" in block, block
        assert len(generate(prep.graph, packed).outputs) == 1  # the normalised rows are not stored


@needs_cc
def test_the_stored_source_keeps_its_pass_before_the_blocks(tmp_path):
    """The stored form: the rows' loop over all rows first (its own work-shared loop), then the
    blocks read the stored rows in place, in the same region."""
    prep = _prepared(tmp_path, _ln_projection(96, 64, op=True, normalised_out=True, gelu=False))
    stored = next(kn for kn in choices(prep.graph, _whole(prep.graph), host=AVX512) if kn.schedule.prologue == "stored")
    body = _body(_run_equal(prep, stored))
    assert body.count("#pragma omp parallel") == 1 and body.count("#pragma omp for") == 2, body
    assert body.index("for (long long rp = 0; rp < 15LL; ++rp)") < body.index("for (long long blk = 0;"), body


def test_the_forms_are_priced_and_the_cheapest_chosen(tmp_path):
    """On the pinned CPU (1 thread): where the normalised rows are an output both forms are listed,
    with the same FLOPs and bytes (one block of rows: the same rows written and read back), so the
    cheapest is the stored one, first; where they are not, the packed form alone, one kernel that
    writes no normalised rows: cheaper than the LayerNorm's row kernel plus the projection's kernel
    a plan ran before (their write and read of the rows, a second region)."""
    device = with_(DEVICES["t4"], name="pinned-cpu", kind="cpu", warp_size=16, sm_count=1)
    model = RooflineModel(host_params())
    graph = _prepared(tmp_path, _ln_projection(96, 64, op=False, normalised_out=True, gelu=False)).graph
    kernels = device_choices(graph, _whole(graph), device)
    assert [kn.schedule.prologue for kn in kernels] == ["stored", "packed"]
    stored, packed = kernels
    assert (stored.scalar_flops, stored.read_bytes, stored.write_bytes) == (
        packed.scalar_flops, packed.read_bytes, packed.write_bytes)
    assert cheapest(kernels, device, model)[0].schedule.prologue == "stored"
    graph = _prepared(tmp_path, _ln_projection(96, 64, op=True, normalised_out=False, gelu=False)).graph
    (packed,) = device_choices(graph, _whole(graph), device)
    ln = next(n.id for n in graph.nodes if n.op_type == "LayerNormalization")
    parts = [cheapest(device_choices(graph, FusionGroup(frozenset(p)), device), device, model)
             for p in ({i for i in range(len(graph)) if i <= ln}, {i for i in range(len(graph)) if i > ln})]
    assert packed.schedule.prologue == "packed" and packed.write_bytes == sum(k.write_bytes for k, _ in parts) - (
        graph.tensors["ln"].nbytes)
    assert model.cost(packed.spec(), device).time_s < sum(c.time_s for _, c in parts)


def test_a_packed_prologue_that_stores_splits_rows_alone(tmp_path):
    """At 2 threads a packed prologue recomputes its rows per column block (priced: more FLOPs than
    the row split), so where its rows store an output it runs with the "rows" split alone (each
    row stored by one thread), and with every split where they store nothing."""
    target = schedule.CpuTarget(lanes=16, threads=2)
    for normalised_out, splits in ((True, {"rows"}), (False, {"rows", "cols"})):
        graph = _prepared(tmp_path, _ln_projection(96, 128, op=True, normalised_out=normalised_out, gelu=False)).graph
        packed = [kn for kn in choices(graph, _whole(graph), host=target)
                  if kn.schedule.prologue == "packed" and kn.schedule.split != schedule.ONE_THREAD]
        assert {kn.schedule.split for kn in packed} == splits
        if not normalised_out:
            rows, cols = (next(kn for kn in packed if kn.schedule.split == s) for s in ("rows", "cols"))
            assert cols.scalar_flops > rows.scalar_flops
