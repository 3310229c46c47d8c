"""Fused ONNX export: each multi-node group becomes one node calling a model-local function.

Problem: the fused model must be valid ONNX that ONNX Runtime runs (so `verify` can prove it equal)
and Netron shows with one box per kernel.
Approach: from the canonical model, walk the plan's groups in order: a single node is copied; a
multi-node group becomes FunctionProto `g<id>` (domain `fusesearch`) over its nodes, inputs the
tensors read from outside (weights included), outputs those used outside, called by node `g<id>`.
`save_model` keeps external weights in the original data file (large ones, above 2 GiB, in its
own), staged and moved into place. `plan_groups_from_json` maps a plan.json onto a model, refusing
unknown nodes, groups not connected, convex and in order, or illegal kernels; `export` and
`measure --plan` read plans through it (`run --plan` its layouts too: `plan_layouts_from_json`).
Layouts live inside programs (`run`): a plan's blocked groups and reorders (plan.json's "layout"
and "layouts") are not exported, every tensor of the fused model is NCHW as in the model.
Invariants: the main graph has one node per group in topological order; graph inputs, outputs and
initializers keep their names; If/Loop bodies are copied untouched."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import onnx
from onnx import helper

from fusesearch.candidates.rules import Legality, Lowerable
from fusesearch.errors import BadInput, check_output_path
from fusesearch.ir.graph import Graph
from fusesearch.layout import Layout
from fusesearch.plans import order_groups, validate_plan
from fusesearch.schedule import CHAIN, anchor_chain

DOMAIN = "fusesearch"
FUNCTION_OPSET = 1
DATA_ALIGN = 4096  # weights start on page boundaries in a written data file (ONNX Runtime maps them)
COPY_CHUNK = 1 << 24  # weights are copied from a data file this many bytes at a time


def fused_model(canonical: onnx.ModelProto, graph: Graph, groups: Sequence[Sequence[int]],
                name_prefix: str = "g") -> onnx.ModelProto:
    """`groups` in plan order (topological); node ids are `graph`'s (= the canonical node order)."""
    main = canonical.graph
    if len(main.node) != len(graph):
        raise ValueError(f"canonical model has {len(main.node)} nodes, the Graph {len(graph)}")
    opset = next(o.version for o in canonical.opset_import if o.domain in ("", "ai.onnx"))
    nodes, functions = [], []
    for gid, group in enumerate(groups):
        members = sorted(group)
        if len(members) == 1:
            nodes.append(main.node[members[0]])
            continue
        inputs, outputs = _boundary(graph, members)
        fname = f"{name_prefix}{gid}"
        functions.append(helper.make_function(
            DOMAIN, fname, inputs, outputs, [main.node[i] for i in members],
            opset_imports=[helper.make_opsetid("", opset)],
            doc_string=" + ".join(f"{graph.nodes[i].name}({graph.nodes[i].op_type})" for i in members)))
        nodes.append(helper.make_node(fname, inputs, outputs, name=fname, domain=DOMAIN))
    model = onnx.ModelProto()
    model.CopyFrom(canonical)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    model.functions.extend(functions)
    if functions and not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, FUNCTION_OPSET))
    _keep_value_info(model, graph)
    return model


def _boundary(graph: Graph, members: list[int]) -> tuple[list[str], list[str]]:
    ids = set(members)
    produced = {t for i in members for t in graph.nodes[i].outputs if t}
    inputs: dict[str, None] = {}
    outputs: dict[str, None] = {}
    for i in members:
        for t in graph.nodes[i].inputs:
            if t and t not in produced:
                inputs.setdefault(t)
        for t in graph.nodes[i].outputs:
            if t and (graph.is_output(t) or any(c not in ids for c in graph.consumers(t))):
                outputs.setdefault(t)
    return list(inputs), list(outputs)


def _keep_value_info(model: onnx.ModelProto, graph: Graph) -> None:
    """value_info for every tensor the main graph passes between nodes (shapes stay visible)."""
    known = {vi.name for vi in model.graph.value_info} | {vi.name for vi in model.graph.input} | {
        vi.name for vi in model.graph.output}
    main_tensors = {t for n in model.graph.node for t in (*n.input, *n.output) if t}
    for name in sorted(main_tensors - known):
        info = graph.tensors.get(name)
        if info is None or info.constant or info.shape is None or info.dtype == "unknown":
            continue
        elem = helper.np_dtype_to_tensor_dtype(_np_dtype(info.dtype))
        model.graph.value_info.append(helper.make_tensor_value_info(name, elem, list(info.shape)))


def _np_dtype(name: str):
    import numpy as np

    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def save_model(model: onnx.ModelProto, path: Path, *, overwrite: bool, flag: str = "--emit") -> Path:
    """Write `model` all at once: staged in a hidden folder next to `path` and moved into place, so
    a failed or interrupted write leaves nothing behind. Weights go into its own data file beside
    it, `path`.data: those that stay in the original's data file (too large to read into memory,
    copied from it in chunks) and, above protobuf's 2 GiB, the large ones the proto holds. The
    moved weights of `model` then name that file (it is written last, not used after)."""
    from fusesearch.verify import PROTO_LIMIT

    path = Path(path)
    check_output_path(path, overwrite, flag)
    moved = _weights_to_move(model, model.ByteSize() > PROTO_LIMIT)
    data = path.with_name(path.name + ".data")
    if moved:
        check_output_path(data, overwrite, f"{flag} (its weights)")
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.name}.") as tmp:
        staged = Path(tmp) / path.name
        if moved:
            _write_weights(moved, staged.with_name(data.name), f"{flag} {path}")
        staged.write_bytes(model.SerializeToString())
        if moved:
            os.replace(staged.with_name(data.name), data)
        os.replace(staged, path)
    return path


def _weights_to_move(model: onnx.ModelProto, big: bool) -> list[onnx.TensorProto]:
    """The tensors of `model` that go into a data file: those in a data file now and, when `big`,
    the initializers holding at least `ASIDE_MIN_BYTES`."""
    from onnx.external_data_helper import _get_all_tensors, _get_initializer_tensors

    from fusesearch.ir.canonicalize import data_file
    from fusesearch.verify import ASIDE_MIN_BYTES

    moved = [t for t in _get_all_tensors(model) if data_file(t)]
    if big:
        moved += [t for t in _get_initializer_tensors(model)
                  if t.data_location != onnx.TensorProto.EXTERNAL and len(t.raw_data) >= ASIDE_MIN_BYTES]
    return moved


def _write_weights(tensors: list[onnx.TensorProto], data: Path, label: str) -> None:
    """Write the bytes of `tensors` into `data`, each at a page-aligned offset, from their data file
    in chunks or from the proto, and make each name `data`'s file name; BadInput when a data file
    holds fewer bytes than its tensor (it changed since the model was read)."""
    from fusesearch.ir.canonicalize import data_file

    with open(data, "wb") as out:
        for t in tensors:
            out.seek(-out.tell() % DATA_ALIGN, os.SEEK_CUR)
            offset, file = out.tell(), data_file(t)
            if file:
                info = {e.key: e.value for e in t.external_data}
                want = int(info["length"]) if "length" in info else -1
                with open(file, "rb") as src:
                    src.seek(int(info.get("offset", 0)))
                    length = _copy(src, out, want)
                if want >= 0 and length != want:
                    raise BadInput(f"{label}: weight '{t.name}' holds {want} bytes in {file}, which now has "
                                   f"{length} of them; the file changed since the model was read: run again")
            else:
                length = out.write(t.raw_data)
                t.ClearField("raw_data")
            t.data_location = onnx.TensorProto.EXTERNAL
            del t.external_data[:]
            for key, value in (("location", data.name), ("offset", offset), ("length", length)):
                t.external_data.add(key=key, value=str(value))


def _copy(src, out, length: int) -> int:
    """Copy `length` bytes (all that is left when -1) from `src` to `out`, a chunk at a time; the
    bytes copied."""
    copied = 0
    while length < 0 or copied < length:
        chunk = src.read(COPY_CHUNK if length < 0 else min(COPY_CHUNK, length - copied))
        if not chunk:
            break
        copied += out.write(chunk)
    return copied


# -- plans from elsewhere ---------------------------------------------------------------------

def plan_groups_from_json(path: Path, graph: Graph, legality: Legality | None = None) -> list[list[int]]:
    """Node-id groups of a plan.json, in its order; BadInput naming the group and the problem.
    Each group must be legal under `legality` (a device's rules), or, without one, lowerable."""
    doc = _read_plan(path)
    ids = {n.name: n.id for n in graph.nodes}
    owner: dict[int, int] = {}
    groups = []
    for g in doc["groups"]:
        members = []
        for name in g["nodes"]:
            if name not in ids:
                raise BadInput(f"{path}: group g{g['id']} names node '{name}', which the model does not have; "
                               "plan and export the same model with the same --dim/--input-shape")
            if ids[name] in owner:
                raise BadInput(f"{path}: node '{name}' is in groups g{owner[ids[name]]} and g{g['id']}; "
                               "each node must be in exactly one group")
            owner[ids[name]] = g["id"]
            members.append(ids[name])
        groups.append(members)
    missing = [n.name for n in graph.nodes if n.id not in owner]
    if missing:
        raise BadInput(f"{path}: node '{missing[0]}' is in no group ({len(missing)} missing); a plan must "
                       "cover every node of the canonical model")
    _check_groups(path, graph, doc, groups)
    _check_kernels(path, graph, doc, groups, legality)
    return [groups[i] for i in order_groups(graph, [frozenset(g) for g in groups])]


def plan_layouts_from_json(path: Path, graph: Graph, layout: Layout) -> tuple[dict | None, set[frozenset[int]]]:
    """(plan.json's layout record, or None; the node-id groups it runs in another layout), for
    `run --plan` to run the plan as it was chosen; BadInput where that layout is not `layout`, the
    one the device running it has (`costing.device_layout`: a CPU's channel block, a GPU's NHWC).
    Read after `plan_groups_from_json` has checked it."""
    doc = _read_plan(path)
    layouts = doc.get("layouts")
    ids = {n.name: n.id for n in graph.nodes}
    blocked = {frozenset(ids[name] for name in g["nodes"]) for g in doc["groups"]
               if g.get("layout", {}).get("out", "NCHW") != "NCHW"}
    planned = layouts.get("layout", f"NCHW{layouts['block']}c") if layouts else "NCHW"
    if blocked and planned != layout.name:
        where = (f"channel blocks of {layouts['block']}, this CPU's are {layout.block or 'none'}" if layouts["block"]
                 else f"{planned}, this device's other layout is {layout.name if layout.blocked else 'none'}")
        raise BadInput(f"{path}: the plan runs groups in {where}; plan again on this machine (or with --layouts nchw)")
    return ({k: layouts[k] for k in ("choice", "block", "layout") if k in layouts} if layouts else None), blocked


def _check_groups(path: Path, graph: Graph, doc: dict, groups: list[list[int]]) -> None:
    decision = validate_plan(graph, groups)
    if decision:
        return
    reason = decision.reason
    for index, g in enumerate(doc["groups"]):  # validate_plan counts groups by position
        reason = reason.replace(f"group {index} ", f"group g{g['id']} ")
    raise BadInput(f"{path}: {reason}; the plan does not fit this model")


def _check_kernels(path: Path, graph: Graph, doc: dict, groups: list[list[int]],
                   legality: Legality | None) -> None:
    if legality is None:  # no device: only the rules that need none (the device and generator fields go unread)
        legality = Legality(graph, device=None, model=None, capabilities=None, max_group_size=len(graph),
                            rules=(Lowerable(),))
    for g, members in zip(doc["groups"], groups, strict=True):
        decision = legality.check(members).decision
        if not decision and _blocked_only(graph, g, frozenset(members), legality):
            continue
        if not decision:
            names = ", ".join(graph.nodes[i].name for i in sorted(members))
            raise BadInput(f"{path}: group g{g['id']} ({names}) cannot be one kernel: {decision.reason}; "
                           "split it, or write the plan again with `fusesearch plan -o`")


def _blocked_only(graph: Graph, g: dict, members: frozenset[int], legality: Legality) -> bool:
    """Whether a plan's group that has no NCHW form runs as the blocked form it has alone (a
    chain of anchors, `schedule.anchor_chain`): the plan says so, and the device's rules take
    it (`Legality.blocked_only`; without a device, the chain alone)."""
    if g.get("schedule", {}).get("product") != CHAIN or anchor_chain(graph, members) is None:
        return False
    return legality.device is None or legality.blocked_only(members)


def _read_plan(path: Path) -> dict:
    import jsonschema

    from fusesearch.plans import plan_schema

    try:
        doc = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise BadInput(f"{path}: no such file; give a plan.json written by `fusesearch plan -o`") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadInput(f"{path}: not JSON ({exc}); give a plan.json written by `fusesearch plan -o`") from None
    try:
        jsonschema.validate(doc, plan_schema())
    except jsonschema.ValidationError as exc:
        where = "/".join(map(str, exc.absolute_path)) or "top level"
        raise BadInput(f"{path}: not a fusesearch.plan/1 document at {where}: {exc.message}") from None
    return doc
