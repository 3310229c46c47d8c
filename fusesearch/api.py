"""The Python API for notebooks: `fusesearch.plan(model, device=..., strategy=...)`.

Problem: researchers script experiments; they want the CLI's pipeline as one call returning
values they can inspect (`Plan.to_pandas()`), not files.
Approach: the same steps as `fusesearch plan`: prepare (load → canonicalize → [half conversion] →
Graph), resolve
the device (name or profile.json), search, return the validated Plan.
Invariants: no files are written; errors are the package's (`FusesearchError`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from pathlib import Path

from fusesearch.errors import BadInput
from fusesearch.ir.shapes import ShapeBindings
from fusesearch.plans import ModelInfo, Plan
from fusesearch.search.problem import SearchConfig


def resolve_device(name_or_path: str):
    """(label, DeviceSpec, RooflineParams, profile path or None); BadInput for an unknown name or a
    list of several (one command, one device: `compare` takes lists)."""
    from costmodels import CostModelError, load_device

    text = str(name_or_path)
    if "," in text and not Path(text).is_file():
        raise BadInput(f"--device {text}: give one device here (a name or a profile.json); to set several "
                       f"devices side by side run `fusesearch compare MODEL --device {text}`")
    try:
        spec, params = load_device(name_or_path)
    except CostModelError as exc:
        raise BadInput(f"--device {name_or_path}: {exc}") from None
    is_profile = str(name_or_path).endswith(".json") or Path(str(name_or_path)).is_file()
    return (spec.name, spec, params, str(name_or_path) if is_profile else None)


def for_device(prep, spec, params):
    """(prepared model, cost-model parameters) for one device: TF32 is used only where the user
    allows it (`--no-tf32` clears `Graph.allow_tf32`) and the device has TF32 tensor cores (sm_80
    and later; never on a CPU), and then for both the generated skeleton and the library's price."""
    if prep.graph.allow_tf32 and spec.tf32_flops_per_s <= 0:
        prep = dataclasses.replace(prep, graph=dataclasses.replace(prep.graph, allow_tf32=False))
    return prep, (params if prep.graph.allow_tf32 else params.with_updates(float32_uses_tf32=False))


def model_info(prep) -> ModelInfo:
    return ModelInfo(prep.loaded.name, prep.loaded.sha256, prep.loaded.nodes, len(prep.graph))


def plan(model: str, device: str = "h100-sxm", strategy: str = "greedy", *,
         input_shapes: Mapping[str, Iterable[int]] | None = None, dims: Mapping[str, int] | None = None,
         time_limit_s: float = 60.0, max_group_size: int = 16, seed: int = 0,
         workers: int | None = None, prepared=None, dtype: str = "float32", tf32: bool = True,
         lone_anchors: str = "priced", costs: str = "predicted") -> Plan:
    """`dtype`: float16 / bfloat16 plans the model converted to half (`ir.precision`); `tf32`:
    False plans float32 GEMMs and convs without TF32 (`--no-tf32`); `lone_anchors`: how a lone
    gemm/conv may run (`rules.LONE_ANCHORS`): "library" makes every one a library call (with
    strategy none: the unfused graph as ONNX Runtime runs it node by node, `measure --baseline
    library`'s reference), "generated" our kernel, "priced" whichever is cheaper; `costs`: what
    prices each group's choices (`autotune`): "predicted" (the cost model), "measured" (each timed
    on this machine: the CPU for host, CuPy for a GPU; kept in the timing database) or "hybrid"
    (the model's plan, then the choices of the groups each plan uses, searched again until the
    plan uses only measured groups)."""
    from costmodels import RooflineModel
    from fusesearch.autotune import check_costs, tuned_search
    from fusesearch.pipeline import prepare

    check_costs(costs)

    bindings = ShapeBindings.parse(
        [f"{k}={'x'.join(map(str, v))}" for k, v in (input_shapes or {}).items()],
        [f"{k}={v}" for k, v in (dims or {}).items()])
    label, spec, params, profile = resolve_device(device)
    prep, params = for_device(prepared or prepare(model, bindings, dtype=dtype, tf32=tf32), spec, params)
    config = SearchConfig(time_limit_s=time_limit_s, seed=seed, max_group_size=max_group_size,
                          lone_anchors=lone_anchors, **({"workers": workers} if workers else {}))
    return tuned_search(prep, spec, RooflineModel(params), strategy, config, costs, profile, device_label=label,
                        model_info=model_info(prep))[0]
