"""Errors raised by the cost-model package.

Problem: `costmodels` must not import `fusesearch`, yet its callers (the CLI) need to turn a bad
device name or a broken profile file into one clear line and exit code 2.
Approach: a small hierarchy rooted at `CostModelError`; the user-fixable ones also derive from
`ValueError`, so callers that only know the standard library still catch them.
Invariant: messages are one line and say what was expected, what came, and the fix.
"""

from __future__ import annotations


class CostModelError(Exception):
    """Base of every error `costmodels` raises on purpose."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


class InvalidSpec(CostModelError, ValueError):
    """A DeviceSpec, KernelSpec or RooflineParams value is out of range (negative bytes, ...)."""


class UnknownDevice(CostModelError, ValueError):
    """A device name is not in the built-in table (the message lists the known names)."""


class ProfileError(CostModelError, ValueError):
    """A profile.json cannot be read: missing, not JSON, wrong schema or bad fields."""


class CacheFolderError(ValueError):
    """$FUSESEARCH_CACHE names something that cannot be a folder (a file, or a path under one).
    Not a CostModelError: it is the environment's fault, not the device's, so the callers that
    turn a CostModelError into "--device NAME: ..." let it through."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))
