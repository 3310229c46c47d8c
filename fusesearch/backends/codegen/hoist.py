"""Loop-invariant code motion over a generated C body.

Problem: the emitters write each element's value as a chain of temporaries inside its loop; a
per-row value (a gather index, a scale, a divisor) computed per element costs the loop its speed.
Approach: one textual pass over every skeleton's source (`hoist_loop_invariants`), so no skeleton
decides it on its own: each innermost flat loop's temporaries that depend neither on its variable
nor on anything the loop writes move before it, a division by a hoisted float becomes a
multiplication by its reciprocal.
Invariants: imports nothing of the generator; a body it cannot read is returned unchanged.
"""

from __future__ import annotations

import re

# C loop-invariant code motion over a generated body (`hoist_loop_invariants`): one pass over every
# skeleton's source, so no skeleton decides it on its own
_DECLARATION = re.compile(r"^(\w[\w ]*?) (v\d+r?) = (.+);$")  # a temporary, or a hoisted one's reciprocal
_ASSIGNMENT = re.compile(r"^(\w+)(\[.+\])? [-+*]?= .+;$")  # a store into an array, an accumulator's update
_DIVISION = re.compile(r"^\((v\d+) / (v\d+)\)$")
_READ_ONLY = re.compile(r"^(in|pk)\d+$")  # a kernel's inputs and packed weights: never written
_LOOP = re.compile(r"^(\s*)for \(long long (\w+) = [^;]+;[^;]+;[^)]+\) \{$")
_IDENT = re.compile(r"[A-Za-z_]\w*")


def hoist_invariants(lines: list[str], var: str) -> tuple[list[str], list[str]] | None:
    """(before, inside) for a flat C loop body over `var`: the temporaries whose value does not
    depend on `var` (a row's gather index, a per-row scale), to run once before the loop, and the
    rest, where a division by a hoisted float temporary becomes a multiplication by its reciprocal
    (computed once before the loop: at most one rounding apart; a divisor below 2^-126 would give
    an infinity where the quotient of a tiny numerator is finite). A temporary is invariant when
    its expression names neither `var`, a variant temporary nor anything the body assigns, and
    reads only kernel inputs and packed weights. None for a body with any statement other than a
    temporary's declaration, a store into an array or an accumulator's update."""
    assigned = {var}
    for line in lines:
        if _DECLARATION.match(line):
            continue
        written = _ASSIGNMENT.match(line)
        if written is None:
            return None
        assigned.add(written.group(1))
    before: list[str] = []
    inside: list[str] = []
    variant, floats, reciprocals = set(assigned), set(), {}
    for line in lines:
        declared = _DECLARATION.match(line)
        if declared is None:
            inside.append(line)
            continue
        ctype, name, expr = declared.groups()
        arrays = re.findall(r"(\w+)\[", expr)
        if set(_IDENT.findall(expr)) & variant or not all(_READ_ONLY.match(a) for a in arrays):
            variant.add(name)
            division = _DIVISION.match(expr)
            if ctype == "float" and division and division.group(2) in floats:
                divisor = division.group(2)
                if divisor not in reciprocals:
                    reciprocals[divisor] = f"{divisor}r"
                    before.append(f"float {divisor}r = 1.0f / {divisor};")
                line = f"{ctype} {name} = ({division.group(1)} * {reciprocals[divisor]});"
            inside.append(line)
        else:
            before.append(line)
            if ctype == "float":
                floats.add(name)
    return before, inside


def hoist_loop_invariants(body: str) -> str:
    """`body` (C statements) with each innermost `for (long long x ...)` loop's invariant
    temporaries (`hoist_invariants`) moved before it, and before the OpenMP pragmas that must stay
    on its line; hoisted names get a kernel-wide prefix (`h<n>_`), so two loops of one block
    hoisting the same temporary's name do not collide."""
    lines = body.split("\n")
    out: list[str] = []
    hoisted = 0
    i = 0
    while i < len(lines):
        loop = _LOOP.match(lines[i])
        end = None
        if loop:
            close = f"{loop.group(1)}}}"
            end = next((j for j in range(i + 1, len(lines)) if lines[j] == close), None)
        split = None
        if end is not None:
            inner = [x.strip() for x in lines[i + 1:end]]
            if not any(x.startswith(("for ", "#", "FS_", "if ", "{", "}")) for x in inner):
                split = hoist_invariants(inner, loop.group(2))
        if not split or not split[0]:
            out.append(lines[i])
            i += 1
            continue
        before, inside = split
        hoisted += 1
        names = [_DECLARATION.match(x).group(2) for x in before]
        rename = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\b")
        prefix = f"h{hoisted}_"

        def fix(text: str, rename=rename, prefix=prefix) -> str:
            return rename.sub(lambda found: prefix + found.group(1), text)

        head = []
        while out and out[-1].strip().startswith(("#pragma", "FS_SIMD")):
            head.insert(0, out.pop())
        indent = loop.group(1)
        inner_indent = lines[i + 1][:len(lines[i + 1]) - len(lines[i + 1].lstrip())]
        out += [indent + fix(x) for x in before] + head + [lines[i]] + [inner_indent + fix(x) for x in inside]
        out.append(lines[end])
        i = end + 1
    return "\n".join(out)
