"""Package boundary: costmodels never imports fusesearch (the dependency points one way)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import costmodels


def test_importing_costmodels_does_not_import_fusesearch():
    """Boundary, at run time: a fresh interpreter imports costmodels without fusesearch."""
    code = ("import sys, costmodels, costmodels.profile; "
            "assert 'fusesearch' not in sys.modules, sorted(m for m in sys.modules "
            "if m.startswith('fusesearch'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=Path(costmodels.__file__).parents[1], timeout=60)
    assert done.returncode == 0, done.stderr


def test_no_module_mentions_fusesearch_in_an_import():
    """Boundary, in the source: no import statement (even a lazy one) names fusesearch."""
    for path in Path(costmodels.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            assert not any(n.split(".")[0] == "fusesearch" for n in names), path.name
