"""The GPU harness cannot pass without a GPU: conftest's gpu marker, scripts/gpu_check.sh and its
JUnit count (scripts/gpu_tests_ran.py).

A machine without CuPy or without a visible device skips the gpu tests; a CuPy that is installed
but broken (a CUDA library missing, a runtime that errors) makes them errors. The cases a CI
machine cannot be in are set up with a stand-in `cupy` package on PYTHONPATH, run by a real pytest
in a subprocess with tests/conftest.py as its plugin. gpu_check.sh stops in one line before
installing anything when no GPU is visible, and fails when the gpu tests skipped or none ran.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

GPU_TEST = """
import pytest

@pytest.mark.gpu
def test_on_the_gpu():
    pass
"""

# stand-ins for CuPy installs this machine cannot have: (body of cupy/__init__.py)
BROKEN_IMPORT = 'raise ImportError("libnvrtc.so.13: cannot open shared object file")\n'
RUNTIME = """
class CUDARuntimeError(RuntimeError):
    def __init__(self, status):
        super().__init__(f"cudaError {{status}}")
        self.status = status

class runtime:
    @staticmethod
    def getDeviceCount():
        raise CUDARuntimeError({status})

class cuda:
    runtime = runtime
"""


def _pytest(tmp_path: Path, test_source: str, *args: str, pythonpath: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    test = tmp_path / "test_probe.py"
    test.write_text(textwrap.dedent(test_source))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*pythonpath, str(ROOT)]),
           "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}  # hypothesis's plugin alone takes seconds to import
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-o", "addopts=",
                           "--rootdir", str(tmp_path), *args, str(test)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)


def _gpu_visible() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    return listed.returncode == 0 and "GPU " in listed.stdout


@pytest.mark.parametrize(("cupy", "outcome", "needle"), [
    (BROKEN_IMPORT, "1 error", "GPU test cannot run: CuPy is installed but does not import: ImportError: libnvrtc"),
    (RUNTIME.format(status=3), "1 error", "GPU test cannot run: the CUDA runtime fails"),  # cudaErrorInitializationError
    (RUNTIME.format(status=100), "1 skipped", "needs an NVIDIA GPU with CuPy: no GPU visible"),  # cudaErrorNoDevice
], ids=["import-fails", "runtime-fails", "no-device"])
def test_gpu_tests_skip_only_without_a_gpu_and_error_on_a_broken_cupy(tmp_path, cupy, outcome, needle):
    fake = tmp_path / "site" / "cupy"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(cupy)
    proc = _pytest(tmp_path, GPU_TEST, "-p", "tests.conftest", pythonpath=(str(fake.parent),))
    assert outcome in proc.stdout and needle in proc.stdout, proc.stdout + proc.stderr
    assert proc.returncode == (1 if "error" in outcome else 0), proc.stdout


def test_gpu_tests_skip_when_cupy_is_not_installed(tmp_path):
    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("cupy is installed here")
    proc = _pytest(tmp_path, GPU_TEST, "-p", "tests.conftest")
    assert proc.returncode == 0 and "1 skipped" in proc.stdout, proc.stdout + proc.stderr
    assert "needs an NVIDIA GPU with CuPy: CuPy is not installed" in proc.stdout


def test_gpu_check_stops_in_one_line_without_a_gpu(tmp_path):
    if _gpu_visible():
        pytest.skip("a GPU is visible: gpu_check.sh runs in full")
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "OUT": str(out)})
    assert proc.returncode == 1 and proc.stdout == "", proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: no GPU visible: "), proc.stderr
    assert not out.exists()  # it stopped before its first step


def _gpu_tests_ran(report: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_tests_ran.py"), str(report)],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(("source", "select", "code", "line"), [
    ("import pytest\ndef test_a():\n    pass\ndef test_b():\n    pytest.skip('needs an NVIDIA GPU')\n", "",
     1, "gpu tests: 1 of 2 skipped, e.g. test_probe::test_b: needs an NVIDIA GPU"),
    ("def test_a():\n    pass\ndef test_b():\n    pass\n", "", 0, "gpu tests: 2 ran, none skipped"),
    ("def test_a():\n    pass\n", "no_such_test", 1, "gpu tests: none ran"),
], ids=["one-skipped", "all-ran", "none-selected"])
def test_gpu_tests_ran_reads_pytests_junit_report(tmp_path, source, select, code, line):
    report = tmp_path / "report.xml"
    _pytest(tmp_path, source, f"--junitxml={report}", *(("-k", select) if select else ()))
    proc = _gpu_tests_ran(report)
    assert proc.returncode == code, proc.stdout + proc.stderr
    said = (proc.stdout if code == 0 else proc.stderr).strip()
    assert said.startswith(line) and len(said.splitlines()) == 1, said


def test_gpu_tests_ran_refuses_a_missing_report(tmp_path):
    proc = _gpu_tests_ran(tmp_path / "none.xml")
    assert proc.returncode == 1 and "no readable JUnit report" in proc.stderr
