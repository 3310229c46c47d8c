"""What the cost benchmarks share: the machine's name, a plan priced one way on `host`, and how a
median with its p20-p80 spread is written.

Two programs timed in the same rounds are compared round by round (`timing.paired`): "not
distinguishable" where the p20-p80 of their per-round ratios holds 1; on a shared machine a
difference inside the spread is not a result.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
from datetime import UTC, datetime

from fusesearch import zoo


def machine() -> str:
    """The CPU as lscpu names it, with its cores and the OpenMP threads the run uses."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        text = ""
    fields = dict(re.findall(r"^([^:\n]+):\s*(.+)$", text, re.M))
    name = fields.get("Model name", platform.processor() or "unknown CPU")
    cpus = fields.get("CPU(s)", str(os.cpu_count()))
    return f"{name}, {cpus} CPUs, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}"


def header(title: str, command: str) -> str:
    """The lines every results file opens with: what, the command, the machine, the date."""
    date = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    return f"# {title}\n\n    {command}\n\nMachine: {machine()}; {date}.\n"


def zoo_models() -> list[str]:
    return [m.name for m in zoo.list_models()]


def host_plan(prep, costs: str, *, strategy: str = "cpsat", time_limit_s: float = 60.0, cache=None,
              device: str = "host"):
    """(Plan, SearchProblem): `prep` planned for `device` (`host` or a host profile.json) with `costs`
    (`autotune.tuned_search`); `cache`: the timing database (default: the cache folder's)."""
    from costmodels import RooflineModel
    from fusesearch.api import for_device, model_info, resolve_device
    from fusesearch.autotune import tuned_search
    from fusesearch.search.problem import SearchConfig

    label, spec, params, profile = resolve_device(device)
    prep, params = for_device(prep, spec, params)
    return tuned_search(prep, spec, RooflineModel(params), strategy, SearchConfig(time_limit_s=time_limit_s),
                        costs, profile, cache=cache, device_label=label, model_info=model_info(prep))


def run_at(program, threads: int, feeds):
    """One run of CPU `program` (`run.Program`) with `threads` OpenMP threads (libgomp's count is
    the process's: set per run)."""
    def go() -> None:
        program.library.fs_set_threads(threads)
        program(feeds)
    return go


def spread(median: float, p20: float, p80: float, unit: float = 1e-3, digits: int = 3) -> str:
    """`median (p20-p80)` in `unit` (ms by default)."""
    return f"{median / unit:.{digits}f} ({p20 / unit:.{digits}f}-{p80 / unit:.{digits}f})"


# The child process callgrind runs: each entry's kernel called once (its filters packed first), so
# the counts of its parallel region (`--toggle-collect=GOMP_parallel`) are one call's. Prints
# "start I" before entry I: a crash names the kernel it stopped in.
CALLGRIND_CHILD = r"""
import ctypes, json, sys
import numpy as np
for i, e in enumerate(json.load(open(sys.argv[1]))):
    print("start", i, flush=True)
    lib = ctypes.CDLL(e["lib"])
    bufs = [np.load(p) for p in e["inputs"]] + [np.zeros(s, np.float32) for s in e["outputs"]]
    packs = [np.zeros(s, np.float32) for s in e["packed"]]
    ptr = [b.ctypes.data_as(ctypes.c_void_p) for b in bufs + packs]
    if packs:
        getattr(lib, e["name"] + "_pack")(*ptr[:len(e["inputs"])], *ptr[len(bufs):])
    getattr(lib, e["name"])(*ptr)
"""


def callgrind_entry(kernel, values, folder, stem: str) -> dict:
    """A generated `kernel` compiled, its inputs (from `values`) saved under `folder` as STEM_I.npy:
    one entry of CALLGRIND_CHILD's list."""
    import numpy as np

    from fusesearch.backends import cpu

    paths = []
    for j, a in enumerate(kernel.inputs):
        path = folder / f"{stem}_{j}.npy"
        np.save(path, np.ascontiguousarray(values[a.tensor], dtype=np.float32))
        paths.append(str(path))
    return {"lib": cpu.compile_kernel(kernel)._name, "name": kernel.name, "inputs": paths,
            "outputs": [list(a.shape) for a in kernel.outputs], "packed": [list(p.arg.shape) for p in kernel.packed]}
