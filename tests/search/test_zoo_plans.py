"""Every zoo model × every strategy: a valid plan whose plan.json matches the shipped JSON Schema;
resnet50's baseline and exact plans; byte-identical output on a second run."""

from __future__ import annotations

import functools
import json
from importlib import resources

import jsonschema
import onnx
import pytest

from costmodels import RooflineModel, get_device
from fusesearch import zoo
from fusesearch.api import model_info
from fusesearch.export import fused_model
from fusesearch.ir.canonicalize import to_proto
from fusesearch.pipeline import prepare
from fusesearch.plans import validate_plan
from fusesearch.search import STRATEGIES, SearchConfig, search
from fusesearch.verify import compare, random_feeds, run
from tests.conftest import SCALED_TWINS, zoo_params

H100 = get_device("h100-sxm")
SCHEMA = json.loads(resources.files("fusesearch").joinpath("schemas/plan.schema.json").read_text())


@functools.lru_cache(maxsize=2)
def prepared(name: str):
    return prepare(f"zoo:{name}")


def plan_of(name: str, strategy: str):
    prep = prepared(name)
    return search(prep.graph, H100, RooflineModel(), strategy, config=SearchConfig(time_limit_s=60, workers=2),
                  model_info=model_info(prep))


# the largest transformers (a minute, half a minute and 27 s here) under -m slow (`make test-all`):
# bert-small and vit-small keep the transformer case in the default run
LONG_PLANS = ("gpt2", *SCALED_TWINS)


@pytest.mark.parametrize("name", zoo_params(LONG_PLANS))
def test_every_strategy_plans_every_zoo_model_and_its_fused_model_verifies(name):
    """plan → plan.json (schema) → fused.onnx (checker, one node per kernel) → ONNX Runtime equal."""
    plans = {s: plan_of(name, s) for s in STRATEGIES}
    prep = prepared(name)
    graph = prep.graph
    canonical = to_proto(prep.canonical)
    feeds = random_feeds(canonical, seed=2)
    reference = run(zoo.build_model(name), feeds)
    for strategy, plan in plans.items():
        assert validate_plan(graph, plan.partition()), strategy
        doc = json.loads(plan.to_json())
        jsonschema.validate(doc, SCHEMA)
        assert doc["totals"]["kernels"] == plan.kernels
        assert sum(len(g["nodes"]) for g in doc["groups"]) == len(graph)
        fused = fused_model(canonical, graph, [g.nodes for g in plan.groups])
        onnx.checker.check_model(fused, full_check=True)
        assert len(fused.graph.node) == plan.kernels
        assert len(fused.functions) == sum(len(g.nodes) > 1 for g in plan.groups)
        assert all(f.domain == "fusesearch" for f in fused.functions)
        diffs = compare(reference, run(fused, feeds))
        assert diffs and all(d.ok for d in diffs), (strategy, diffs)
    tol = 1e-12
    assert plans["cpsat"].time_s <= plans["greedy"].time_s + tol
    assert plans["cpsat"].time_s <= plans["rules"].time_s + tol
    assert plans["cpsat"].solver.status == "OPTIMAL"
    assert plans["cpsat"].lower_bound_s <= plans["cpsat"].time_s <= plans["none"].time_s


def test_resnet50_rules_baseline_and_cpsat():
    rules, cpsat = plan_of("resnet50", "rules"), plan_of("resnet50", "cpsat")
    assert rules.kernels <= 58  # BN folded, Conv+Relu, Conv+Add+Relu
    fused_ops = {tuple(rules.graph.nodes[i].op_type for i in g.nodes) for g in rules.groups}
    assert ("Conv", "Relu") in fused_ops and ("Conv", "Add", "Relu") in fused_ops
    assert cpsat.time_s <= rules.time_s


@pytest.mark.parametrize("strategy", ["greedy", "cpsat"])
def test_plan_json_is_byte_identical_across_runs(strategy):
    prep = prepare("zoo:bert-small")
    texts = {search(prep.graph, H100, RooflineModel(), strategy, config=SearchConfig(time_limit_s=60, workers=2),
                    model_info=model_info(prep)).to_json() for _ in range(2)}
    assert len(texts) == 1


def test_plan_to_pandas_and_python_api():
    import fusesearch

    plan = fusesearch.plan("zoo:bert-small", device="a100-80gb", strategy="greedy")
    df = plan.to_pandas()
    assert len(df) == len(plan.groups) and {"template", "time_s", "ops"} <= set(df.columns)
    assert abs(df["time_s"].sum() - plan.time_s) / plan.time_s < 1e-5
