"""The CUDA vectorized skeleton: elementwise/broadcast pointwise kernels over float32 outputs of one
shape with |S| % 4 == 0, four elements per thread through float4 loads and stores.
"""

from __future__ import annotations

import math

from fusesearch.backends.codegen.base import _indent, cuda_entry
from fusesearch.backends.codegen.c_prelude import _CU_PRELUDE
from fusesearch.backends.codegen.emitter import _Emitter
from fusesearch.ir.graph import Graph
from fusesearch.lowering import Kernel
from fusesearch.schedule import VECTOR


def _vectorized(graph: Graph, kernel: Kernel, name: str, ins, outs, args):
    """CUDA for a pointwise kernel of elementwise/broadcast ops whose outputs are float32 of one
    shape S with |S| % 4 == 0: each thread handles 4 consecutive elements, loading every float32
    input of shape S as one float4 (inputs of other shapes are broadcast, loaded one by one) and
    storing each output as one float4. The schedule chose it (`schedule.vectorizable`)."""
    shape = outs[0].shape
    size = math.prod(shape)
    full = [a for a in ins if a.shape == shape and a.dtype == "float32"]
    quads = size // VECTOR
    lines = [f"const float4 q{a.name} = reinterpret_cast<const float4*>({a.name})[q];" for a in full]
    results: dict[str, list[str]] = {o.name: [] for o in outs}
    count = 0
    for lane, comp in enumerate("xyzw"):  # four lanes, one emitter each (temporaries numbered on)
        e = _Emitter(graph, kernel, args)
        e.count = count
        e.vec_loads = {a.tensor: f"q{a.name}.{comp}" for a in full}
        idx = e.unflatten(f"(q * {VECTOR}LL + {lane})", shape)
        for o in outs:
            results[o.name].append(e.value(o.tensor, idx))
        lines += e.lines
        count = e.count
    body = [f"for (long long q = blockIdx.x * (long long)blockDim.x + threadIdx.x; q < {quads}LL;"
            " q += (long long)blockDim.x * gridDim.x) {"]
    body += ["    " + x for x in lines]
    for o in outs:
        vals = results[o.name]
        body.append(f"    reinterpret_cast<float4*>({o.name})[q] = make_float4({', '.join(vals)});")
    body.append("}")
    src = (f"{_CU_PRELUDE}\n{cuda_entry(name, ins, outs)} {{\n"
           f"{_indent(body, 1)}\n}}\n")
    return src
