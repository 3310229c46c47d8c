"""Canonicalization never changes results: ONNX Runtime on every zoo model before and after,
on seeded random inputs, |a - b| <= 1e-4 * max(1, max|a|) for every output."""

from __future__ import annotations

import pytest

from fusesearch import zoo
from fusesearch.ir.canonicalize import to_proto
from fusesearch.pipeline import prepare
from fusesearch.verify import compare, random_feeds, run


@pytest.mark.parametrize("name", list(zoo.ZOO))
def test_canonical_model_runs_equal(name):
    original = zoo.build_model(name)
    prep = prepare(f"zoo:{name}")
    canonical = to_proto(prep.canonical)
    feeds = random_feeds(canonical, seed=11)
    diffs = compare(run(original, feeds), run(canonical, feeds), rtol=1e-4)
    assert diffs and all(d.ok for d in diffs), diffs
    assert len(prep.graph) <= prep.loaded.nodes
    assert all(n.op_type not in ("Identity", "Dropout") for n in prep.graph.nodes)


@pytest.mark.parametrize("name", [n for n in zoo.ZOO if n != "rnn-control"])
def test_canonical_model_has_static_shapes(name):
    prep = prepare(f"zoo:{name}")
    unknown = [t for n in prep.graph.nodes for t in n.outputs if prep.graph.tensors[t].shape is None]
    assert unknown == []
    assert "BatchNormalization" not in {n.op_type for n in prep.graph.nodes}
