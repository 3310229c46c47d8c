"""`fusesearch zoo export NAME --layers N ...`: the builders' sizes from the command line."""

from __future__ import annotations

import json

import onnx
import pytest

from fusesearch.cli import ZOO_SIZES
from fusesearch.zoo import ZOO, build_model


def test_the_size_options_are_every_builders_parameters(run_cli):
    assert set(ZOO_SIZES) == {p for e in ZOO.values() for p in e.params()}
    code, out, err = run_cli("zoo", "list", "--json")
    assert code == 0, err
    listed = {m["name"]: m["sizes"] for m in json.loads(out)["models"]}
    assert listed["bert-base"] == ["--layers", "--hidden", "--heads", "--intermediate", "--vocab"]
    assert listed["gpt2"][-1] == "--n-positions" and listed["resnet18"] == []


@pytest.mark.parametrize("name, flags, params", [
    ("bert-base", ("--layers", "1", "--hidden", "64", "--heads", "4", "--intermediate", "128", "--vocab", "50"),
     {"layers": 1, "hidden": 64, "heads": 4, "intermediate": 128, "vocab": 50}),
    ("gpt2", ("--layers", "1", "--hidden", "32", "--heads", "2", "--vocab", "40", "--n-positions", "16"),
     {"layers": 1, "hidden": 32, "heads": 2, "vocab": 40, "n_positions": 16}),
])
def test_export_builds_the_model_at_the_sizes_given(run_cli, tmp_path, name, flags, params):
    path = tmp_path / "m.onnx"
    code, _, err = run_cli("zoo", "export", name, "-o", path, *flags)
    assert code == 0, err
    assert path.read_bytes() == build_model(name, **params).SerializeToString()
    assert len(onnx.load(str(path)).graph.node) < len(build_model(name, layers=2, **{
        k: v for k, v in params.items() if k != "layers"}).graph.node)


def test_bert_base_with_four_layers(run_cli, tmp_path):
    path = tmp_path / "b.onnx"
    code, _, err = run_cli("zoo", "export", "bert-base", "--layers", "4", "-o", path)
    assert code == 0, err
    assert path.read_bytes() == build_model("bert-base", layers=4).SerializeToString()


@pytest.mark.parametrize("flags, needle", [
    (("bert-small", "--layers", "0"), "--layers 0: give a positive whole number"),
    (("bert-small", "--heads", "-2"), "--heads -2: give a positive whole number"),
    (("resnet18", "--hidden", "64"), "--hidden 64: zoo model resnet18 has no such size; its sizes: none"),
    (("bert-small", "--n-positions", "8"), "--n-positions 8: zoo model bert-small has no such size; its sizes: "
                                           "--layers, --hidden, --heads, --intermediate, --vocab"),
    (("bert-small", "--heads", "3"), "multiple of heads=3; give heads (--heads) that divide hidden (--hidden)"),
    (("bert-small", "--layers", "x"), "--layers"),
])
def test_bad_sizes_exit_2_naming_the_option(run_cli, tmp_path, flags, needle):
    path = tmp_path / "m.onnx"
    code, out, err = run_cli("zoo", "export", *flags, "-o", path)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert err.startswith("fusesearch: error: ") and needle in err and not path.exists()
