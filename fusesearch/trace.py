"""`run --trace FILE`: a Chrome trace of a plan's program, one event per step per round.

Problem: `run` gives a program's whole time; which step takes it, and which is noisy across
rounds, needs a per-step timeline readable in Perfetto or chrome://tracing.
Approach: the plan's steps (`run.plan_steps`) become one program whose every step is its own call
(`run.one_by_one`: never the CUDA graph), run `rounds` times after `warmup`; each step bracketed by
`Backend.clock` for its duration and stamped by `now` for its start, each round an enclosing event.
Complete ("X") events carry ts/dur in microseconds, pid/tid, the name and args (group id, how it
runs, skeleton, ops, round).
Invariants: every step with code has exactly one event per round, inside its round's event;
durations are >= 0; `trace_rounds` reads time only from the clock and `now` it is given (a test
passes fake ones)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

US_PER_S = 1e6
PID, TID = 1, 1


@dataclass(frozen=True)
class TracedStep:
    """One call of the program, as the trace names it."""

    name: str
    category: str  # "generated" | "library"
    call: Callable[[], object]
    args: Mapping[str, object] = field(default_factory=dict)


def trace_rounds(steps: Sequence[TracedStep], rounds: int, clock, *, warmup: int = 0,
                 now: Callable[[], float] = time.perf_counter) -> list[dict]:
    """Run `steps` in order `warmup` times untimed, then `rounds` times, each step timed by
    `clock` (`timing.Clock`) and stamped by `now` (seconds): the "X" events, each round's last,
    with ts relative to the first round's start."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    for _ in range(warmup):
        for s in steps:
            s.call()
    events: list[dict] = []
    origin = now()
    for r in range(rounds):
        begin = now() - origin
        end = begin
        for s in steps:
            ts = now() - origin
            token = clock.start()
            s.call()
            dur = clock.stop(token)
            events.append(_event(s.name, s.category, ts, dur, {**s.args, "round": r}))
            end = max(end, ts + dur)
        end = max(end, now() - origin)
        events.append(_event(f"round {r}", "round", begin, end - begin, {"round": r, "steps": len(steps)}))
    return events


def _event(name: str, category: str, ts_s: float, dur_s: float, args: Mapping[str, object]) -> dict:
    return {"name": name, "cat": category, "ph": "X", "ts": ts_s * US_PER_S, "dur": max(0.0, dur_s) * US_PER_S,
            "pid": PID, "tid": TID, "args": dict(args)}


def chrome_trace(events: Sequence[dict], process: str, thread: str, other: Mapping[str, object]) -> dict:
    """The Trace Event Format's JSON object: the events after the names of their process and
    thread ("M" events); `other` goes to otherData (model, plan, clock, threads)."""
    meta = [{"name": "process_name", "ph": "M", "pid": PID, "tid": TID, "args": {"name": process}},
            {"name": "thread_name", "ph": "M", "pid": PID, "tid": TID, "args": {"name": thread}}]
    return {"traceEvents": [*meta, *events], "displayTimeUnit": "ms", "otherData": dict(other)}


def write_trace(doc: dict, path: Path) -> None:
    Path(path).write_text(json.dumps(doc) + "\n")


def traced_steps(graph, plan, steps, program) -> list[TracedStep]:
    """The program's calls (one per step with code, `run.one_by_one`) named for the trace."""
    from fusesearch.run import one_by_one

    calls = program.launches if hasattr(program, "launches") else program.calls  # CudaProgram, Program
    traced = []
    for (how, [s]), call in zip(one_by_one(steps), calls, strict=True):
        ops = "+".join(graph.nodes[i].op_type for i in s.nodes)
        label = s.kernel.name if s.kernel is not None else f"{ops} ({graph.nodes[s.nodes[0]].name})"
        skeleton = plan.groups[s.group].kernel.schedule.skeleton.value if s.nodes else "reorder"
        traced.append(TracedStep(f"g{s.group} {label}" if s.nodes else label, how, call,
                                 {"group": s.group, "how": how, "skeleton": skeleton, "ops": ops}))
    return traced


def trace_plan(prep, plan, *, backend="cpu", threads: int = 1, rounds: int = 20, warmup: int = 3, seed: int = 0,
               input_values=None) -> dict:
    """The plan's program run step by step on `backend` (module note): the Chrome trace."""
    from fusesearch.backends.registry import get_backend
    from fusesearch.run import (
        CudaProgram,
        Program,
        one_by_one,
        plan_steps,
        program_inputs,
        restore_threads,
    )

    backend = get_backend(backend)
    backend.require()
    canonical, weights, feeds = program_inputs(prep, seed, input_values)
    steps = plan_steps(prep.graph, plan)
    device = backend.program_device(threads)
    try:
        if device is None:
            program = Program(prep.graph, canonical, steps, weights, threads, split=one_by_one)
            clock = backend.clock()
        else:
            program = CudaProgram(prep.graph, canonical, steps, weights, device, threads)
            clock = device.clock()
        program.set_inputs(feeds)
        events = trace_rounds(traced_steps(prep.graph, plan, steps, program), rounds, clock, warmup=warmup)
    finally:
        restore_threads()
    name = getattr(plan.model, "name", "") or "model"
    return chrome_trace(events, f"fusesearch run {name}", f"plan ({plan.strategy}) on {backend.name}",
                        {"model": name, "strategy": plan.strategy, "device": plan.device, "backend": backend.name,
                         "threads": threads, "rounds": rounds, "warmup": warmup, "clock": clock.name})
