"""The tuned tile table (tiles.json beside a profile.json, written by scripts/tune_tiles.py on a
GPU): the script's choice from timings (fake ones here), the table read into the device
(`DeviceSpec.tuned_tiles`), lowering offering the tuned configuration alone for its shape class
(the plan's choice follows the table; without one, the model's), and a malformed table a BadInput
naming the file."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
from onnx import helper

from costmodels import RooflineModel
from costmodels.profile import TILES_FILE, save_tuned_tiles
from fusesearch.api import for_device, resolve_device
from fusesearch.costing import cheapest, device_choices
from fusesearch.groups import FusionGroup
from fusesearch.pipeline import prepare
from fusesearch.schedule import MMA_SYNC_TILES, shape_class
from tests.backends.test_cuda_emulated import rand
from tests.conftest import make_model, save

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "experiments" / "h200-profile" / "profile.json"


def _tune_script():
    spec = importlib.util.spec_from_file_location("tune_tiles", ROOT / "scripts" / "tune_tiles.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_script_picks_the_least_geometric_mean_per_skeleton_and_class():
    """Fake per-launch seconds over two shapes: per (skeleton, class) the configuration of the least
    geometric mean (not the least sum: 1 and 100 us beat 20 and 20), every timed one listed."""
    a, b = (64, 64, 32, 32, 4), (128, 128, 64, 64, 4)
    rows = _tune_script().pick({("mma-sync-f16", "large", a): [1e-6, 100e-6], ("mma-sync-f16", "large", b): [20e-6, 20e-6],
                                ("mma-f16", "small", (32, 32)): [3e-6]})
    by_key = {(r["skeleton"], r["class"]): r for r in rows}
    assert by_key["mma-sync-f16", "large"]["config"] == list(a)
    assert by_key["mma-sync-f16", "large"]["geomean_s"] == pytest.approx(10e-6)
    assert [t["config"] for t in by_key["mma-sync-f16", "large"]["timed"]] == [list(a), list(b)]
    assert by_key["mma-f16", "small"]["config"] == [32, 32]


def gemm(tmp_path, m=4096, n=3072, k=768):
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Add", ["y", "b"], ["z"]),
             helper.make_node("Relu", ["z"], ["out"])]
    return save(make_model(nodes, [("x", [m, k])], [("out", None)], [("w", rand(k, n)), ("b", rand(n, seed=2))]),
                tmp_path / "gemm.onnx")


def profile_with(tmp_path, rows) -> Path:
    """A copy of the committed H200 profile with `rows` as the tuned table beside it."""
    folder = tmp_path / "h200"
    folder.mkdir(parents=True)
    shutil.copy(PROFILE, folder / "profile.json")
    if rows is not None:
        save_tuned_tiles(rows, "h200", folder / TILES_FILE)
    return folder / "profile.json"


def chosen(path, device):
    _, spec, params, _ = resolve_device(str(device))
    prep, params = for_device(prepare(path, tf32=True, dtype="float16"), spec, params)
    options = device_choices(prep.graph, FusionGroup(frozenset(range(len(prep.graph)))), spec)
    return spec, options, cheapest(options, spec, RooflineModel(params))[0]


def test_lowering_offers_the_tuned_configuration_and_the_plan_follows_it(tmp_path):
    """A 4096 x 3072 x 768 FP16 GEMM + bias + ReLU ("large") on the H200 profile: without a table
    every mma.sync configuration is a choice and the model picks one; with a table naming another
    configuration for mma-sync-f16 / large, that one alone is offered and chosen (the wmma tiles,
    untuned, all still offered); a row for another class changes nothing."""
    path = gemm(tmp_path)
    assert shape_class(4096, 3072) == "large"
    _, options, model_choice = chosen(path, profile_with(tmp_path / "a", None))
    sync = {(*k.tile[:2], *k.schedule.warp, k.schedule.stages) for k in options if k.schedule.skeleton == "mma-sync-f16"}
    assert sync == set(MMA_SYNC_TILES) and model_choice.schedule.skeleton == "mma-sync-f16"
    model_config = (*model_choice.tile[:2], *model_choice.schedule.warp, model_choice.schedule.stages)
    other = next(c for c in MMA_SYNC_TILES if c != model_config)
    rows = [{"skeleton": "mma-sync-f16", "class": "large", "config": list(other)},
            {"skeleton": "mma-sync-f16", "class": "skinny", "config": list(model_config)}]
    spec, options, tuned_choice = chosen(path, profile_with(tmp_path / "b", rows))
    assert ("mma-sync-f16", "large", other) in spec.tuned_tiles
    sync = [k for k in options if k.schedule.skeleton == "mma-sync-f16"]
    assert {(*k.tile[:2], *k.schedule.warp, k.schedule.stages) for k in sync} == {other}
    assert len([k for k in options if k.schedule.skeleton == "mma-f16"]) == 4
    assert (*tuned_choice.tile[:2], *tuned_choice.schedule.warp, tuned_choice.schedule.stages) == other


@pytest.mark.parametrize("text,says", [
    ("{not json", "cannot read the tuned tile table"),
    (json.dumps({"schema": "fusesearch.tiles/1", "tiles": [{"skeleton": "mma-sync-f16", "class": "huge",
                                                             "config": [64, 64, 32, 32, 4]}]}), "tiles[0]"),
    (json.dumps({"schema": "fusesearch.tiles/1", "tiles": [{"skeleton": "mma-sync-f16", "class": "large",
                                                             "config": [96, 96, 32, 32, 4]}]}), "is not one of"),
], ids=["not-json", "unknown-class", "unknown-configuration"])
def test_a_malformed_table_exits_2_naming_the_file(tmp_path, run_cli, text, says):
    profile = profile_with(tmp_path, None)
    (profile.parent / TILES_FILE).write_text(text)
    code, out, err = run_cli("plan", gemm(tmp_path, 64, 64, 64), "--device", profile)
    assert code == 2 and err.count("\n") == 1 and err.startswith("fusesearch: error: "), err
    assert str(profile.parent / TILES_FILE) in err and says in err
