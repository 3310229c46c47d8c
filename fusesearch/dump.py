"""`--dump DIR`: the code a plan runs, one file per group, for reading (as XLA's dump folder).

Problem: the kernel cache keeps compiled objects only; a reader wanting to read, diff or hand-edit
what a plan runs has no source to look at.
Approach: the plan's groups become `run`'s steps (`run.plan_steps`), each written by group id:
`g7.c` (C source; `gN.unitK.c` its linked C units), `g7.cu` (CUDA source where the schedule has
one), `g7.json` (nodes, ops, how it runs and why, its schedule as plan.json records it, its
launch), and `index.json` (model, device, strategy, every group's files). A plan with layouts:
each reorder step `run` adds (`run._laid_out`) by its index, tensor and direction,
`r0.clip_4.NCHW-NCHW16c.c` and `.json` (the plan's reorder, its schedule, its launch).
`check_dump_dir` is the one check every command's --dump passes before any work.
Invariants: a folder that holds files is written into only with --force, and then only the
files named above are replaced; nothing else in it is touched."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from fusesearch.errors import BadInput, writing

FLAG = "--dump"
INDEX = "index.json"


def check_dump_dir(path: Path, overwrite: bool) -> None:
    """BadInput (exit 2, one line) when PATH cannot take a dump: a file, a folder that cannot be
    written, a missing parent, or a folder with files in it (without --force)."""
    if path.exists() and not path.is_dir():
        raise BadInput(f"{FLAG} {path}: is a file, not a folder; give a folder path (it is created if missing)")
    if not path.exists():
        if not path.parent.is_dir():
            raise BadInput(f"{FLAG} {path}: folder {path.parent} does not exist; create it first")
        if not os.access(path.parent, os.W_OK | os.X_OK):
            raise BadInput(f"{FLAG} {path}: cannot create it in {path.parent} (not writable); give a folder you "
                           "can write to")
        return
    if not os.access(path, os.W_OK | os.X_OK):
        raise BadInput(f"{FLAG} {path}: folder is not writable; give a folder you can write to")
    if any(path.iterdir()) and not overwrite:
        raise BadInput(f"{FLAG} {path}: folder is not empty; give an empty or new folder, or pass --force to "
                       "replace the dump in it")


def dump_files(plan) -> dict[str, str]:
    """File name -> text of the plan's dump (module note), index included."""
    from fusesearch.run import plan_steps

    steps = plan_steps(plan.graph, plan)
    files: dict[str, str] = {}
    groups = []
    for g in plan.groups:
        mine = [s for s in steps if s.group == g.id]
        how = mine[0].how if len(mine) == 1 else "library"  # a refused group: a library step per node
        names = _group_files(plan, g, how, mine, files)
        groups.append({"id": g.id, "runs_as": how,
                       "template": "alias" if g.kernel.alias else g.kernel.template,
                       "ops": [plan.graph.nodes[i].op_type for i in g.nodes], "files": names})
    reorders = [_reorder_files(plan, i, r, steps, files) for i, r in enumerate(plan.reorders)]
    files[INDEX] = _json({"model": plan.model.name, "device": plan.device, "strategy": plan.strategy,
                          "groups": groups, **({"reorders": reorders} if reorders else {})})
    return files


def _reorder_files(plan, i: int, r, steps, files: dict[str, str]) -> dict:
    """Add reorder R's files (the C source of the step `run` runs for it, then its JSON) to FILES,
    named `r{i}.{tensor}.{from}-{to}` (the tensor's name in letters, digits and `._-`); its index row."""
    from fusesearch.layout import copy_name

    step = next(s for s in steps if s.group == -1 and s.outputs == (copy_name(r.tensor, r.target),))
    stem = f"r{i}.{re.sub(r'[^A-Za-z0-9._-]+', '_', r.tensor)[:80]}.{r.source.name}-{r.target.name}"
    files[f"{stem}.c"] = step.kernel.c_source
    files[f"{stem}.json"] = _json({**plan.reorder_dict(r), "runs_as": step.how,
                                   "schedule": r.kernel.schedule.to_dict(), "launch": _launch(step.kernel)})
    return {**plan.reorder_dict(r), "files": [f"{stem}.c", f"{stem}.json"]}


def _group_files(plan, g, how: str, steps, files: dict[str, str]) -> list[str]:
    """Add group G's files (sources, then its JSON) to FILES; their names."""
    stem = f"g{g.id}"
    kernel = steps[0].kernel if how == "generated" else None
    names = []
    if kernel is not None:
        files[f"{stem}.c"] = kernel.c_source
        names.append(f"{stem}.c")
        for i, unit in enumerate(kernel.c_units):
            files[f"{stem}.unit{i}.c"] = unit
            names.append(f"{stem}.unit{i}.c")
        if kernel.cuda_source:
            files[f"{stem}.cu"] = kernel.cuda_source
            names.append(f"{stem}.cu")
    doc = {**plan.group_dict(g), "runs_as": how,
           "reason": steps[0].reason, "launch": _launch(kernel) if kernel is not None else None}
    files[f"{stem}.json"] = _json(doc)
    return [*names, f"{stem}.json"]


def _launch(kernel) -> dict:
    """How the program calls the kernel: its C function and arguments (in order: inputs, outputs,
    packed weights), and on a GPU its grid, block and skeleton."""
    def args(items):
        return [{"name": a.name, "tensor": a.tensor, "shape": list(a.shape), "dtype": a.dtype} for a in items]

    doc = {"function": kernel.name, "inputs": args(kernel.inputs), "outputs": args(kernel.outputs),
           "packed": [{"name": p.arg.name, "weight": p.arg.tensor, "floats": p.arg.size} for p in kernel.packed]}
    if kernel.cuda_source:
        doc["cuda"] = {"grid": list(kernel.grid), "block": list(kernel.block), "skeleton": kernel.skeleton}
    return doc


def _json(doc: dict) -> str:
    return json.dumps(doc, indent=1) + "\n"


def write_dump(plan, path: Path, overwrite: bool) -> list[Path]:
    """Write the plan's dump into PATH (checked by `check_dump_dir`, created if missing); the
    paths written, the index last."""
    check_dump_dir(path, overwrite)
    files = dump_files(plan)
    written = []
    with writing(path, FLAG):
        path.mkdir(exist_ok=True)
        for name, text in sorted(files.items(), key=lambda item: item[0] == INDEX):
            (path / name).write_text(text)
            written.append(path / name)
    return written
