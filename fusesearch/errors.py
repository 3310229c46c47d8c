"""One error hierarchy for the whole package.

Problem: the CLI must turn every user mistake into exit code 2 and one clear line, and every
internal failure into exit code 1, without tracebacks leaking to users.
Approach: every raised error derives from `FusesearchError`; `BadInput` (and subclasses) means the
user can fix it, and its message says what was expected, what came, and the fix.
Invariant: messages are one line (no newlines), name the file / node / option involved.
"""

from __future__ import annotations


class FusesearchError(Exception):
    """Base of every error the package raises on purpose."""

    exit_code = 1

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


class BadInput(FusesearchError):
    """The user's model, flag or file is wrong; the message says how to fix it (exit code 2)."""

    exit_code = 2


def check_output_path(path, overwrite: bool, flag: str) -> None:
    """Refuse to overwrite a file unless asked, or to write into a missing folder."""
    from pathlib import Path

    path = Path(path)
    if path.exists() and not overwrite:
        raise BadInput(f"{flag} {path}: file exists; remove it or pass --force to overwrite")
    if not path.parent.exists():
        raise BadInput(f"{flag} {path}: folder {path.parent} does not exist; create it first")


class ModelLoadError(BadInput):
    """The model file cannot be read or is not a valid ONNX graph."""


class ShapeBindingError(BadInput):
    """A dynamic dim is unbound, or an --input-shape / --dim flag does not fit the model."""


class UnsupportedModel(BadInput):
    """The model uses something fusesearch cannot handle (an opset out of range, ...)."""
