"""What a number the user gives must be, decided once for the command line and the sweep config.

Problem: the same setting reaches the tool as a CLI option (`--seed`, `--threads`, `--time-limit`)
and as a sweep config key (`params.seed`, `threads`, `params.time_limit_s`); checked twice, the two
drift apart (a seed CP-SAT cannot take, a NaN time limit, 100000 threads that crash the process).
Approach: one rule per kind of value; a rule takes the value and returns None when it is fine,
else what to give instead (the text after "give"). `cli` attaches rules to options, `sweep`
applies them to its keys; each spells the where (option or TOML key) itself.
Counts of threads or processes are bounded by the CPUs this process may run on: more cannot run
at once, and far more (thousands) exhaust the machine (a crash or a hang, not an error line).
"""

from __future__ import annotations

import math
import os


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, else the machine's count)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


SEED_MAX = 2**31 - 1  # CP-SAT's random_seed is a signed 32-bit integer; numpy takes it too


def seconds(value) -> str | None:
    return None if math.isfinite(value) and value > 0 else "a positive, finite number of seconds"


def tolerance(value) -> str | None:
    return None if math.isfinite(value) and value >= 0 else "a finite number >= 0"


def count(value) -> str | None:
    return None if value >= 1 else "a positive whole number"


def seed(value) -> str | None:
    return None if 0 <= value <= SEED_MAX else f"a whole number from 0 to {SEED_MAX}"


def cpus(value) -> str | None:
    """Threads or worker processes: 1 to the CPUs this process may use."""
    n = usable_cpus()
    return None if 1 <= value <= n else f"a whole number from 1 to {n} (the CPUs this machine lets fusesearch use)"
