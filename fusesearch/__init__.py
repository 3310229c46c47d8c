"""fusesearch: find the best way to fuse an ONNX graph's operators into GPU kernels, for a GPU.

`fusesearch.plan(model, device=..., strategy=...)` returns a validated `Plan` (see
`fusesearch.api`); the command line is `fusesearch --help`. Importing the package loads neither
ortools nor cupy.
"""

from __future__ import annotations

__version__ = "0.1.0"


def plan(model: str, device: str = "h100-sxm", strategy: str = "greedy", **kwargs):
    """Plan `model` (path or zoo:NAME) on `device` with `strategy`; see fusesearch.api.plan."""
    from fusesearch.api import plan as _plan

    return _plan(model, device, strategy, **kwargs)


__all__ = ["__version__", "plan"]
