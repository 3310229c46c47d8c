"""The command line contract: `inspect` (text, --json, --canonical), `zoo list|export`."""

from __future__ import annotations

import json
import subprocess
import sys

import onnx

from fusesearch.verify import compare, random_feeds, run


def test_inspect_json_keys_and_resnet50_counts(run_cli):
    code, out, err = run_cli("inspect", "zoo:resnet50", "--json")
    assert code == 0, err
    doc = json.loads(out)
    for key in ("model", "nodes", "canonical_nodes", "ops", "kinds", "flops", "weight_bytes",
                "activation_bytes", "inputs", "outputs", "passes"):
        assert key in doc
    assert doc["nodes"] == 175 and doc["canonical_nodes"] == 122
    assert doc["passes"]["batchnorm_folding"] == 53
    assert "BatchNormalization" not in doc["ops"] and doc["ops"]["Conv"] == 53
    assert doc["inputs"][0]["shape"] == [1, 3, 224, 224]
    assert 7.5e9 < doc["flops"] < 8.5e9  # ResNet-50 is ~4.1 GMACs at 224x224


def _table_rows(text: str, title: str) -> list[list[str]]:
    """The body rows of the rich table printed under `title` (cells stripped)."""
    lines = text.splitlines()
    rows = []
    for line in lines[lines.index(title) + 1:]:
        if line.startswith("└"):
            break
        if line.startswith("│"):
            rows.append([cell.strip() for cell in line.strip("│").split("│")])
    return rows


def test_inspect_text_output_states_what_the_json_holds(run_cli):
    code, out, err = run_cli("inspect", "zoo:resnet18", "--json")
    assert code == 0, err
    doc = json.loads(out)
    code, text, err = run_cli("inspect", "zoo:resnet18")
    assert code == 0, err
    lines = text.splitlines()
    assert lines[0] == f"resnet18  (zoo:resnet18, opset {doc['opset']} → {doc['canonical_opset']})"
    assert lines[1].startswith("nodes 69 → 49 after canonicalization   FLOPs 3.64 G   weights 44.6 MiB   "
                               "activations 21.9 MiB")
    assert (doc["nodes"], doc["canonical_nodes"], doc["flops"]) == (69, 49, 3635523560)
    assert _table_rows(text, "inputs / outputs") == [["input", "input", "1x3x224x224", "float32"],
                                                     ["output", "logits", "1x1000", "float32"]]
    ops = {op: int(count) for op, count in _table_rows(text, "ops (canonical)")}
    assert ops == doc["ops"] == {"Conv": 20, "Relu": 17, "Sum": 8, "Flatten": 1, "Gemm": 1, "GlobalAveragePool": 1,
                                 "MaxPool": 1}
    assert sum(ops.values()) == doc["canonical_nodes"]
    assert "kinds: " + ", ".join(f"{k} {v}" for k, v in doc["kinds"].items()) in lines
    assert "passes: " + ", ".join(f"{k} {v}" for k, v in doc["passes"].items()) in lines
    assert doc["passes"]["batchnorm_folding"] == 20  # one BatchNormalization after each Conv, folded into it


def test_inspect_canonical_runs_in_ort_and_refuses_overwrite(run_cli, tmp_path):
    path = tmp_path / "canon.onnx"
    code, out, err = run_cli("inspect", "zoo:mobilenetv2", "--canonical", path, "--json")
    assert code == 0, err
    model = onnx.load(str(path))
    onnx.checker.check_model(model)
    assert len(model.graph.node) == json.loads(out)["canonical_nodes"]
    feeds = random_feeds(model, seed=0)
    assert run(str(path), feeds)
    code, _, err = run_cli("inspect", "zoo:mobilenetv2", "--canonical", path)
    assert code == 2 and "exists" in err
    code, _, err = run_cli("inspect", "zoo:mobilenetv2", "--canonical", path, "--force")
    assert code == 0


def test_devices_lists_the_table_and_the_host_figures_measured_once(run_cli):
    """`devices`: every GPU of the table and the host, whose measured figures (FP32 peak, DRAM,
    cache curve) are stated below the table and carried in full by --json."""
    from costmodels import DEVICES, host_cpu

    code, out, _ = run_cli("devices")
    assert code == 0
    assert all(name in out for name in DEVICES)
    host = host_cpu()
    line = next(x for x in out.splitlines() if x.startswith("host, measured once"))
    assert f"FP32 {host.fp32_flops_per_s / 1e9:.1f} GFLOP/s" in line
    assert f"DRAM {host.dram_bytes_per_s / 1e9:.1f} GB/s" in line
    assert ("no cache faster than DRAM" in line) == (host.cache_curve == ())
    assert all(f"{rate / 1e9:.1f} GB/s at {size / 2**20:g} MiB" in line for size, rate in host.cache_curve)
    code, out, _ = run_cli("devices", "--json")
    listed = {d["name"]: d for d in json.loads(out)["devices"]}
    assert [tuple(point) for point in listed["host"]["cache_curve"]] == list(host.cache_curve)
    assert listed["h100-sxm"]["cache_curve"] == []  # GPU timings flush L2: every byte at DRAM's rate


def test_zoo_list_and_export_round_trip(run_cli, tmp_path):
    code, out, _ = run_cli("zoo", "list", "--json")
    names = [m["name"] for m in json.loads(out)["models"]]
    assert {"resnet18", "resnet50", "mobilenetv2", "bert-base", "gpt2", "unet"} <= set(names)
    path = tmp_path / "bert.onnx"
    code, _, err = run_cli("zoo", "export", "bert-small", "-o", path)
    assert code == 0, err
    model = onnx.load(str(path))
    assert err.startswith(f"wrote {path} ({len(model.graph.node)} nodes, ") and err.count("\n") == 1  # one line
    dims = [d.dim_param or d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    assert dims == ["batch", "seq"]
    code, _, err = run_cli("inspect", path)
    assert code == 2 and "--dim" in err  # exported models keep their dynamic dims
    code, out, err = run_cli("inspect", path, "--dim", "batch=2", "--dim", "seq=16", "--json")
    assert code == 0, err
    assert json.loads(out)["inputs"][0]["shape"] == [2, 16]
    code, _, err = run_cli("zoo", "export", "bert-small", "-o", path)
    assert code == 2 and "exists" in err


def test_json_stdout_is_one_document_and_entry_point_runs():
    proc = subprocess.run([sys.executable, "-m", "fusesearch", "inspect", "zoo:resnet18", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["model"]
    bad = subprocess.run([sys.executable, "-m", "fusesearch", "inspect", "missing.onnx"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stdout == "" and len(bad.stderr.strip().splitlines()) == 1


def test_canonicalization_keeps_results_for_a_model_file(tmp_path):
    """The end-to-end path on a file: export, inspect --canonical, ORT on both."""
    from fusesearch import zoo

    src = tmp_path / "r18.onnx"
    src.write_bytes(zoo.build_model("resnet18").SerializeToString())
    out = tmp_path / "r18c.onnx"
    proc = subprocess.run([sys.executable, "-m", "fusesearch", "inspect", str(src), "--dim", "batch=2",
                           "--canonical", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    canonical = onnx.load(str(out))
    feeds = random_feeds(canonical, seed=5)
    assert all(d.ok for d in compare(run(str(src), feeds), run(str(out), feeds)))
