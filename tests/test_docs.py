"""The docs as a map, held to the code: docs/cli.md names every command and every option of the
command line (and none that is gone), README's code map finds every module in one step (its file
or the folder that holds it), and every module opens with a docstring of at most 15 lines
(problem, approach, invariants; measured history belongs beside its benchmark)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import typer

from fusesearch.cli import app

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("costmodels", "fusesearch")
DOCSTRING_LINES = 15


def _commands(cmd=None, path=()):
    """(command words, click command) for every command, the root's options as ()."""
    cmd = cmd or typer.main.get_command(app)
    if hasattr(cmd, "commands"):
        if not path:
            yield path, cmd
        for name, sub in cmd.commands.items():
            yield from _commands(sub, (*path, name))
    else:
        yield path, cmd


def _options(cmd) -> set[str]:
    return {o for p in cmd.params if p.param_type_name == "option" for o in (*p.opts, *p.secondary_opts)} - {"--help"}


def _reference() -> dict[tuple[str, ...], set[str]]:
    """docs/cli.md's "Every command and option": command words → the options its entry lists."""
    text = (ROOT / "docs" / "cli.md").read_text()
    assert "\n## Every command and option\n" in text
    section = text.split("\n## Every command and option\n", 1)[1].split("\n## ", 1)[0]
    entries = {}
    for block in section.split("\n### ")[1:]:
        title, body = block.split("\n", 1)
        words = tuple(title.split()[1:])  # "fusesearch zoo list" -> ("zoo", "list")
        entries[words] = {o for line in body.splitlines() if line.startswith("- `")
                          for o in re.findall(r"`(-[-\w]+)`", line.split(":", 1)[0])}
    return entries


def test_the_cli_reference_names_every_command_and_option():
    reference = _reference()
    commands = dict(_commands())
    assert set(reference) == set(commands), (set(commands) ^ set(reference))
    for words, cmd in commands.items():
        assert reference[words] == _options(cmd), (" ".join(words), _options(cmd) ^ reference[words])


def _code_map() -> dict[str, str]:
    """README's "Where the code lives" block: package → the text of its entries."""
    text = (ROOT / "README.md").read_text()
    block = text.split("## Where the code lives", 1)[1].split("```", 2)[1]
    sections: dict[str, list[str]] = {}
    current = None
    for line in block.splitlines():
        if line and not line[0].isspace():
            current = line.split()[0].rstrip("/")
            sections.setdefault(current, [])
        elif current is not None:
            sections[current].append(line)
    return {name: "\n".join(lines) for name, lines in sections.items()}


def _named(entries: str, relative: str) -> bool:
    """The module's path inside its package is in the entries, or a folder holding it is ("search/")."""
    parts = relative.split("/")
    candidates = [relative] + ["/".join(parts[:i]) + "/" for i in range(1, len(parts))]
    return any(re.search(rf"(?<![\w/]){re.escape(c)}(?![\w])", entries) for c in candidates)


def test_the_readme_code_map_finds_every_module():
    code_map = _code_map()
    missing = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT / package).as_posix()
            if path.name != "__init__.py" and not _named(code_map[package], relative):
                missing.append(f"{package}/{relative}")
    assert not missing, missing


def test_the_code_map_check_needs_the_file_or_its_folder():
    entries = "  search/   strategies\n  ir/load.py  read a model\n  errors.py, values.py  errors"
    assert _named(entries, "search/decompose.py") and _named(entries, "ir/load.py")
    assert _named(entries, "values.py") and not _named(entries, "ir/pool.py") and not _named(entries, "load.py")


def test_every_module_opens_with_a_short_docstring():
    long = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
            lines = len(doc.splitlines()) if doc else 0
            if not 0 < lines <= DOCSTRING_LINES:
                long[path.relative_to(ROOT).as_posix()] = lines
    assert not long, long
