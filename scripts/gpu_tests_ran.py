"""Did the GPU tests run? Exit 1 with one line unless a pytest JUnit XML report holds at least one
test and no skipped one; exit 0 with a one-line count otherwise.

gpu_check.sh runs `pytest -m gpu --junitxml=...` on a GPU machine: there a skipped gpu test means
the GPU was not used (CuPy missing, no device visible), which a green pytest run would hide.
Usage: python scripts/gpu_tests_ran.py REPORT.xml
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET


def verdict(path: str) -> tuple[bool, str]:
    """(ok, one line) for the JUnit XML report at `path`."""
    try:
        cases = list(ET.parse(path).getroot().iter("testcase"))
    except (OSError, ET.ParseError) as exc:
        return False, f"gpu tests: no readable JUnit report at {path} ({exc})"
    skipped = [c for c in cases if c.find("skipped") is not None]
    if not cases:
        return False, f"gpu tests: none ran (no test selected by -m gpu in {path})"
    if skipped:
        first = skipped[0]
        why = (first.find("skipped").get("message") or "").strip()
        return False, (f"gpu tests: {len(skipped)} of {len(cases)} skipped, e.g. "
                       f"{first.get('classname')}::{first.get('name')}: {why}")
    return True, f"gpu tests: {len(cases)} ran, none skipped"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python scripts/gpu_tests_ran.py REPORT.xml", file=sys.stderr)
        return 2
    ok, line = verdict(argv[0])
    print(line, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
