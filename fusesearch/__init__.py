"""fusesearch: find the best way to fuse an ONNX graph's operators into GPU kernels, for a GPU.

`fusesearch.plan`, `measure`, `run`, `compare` and `sweep` are the commands as functions, with the
commands' defaults (`plan`'s device, a flag the command requires: h100-sxm), each returning a result with `to_pandas()`
(see `fusesearch.api`); the command line is `fusesearch --help`. Importing the package loads
neither ortools nor cupy. The submodules `fusesearch.run`, `.measure` and `.sweep` stay importable
by their full names; the package's attributes of those names are the functions.
"""

from __future__ import annotations

import sys
import types

__version__ = "0.1.0"
_API = ("measure", "run", "compare", "sweep")


def plan(model: str, device: str = "h100-sxm", strategy: str = "cpsat", **kwargs):
    """Plan `model` (path or zoo:NAME) on `device` with `strategy`; see fusesearch.api.plan."""
    from fusesearch.api import plan as _plan

    return _plan(model, device, strategy, **kwargs)


def _lazy(name: str):
    def call(*args, **kwargs):
        from fusesearch import api

        return getattr(api, name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"`fusesearch {name}` as a function; see fusesearch.api.{name} (imported on the first call)."
    return call


measure, run, compare, sweep = (_lazy(name) for name in _API)


class _Package(types.ModuleType):
    """Importing a submodule sets the package's attribute of its name; for the API's names the
    function stays (the submodule is in sys.modules, `import fusesearch.run` still loads it)."""

    def __setattr__(self, name: str, value) -> None:
        if name in _API and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

__all__ = ["__version__", "compare", "measure", "plan", "run", "sweep"]
