"""`fusesearch plan` and `compare`: summaries, plan.json, --explain lines, bad flags."""

from __future__ import annotations

import json
import re
from importlib import resources

import jsonschema

SCHEMA = json.loads(resources.files("fusesearch").joinpath("schemas/plan.schema.json").read_text())


def test_plan_summary_and_output_file(run_cli, tmp_path):
    out = tmp_path / "plan.json"
    code, stdout, err = run_cli("plan", "zoo:resnet50", "--device", "h100-sxm", "--strategy", "rules", "-o", out)
    assert code == 0, err
    assert "kernels 57" in stdout and "speedup" in stdout and "lower bound" in stdout
    doc = json.loads(out.read_text())
    jsonschema.validate(doc, SCHEMA)
    assert doc["strategy"] == "rules" and doc["model"]["nodes"] == 175 and doc["model"]["canonical_nodes"] == 122
    code, _, err = run_cli("plan", "zoo:resnet50", "--device", "h100-sxm", "-o", out)
    assert code == 2 and "exists" in err


def test_plan_json_records_each_groups_chosen_schedule(run_cli, tmp_path):
    """Which choice priced a group (tile, skeleton, grid...) is in plan.json: the schedule of the
    kernel the plan runs, equal to the priced kernel's; the schema's skeletons are the schedule's."""
    from costmodels.kernel import CPU_PRODUCTS
    from fusesearch.api import plan as make_plan
    from fusesearch.schedule import SKELETONS

    groups = SCHEMA["properties"]["groups"]["items"]["properties"]
    assert tuple(groups["schedule"]["properties"]["skeleton"]["enum"]) == SKELETONS
    assert tuple(groups["schedule"]["properties"]["product"]["enum"]) == ("", *CPU_PRODUCTS)
    out = tmp_path / "plan.json"
    code, _, err = run_cli("plan", "zoo:bert-small", "--device", "h100-sxm", "--strategy", "greedy", "-o", out)
    assert code == 0, err
    doc = json.loads(out.read_text())
    jsonschema.validate(doc, SCHEMA)
    plan = make_plan("zoo:bert-small", device="h100-sxm", strategy="greedy")
    for g, row in zip(plan.groups, doc["groups"], strict=True):
        s = g.kernel.schedule
        assert row["schedule"]["skeleton"] == s.skeleton and tuple(row["schedule"]["tile"]) == s.tile
        assert tuple(row["schedule"]["grid"]) == s.grid and row["schedule"]["split_k"] == s.split_k
        assert row["schedule"]["workspace_bytes"] == s.workspace_bytes
    skeletons = {row["schedule"]["skeleton"] for row in doc["groups"]}
    assert {"library", "block-per-row"} <= skeletons and skeletons & {"tiled", "mma-tf32", "mma-sync-tf32"}


def test_plan_json_stdout_has_plan_and_run(run_cli):
    code, stdout, err = run_cli("plan", "zoo:bert-small", "--device", "t4", "--strategy", "cpsat", "--json")
    assert code == 0, err
    doc = json.loads(stdout)
    run = doc.pop("run")
    jsonschema.validate(doc, SCHEMA)
    assert doc["solver"]["status"] == "OPTIMAL" and run["wall_s"] >= 0 and run["stats"]["candidates"] > 0


def test_explain_lines_are_greppable(run_cli):
    code, _, err = run_cli("plan", "zoo:resnet50", "--device", "t4", "--strategy", "greedy", "--explain")
    assert code == 0
    lines = err.strip().splitlines()
    fuse = [line for line in lines if line.startswith("[fuse]")]
    assert fuse and all(re.match(r"\[fuse\] \S+\(\w+\)(\+\S+\(\w+\))+ -> g\d+: [-+]\d+\.\d us$", line) for line in fuse)
    impl = [line for line in lines if line.startswith("[impl]")]  # every fused anchor group's decision
    assert len(impl) == sum(" -> g" in line and "(Conv)" in line for line in fuse)
    assert all(re.match(r"\[impl\] g\d+: generated \(fp32-cuda-core\) \d+\.\d us vs library \S+\(Conv\) "
                        r"\((fp32-cuda-core|tf32-tensor-core)\) \d+\.\d us \+ the rest apart \d+\.\d us = "
                        r"\d+\.\d us$", line) for line in impl)
    others = [line for line in lines if not line.startswith(("[fuse]", "[impl]"))]
    assert others and all(re.match(r"\[(refuse|skip)\] g\d+\+g\d+: .+", line) for line in others)
    assert any("two anchors" in line for line in others)


def test_explain_names_the_smem_limit(run_cli, tmp_path):
    """A MatMul under a 4096-wide Softmax is generated as a row kernel caching 32 KiB of rows: it
    fuses on a T4 (64 KiB per block) and is refused, with the numbers, on a device profile whose
    blocks have 16 KiB."""
    import dataclasses

    import numpy as np
    from onnx import helper

    from costmodels import DEVICES
    from costmodels.profile import Profile, save_profile
    from tests.conftest import make_model, save

    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"], name="mm"),
             helper.make_node("Softmax", ["m"], ["y"], axis=-1, name="sm")]
    model = make_model(nodes, [("x", [256, 64])], [("y", None)], [("w", np.ones((64, 4096), np.float32))])
    path = save(model, tmp_path / "mm_softmax.onnx")
    code, _, err = run_cli("plan", path, "--device", "t4", "--strategy", "greedy", "--explain")
    assert code == 0, err
    assert "[fuse] mm(MatMul)+sm(Softmax) -> g0" in err
    small = dataclasses.replace(DEVICES["t4"], name="t4-16k", smem_per_block_max_bytes=16 * 1024)
    profile = save_profile(Profile(small), tmp_path / "small.json")
    code, _, err = run_cli("plan", path, "--device", profile, "--strategy", "greedy", "--explain")
    assert code == 0, err
    assert re.search(r"\[refuse\] g0\+g1: smem 32\.1 KiB > 16\.0 KiB per block on t4-16k", err), err


def test_compare_devices_and_strategies(run_cli):
    code, stdout, err = run_cli("compare", "zoo:bert-small", "--device", "h100-sxm,t4", "--strategies",
                                "rules,greedy", "--json")
    assert code == 0, err
    doc = json.loads(stdout)
    assert {(r["device"], r["strategy"]) for r in doc["results"]} == {
        (d, s) for d in ("h100-sxm", "t4") for s in ("rules", "greedy")}
    assert {d["strategy"] for d in doc["differences"]} == {"rules", "greedy"}
    code, stdout, err = run_cli("compare", "zoo:resnet18", "--device", "a100-80gb,t4", "--strategies", "none,greedy")
    assert code == 0, err
    assert "greedy" in stdout and "t4" in stdout


def test_bad_plan_flags_exit_2(run_cli):
    for args, needle in [
        (("--strategy", "magic"), "--strategy magic"),
        (("--device", "gtx-9999"), "--device gtx-9999"),
        (("--time-limit", "0"), "--time-limit"),
        (("--max-group-size", "0"), "--max-group-size"),
    ]:
        argv = ["plan", "zoo:resnet18", "--device", "t4", *args]
        code, _, err = run_cli(*argv)
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, (args, err)
    code, _, err = run_cli("compare", "zoo:resnet18", "--device", "t4", "--strategies", "none,magic")
    assert code == 2 and "magic" in err
    # compare's flag is named as plan's (and takes a list, as --device does); --strategies stays an alias
    code, _, err = run_cli("compare", "zoo:resnet18", "--device", "t4", "--strategy", "none,magic")
    assert code == 2 and err.startswith("fusesearch: error: --strategy none,magic: unknown magic"), err


def test_no_tf32_prices_fused_gemms_on_cuda_cores(run_cli):
    """TF32 is the default on a GPU that has it: fused gemm groups are generated for tensor cores
    and priced there (as the library calls are; at batch 8, where the products have the rows to
    fill tensor-core tiles); --no-tf32 puts both on the FP32 CUDA cores; a device without TF32
    (T4) never plans a TF32 kernel."""
    units = {}
    for flags in ((), ("--no-tf32",)):
        code, stdout, err = run_cli("plan", "zoo:bert-small", "--dim", "batch=8", "--device", "h100-sxm",
                                    "--strategy", "greedy", "--json", *flags)
        assert code == 0, err
        units[flags] = {(g["impl"], g["template"], g["compute_unit"]) for g in json.loads(stdout)["groups"]}
    assert {("generated", "gemm", "tf32-tensor-core"), ("library", "gemm", "tf32-tensor-core")} <= units[()]
    assert not any(u.endswith("tensor-core") for _, _, u in units[("--no-tf32",)]), units[("--no-tf32",)]
    code, stdout, err = run_cli("plan", "zoo:bert-small", "--device", "t4", "--strategy", "greedy", "--json")
    assert code == 0, err
    assert not any(g["compute_unit"] == "tf32-tensor-core" for g in json.loads(stdout)["groups"])
