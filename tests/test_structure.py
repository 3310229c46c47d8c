"""The package's import graph runs one way: every module-level import of a fusesearch or
costmodels module goes to the importer's own layer or a lower one (`LAYERS`), so no module imports
one that imports it back and costmodels never imports fusesearch. Read from the sources (ast), so
the check costs no imports; two checks import a leaf in a fresh interpreter to see what it pulls."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The layers, lowest first. A module is in the layer of the longest entry that is the module itself
# or a package holding it; a fusesearch module no entry names falls, through the root package's
# entry, to the leaves, so it may import no other layer until it is placed here.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("cost model", ("costmodels",)),  # hardware and kernels, never graphs
    ("leaves", ("fusesearch", "fusesearch.errors", "fusesearch.layout", "fusesearch.values", "fusesearch.zoo")),
    ("graph", ("fusesearch.ir",)),
    ("groups", ("fusesearch.groups",)),  # FusionGroup, FusionDecision
    ("schedule", ("fusesearch.schedule",)),
    ("lowering", ("fusesearch.lowering",)),
    ("costing", ("fusesearch.costing",)),
    ("candidates", ("fusesearch.candidates",)),  # legality reads the generator's Capabilities as a value
    ("plans", ("fusesearch.plans",)),
    ("code generator", ("fusesearch.backends.codegen",)),
    ("execution", ("fusesearch.backends", "fusesearch.verify",  # runners, ONNX Runtime as the oracle
                   "fusesearch.backends.torch_baseline")),  # PyTorch, the optional baseline
    ("search", ("fusesearch.search",)),
    ("commands", ("fusesearch.pipeline", "fusesearch.api", "fusesearch.measure", "fusesearch.run",
                  "fusesearch.calibrate", "fusesearch.sweep", "fusesearch.export", "fusesearch.explain",
                  "fusesearch.pictures", "fusesearch.report", "fusesearch.autotune", "fusesearch.regret",
                  "fusesearch.buckets", "fusesearch.dynamic", "fusesearch.dump", "fusesearch.trace")),
    ("command line", ("fusesearch.cli", "fusesearch.__main__")),
)


def _modules() -> dict[str, Path]:
    found = {}
    for package in ("fusesearch", "costmodels"):
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def _edges(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module-level imports only (those inside functions and `if TYPE_CHECKING:` are deferred)."""
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    target = f"{node.module}.{alias.name}"
                    edges[name].add(target if target in modules else node.module)
            elif isinstance(node, ast.Import):
                edges[name].update(a.name for a in node.names)
        edges[name] &= modules.keys()
        edges[name].discard(name)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_module_level_import_cycles():
    assert _cycles(_edges(_modules())) == []


def test_the_cost_model_never_imports_the_graph_side():
    edges = _edges(_modules())
    wrong = {m: sorted(t for t in targets if t.startswith("fusesearch"))
             for m, targets in edges.items() if m.startswith("costmodels")}
    assert not {m: t for m, t in wrong.items() if t}


def test_the_cycle_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _layer(module: str) -> int:
    entries = [(len(entry), index) for index, (_, names) in enumerate(LAYERS) for entry in names
               if module == entry or module.startswith(entry + ".")]
    assert entries, f"{module} is in no layer: add it to LAYERS"
    return max(entries)[1]


def _upward(edges: dict[str, set[str]]) -> list[str]:
    """Every import that runs to a higher layer, as 'importer (layer) -> imported (layer)'."""
    def named(m: str) -> str:
        return f"{m} ({LAYERS[_layer(m)][0]})"

    return [f"{named(m)} -> {named(t)}" for m in sorted(edges) for t in sorted(edges[m]) if _layer(t) > _layer(m)]


def test_every_import_points_to_its_own_layer_or_a_lower_one():
    assert _upward(_edges(_modules())) == []


def test_the_layer_check_finds_an_upward_import():
    assert _upward({"fusesearch.lowering": {"fusesearch.candidates.rules"},
                    "fusesearch.candidates.rules": {"fusesearch.lowering", "fusesearch.groups"}}) == [
        "fusesearch.lowering (lowering) -> fusesearch.candidates.rules (candidates)"]
    assert _upward({"fusesearch.candidates.rules": {"fusesearch.backends.codegen"}}) != []
    assert _layer("fusesearch.backends.codegen.base") < _layer("fusesearch.backends.cpu")
    assert _layer("fusesearch.unplaced") == _layer("fusesearch.errors")


def _imported_by(module: str) -> set[str]:
    """The fusesearch modules a fresh interpreter holds after importing `module`."""
    code = f"import sys, {module}; print(' '.join(m for m in sys.modules if m.split('.')[0] == 'fusesearch'))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT, env=env)
    return set(out.stdout.split())


def test_the_group_types_load_nothing_else():
    assert _imported_by("fusesearch.groups") == {"fusesearch", "fusesearch.groups"}


def test_legality_loads_no_code_generator():
    """What the generator writes reaches legality as a value (`Legality.capabilities`)."""
    loaded = _imported_by("fusesearch.candidates.rules")
    assert "fusesearch.lowering" in loaded
    assert not {m for m in loaded if m.startswith("fusesearch.backends")}


def test_leaf_types_import_nothing_of_fusesearch_that_imports_them():
    """The shared types sit in leaves: the groups and decisions, the tensor, the layout, the schedule."""
    edges = _edges(_modules())
    assert edges["fusesearch.groups"] == set()
    assert edges["fusesearch.layout"] == set()
    assert edges["fusesearch.ir.tensor"] <= {"costmodels", "costmodels.kernel"}
    assert edges["fusesearch.schedule"] <= {"fusesearch.ir.graph", "fusesearch.ir.op_kind", "fusesearch.layout",
                                            "costmodels.kernel"}


BACKEND_NAMES = {"cpu", "cupy", "emulate"}
ONLY_BACKENDS = {"cupy", "emulate"}  # "cpu" is also a device kind (DeviceSpec.kind)


def _backend_choices(tree: ast.AST) -> list[str]:
    """What decides on a backend by its name: a `BACKENDS` assignment, a literal tuple, list or
    set of two or more backend names, and a comparison with a backend's name — "cupy" or
    "emulate" anywhere, "cpu" with an operand whose text names a backend."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "BACKENDS" for t in targets):
                found.append(f"line {node.lineno}: BACKENDS =")
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            names = [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in BACKEND_NAMES]
            if len(names) >= 2:
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            named = {o.value for o in operands if isinstance(o, ast.Constant) and isinstance(o.value, str)}
            about_backend = any("backend" in ast.unparse(o).lower() for o in operands
                                if not isinstance(o, ast.Constant))
            if named & ONLY_BACKENDS or ("cpu" in named and about_backend):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_only_the_registry_names_backends():
    """Backends are objects from `backends.registry`: no other module keeps a list of their names
    or branches on one (`backend == "cupy"`); a capability is a field of the Backend."""
    modules = _modules()
    registry = modules.pop("fusesearch.backends.registry")
    found = {name: hits for name, path in sorted(modules.items())
             if (hits := _backend_choices(ast.parse(path.read_text())))}
    assert found == {}
    assert _backend_choices(ast.parse(registry.read_text()))  # the registry is where they are


def test_the_backend_check_finds_names_and_branches():
    source = ('BACKENDS = ("cpu", "cupy")\n'
              'clock = Perf() if backend == "cpu" else Cuda()\n'
              'if self.backend != "cupy": pass\n'
              'ok = spec.kind == "cpu"\n'  # a device kind, not a backend
              'if name in ("cpu", "emulate"): pass\n')
    assert sorted(hit.split(":")[0] for hit in _backend_choices(ast.parse(source))) == [
        "line 1", "line 1", "line 2", "line 3", "line 5"]


def _imports_of(tree: ast.AST, package: str) -> list[tuple[int, bool]]:
    """(line, at module level) of every import of `package` or a module in it."""
    top = {id(n) for n in tree.body}
    found = []
    for node in ast.walk(tree):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
        if any(n == package or n.startswith(package + ".") for n in names):
            found.append((node.lineno, id(node) in top))
    return found


def test_torch_is_imported_lazily_and_in_one_module():
    """torch is an optional extra: one module imports it, inside functions, so that every other
    command runs without it."""
    found = {name: hits for name, path in _modules().items()
             if (hits := _imports_of(ast.parse(path.read_text()), "torch"))}
    assert set(found) == {"fusesearch.backends.torch_baseline"}
    assert not [line for line, top in found["fusesearch.backends.torch_baseline"] if top]
    assert _imports_of(ast.parse("import torch\ndef f():\n    import torch._inductor.config"), "torch") == [
        (1, True), (3, False)]
