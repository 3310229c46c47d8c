"""Profiles: JSON round trip, load_device by name or path, clear errors on bad files."""

from __future__ import annotations

import json

import pytest

from costmodels import (
    DEVICES,
    Profile,
    ProfileError,
    RooflineParams,
    host_params,
    load_device,
    load_profile,
    save_profile,
)

FITTED = RooflineParams().with_updates(overlap=0.8, memory_efficiency={"pointwise": 0.83})


def make_profile() -> Profile:
    fit = {"n_train": 40, "n_heldout": 10,
           "heldout": {"before": {"mape": 0.4, "spearman": float("nan")}}}
    return Profile(DEVICES["a10"], FITTED, backend="cupy", fit=fit)


def test_profile_round_trips_through_json(tmp_path):
    """Serialization: save then load gives the same device and params; NaN becomes null."""
    path = save_profile(make_profile(), tmp_path / "sub" / "profile.json")
    data = json.loads(path.read_text())
    assert data["schema"] == "fusesearch.profile/1"
    assert set(data) == {"schema", "device", "backend", "params", "fit", "versions"}
    assert data["fit"]["heldout"]["before"]["spearman"] is None
    loaded = load_profile(path)
    assert loaded.device == DEVICES["a10"] and loaded.params == FITTED
    assert loaded.backend == "cupy" and loaded.fit["n_train"] == 40
    assert save_profile(loaded, tmp_path / "again.json").read_text() == path.read_text()


def test_load_device_by_name_and_by_path(tmp_path):
    """Device selection: a table name gives default params; a profile path its fitted params."""
    assert load_device("h100-sxm") == (DEVICES["h100-sxm"], RooflineParams())
    path = save_profile(make_profile(), tmp_path / "profile.json")
    assert load_device(str(path)) == (DEVICES["a10"], FITTED)
    assert load_device(path) == (DEVICES["a10"], FITTED)
    bare = save_profile(make_profile(), tmp_path / "a10-profile")
    assert load_device(bare) == (DEVICES["a10"], FITTED)


def test_a_cpu_starts_from_its_library_s_own_efficiencies():
    """`host` (a CPU) gets the model's defaults but MLAS's efficiencies where calibration on two
    CPUs agreed: its convs over overlapping windows below ours, its depthwise convs far below,
    its GEMMs and 1x1 convs as ours; our NCHW depthwise loop below our blocked one, our blocked
    dense convs a little above our NCHW ones; a GPU table
    name gets the defaults alone."""
    spec, params = load_device("host")
    assert spec.kind == "cpu" and params == host_params() != RooflineParams()
    get = params.get
    assert get("library_efficiency", "conv") < get("tc_efficiency", "conv")
    assert get("library_efficiency", "depthwise") < 0.1 * get("tc_efficiency", "depthwise")
    for template in ("gemm", "conv_disjoint"):
        assert get("library_efficiency", template) == get("tc_efficiency", template)
    # our NCHW depthwise loop below our blocked one, our blocked dense convs a little above our NCHW
    # ones (bench_nchwc's measurements), the rest alike
    assert get("product_efficiency", "depthwise") < 1.0 < get("product_efficiency", "nchwc") < 1.25
    assert get("product_efficiency", "band") == get("product_efficiency", "packed") == 1.0
    assert params.with_updates(library_efficiency=dict(RooflineParams().library_efficiency),
                               product_efficiency=dict(RooflineParams().product_efficiency)) == RooflineParams()


@pytest.mark.parametrize(("content", "problem"), [
    (None, "no such file"),
    ("{not json", "not valid JSON"),
    ('{"schema": "fusesearch.plan/1"}', "schema 'fusesearch.plan/1'"),
    ('[1, 2]', "expected an object"),
    ('{"schema": "fusesearch.profile/1", "device": {"name": "x"}}', "missing"),
    ('{"schema": "fusesearch.profile/1", "device": DEVICE, "params": {"overlap": 3}}', "overlap"),
    ('{"schema": "fusesearch.profile/1", "device": DEVICE, "params": {"speed": 1}}', "speed"),
])
def test_bad_profiles_name_the_file_and_problem(tmp_path, content, problem):
    """Bad input: every broken profile is a ProfileError (a ValueError) naming file and problem."""
    path = tmp_path / "broken.json"
    if content is not None:
        path.write_text(content.replace("DEVICE", json.dumps(DEVICES["t4"].to_dict())))
    with pytest.raises(ProfileError) as info:
        load_device(str(path))
    assert isinstance(info.value, ValueError)
    assert str(path) in str(info.value) and problem in str(info.value)
    assert "fusesearch calibrate" in str(info.value) and "\n" not in str(info.value)
