"""Every group of every zoo plan, on the CPU backend, equals ONNX Runtime on that group's subgraph.

For each of the 11 zoo models and each strategy (none, rules, greedy, cpsat; device h100-sxm),
every group of the plan runs on the CPU backend the way `fusesearch measure` runs it:

- a generated C/OpenMP kernel (compiled by cc, cached on disk by source hash);
- where codegen refuses (the opaque template: Loop, If), the library path — the one
  node cut out of the model and run by ONNX Runtime (`backends.library`) — and, where
  `backends.arraylib` implements the op, that array code with numpy (the math the GPU library
  path runs with cupy). Only the groups on `KNOWN_REFUSED` ((model, op types) → reason) may be
  refused: any other refusal fails, and so does a listed group that no plan refuses any more
  ("remove it"), so the list only shrinks;
- every lone anchor (MatMul, Gemm, Conv, ConvTranspose: the unfused plan's library baseline) also
  through `arraylib` with numpy;
- an alias (a lone view) runs nothing and is only counted.

The reference is ONNX Runtime's value of each output tensor when it runs the canonical model on
seeded valid inputs (`verify.all_values`, optimizations off): the group's inputs are ORT's values
too, so this is ORT run on the group's subgraph. Tolerance as `verify.compare` (|a - b| <= 1e-4 ·
max(1, max|a|), NaNs where ORT has them).
Dedupe: kernels are generated under one fixed name, so repeated layers (and a group chosen by
several strategies) give the same source; each (source hash, input shapes) runs once, each
library node once per (op, attributes, input shapes).
Dims: the text models run at batch 1, seq 32 (zoo default 128) so the plain C loop nests of the
large GEMMs (gpt2's tied 50257-wide LM head) stay within the CI budget; the image models run at
their fixed 224×224 (batch 1).

Candidates: plans choose few of the groups the search may choose (a measured-cost plan or another
device may choose any); every candidate group of resnet18 (and, under -m slow, bert-small at its
default seq 128) runs each generated host choice the same way, and every candidate holding
bert-small's pooler Gather does in the fast run.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from costmodels import RooflineModel
from fusesearch import zoo
from fusesearch.api import for_device, resolve_device
from fusesearch.api import plan as make_plan
from fusesearch.backends import arraylib, cpu
from fusesearch.backends.codegen import CodegenRefused, generate
from fusesearch.backends.library import library_runner
from fusesearch.candidates.enumerate import enumerate_candidates
from fusesearch.groups import FusionDecision, FusionGroup
from fusesearch.ir.canonicalize import to_proto
from fusesearch.ir.shapes import ShapeBindings
from fusesearch.lowering import choices
from fusesearch.pipeline import prepare
from fusesearch.search import STRATEGIES
from fusesearch.search.problem import SearchProblem
from fusesearch.verify import all_values, compare, random_feeds
from tests.conftest import zoo_params

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C compiler")

DEVICE = "h100-sxm"
TEXT_SEQ = 32
ANCHORS = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose"})
OPAQUE = "lowers to the opaque template: runs as a library call (ONNX Runtime; arraylib on the GPU)"
KNOWN_REFUSED: dict[tuple[str, tuple[str, ...]], str] = {}  # rnn-control's Loop and If are inlined when it loads


@functools.lru_cache(maxsize=1)
def _model(name: str, seq: int = TEXT_SEQ):
    dims = {"seq": seq} if "seq" in zoo.ZOO[name].default_dims else {}
    prep = prepare(f"zoo:{name}", ShapeBindings.parse(dims=[f"{k}={v}" for k, v in dims.items()]))
    canonical = to_proto(prep.canonical)
    return prep, canonical, all_values(canonical, random_feeds(canonical, 0))


def _assert_matches(values, outputs: dict, what: str) -> None:
    reference = {t: values[t] for t in outputs}
    got = {t: np.asarray(y).reshape(np.shape(values[t])) for t, y in outputs.items()}
    bad = [d for d in compare(reference, got) if not d.ok]
    assert not bad, f"{what}: {bad}"


def _arraylib_key(node, values):
    shapes = tuple(tuple(values[t].shape) if t else None for t in node.inputs)
    return node.op_type, repr(sorted(node.attrs.items())), shapes


def _check_arraylib(node, values, seen: set) -> bool:
    """The node through arraylib with numpy (once per op, attributes and shapes); False when
    arraylib does not implement it."""
    outputs = [t for t in node.outputs if t]
    if not arraylib.supports(node.op_type, node.attrs, len(outputs)):
        return False
    key = _arraylib_key(node, values)
    if key not in seen:
        seen.add(key)
        got = arraylib.run(np, node.op_type, node.attrs, [values[t] if t else None for t in node.inputs], len(outputs))
        _assert_matches(values, dict(zip(outputs, got, strict=True)), f"arraylib {node.op_type} {node.name}")
    return True


@pytest.mark.parametrize("name", zoo_params())
def test_every_group_of_every_zoo_plan_matches_ort_on_the_cpu_backend(name, record_property):
    prep, canonical, values = _model(name)
    graph = prep.graph
    kernels: set = set()
    library_nodes: set = set()
    count = dict.fromkeys(("groups", "alias", "generated", "generated_run", "refused", "refused_checked",
                           "arraylib_checked", "lone_anchors", "library_anchors"), 0)
    refused: set[tuple[str, ...]] = set()
    for strategy in STRATEGIES:
        for g in make_plan(f"zoo:{name}", device=DEVICE, strategy=strategy, prepared=prep).groups:
            count["groups"] += 1
            if g.kernel.alias:
                count["alias"] += 1
                continue
            nodes = [graph.nodes[i] for i in g.nodes]
            if len(nodes) == 1 and nodes[0].op_type in ANCHORS:
                count["lone_anchors"] += 1
                assert _check_arraylib(nodes[0], values, library_nodes), nodes[0].op_type
            if g.kernel.impl == "library" and g.kernel.template != "opaque":  # a lone anchor priced as the
                run, _ = library_runner(canonical, graph, g.kernel, {t: values[t] for t in g.kernel.inputs})
                _assert_matches(values, run(), f"{name} {strategy} g{g.id} library {nodes[0].op_type}")
                count["library_anchors"] += 1  # library's call: no generated form, run as the plan runs it
                continue
            try:
                gk = generate(graph, g.kernel, name="fs_zoo_check")
            except CodegenRefused as exc:
                ops = tuple(n.op_type for n in nodes)
                assert (name, ops) in KNOWN_REFUSED, (
                    f"{name} {strategy} g{g.id} ({'+'.join(ops)}) is refused by codegen: {exc}; fix it, or add "
                    f"({name!r}, {ops!r}) to KNOWN_REFUSED with the reason")
                assert g.kernel.template == "opaque" or KNOWN_REFUSED[name, ops] != OPAQUE, (
                    f"{name} g{g.id} ({'+'.join(ops)}) is listed as opaque but lowers to {g.kernel.template} and "
                    f"is refused: {exc}")
                count["refused"] += 1
                refused.add(ops)
                run, _ = library_runner(canonical, graph, g.kernel, {t: values[t] for t in g.kernel.inputs})
                _assert_matches(values, run(), f"{name} {strategy} g{g.id} library {nodes[0].op_type}")
                _check_arraylib(nodes[0], values, library_nodes)
                count["refused_checked"] += 1
                continue
            count["generated"] += 1
            key = (gk.source_hash, tuple(a.shape for a in gk.inputs))
            if key in kernels:
                continue
            kernels.add(key)
            out = cpu.run(gk, {a.tensor: values[a.tensor] for a in gk.inputs})
            _assert_matches(values, out, f"{name} {strategy} g{g.id} {'+'.join(g.kernel.ops)}")
            count["generated_run"] += 1
    count["arraylib_checked"] = len(library_nodes)
    summary = (f"{name}: {count['groups']} groups over {len(STRATEGIES)} strategies: {count['alias']} alias, "
               f"{count['generated']} generated ({count['generated_run']} distinct kernels run), "
               f"{count['refused']} refused by codegen ({', '.join(sorted('+'.join(o) for o in refused)) or '-'}; "
               f"{count['refused_checked']} checked through the library), {count['arraylib_checked']} distinct "
               f"nodes through arraylib (numpy)")
    print(summary)
    record_property("summary", summary)
    assert count["groups"] == count["alias"] + count["generated"] + count["refused"] + count["library_anchors"]
    assert count["refused_checked"] == count["refused"]
    assert count["generated_run"] > 0
    stale = sorted(ops for model, ops in KNOWN_REFUSED if model == name and ops not in refused)
    assert not stale, f"no {name} plan has a refused {stale} group any more: remove it from KNOWN_REFUSED"


def _check_candidates(prep, values, touching: int | None = None) -> int:
    """Every candidate group the host search enumerates (only those holding node `touching` when
    given), each generated choice as the CPU runs it (`lowering.choices(host=True)`, as `autotune`
    times them), against ONNX Runtime; the number of distinct kernels run."""
    graph = prep.graph
    seen = set()
    for group in enumerate_candidates(_host_legality(prep)).groups:
        if touching is not None and touching not in group:
            continue
        kernels = choices(graph, FusionGroup(group), host=True)
        assert not isinstance(kernels, FusionDecision), (sorted(group), kernels)
        for kernel in kernels:
            if kernel.alias or kernel.impl != "generated":
                continue
            try:
                gk = generate(graph, kernel, name="fs_candidate")
            except CodegenRefused:
                continue
            key = (gk.source_hash, tuple(a.shape for a in gk.inputs))
            if key not in seen:
                seen.add(key)
                out = cpu.run(gk, {a.tensor: values[a.tensor] for a in gk.inputs})
                _assert_matches(values, out, f"candidate {'+'.join(graph.nodes[i].name for i in sorted(group))}")
    return len(seen)


def _host_legality(prep):
    """The legality rules the search applies for `--device host`."""
    _, spec, params, _ = resolve_device("host")
    prep, params = for_device(prep, spec, params)
    return SearchProblem.build(prep.graph, spec, RooflineModel(params)).legality


def test_every_candidate_with_bert_smalls_pooler_gather_matches_ort():
    """bert-small at seq 128: the pooler's Gather of the first token after the final LayerNorm
    has 128 values, as many as the LayerNorm's rows (hidden = seq = 128). Every candidate group
    holding it, each generated choice, equals ONNX Runtime; the LayerNorm's variance pass through
    the Gather as one row kernel is refused, naming the Gather (it read token 0's elements with
    each row's moments: max rel err 0.26)."""
    prep, _, values = _model("bert-small", seq=128)
    graph = prep.graph
    gather = [n for n in graph.nodes if n.op_type == "Gather"][-1]
    assert graph.tensors[gather.inputs[0]].shape == (1, 128, 128) and graph.tensors[gather.outputs[0]].size == 128
    assert _check_candidates(prep, values, gather.id) >= 5
    variance = max(n.id for n in graph.nodes if n.op_type == "ReduceMean" and n.id < gather.id)
    decision = _host_legality(prep).check(frozenset(range(variance, gather.id + 1))).decision
    assert not decision and f"{gather.name}(Gather)" in decision.reason, decision


@pytest.mark.parametrize("name", [pytest.param("bert-small", marks=pytest.mark.slow), "resnet18"])
def test_every_candidate_group_matches_ort(name):
    """Every candidate group the host search may choose, not only the plans' groups, at the zoo's
    default dims (bert-small's seq 128 = hidden is where its pooler Gather has one value per row).
    resnet18: about 30 s from a cold compiler cache on one core; bert-small (over 1000 kernels):
    about 2-3 minutes, so under -m slow."""
    dims = zoo.ZOO[name].default_dims
    prep, _, values = _model(name, seq=dims.get("seq", TEXT_SEQ))
    assert _check_candidates(prep, values) > 0


def test_known_refused_names_zoo_models():
    assert {model for model, _ in KNOWN_REFUSED} <= set(zoo.ZOO)
