"""The README's tour, run: every `$ fusesearch ...` line in its code blocks, in order, in one folder.

    python scripts/readme_tour.py --update    # rerun every command, write its real output back
    python scripts/readme_tour.py --check     # rerun, fail where the output's shape differs
    python scripts/readme_tour.py --check --fast   # only the commands that plan (no compiling)

A shown output ending in a `...` line keeps that many first lines, one starting with `...` that
many last lines (else the whole output is shown); the check compares the shown lines
with the first lines of the real output, numbers and table rules ignored (figures move between
runs and machines, the shape must not).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
HEAVY = frozenset({"run", "measure", "regret", "calibrate", "sweep"})  # compile or time kernels
MORE = "..."
MACHINE_STATE = "WARNING fusesearch.backends.timing"  # the busy-machine line: the load of the moment, not the tool


@dataclass
class Command:
    line: int  # index of the `$ ` line in the README
    text: str
    shown: list[str]  # the output lines shown, without the `...` line
    truncated: bool  # a `...` line ends the shown output: the first lines shown
    tail: bool = False  # a `...` line starts it: the last lines shown

    @property
    def heavy(self) -> bool:
        words = [w for w in shlex.split(self.text) if "=" not in w]
        return len(words) > 1 and words[1] in HEAVY


def commands(lines: list[str]) -> list[Command]:
    """Every `$ ` line of a plain fenced block (```python blocks are code), with the lines after it."""
    found: list[Command] = []
    block = None  # the fence line of the block we are in
    current: Command | None = None
    for i, line in enumerate(lines):
        if line.startswith("```"):
            block, current = (None if block else line), None
        elif block == "```" and line.startswith("$ "):
            current = Command(i, line[2:], [], False)
            found.append(current)
        elif current is not None and not current.truncated:
            if line == MORE and not current.shown and not current.tail:
                current.tail = True
            elif line == MORE and not current.tail:
                current.truncated = True
            else:
                current.shown.append(line)
    return found


def execute(command: Command, cwd: Path) -> list[str]:
    """The command's output, stdout and stderr in the order written, as a pipe receives it."""
    text = re.sub(r"(^|\s)fusesearch\s", lambda m: f"{m.group(1)}{shlex.quote(sys.executable)} -m fusesearch ",
                  command.text, count=1)
    env = dict(os.environ, NO_COLOR="1", TERM="dumb",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")])))
    proc = subprocess.run(["bash", "-c", text], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    return [line for line in proc.stdout.rstrip("\n").split("\n") if not line.startswith(MACHINE_STATE)]


def shape(line: str) -> str:
    line = re.sub(r"[-+]?\d[\d.,]*(e[-+]?\d+)?", "#", line)
    line = re.sub(r"[\u2500-\u257f]", " ", line)  # box drawing: widths follow the figures
    return " ".join(line.split())


def _shown_part(command: Command, output: list[str]) -> list[str]:
    """The part of `output` the README shows for `command`: its last lines, or its first."""
    return output[-len(command.shown):] if command.tail else output[:len(command.shown)]


def _replace(lines: list[str], command: Command, output: list[str]) -> None:
    if command.tail:
        new = [MORE] + output[-len(command.shown):]
    else:
        keep = len(command.shown) if command.truncated else len(output)
        new = output[:keep] + ([MORE] if len(output) > keep else [])
    end = command.line + 1 + len(command.shown) + (1 if command.truncated or command.tail else 0)
    lines[command.line + 1:end] = new


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--update", action="store_true")
    mode.add_argument("--check", action="store_true")
    parser.add_argument("--fast", action="store_true", help="skip the commands that compile or time kernels")
    parser.add_argument("--workdir", type=Path, help="run in this folder (default: a new temporary one)")
    args = parser.parse_args(argv)
    lines = README.read_text().split("\n")
    todo = [c for c in commands(lines) if not (args.fast and c.heavy)]
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        cwd = args.workdir or Path(tmp)
        outputs = {c.line: execute(c, cwd) for c in todo}  # in README order: later commands read earlier files
        for command in sorted(todo, key=lambda c: -c.line):  # bottom up: line numbers stay valid
            output = outputs[command.line]
            if args.update:
                _replace(lines, command, output)
            elif [shape(x) for x in _shown_part(command, output)] != [shape(x) for x in command.shown]:
                failures.append(command)
                print(f"README output differs for: $ {command.text}", file=sys.stderr)
                for want, got in zip(command.shown, _shown_part(command, output) + [""] * len(command.shown),
                                     strict=False):
                    if shape(want) != shape(got):
                        print(f"  README: {want}\n  now:    {got}", file=sys.stderr)
                        break
    if args.update:
        README.write_text("\n".join(lines))
        print(f"README: {len(todo)} commands rerun")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
