"""The CPU side of "one kernel, one truth": for every group of every zoo plan made for the host
(each strategy), the kernel the C backend is given is the one the search priced, and what it
writes is that kernel's schedule: a fused gemm/conv is `packed` (C only, priced on `cpu-simd`
with each prologue element computed once per panel), a fused depthwise conv `depthwise` (its own
template and loop over zero-bordered planes, never the packed GEMM), a lone one the same C (the
host's defaults price it at or under the library call, and ties are ours), but for a
ConvTranspose (`CPU_LIBRARY_ONLY`: a library call), every other generated kernel writes the
skeleton lowering chose, its scratch buffers from the per-thread arena (no malloc per call). Structural: the sources are generated, not compiled (numerics: the
end-to-end runs in tests/test_run.py and the packed edge cases in test_cpu_packed.py)."""

from __future__ import annotations

import pytest

from costmodels import RooflineModel, host_cpu, host_params
from fusesearch.api import plan as make_plan
from fusesearch.backends.codegen import CPU_LIBRARY_ONLY, generate
from fusesearch.costing import kernel_cost
from fusesearch.ir.shapes import ShapeBindings
from fusesearch.pipeline import prepare
from fusesearch.search import STRATEGIES
from fusesearch.zoo import ZOO
from tests.conftest import zoo_params


@pytest.mark.parametrize("name", zoo_params())
def test_every_host_kernel_of_every_zoo_plan_is_its_priced_schedule(name):
    dims = ["seq=32"] if "seq" in ZOO[name].default_dims else []  # the text models shorter: planning time
    prep = prepare(f"zoo:{name}", ShapeBindings.parse(dims=dims))
    device, model = host_cpu(1), RooflineModel(host_params())  # the host at 1 thread, as the plans default to
    packed = 0
    for strategy in STRATEGIES:
        p = make_plan(f"zoo:{name}", device="host", strategy=strategy, prepared=prep, time_limit_s=1)
        for g in p.groups:
            k = g.kernel
            assert kernel_cost(k, device, model).time_s == pytest.approx(g.cost.time_s, rel=1e-12), (name, g.id)
            ours = k.anchor is not None and k.impl == "generated"
            if k.anchor is not None and len(k.nodes) == 1:
                assert ours == (p.graph.nodes[k.anchor].op_type not in CPU_LIBRARY_ONLY), (name, strategy, g.id)
            own = "depthwise" if k.template == "depthwise" else "packed"
            assert (k.schedule.skeleton == own) == ours, (name, strategy, g.id, k.schedule)
            if k.alias or k.impl == "library":
                continue
            gk = generate(p.graph, k)
            assert gk.skeleton == k.schedule.skeleton, (name, strategy, g.id)
            assert "malloc(" not in gk.c_source, (name, strategy, g.id)  # scratch comes from the arena
            if ours:
                packed += 1
                assert gk.cuda_source == "" and g.cost.compute_unit == "cpu-simd"
                assert k.spec().unit == "cpu-simd" and k.spec().smem_bytes == 0
                body = gk.c_source.split(f"\nvoid {gk.name}(")[1].split(f"\nvoid {gk.name}_pack(")[0]  # the kernel itself
                if k.schedule.product == "nchwc":  # blocked (a plan's layout choice): block vectors, no panel
                    assert "fs_vb" in body and "patch[" not in body and "fs_gemm" not in body, (name, strategy, g.id)
                else:
                    assert ("patch[" in body and "fs_gemm" not in body) == (own == "depthwise"), (name, strategy, g.id)
    assert packed or name == "rnn-control", f"{name}: no fused gemm/conv in any host plan"
