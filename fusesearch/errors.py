"""One error hierarchy for the whole package.

Problem: the CLI must turn every user mistake into exit code 2 and one clear line, and every
internal failure into exit code 1, without tracebacks leaking to users.
Approach: every raised error derives from `FusesearchError`; `BadInput` (and subclasses) means the
user can fix it, and its message says what was expected, what came, and the fix.
`check_outputs` is the one check of a command's output paths (each via `check_output_path`), given
every file the command reads; `writing` names the user's path when a write fails.
Invariant: messages are one line (no newlines), name the file / node / option involved.
"""

from __future__ import annotations

from contextlib import contextmanager


class FusesearchError(Exception):
    """Base of every error the package raises on purpose."""

    exit_code = 1

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


class BadInput(FusesearchError):
    """The user's model, flag or file is wrong; the message says how to fix it (exit code 2)."""

    exit_code = 2


def check_output_path(path, overwrite: bool, flag: str) -> None:
    """Refuse to overwrite a file unless asked, to write over a folder or anything that is not a
    plain file (a device such as /dev/full, a pipe: a staged write would replace it), or into a
    missing folder."""
    from pathlib import Path

    path = Path(path)
    if path.is_dir():
        raise BadInput(f"{flag} {path}: is a folder; give a file path, e.g. {path / 'out'}")
    if path.exists() and not path.is_file():
        raise BadInput(f"{flag} {path}: is not a plain file (a device, pipe or socket); give a file path")
    if path.exists() and not overwrite:
        raise BadInput(f"{flag} {path}: file exists; remove it or pass --force to overwrite")
    if not path.parent.exists():
        raise BadInput(f"{flag} {path}: folder {path.parent} does not exist; create it first")


def _same(a, b) -> bool:
    """One file, however spelled (.., a link)."""
    import os

    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _inside(path, folder) -> bool:
    import os

    return os.path.realpath(path).startswith(os.path.realpath(folder).rstrip(os.sep) + os.sep)


def check_not_read(outputs, reads) -> None:
    """No output (path, flag) may replace a file the command reads: `reads` are (path, what), a
    path a file or a folder whose every file the command reads (a sweep's cells/). --force never
    allows it: the command would destroy its own input, or read its own output back."""
    for path, flag in outputs:
        for source, what in reads:
            if source is None:
                continue
            if _same(path, source) or _inside(path, source):
                raise BadInput(f"{flag} {path}: is a file this command reads (the {what}); write to another path")


def check_outputs(outputs, overwrite: bool, reads=()) -> None:
    """One command's output paths, all at once: `outputs` are (path or None, flag), `reads` are
    (path, what) of what the command reads (`check_not_read`). No two outputs may be one file,
    and each passes `check_output_path`."""
    given = [(path, flag) for path, flag in outputs if path is not None]
    check_not_read(given, reads)
    for index, (path, flag) in enumerate(given):
        for other, other_flag in given[:index]:
            if _same(path, other):
                raise BadInput(f"{flag} {path}: {other_flag} writes to the same path; give each output its own path")
    for path, flag in given:
        check_output_path(path, overwrite, flag)


@contextmanager
def writing(path, flag: str):
    """Writes to the user's PATH: a failure to write (no such folder, no space, read-only, /proc)
    is a BadInput naming PATH, never the temporary name a staged write used."""
    try:
        yield
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise BadInput(f"{flag} {path}: cannot write it ({reason}); give a path in a folder you can write "
                       "to, with free space") from None


class ModelLoadError(BadInput):
    """The model file cannot be read or is not a valid ONNX graph."""


class ShapeBindingError(BadInput):
    """A dynamic dim is unbound, or an --input-shape / --dim flag does not fit the model."""


class UnsupportedModel(BadInput):
    """The model uses something fusesearch cannot handle (an opset out of range, ...)."""
