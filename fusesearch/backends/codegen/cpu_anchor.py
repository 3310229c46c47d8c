"""Which C skeleton a gemm/conv group takes (C only): the product's own loops when every output
is the product element for element (`cpu_gemm` for MatMul/Gemm, `cpu_conv` for Conv), else the
product materialized into scratch by those loops and the outputs moved from it by pointwise loops
(a Transpose after a MatMul, a Reshape+Transpose or a Concat after a Conv), or stored straight at
the output's strides where our micro-kernel can.
Invariants: None means the group has no packed skeleton here (the caller falls back to the
generic loops); the choice reads only the graph and the kernel, so the source is deterministic.
"""

from __future__ import annotations

from fusesearch.backends.codegen.base import Arg, compute_dtype, shared_scratch
from fusesearch.backends.codegen.cpu_conv import _conv_loops
from fusesearch.backends.codegen.cpu_conv_chain import chain_loops
from fusesearch.backends.codegen.cpu_gemm import _matmul_row_loops, _view_strides, gemm_product
from fusesearch.backends.codegen.pointwise import _pointwise_loops
from fusesearch.ir.graph import Graph, Node
from fusesearch.lowering import Kernel
from fusesearch.schedule import CHAIN, anchor_derived


def _anchor_row_loops(graph: Graph, kernel: Kernel, args, outs, packs: dict, defs: list[str] | None = None) -> list[str] | None:
    """C skeleton for gemm/conv with a prologue on the activation operand: per output row (all
    output dims but the one the weights span), the operand's row (MatMul/Gemm: A[m, :]; Conv: the
    input patch of one output pixel and group) is computed once into a buffer, then reused for
    every output column — the CPU analogue of a tile load. None when there is nothing to hoist."""
    if kernel.anchor is None:
        return None
    anchor = graph.nodes[kernel.anchor]
    if kernel.schedule.product == CHAIN:  # a 1x1 conv and the depthwise conv after it
        return chain_loops(graph, kernel, args, outs, packs)
    if anchor_derived(graph, kernel.nodes, anchor) is None:  # the epilogue moves elements
        return _materialized_loops(graph, kernel, args, outs, anchor, packs)
    if anchor.op_type in ("MatMul", "Gemm"):
        return _matmul_row_loops(graph, kernel, args, outs, anchor, packs=packs, defs=defs)
    if anchor.op_type != "Conv":
        return None
    return _conv_loops(graph, kernel, args, outs, anchor, packs)


def _materialized_loops(graph: Graph, kernel: Kernel, args, outs, anchor: Node, packs: dict) -> list[str] | None:
    """C skeleton for a MatMul/Gemm/Conv whose epilogue reads the product at other positions than
    the one computed (a Transpose after a MatMul, a Reshape+Transpose or a Concat after a Conv):
    the product (prologue applied) into a scratch buffer by the anchor's own loops (the BLAS blocks),
    then every output by pointwise loops that read the buffer. None for other anchors, 1-D
    operands, or a product that is not float32."""
    y = anchor.outputs[0]
    info = graph.tensors[y]
    if anchor.op_type not in ("MatMul", "Gemm", "Conv") or compute_dtype(info.dtype) != "float32":
        return None
    buffer = Arg("ybuf", y, tuple(info.shape), "float32")  # the product as computed (float)
    strides = _view_strides(graph, kernel, outs, y) if anchor.op_type == "MatMul" else None
    own = anchor.op_type != "Conv" and gemm_product(graph, kernel, anchor) == "own"
    stored = (_matmul_row_loops(graph, kernel, args, [buffer], anchor, store=(outs[0].name, strides), packs=packs)
              if strides else None)
    if stored and own:  # our micro-kernel stores the product in place: no BLAS needed
        return stored
    product = (_conv_loops(graph, kernel, args, [buffer], anchor, packs) if anchor.op_type == "Conv"
               else _matmul_row_loops(graph, kernel, args, [buffer], anchor, packs=packs))
    if product is None:
        return None
    c_loops, _ = _pointwise_loops(graph, kernel, {**args, y: buffer}, outs, materialized=frozenset({y}))
    whole = ["    " + shared_scratch("ybuf", f"{max(1, buffer.size)}LL"), *product, *c_loops]
    return ["#ifdef FS_BLAS_SGEMM", *stored, "#else", *whole, "#endif"] if stored else whole
