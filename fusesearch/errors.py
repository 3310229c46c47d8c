"""One error hierarchy for the whole package.

Problem: the CLI must turn every user mistake into exit code 2 and one clear line, and every
internal failure into exit code 1, without tracebacks leaking to users.
Approach: every raised error derives from `FusesearchError`; `BadInput` (and subclasses) means the
user can fix it, and its message says what was expected, what came, and the fix.
`check_outputs` is the one check of a command's output paths (each via `check_output_path`).
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
    """Refuse to overwrite a file unless asked, to write over a folder, or into a missing folder."""
    from pathlib import Path

    path = Path(path)
    if path.is_dir():
        raise BadInput(f"{flag} {path}: is a folder; give a file path, e.g. {path / 'out'}")
    if path.exists() and not overwrite:
        raise BadInput(f"{flag} {path}: file exists; remove it or pass --force to overwrite")
    if not path.parent.exists():
        raise BadInput(f"{flag} {path}: folder {path.parent} does not exist; create it first")


def check_outputs(outputs, overwrite: bool, reads=()) -> None:
    """One command's output paths, all at once: `outputs` are (path or None, flag), `reads` are
    (path, what) of files the command reads. None may be a file the command reads (it would
    read its own output back), no two may be one file, and each passes `check_output_path`."""
    import os

    def same(a, b) -> bool:
        if os.path.realpath(a) == os.path.realpath(b):
            return True
        try:
            return os.path.samefile(a, b)
        except OSError:
            return False

    given = [(path, flag) for path, flag in outputs if path is not None]
    for index, (path, flag) in enumerate(given):
        for source, what in reads:
            if source is not None and same(path, source):
                raise BadInput(f"{flag} {path}: is the {what} this command reads; write to another path")
        for other, other_flag in given[:index]:
            if same(path, other):
                raise BadInput(f"{flag} {path}: {other_flag} writes to the same path; give each output its own path")
    for path, flag in given:
        check_output_path(path, overwrite, flag)


class ModelLoadError(BadInput):
    """The model file cannot be read or is not a valid ONNX graph."""


class ShapeBindingError(BadInput):
    """A dynamic dim is unbound, or an --input-shape / --dim flag does not fit the model."""


class UnsupportedModel(BadInput):
    """The model uses something fusesearch cannot handle (an opset out of range, ...)."""
