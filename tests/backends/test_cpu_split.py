"""A CPU gemm's thread split is a schedule choice: lowering lists the splits over rows, columns
or both that make other blocks at the target's threads, the cost model prices each by its load
imbalance (`schedule.split_imbalance`), so 16 threads over 96 rows do not get blocks below the
micro-kernel's 12-row tile, and each split's C shares its blocks as the schedule names and equals
ONNX Runtime at any thread count."""

from __future__ import annotations

import re
import subprocess
from dataclasses import replace as with_

import numpy as np
import pytest
from onnx import helper

from costmodels import DEVICES, RooflineModel
from costmodels.roofline import host_params
from fusesearch.backends import cpu
from fusesearch.backends.codegen import generate
from fusesearch.backends.codegen.cpu_gemm import _split_lines
from fusesearch.backends.cpu import openmp_threads
from fusesearch.costing import cheapest, device_choices
from fusesearch.lowering import choices
from fusesearch.schedule import (
    CPU_SPLITS,
    ONE_THREAD,
    SPLIT_TILE_ROWS,
    CpuTarget,
    split_blocks,
    split_imbalance,
    split_row_limit,
)
from tests.backends.test_cpu_products import _graph, _whole

needs_cc = pytest.mark.skipif(not cpu.available(), reason="no C compiler")
AVX512_16 = CpuTarget(lanes=16, threads=16)


def _w(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 0.3


def _bias_relu(m: int, k: int = 48, n: int = 100):
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Add", ["y", "b"], ["h"]),
             helper.make_node("Relu", ["h"], ["out"])]
    return nodes, [("x", [m, k])], [("out", None)], [("w", _w([k, n])), ("b", _w([n], 1))]


def _gelu(m: int):  # bias + GELU: the tile epilogue with AVX-512, a prologue-free A read in place
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Add", ["y", "b"], ["h"]),
             helper.make_node("Div", ["h", "sqrt2"], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
             helper.make_node("Add", ["e", "one"], ["e1"]), helper.make_node("Mul", ["h", "e1"], ["g"]),
             helper.make_node("Mul", ["g", "half"], ["out"])]
    inits = [("w", _w([40, 72])), ("b", _w([72], 1)), ("sqrt2", np.float32(1.4142135)), ("one", np.float32(1.0)),
             ("half", np.float32(0.5))]
    return nodes, [("x", [m, 40])], [("out", None)], inits


def _residual(m: int):  # a prologue on A (recomputed per column block) and a bias + residual added at the store
    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("MatMul", ["a", "w"], ["y"]),
             helper.make_node("Add", ["y", "b"], ["h"]), helper.make_node("Add", ["h", "r"], ["out"])]
    return nodes, [("x", [m, 36]), ("r", [m, 80])], [("out", None)], [("w", _w([36, 80])), ("b", _w([80], 1))]


def _gemm_trans_b(m: int):  # B stored N x K: a column block is a block of B's rows
    nodes = [helper.make_node("Gemm", ["x", "w", "c"], ["y"], transB=1), helper.make_node("Relu", ["y"], ["out"])]
    return nodes, [("x", [m, 32])], [("out", None)], [("w", _w([96, 32])), ("c", _w([96], 1))]


def _heads(m: int):  # a batched product stored through a head merge (a Transpose)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"]),
             helper.make_node("Transpose", ["y"], ["out"], perm=[1, 0, 2])]
    return nodes, [("x", [2, m, 16])], [("out", None)], [("w", _w([16, 64]))]


GROUPS = {"bias relu": _bias_relu, "gelu": _gelu, "residual": _residual, "gemm transB": _gemm_trans_b,
          "heads": _heads}


def _cpu(threads: int, lanes: int = 16):
    return with_(DEVICES["t4"], name="pinned-cpu", kind="cpu", warp_size=lanes, sm_count=threads)


def _team_forms(graph):
    """The group's choices at 16 threads but the one-thread forms (tests/backends/test_cpu_one_thread.py)."""
    return [k for k in choices(graph, _whole(graph), host=AVX512_16) if k.schedule.split != ONE_THREAD]


def test_a_gemm_lists_each_split_and_one_thread_lists_rows_alone():
    """At 16 threads every product is listed over rows, columns and tiles, "rows" first, then each
    on one thread; at one thread every split makes the same one block, so "rows" alone is listed,
    as before the splits."""
    from tests.test_lowering import graph_of

    graph = graph_of(*_bias_relu(96))
    many = choices(graph, _whole(graph), host=AVX512_16)
    assert [(k.schedule.product, k.schedule.split) for k in many] == [
        (p, s) for p in ("own", "blas") for s in CPU_SPLITS] + [("own", ONE_THREAD), ("blas", ONE_THREAD)]
    one = choices(graph, _whole(graph), host=CpuTarget(lanes=16))
    assert [(k.schedule.product, k.schedule.split, k.imbalance) for k in one] == [("own", "rows", 1.0),
                                                                                  ("blas", "rows", 1.0)]
    assert all(k.schedule.to_dict()["split"] == k.schedule.split for k in many)


def test_a_split_without_a_constant_b_or_under_a_softmax_is_rows_alone():
    """Column blocks read a slice of B: listed where B is a 2-D float32 constant alone; attention's
    scores (B an input) and a product under a Softmax split rows."""
    from tests.test_lowering import graph_of

    scores = graph_of([helper.make_node("MatMul", ["q", "k"], ["out"])], [("q", [96, 32]), ("k", [32, 96])],
                      [("out", None)], [])
    softmax = graph_of([helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Softmax", ["y"], ["out"])],
                       [("x", [96, 32])], [("out", None)], [("w", _w([32, 64]))])
    for graph in (scores, softmax):
        kernels = [k for k in _team_forms(graph) if k.impl == "generated"]
        assert kernels and {k.schedule.split for k in kernels} == {"rows"}


@pytest.mark.parametrize("m", [96, 128])
def test_sixteen_threads_never_pick_blocks_below_the_tile(m):
    """16 threads over M rows: blocks of M/16 rows (6 or 8) fill half a 12-row tile, so the
    cheapest choice on a 16-thread AVX-512 CPU splits columns (or both), its blocks at least a tile
    tall; the row split's price says why (its imbalance)."""
    from tests.test_lowering import graph_of

    graph = graph_of(*_bias_relu(m, k=256, n=512))
    device = _cpu(16)
    kernels = device_choices(graph, _whole(graph), device)
    best, _ = cheapest(kernels, device, RooflineModel(host_params()))
    _, rows_per_block, _, _ = split_blocks(best.schedule.split, 1, m, 512, 16)
    assert best.schedule.split != "rows" and rows_per_block >= SPLIT_TILE_ROWS
    rows = next(k for k in kernels if k.schedule.split == "rows" and k.schedule.product == best.schedule.product)
    assert rows.imbalance == split_imbalance("rows", 1, m, 512, CpuTarget(lanes=16, threads=16)) > 1.3


def test_the_imbalance_formula():
    """busiest thread over an even share, in whole 12 x 32 tiles (AVX-512) or 6 x 16."""
    t16 = CpuTarget(lanes=16, threads=16)
    assert split_blocks("rows", 1, 96, 512, 16) == (16, 6, 1, 512)
    assert split_imbalance("rows", 1, 96, 512, t16) == 2.0  # 6 of a 12-row tile's rows
    assert split_blocks("cols", 1, 96, 512, 16) == (1, 96, 16, 32)
    assert split_imbalance("cols", 1, 96, 512, t16) == 1.0
    assert split_blocks("tiles", 1, 96, 512, 16) == (8, 12, 2, 256)
    assert split_imbalance("cols", 1, 96, 100, t16) == 4.0  # 4 column blocks for 16 threads
    assert split_imbalance("rows", 1, 96, 512, CpuTarget(lanes=8, threads=16)) == 1.0  # 6-row tiles
    assert split_imbalance("rows", 4, 128, 64, CpuTarget(lanes=16, threads=1)) == 1.0


@needs_cc
@pytest.mark.parametrize("name", sorted(GROUPS))
def test_every_split_equals_onnx_runtime_at_any_thread_count(tmp_path, name):
    """Each listed split of each product, its C run at 1, 2 and 4 OpenMP threads (4: "tiles" makes
    blocks of rows and of columns over 24 rows), equals ONNX Runtime; and its block loop is the
    split's: no column blocks for "rows", else the split's row limit and `cblocks` blocks."""
    graph, values = _graph(tmp_path, *GROUPS[name](24))
    kernels = [k for k in _team_forms(graph) if k.impl == "generated"]
    assert {k.schedule.split for k in kernels} == set(CPU_SPLITS)
    for kernel in kernels:
        gk = generate(graph, kernel)
        body = gk.c_source[gk.c_source.index(f"void {gk.name}("):]
        split = kernel.schedule.split
        limits = re.findall(r"long long rsplit = split < (\d+)LL", body)
        if split == "rows":
            assert not limits and "cblocks" not in body
        else:
            assert limits and {int(x) for x in limits} == {split_row_limit(split, 24)}
            assert re.search(r"blk < \d+LL \* blocks \* cblocks;", body)
        for threads in (1, 2, 4):
            with openmp_threads(threads):
                out = cpu.run(gk, {a.tensor: values[a.tensor] for a in gk.inputs})
            for a in gk.outputs:
                ref = values[a.tensor].astype(np.float64)
                np.testing.assert_allclose(out[a.tensor], ref, rtol=0, atol=1e-4 * max(1.0, float(np.abs(ref).max())),
                                           err_msg=f"{kernel.schedule} at {threads} threads")


@needs_cc
def test_the_c_computes_the_blocks_the_schedule_prices(tmp_path):
    """The C preamble of the block loop (`cpu_gemm._split_lines`), compiled and run at several
    thread counts, makes the blocks `schedule.split_blocks` gives for every split."""
    cases = [(s, b, m, n, t) for s in CPU_SPLITS for b, m, n in ((1, 96, 512), (1, 24, 100), (4, 128, 64), (1, 7, 33))
             for t in (1, 2, 3, 5, 16)]
    funcs = []
    for i, (split, batches, m, n, _) in enumerate(cases):
        lines = _split_lines(split, batches, m, n, cap=1 << 30)
        cols = ("cblocks", f"(nb < {n}LL ? nb : {n}LL)") if split != "rows" else ("1LL", f"{n}LL")
        funcs.append(f"static void case{i}(long long t) {{\nfs_t = t;\n" + "\n".join(lines)
                     + f'\nprintf("%lld %lld %lld %lld\\n", blocks, mb, {cols[0]}, {cols[1]});\n}}')
    calls = "\n".join(f"case{i}({t}LL);" for i, (*_, t) in enumerate(cases))
    src = ("#include <stdio.h>\nstatic long long fs_t;\nstatic long long fs_threads(void) { return fs_t; }\n"
           + "\n".join(funcs) + f"\nint main(void) {{\n{calls}\nreturn 0; }}\n")
    (tmp_path / "split.c").write_text(src)
    subprocess.run([cpu.compiler(), "-O0", "-o", str(tmp_path / "split"), str(tmp_path / "split.c")], check=True)
    printed = subprocess.run([str(tmp_path / "split")], capture_output=True, text=True, check=True).stdout.split("\n")
    for (split, batches, m, n, t), line in zip(cases, printed, strict=False):
        assert tuple(int(x) for x in line.split()) == split_blocks(split, batches, m, n, t), (split, batches, m, n, t)
