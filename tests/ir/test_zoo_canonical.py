"""Canonicalization never changes results: ONNX Runtime on every zoo model before and after,
on seeded random inputs, |a - b| <= 1e-4 * max(1, max|a|) for every output; and the canonical
graph is what fusion expects (static shapes, no BatchNormalization / Identity / Dropout)."""

from __future__ import annotations

import pytest

from fusesearch import zoo
from fusesearch.ir.canonicalize import to_proto
from fusesearch.pipeline import prepare
from fusesearch.verify import compare, random_feeds, run
from tests.conftest import zoo_params


@pytest.mark.parametrize("name", zoo_params())
def test_canonical_model_runs_equal(name):
    original = zoo.build_model(name)
    prep = prepare(f"zoo:{name}")
    canonical = to_proto(prep.canonical)
    feeds = random_feeds(canonical, seed=11)
    diffs = compare(run(original, feeds), run(canonical, feeds), rtol=1e-4)
    assert diffs and all(d.ok for d in diffs), diffs
    ops = {n.op_type for n in prep.graph.nodes}
    assert len(prep.graph) < prep.loaded.nodes or prep.passes["loop_unrolling"]  # a body's copies add nodes
    assert not ops & {"Identity", "Dropout", "BatchNormalization", "Constant", "Shape"}
    unknown = [t for n in prep.graph.nodes for t in n.outputs if prep.graph.tensors[t].shape is None]
    assert unknown == []
