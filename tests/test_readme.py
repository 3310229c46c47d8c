"""The README's tour is real: each `$ fusesearch ...` command it shows, rerun in order in one folder,
prints output of the shape shown (numbers and table rules aside; `scripts/readme_tour.py`)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tour():
    spec = importlib.util.spec_from_file_location("readme_tour", ROOT / "scripts" / "readme_tour.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


TOUR = _tour()


def test_the_tour_shows_commands_with_their_output():
    found = TOUR.commands(TOUR.README.read_text().split("\n"))
    assert len(found) >= 8
    assert all(c.shown for c in found), [c.text for c in found if not c.shown]
    assert {c.text.split()[1] for c in found if not c.heavy} >= {"zoo", "inspect", "plan", "verify", "compare"}
    assert any(c.heavy for c in found)


def test_shape_ignores_figures_and_rules_but_not_words():
    assert TOUR.shape("│ g57   │ gemm │ 8.6 us │") == TOUR.shape("│ g1 │ gemm      │ 12.25 us │")
    assert TOUR.shape("kernels 58 speedup 1.72x") != TOUR.shape("kernels 58 slowdown 1.72x")


def test_the_planning_commands_print_what_the_readme_shows(tmp_path, capsys):
    assert TOUR.main(["--check", "--fast", "--workdir", str(tmp_path)]) == 0, capsys.readouterr().err


@pytest.mark.slow
def test_every_tour_command_prints_what_the_readme_shows(tmp_path, capsys):
    assert TOUR.main(["--check", "--workdir", str(tmp_path)]) == 0, capsys.readouterr().err
