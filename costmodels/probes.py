"""Measurements of this machine that `host_cpu()` turns into a DeviceSpec.

Problem: a CPU's datasheet figures are not at hand (a VM reports its nominal clock; its last-level
cache is shared), and the roofline prices every host kernel from them.
Approach: short probes, each a lower bound taken as the best of a few passes:
`measure_copy_bandwidth(n, workers)` (a threaded numpy copy, STREAM's read + write bytes; DRAM when
n is beyond the last-level cache); `measure_cache_curve(...)` (the copy at doubling footprints from
L2 to the last-level cache, made non-increasing and cut where it no longer beats DRAM by
CACHE_MIN_SPEEDUP; read by `DeviceSpec.bandwidth_for`); `measure_fma_peak()` (a C loop of
independent vector FMAs, 512-bit where the core has AVX-512 via `#pragma GCC target`; 0 without a
compiler); `measure_launch_overhead(threads)` (an OpenMP region's fork and join around a trivial
kernel, at the kernels' thread count).
Invariants: pure measurements (no files; `host_cpu()` keeps the figures); each within a fraction
of a second; an unusable result is 0, never guessed."""

from __future__ import annotations

import functools
import math
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

KIB = 1024
MIB = 1024 * KIB
# Part of the key a machine's figures are kept under: raised when a probe changes what it
# measures, so that figures an older probe kept are measured again.
PROBES_VERSION = 7  # 7: the parallel region's cost with its threads spinning briefly (OPENMP_WAIT)

# How libgomp's threads wait between parallel regions, in the generated kernels and in the probe
# that prices their regions: spin about 0.3 ms (libgomp counts some 100000 spins a millisecond),
# then sleep. A program's kernels are called back to back, so its threads stay awake from one
# region to the next (sleeping at once cost each region a futex wake on a VM: mobilenetv2 at 2
# threads 6.45 ms against 4.87 ms spinning); 0.3 ms after the program they sleep, so they do not
# take the cores from ONNX Runtime timed next in the same round (libgomp's default, 300000 spins,
# about 3 ms, did). But a spinning thread never yields its core: where another process is busy,
# a team's spin holds the core its partner waits for, and every barrier can cost a time slice
# (bert-small at 2 threads beside one busy process: 37.7 ms, against 1.3 ms at 1 thread). So the
# threads spin only where the machine is idle when libgomp loads (`busy_cpus` under
# IDLE_BUSY_CPUS), else wait passively (OPENMP_PASSIVE: a futex wake per region, about 1.4x slower
# at 2 threads on an idle VM, never a time slice). The user's OMP_WAIT_POLICY or GOMP_SPINCOUNT
# is kept; the launch probe always measures the spinning team (what an idle machine runs).
OPENMP_WAIT = {"GOMP_SPINCOUNT": "30000"}
OPENMP_PASSIVE = {"OMP_WAIT_POLICY": "PASSIVE"}
IDLE_BUSY_CPUS = 0.5  # busy CPUs (other processes) below which the machine counts as idle
IDLE_SAMPLE_S = 0.05  # how long `busy_cpus` watches

# Copy used to measure DRAM bandwidth: each array is 2x the last-level cache (a streaming working
# set larger than the cache gets almost no hits), within [32, 128] MiB, so at most 256 MiB is
# touched. First-touch page faults are slow and erratic on some VMs, so the arrays are
# initialized in parallel, outside the timed passes, and the best of a few passes counts.
BANDWIDTH_PROBE_MIN_BYTES = 32 * MIB
BANDWIDTH_PROBE_BYTES = 128 * MIB
BANDWIDTH_PROBE_BUDGET_S = 0.4
# Each timed pass of a small copy repeats it until about this many bytes have moved, so that the
# thread pool's dispatch (tens of microseconds) is not what is timed.
PASS_BYTES = 16 * MIB
# The cache probe: a footprint (both arrays) from CACHE_PROBE_CORE_CACHES of each thread's core
# cache up to the last-level cache, doubling; each footprint gets CACHE_PROBE_BUDGET_S.
CACHE_PROBE_CORE_CACHES = 0.5
CACHE_PROBE_BUDGET_S = 0.12
# A footprint that copies at most this much faster than DRAM ends the cache curve.
CACHE_MIN_SPEEDUP = 1.25
# The FMA probe: accumulators (more than latency x ports = 4 x 2 on current x86 cores) and
# iterations per timed pass (~25 ms at 3 GHz).
FMA_ACCUMULATORS = 12
FMA_ITERATIONS = 6_000_000
FMA_PASSES = 5

def _fma_source(accumulators: int) -> str:
    """The probe's C: `accumulators` independent vectors, each updated by one FMA per iteration."""
    names = [f"c{i}" for i in range(accumulators)]
    return _FMA_TEMPLATE % {
        "declare": ", ".join(names),
        "init": " ".join(f"{v} = b * {i + 1}.0f;" for i, v in enumerate(names)),
        "step": " ".join(f"{v} = {v} * a + b;" for v in names),
        "sum": " + ".join(names),
    }


_FMA_TEMPLATE = r"""
#if defined(__AVX512F__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("prefer-vector-width=512")
#endif
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#if defined(__AVX512F__)
#define LANES 16
#elif defined(__AVX__)
#define LANES 8
#else
#define LANES 4
#endif
typedef float vec __attribute__((vector_size(4 * LANES)));
int main(int argc, char **argv) {
  long iterations = atol(argv[1]);
  int passes = atoi(argv[2]);
  float seed = (float)argc * 1e-7f;
  vec a, b, %(declare)s;
  for (int l = 0; l < LANES; ++l) { a[l] = 1.0f - seed; b[l] = seed; }
  %(init)s
  double best = 1e30;
  for (int p = 0; p < passes; ++p) {
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long n = 0; n < iterations; ++n) {
      %(step)s
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double s = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    if (s < best) best = s;
  }
  vec total = %(sum)s;
  float sum = 0.0f;
  for (int l = 0; l < LANES; ++l) sum += total[l];
  printf("%%d %%.9e %%g\n", LANES, best, (double)sum);
  return 0;
}
"""


@functools.lru_cache(maxsize=16)
def measure_copy_bandwidth(nbytes: int = BANDWIDTH_PROBE_BYTES, workers: int = 0,
                           budget_s: float = BANDWIDTH_PROBE_BUDGET_S,
                           clock: Callable[[], float] = time.perf_counter) -> float:
    """Copy bandwidth in bytes/s (read + write, as STREAM counts it): best of a few passes.

    The arrays are split across `workers` threads (default: usable CPUs, at most 16; numpy
    releases the GIL while copying), each thread first-touching its own chunk and repeating its
    copy until a pass moves about PASS_BYTES. Stops after `budget_s` as `clock` (seconds) reads
    it; a DRAM-sized probe (at least BANDWIDTH_PROBE_MIN_BYTES) halves its size when memory is short.
    """
    available = _mem_available_bytes()
    while available and nbytes > BANDWIDTH_PROBE_MIN_BYTES and 4 * nbytes > available:
        nbytes //= 2
    workers = workers or min(usable_cpus(), 16)
    src = np.empty(max(nbytes // 4, workers), dtype=np.float32)
    dst = np.empty_like(src)
    bounds = np.linspace(0, src.size, workers + 1).astype(int)
    chunks = [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    repeats = max(1, PASS_BYTES // (2 * src.nbytes))

    def touch(chunk: slice) -> None:
        src[chunk] = 1.0
        dst[chunk] = 0.0

    def copy(chunk: slice) -> None:
        for _ in range(repeats):
            np.copyto(dst[chunk], src[chunk])

    best_s = float("inf")
    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(touch, chunks))
        list(pool.map(copy, chunks))  # warm: caches, page tables
        start = clock()
        for _ in range(20):
            t0 = clock()
            list(pool.map(copy, chunks))
            best_s = min(best_s, clock() - t0)
            if clock() - start > budget_s:
                break
    return 2 * src.nbytes * repeats / best_s


def measure_cache_curve(llc_bytes: int, core_cache_bytes: int, dram_bytes_per_s: float,
                        workers: int) -> tuple[tuple[int, float], ...]:
    """((footprint bytes, copy bytes/s), ...) at doubling footprints from CACHE_PROBE_CORE_CACHES of
    the threads' core caches up to the last-level cache: each rate at least that of every larger
    footprint, the curve ending at the last footprint that copies CACHE_MIN_SPEEDUP x faster than
    DRAM; () when none does."""
    footprint = int(CACHE_PROBE_CORE_CACHES * core_cache_bytes) * max(1, workers)
    points: list[tuple[int, float]] = []
    while footprint <= llc_bytes:
        points.append((footprint, measure_copy_bandwidth(footprint // 2, workers, CACHE_PROBE_BUDGET_S)))
        footprint *= 2
    return monotone_curve(points, dram_bytes_per_s)


def monotone_curve(points: list[tuple[int, float]], dram_bytes_per_s: float) -> tuple[tuple[int, float], ...]:
    """`points` (ascending footprints) with each rate raised to the best of the larger footprints'
    (a bigger working set never copies faster: a slower pass was another tenant), then cut after
    the last point still CACHE_MIN_SPEEDUP x faster than DRAM."""
    curve: list[tuple[int, float]] = []
    best = 0.0
    for size, rate in reversed(points):
        best = max(best, rate)
        curve.append((size, best))
    curve.reverse()
    while curve and curve[-1][1] < CACHE_MIN_SPEEDUP * dram_bytes_per_s:
        curve.pop()
    return tuple(curve)


def c_program_output(source: str, flags: list[str], args: list, env: dict[str, str] | None = None) -> str | None:
    """What a C program prints: `source` compiled with the system's C compiler and `flags`, run
    with `args` (and `env` over this process's environment); None when there is no compiler or
    the build or the run fails. Each probe's program, and the benchmarks' (`bench_cpu`), run
    through here."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        return None
    with tempfile.TemporaryDirectory(prefix="fusesearch-probe-") as folder:
        src, binary = Path(folder) / "probe.c", Path(folder) / "probe"
        src.write_text(source)
        try:
            subprocess.run([compiler, *flags, "-o", str(binary), str(src)], check=True, capture_output=True, timeout=60)
            return subprocess.run([str(binary), *map(str, args)], check=True, capture_output=True, text=True,
                                  timeout=60, env={**os.environ, **(env or {})}).stdout
        except (OSError, subprocess.SubprocessError):
            return None


@functools.lru_cache(maxsize=1)
def measure_fma_peak() -> tuple[float, int]:
    """(FP32 flop/s of one thread issuing independent vector FMAs, its vector lanes); (0, 0) when
    no C compiler builds the probe or its output is unusable."""
    out = c_program_output(_fma_source(FMA_ACCUMULATORS), ["-O2", "-march=native", "-ffp-contract=fast"],
                           [FMA_ITERATIONS, FMA_PASSES])
    if out is None:
        return 0.0, 0
    m = re.fullmatch(r"(\d+) (\S+) \S+\s*", out)
    if not m or float(m.group(2)) <= 0:
        return 0.0, 0
    lanes = int(m.group(1))
    return FMA_ITERATIONS * FMA_ACCUMULATORS * lanes * 2 / float(m.group(2)), lanes


# The launch probe: each timed pass calls the kernel in batches of LAUNCH_BATCH until
# LAUNCH_PASS_S has passed, and the best batch of LAUNCH_PASSES passes counts. A busy machine
# makes a region of several threads far slower while a thread waits for its core (5 ms, not
# 0.8 us, averaged over a pass with the other core taken: a figure that, kept in the cache file,
# would price every host kernel at 5 ms); short batches both find the moments the team runs
# together and keep the probe within 0.08 s here, 0.2 s on a busy host.
LAUNCH_BATCH = 8
LAUNCH_PASS_S = 0.01
LAUNCH_PASSES = 3
# A best batch slower than this never had its team running together (an idle core forks and joins
# in microseconds): the machine was too busy to say, so the probe reports 0 and the estimate is used.
LAUNCH_MAX_S = 1e-4

_LAUNCH_SOURCE = r"""
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
__attribute__((noinline)) void fs_region(float* out, long n) {
    #pragma omp parallel for schedule(static)
    for (long i = 0; i < n; ++i) out[i] = (float)i;
}
static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}
int main(int argc, char **argv) {
  long batch = atol(argv[1]);
  double pass_s = atof(argv[2]);
  int passes = atoi(argv[3]);
  static float out[64];
  double best = 1e30;
  fs_region(out, 64);
  for (int p = 0; p < passes; ++p) {
    double start = now(), t0 = start, t1 = start;
    do {
      for (long c = 0; c < batch; ++c) fs_region(out, 64);
      t1 = now();
      if ((t1 - t0) / (double)batch < best) best = (t1 - t0) / (double)batch;
      t0 = t1;
    } while (t1 - start < pass_s);
  }
  printf("%.9e %g\n", best, (double)out[63]);
  return 0;
}
"""


@functools.lru_cache(maxsize=16)
def measure_launch_overhead(threads: int) -> float:
    """Seconds one call of a kernel that is an OpenMP parallel region over a few floats takes,
    with `threads` OpenMP threads waiting between regions as the CPU backend loads libgomp
    (`OPENMP_WAIT`); 0.0 when no C compiler with OpenMP
    builds the probe, its output is unusable, or the machine is too busy for its team to run
    together (LAUNCH_MAX_S)."""
    out = c_program_output(_LAUNCH_SOURCE, ["-O2", "-fopenmp"], [LAUNCH_BATCH, LAUNCH_PASS_S, LAUNCH_PASSES],
                           {"OMP_NUM_THREADS": str(max(1, threads)), **OPENMP_WAIT})
    if out is None:
        return 0.0
    m = re.fullmatch(r"(\S+) \S+\s*", out)
    try:
        seconds = float(m.group(1)) if m else 0.0
    except ValueError:
        return 0.0
    return seconds if math.isfinite(seconds) and 0 < seconds <= LAUNCH_MAX_S else 0.0


def busy_cpus(seconds: float = IDLE_SAMPLE_S) -> float:
    """How many CPUs the machine kept busy over the next `seconds` (/proc/stat's non-idle share of
    every CPU's time, times the CPUs; this process sleeps meanwhile, so it is the others' work);
    0.0 where /proc/stat cannot be read (not Linux)."""
    def sample() -> tuple[int, int] | None:
        try:
            fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        except (OSError, ValueError, IndexError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields[:8]), idle
    first = sample()
    time.sleep(seconds)
    second = sample()
    if first is None or second is None or second[0] <= first[0]:
        return 0.0
    total, idle = second[0] - first[0], second[1] - first[1]
    return max(0.0, (total - idle) / total * usable_cpus())


def openmp_wait(busy: float) -> dict[str, str]:
    """The wait settings libgomp loads with (module note): spinning on an idle machine (`busy`
    CPUs taken by others under IDLE_BUSY_CPUS), passive otherwise."""
    return OPENMP_WAIT if busy < IDLE_BUSY_CPUS else OPENMP_PASSIVE


def usable_cpus() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def _mem_available_bytes() -> int:
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        return 0
    m = re.search(r"MemAvailable:\s+(\d+) kB", text)
    return int(m.group(1)) * KIB if m else 0
