"""Does a plan found for one GPU suit another? Re-cost each model's T4 plan on an H200 and back.

Problem: the devices sweep shows that the best (cpsat) plan of a model changes between GPUs; the
question is whether the change matters (a plan tuned for one GPU is slower on the other) or is a
tie (several plans cost the same and the solver picked another).
Approach: read the fused groups of the cpsat plans from experiments/devices/results.parquet,
rebuild each plan's partition on the model's canonical graph (the other nodes alone), and cost it
with the other device's legality rules and roofline model. A group that is not legal there
(e.g. its shared memory does not fit) is counted, and the plan is then not runnable as is.
Invariants: reads only the results; prints one Markdown table on stdout.

    .venv/bin/python experiments/portability.py [A B]      # default: t4 h200
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd

from costmodels import RooflineModel
from fusesearch.api import for_device, resolve_device
from fusesearch.backends.codegen import CAPABILITIES
from fusesearch.candidates.rules import Legality
from fusesearch.pipeline import prepare

RESULTS = Path(__file__).parent / "devices" / "results.parquet"


def partition(graph, fused: list[str]) -> list[frozenset[int]]:
    ids = {n.name: n.id for n in graph.nodes}
    groups = [frozenset(ids[name] for name in g.split("+")) for g in fused]
    taken = set().union(*groups) if groups else set()
    return groups + [frozenset({v}) for v in range(len(graph)) if v not in taken]


def cost_on(prep, groups, device: str, max_group_size: int) -> tuple[float, list[str]]:
    """(predicted time, refusal reasons of the groups that are not legal on `device`), priced as
    the sweep prices it: TF32 only where the device has it (`fusesearch.api.for_device`)."""
    _, spec, params, _ = resolve_device(device)
    prep, params = for_device(prep, spec, params)
    legality = Legality(prep.graph, spec, RooflineModel(params), CAPABILITIES, max_group_size)
    refused = [legality.check(g).decision.reason for g in groups if not legality.check(g).decision]
    return sum(legality.time_s(g) for g in groups), refused


def versus(foreign: float, own: float, refused: list[str]) -> str:
    return f"not runnable: {len(refused)} illegal groups" if refused else f"{foreign / own - 1:+.2%}"


def main(a: str = "t4", b: str = "h200") -> None:
    rows = pd.read_parquet(RESULTS)
    rows = rows[(rows.status == "ok") & (rows.strategy == "cpsat")]
    print(f"| model | {a}'s plan on {b}, vs {b}'s plan | {b}'s plan on {a}, vs {a}'s plan | why (first refusal) |")
    print("| --- | ---: | ---: | --- |")
    for model in dict.fromkeys(rows.sort_values("cell_index").model):
        cells = rows[rows.model == model].set_index("device")
        prep = prepare(cells.loc[a, "model_source"])
        size = int(cells.loc[a, "max_group_size"])
        plan_a = partition(prep.graph, json.loads(cells.loc[a, "fused_groups"]))
        plan_b = partition(prep.graph, json.loads(cells.loc[b, "fused_groups"]))
        a_on_b, bad_ab = cost_on(prep, plan_a, b, size)
        b_on_a, bad_ba = cost_on(prep, plan_b, a, size)
        own_a, _ = cost_on(prep, plan_a, a, size)
        own_b, _ = cost_on(prep, plan_b, b, size)
        why = (bad_ab and f"on {b}: {bad_ab[0]}") or (bad_ba and f"on {a}: {bad_ba[0]}") or ""
        print(f"| {model} | {versus(a_on_b, own_b, bad_ab)} | {versus(b_on_a, own_a, bad_ba)} | {why} |")


if __name__ == "__main__":
    main(*sys.argv[1:3])
