"""The decomposed exact search: cuts joined over crossing candidates give the undivided optimum,
identical blocks are solved once, pieces solved in parallel give the serial plan byte for byte, and
a search stopped at its limit says so."""

from __future__ import annotations

import json
import threading
from importlib import resources

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from costmodels import RooflineModel, get_device
from fusesearch.candidates.enumerate import enumerate_candidates
from fusesearch.search import SearchConfig, SearchProblem, search
from fusesearch.search import cpsat as cpsat_module
from fusesearch.search.cpsat import CpSatSolver
from fusesearch.search.decompose import split
from tests.conftest import make_model, save
from tests.search.chains import BLOCK, chain_graph
from tests.search.test_search import BINARY, OPS, build, random_dags

H100 = get_device("h100-sxm")
MODEL = RooflineModel()
SCHEMA = json.loads(resources.files("fusesearch").joinpath("schemas/plan.schema.json").read_text())


def blocks(n: int) -> list[tuple[str, str, tuple[str, ...]]]:
    """n identical residual blocks: y = x + relu(x·x)."""
    spec, x = [], "x"
    for i in range(n):
        spec += [(f"mm{i}", "MatMul", (x, x)), (f"relu{i}", "Relu", (f"mm{i}",)), (f"add{i}", "Add", (x, f"relu{i}"))]
        x = f"add{i}"
    return spec


def solve(graph, decompose: bool, workers: int = 1, solver: CpSatSolver | None = None):
    """cpsat, whole or decomposed; groups of up to 4 nodes keep the crossing candidates few."""
    solver = solver or CpSatSolver(decompose=decompose)
    problem = SearchProblem.build(graph, H100, MODEL, SearchConfig(time_limit_s=30, workers=workers,
                                                                   max_group_size=4))
    return solver, solver.solve(problem, time_limit_s=30, seed=0)


class ThreadsSeen(CpSatSolver):
    """cpsat that notes which threads solved its models."""

    def __init__(self) -> None:
        super().__init__(decompose=True)
        self.threads: set[int] = set()

    def _solve_part(self, *args, **kwargs):
        self.threads.add(threading.get_ident())
        return super()._solve_part(*args, **kwargs)


@st.composite
def random_chains(draw):
    """A random block of up to 6 nodes repeated 2 to 5 times, each copy reading the last node of
    the one before (its other sinks are graph outputs): identical pieces joined at one tensor."""
    block = []
    for i in range(draw(st.integers(min_value=1, max_value=6))):
        op = draw(st.sampled_from(OPS))
        pool = ["in", *(f"b{j}" for j in range(i))]
        block.append((op, tuple(draw(st.sampled_from(pool)) for _ in range(2 if op in BINARY else 1))))
    spec, prev = [], "x"
    for c in range(draw(st.integers(min_value=2, max_value=5))):
        names = {"in": prev, **{f"b{j}": f"c{c}b{j}" for j in range(len(block))}}
        spec += [(f"c{c}b{j}", op, tuple(names[t] for t in ins)) for j, (op, ins) in enumerate(block)]
        prev = f"c{c}b{len(block) - 1}"
    size = draw(st.sampled_from([(8, 8), (256, 256)]))
    return build(spec, {"x": size, **{name: size for name, _, _ in spec}})


def test_repeated_blocks_decompose_to_the_undivided_optimum():
    graph = build(blocks(4))
    problem = SearchProblem.build(graph, H100, MODEL, SearchConfig(workers=1, max_group_size=4))
    chain = split(len(graph), enumerate_candidates(problem.legality).groups)
    assert chain.pieces > 4 and any(chain.crossing)  # cuts inside blocks, some crossed by candidates
    _, whole = solve(graph, decompose=False)
    solver, pieces = solve(graph, decompose=True)
    assert "decomposition" not in whole.stats
    assert pieces.stats["objective_ps"] == whole.stats["objective_ps"]
    assert set(pieces.groups) == set(whole.groups)
    assert pieces.status == whole.status == "OPTIMAL"
    d = pieces.stats["decomposition"]
    assert d["proven_whole"] and d["pieces"] == chain.pieces
    assert solver.solves == d["distinct"] < d["subproblems"]


def test_identical_blocks_are_solved_once():
    """Twice the blocks, the same CP-SAT models: the first and last blocks differ from the rest (the
    graph input, the graph output), every middle block is the same problem."""
    solves = {}
    for n in (4, 8):
        solver, result = solve(build(blocks(n)), decompose=True)
        solves[n] = (solver.solves, result.stats["decomposition"]["subproblems"])
    assert solves[8][0] == solves[4][0]
    assert solves[8][1] > solves[4][1]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_dags())
def test_random_dags_decomposed_equals_undivided(graph):
    _, whole = solve(graph, decompose=False)
    _, pieces = solve(graph, decompose=True)
    assert whole.status == pieces.status == "OPTIMAL"
    assert pieces.stats["objective_ps"] == whole.stats["objective_ps"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_chains())
def test_random_chains_decomposed_equals_undivided_and_parallel_equals_serial(graph):
    _, whole = solve(graph, decompose=False)
    _, serial = solve(graph, decompose=True)
    _, parallel = solve(graph, decompose=True, workers=3)
    assert whole.status == serial.status == "OPTIMAL"
    assert serial.stats["objective_ps"] == whole.stats["objective_ps"]
    assert parallel.stats["objective_ps"] == serial.stats["objective_ps"]
    if "decomposition" in serial.stats:  # cut into pieces (one piece is solved whole, by every worker)
        assert parallel.groups == serial.groups


def test_chain_builder_structure():
    """Blocks of BLOCK in order, each Add of a block's end joining the previous block's output (the
    graph input for the first); one graph output, the last node's; the same graph every build."""
    graph = chain_graph(12)
    assert len(graph) == 12 and [n.op_type for n in graph.nodes] == [*BLOCK, *BLOCK, *BLOCK[:2]]
    assert all(graph.nodes[i].inputs[0] == graph.nodes[i - 1].outputs[0] for i in range(1, 12))
    assert graph.nodes[0].inputs == ("x", "w") and graph.nodes[1].inputs[1] == "b"
    assert graph.nodes[4].inputs[1] == "x" and graph.nodes[9].inputs[1] == graph.nodes[4].outputs[0]
    assert graph.nodes[3].attrs == {"axis": -1}
    assert tuple(graph.outputs) == graph.nodes[11].outputs
    assert all({k: getattr(a, k) for k in ("op_type", "inputs", "outputs", "attrs")}
               == {k: getattr(b, k) for k in ("op_type", "inputs", "outputs", "attrs")}
               for a, b in zip(graph.nodes, chain_graph(12).nodes, strict=True))


def test_a_chain_twice_as_long_solves_no_more_models_and_matches_the_whole_graph():
    results = {}
    for n in (60, 120):
        solver, result = solve(chain_graph(n), decompose=True)
        results[n] = (solver.solves, result)
    (short_solves, short), (long_solves, long) = results[60], results[120]
    assert long_solves == short_solves == short.stats["decomposition"]["distinct"]
    assert long.stats["decomposition"]["subproblems"] > short.stats["decomposition"]["subproblems"]
    assert long.status == "OPTIMAL" and long.stats["decomposition"]["proven_whole"]
    _, whole = solve(chain_graph(60), decompose=False)
    assert whole.status == "OPTIMAL" and whole.stats["objective_ps"] == short.stats["objective_ps"]


def test_pieces_are_solved_in_parallel_to_the_serial_plan_json(tmp_path):
    """Several workers solve the distinct pieces on several threads; the plan is the serial one,
    byte for byte."""
    graph = build(blocks(8))
    docs, threads = [], []
    for workers in (1, 3):
        solver = ThreadsSeen()
        problem = SearchProblem.build(graph, H100, MODEL, SearchConfig(time_limit_s=30, workers=workers,
                                                                       max_group_size=4))
        result = solver.solve(problem, time_limit_s=30, seed=0)
        assert result.status == "OPTIMAL"
        docs.append(search(graph, H100, MODEL, "cpsat", problem=problem).to_json())
        threads.append(len(solver.threads))
    assert threads[0] == 1 and threads[1] > 1
    assert docs[0] == docs[1]


def test_a_deep_chain_is_decomposed_and_its_plan_json_says_so(run_cli, tmp_path):
    """From DECOMPOSE_FROM_NODES nodes on, `fusesearch plan` decomposes; plan.json says how, the same
    with one worker and with two (the pieces solved two at a time)."""
    import numpy as np
    from onnx import helper

    nodes, x = [], "x"
    for i in range(cpsat_module.DECOMPOSE_FROM_NODES // 3 + 1):
        nodes += [helper.make_node("MatMul", [x, "w"], [f"m{i}"]), helper.make_node("Relu", [f"m{i}"], [f"r{i}"]),
                  helper.make_node("Add", [f"r{i}", x], [f"a{i}"])]
        x = f"a{i}"
    model = make_model(nodes, [("x", [64, 64])], [(x, [64, 64])], [("w", np.eye(64, dtype=np.float32))])
    path = save(model, tmp_path / "chain.onnx")
    outs = []
    for k, workers in enumerate(("1", "2")):
        code, out, err = run_cli("plan", path, "--device", "h100-sxm", "--workers", workers,
                                 "-o", tmp_path / f"p{k}.json")
        assert code == 0, err
        outs.append((tmp_path / f"p{k}.json").read_bytes())
    assert outs[0] == outs[1]
    doc = json.loads(outs[0])
    jsonschema.validate(doc, SCHEMA)
    solver = doc["solver"]
    assert solver["status"] == "OPTIMAL" and "stopped" not in solver and "fallback" not in solver
    d = solver["decomposition"]
    assert d["proven_whole"] is True and d["pieces"] > 100 and d["distinct"] < 20
    assert "optimum proven for the whole graph" in out


def test_plan_decompose_flag_cuts_a_small_graph_or_keeps_it_whole(run_cli, tmp_path):
    """`plan --decompose always` cuts a graph below DECOMPOSE_FROM_NODES, `never` solves it whole
    (the same objective, both proven), a value outside auto/always/never exits 2 naming the flag."""
    import numpy as np
    from onnx import helper

    nodes, x = [], "x"
    for i in range(6):
        nodes += [helper.make_node("MatMul", [x, "w"], [f"m{i}"]), helper.make_node("Relu", [f"m{i}"], [f"r{i}"]),
                  helper.make_node("Add", [f"r{i}", x], [f"a{i}"])]
        x = f"a{i}"
    path = save(make_model(nodes, [("x", [64, 64])], [(x, [64, 64])], [("w", np.eye(64, dtype=np.float32))]),
                tmp_path / "chain.onnx")
    docs = {}
    for how in ("always", "never"):
        code, _, err = run_cli("plan", path, "--device", "h100-sxm", "--decompose", how, "-o", tmp_path / f"{how}.json")
        assert code == 0, err
        docs[how] = json.loads((tmp_path / f"{how}.json").read_text())
    assert docs["always"]["solver"]["decomposition"]["pieces"] > 1
    assert "decomposition" not in docs["never"]["solver"]
    assert docs["always"]["totals"]["time_s"] == pytest.approx(docs["never"]["totals"]["time_s"], rel=1e-9)
    code, _, err = run_cli("plan", path, "--device", "h100-sxm", "--decompose", "sometimes")
    assert code == 2 and err.startswith("fusesearch: error: --decompose 'sometimes'") and err.count("\n") == 1


def test_a_stopped_search_states_its_gap_and_the_greedy_fallback(monkeypatch):
    """CP-SAT given no time at all (its one-second floor lifted) stops before proving anything: the
    output and plan.json say it stopped, with the gap to the bound, and that greedy's plan came back."""
    monkeypatch.setattr(cpsat_module, "MIN_SOLVE_S", 0.0)
    monkeypatch.setattr(cpsat_module, "SAFETY_S", 1e3)
    graph = build(blocks(3))
    problem = SearchProblem.build(graph, H100, MODEL, SearchConfig(time_limit_s=0.01, workers=1))
    plan = search(graph, H100, MODEL, "cpsat", problem=problem)
    greedy = search(graph, H100, MODEL, "greedy", problem=problem)
    outcome = plan.solver.outcome()
    assert plan.solver.status == "FEASIBLE" and outcome["stopped"] == "time limit"
    assert plan.time_s <= greedy.time_s
    if plan.time_s == greedy.time_s:
        assert outcome["fallback"] == "greedy" and "greedy" in plan.solver.summary()
    assert "not proven optimal, gap" in plan.solver.summary()
    doc = json.loads(plan.to_json())
    jsonschema.validate(doc, SCHEMA)
    assert doc["solver"]["stopped"] == "time limit" and doc["solver"]["gap"] is not None


def _zoo_problem(tmp_path, name: str, **sizes):
    from fusesearch import zoo
    from fusesearch.ir.shapes import ShapeBindings
    from fusesearch.pipeline import prepare

    path = save(zoo.build_model(name, **sizes), tmp_path / f"{name}-{sizes['layers']}.onnx")
    graph = prepare(path, ShapeBindings.parse([], []).with_defaults(zoo.ZOO[name].default_dims)).graph
    return graph, SearchProblem.build(graph, H100, MODEL, SearchConfig(workers=1))


def test_groups_of_one_structure_share_their_lowering_and_agree_with_their_own(tmp_path):
    """Every candidate's shared decision and cost equal what lowering it itself gives (at 2
    layers, the second's groups twins of the first's), and a model twice as deep lowers no more
    groups (its repeated blocks are lowered once)."""
    lowered = {}
    for layers in (2, 4):
        graph, problem = _zoo_problem(tmp_path, "llama-decode", layers=layers)
        candidates = enumerate_candidates(problem.legality).groups
        lowered[layers] = problem.legality.evaluated
        if layers == 2:
            own = SearchProblem.build(graph, H100, MODEL, SearchConfig(workers=1)).legality
            for g in candidates:
                assert own.check(g).decision and own.check(g).time_s == problem.time_s(g), sorted(g)
    assert lowered[4] == lowered[2]


def test_greedy_prices_each_structure_once_however_deep_the_model(tmp_path):
    """Greedy's merges read a union's decision and time through the memo of twins, so a model twice
    as deep lowers no more groups, and the plan is the one lowering each union gives."""
    from fusesearch.search.greedy import greedy_partition

    lowered, plans = {}, {}
    for layers in (3, 6):
        graph, problem = _zoo_problem(tmp_path, "llama-decode", layers=layers)
        groups = greedy_partition(problem)
        lowered[layers] = problem.legality.evaluated
        own = SearchProblem.build(graph, H100, MODEL, SearchConfig(workers=1)).legality
        assert all(own.check(g).decision for g in groups)
        plans[layers] = sum(len(g) > 1 for g in groups)
    assert lowered[6] == lowered[3] and plans[6] > plans[3]


def test_greedy_and_the_unfused_figures_price_a_repeated_block_once(tmp_path, monkeypatch):
    """Greedy asks legality by structure and the unfused figures lower one node per structure: a
    model twice as deep lowers no more groups, and the figures equal each node lowered alone."""
    from fusesearch import costing
    from fusesearch.lowering import FusionGroup, lower
    from fusesearch.search.greedy import greedy_partition

    lowered, evaluated = {}, {}
    for layers in (3, 6):
        graph, problem = _zoo_problem(tmp_path, "llama-decode", layers=layers)
        greedy_partition(problem)
        evaluated[layers] = problem.legality.evaluated
        calls = []
        monkeypatch.setattr(costing, "lower", lambda g, group, _calls=calls: _calls.append(group) or lower(g, group))
        figures = costing.graph_figures(graph, H100, MODEL)
        monkeypatch.undo()
        lowered[layers] = len(calls)
        alone = [lower(graph, FusionGroup.single(n.id)) for n in graph.nodes]
        assert figures.unfused_kernels == len(graph)
        assert figures.unfused_time_s == sum(costing.kernel_cost(k, H100, MODEL).time_s for k in alone)
        assert figures.tc_flops == sum(k.tc_flops for k in alone)
        assert figures.scalar_flops == sum(k.scalar_flops for k in alone)
    assert evaluated[6] == evaluated[3]
    assert lowered[6] == lowered[3] < len(graph)
