"""Device profiles: a DeviceSpec plus fitted RooflineParams, saved as JSON.

Problem: `fusesearch calibrate` fits the model to one machine; `fusesearch plan --device` must
then accept either a table name ("h100-sxm": datasheet figures, default parameters) or the
profile.json that calibration wrote (measured device, fitted parameters).
Approach: `Profile` <-> JSON under schema "fusesearch.profile/1"
({"schema", "device", "backend", "params", "fit", "versions"}); `load_device` dispatches on
whether its argument looks like a path, and takes the tuned tile table (tiles.json, schema
"fusesearch.tiles/1") beside a profile into its device (`DeviceSpec.tuned_tiles`).
Invariants: writing is deterministic (sorted keys, non-finite floats as null); every read failure
is a `ProfileError` that names the file and the problem.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import platform
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from costmodels.devices import DEVICES, HOST_NAMES, DeviceSpec, get_device, host_record
from costmodels.errors import InvalidSpec, ProfileError
from costmodels.kernel import SHAPE_CLASSES
from costmodels.roofline import RooflineParams, host_params

SCHEMA = "fusesearch.profile/1"
_FIX = "expected a profile.json written by `fusesearch calibrate`"


def installed_versions(distributions: Iterable[str]) -> dict[str, str | None]:
    """The installed version of each distribution; None for one that is not installed."""
    found: dict[str, str | None] = {}
    for dist in distributions:
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            found[dist] = None
    return found


def default_versions() -> dict[str, str]:
    """Versions that produced a profile (for provenance; not checked on load)."""
    try:
        package = metadata.version("fusesearch")
    except metadata.PackageNotFoundError:
        package = "unknown"
    return {"fusesearch": package, "python": platform.python_version(), "numpy": np.__version__}


@dataclass(frozen=True)
class Profile:
    """A device, the model parameters for it, and how they were obtained (`fit`: accuracy
    report from calibration, None for defaults)."""

    device: DeviceSpec
    params: RooflineParams = field(default_factory=RooflineParams)
    backend: str = ""
    fit: Mapping[str, Any] | None = None
    versions: Mapping[str, str] = field(default_factory=default_versions)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "device": self.device.to_dict(),
            "backend": self.backend,
            "params": self.params.to_dict(),
            "fit": _json_safe(self.fit),
            "versions": dict(self.versions),
        }

    @classmethod
    def from_dict(cls, data: Any) -> Profile:
        """Inverse of `to_dict`; raises ValueError (InvalidSpec) saying what is wrong."""
        if not isinstance(data, Mapping):
            raise InvalidSpec(f"top level is {type(data).__name__}, expected an object")
        if data.get("schema") != SCHEMA:
            raise InvalidSpec(f"schema {data.get('schema')!r}, expected {SCHEMA!r}")
        if not isinstance(data.get("device"), Mapping):
            raise InvalidSpec("missing 'device' object")
        params = data.get("params")
        if not isinstance(params, Mapping):
            raise InvalidSpec("missing 'params' object" if params is None else "'params' is not an object")
        fit = data.get("fit")
        if fit is not None and not isinstance(fit, Mapping):
            raise InvalidSpec("'fit' is not an object or null")
        return cls(
            device=DeviceSpec.from_dict(data["device"]),
            params=RooflineParams.from_dict(params),
            backend=str(data.get("backend") or ""),
            fit=fit,
            versions=dict(data.get("versions") or {}),
        )


def save_profile(profile: Profile, path: str | os.PathLike[str]) -> Path:
    """Write `profile` as JSON (parents created); returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(profile.to_dict(), indent=2, sort_keys=True, allow_nan=False)
    out.write_text(text + "\n")
    return out


def load_profile(path: str | os.PathLike[str]) -> Profile:
    """Read a profile.json; ProfileError naming the file and the problem on any failure."""
    src = Path(path)
    try:
        text = src.read_text()
    except FileNotFoundError:
        raise ProfileError(f"{src}: no such file; {_FIX}") from None
    except OSError as exc:
        raise ProfileError(f"{src}: cannot read ({exc.strerror}); {_FIX}") from None
    except UnicodeDecodeError:
        raise ProfileError(f"{src}: not a text file (binary data); {_FIX}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProfileError(
            f"{src}: not valid JSON ({exc.msg} at line {exc.lineno}); {_FIX}") from None
    try:
        return Profile.from_dict(data)
    except (InvalidSpec, TypeError, ValueError) as exc:
        raise ProfileError(f"{src}: {exc}; {_FIX}") from None


TILES_FILE = "tiles.json"  # the tuned tile table, beside a profile.json
TILES_SCHEMA = "fusesearch.tiles/1"
_TILES_FIX = "expected a tiles.json written by scripts/tune_tiles.py"


def save_tuned_tiles(entries: Iterable[Mapping[str, Any]], device: str, path: str | os.PathLike[str]) -> Path:
    """Write the tuned table: each entry {"skeleton", "class", "config", and its figures}."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"schema": TILES_SCHEMA, "device": device, "tiles": [_json_safe(dict(e)) for e in entries]}
    out.write_text(json.dumps(doc, indent=2, sort_keys=True, allow_nan=False) + "\n")
    return out


def load_tuned_tiles(path: str | os.PathLike[str]) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
    """The tuned table's (skeleton, shape class, configuration) rows; ProfileError naming the file
    and what is wrong (not JSON, another schema, a row without a tensor-core skeleton, a known shape
    class and a configuration of positive integers, a (skeleton, class) twice)."""
    src = Path(path)
    try:
        data = json.loads(src.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProfileError(f"{src}: cannot read the tuned tile table ({exc}); {_TILES_FIX}") from None
    rows = data.get("tiles") if isinstance(data, Mapping) and data.get("schema") == TILES_SCHEMA else None
    if not isinstance(rows, list):
        raise ProfileError(f"{src}: not a tuned tile table (schema {TILES_SCHEMA!r} with a 'tiles' list); {_TILES_FIX}")
    table: dict[tuple[str, str], tuple[int, ...]] = {}
    for i, row in enumerate(rows):
        config = row.get("config") if isinstance(row, Mapping) else None
        ok = (isinstance(row, Mapping) and isinstance(row.get("skeleton"), str) and row["skeleton"].startswith("mma-")
              and row.get("class") in SHAPE_CLASSES and isinstance(config, list) and config
              and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in config))
        if not ok:
            raise ProfileError(f"{src}: tiles[{i}] = {row!r}: expected {{'skeleton': 'mma-...', 'class': one of "
                               f"{', '.join(SHAPE_CLASSES)}, 'config': [positive integers]}}; {_TILES_FIX}")
        key = (row["skeleton"], row["class"])
        if key in table:
            raise ProfileError(f"{src}: tiles[{i}]: {key[0]} / {key[1]} given twice; {_TILES_FIX}")
        table[key] = tuple(config)
    return tuple((skeleton, cls, config) for (skeleton, cls), config in table.items())


def load_device(name_or_path: str | os.PathLike[str], threads: int | None = None) -> tuple[DeviceSpec, RooflineParams]:
    """A table name ('h100-sxm', 'host': this machine at `threads` OpenMP threads) -> (spec, default
    params: `host_params()` for a CPU); a profile path (ends in .json, contains a path separator,
    or names an existing file) -> (its device, its params)."""
    text = os.fspath(name_or_path)
    looks_like_path = text.lower().endswith(".json") or "/" in text or os.sep in text
    is_name = text.strip().lower() in DEVICES or text.strip().lower() in HOST_NAMES
    if looks_like_path or (not is_name and Path(text).is_file()):
        profile = load_profile(text)
        tiles = Path(text).parent / TILES_FILE
        if tiles.is_file():  # measured on this device: lowering's tensor-core configurations per shape class
            return dataclasses.replace(profile.device, tuned_tiles=load_tuned_tiles(tiles)), profile.params
        return profile.device, profile.params
    spec = get_device(text, threads)
    return spec, (host_params() if spec.kind == "cpu" else RooflineParams())


def priced_by(spec: DeviceSpec, profile: str | os.PathLike[str] | None) -> dict[str, Any]:
    """What priced a plan beyond its device's name, for plan.json: on a CPU its threads and the
    measured figures (`host_record`; a profile's own, not the cache file's, where one was
    given), and a profile's sha256; {} for a GPU of the table."""
    record = host_record(spec) if spec.kind == "cpu" else {}
    if profile is not None:
        record.pop("figures_file", None)
        record["profile_sha256"] = hashlib.sha256(Path(profile).read_bytes()).hexdigest()
    return record


def _json_safe(value: Any) -> Any:
    """Plain JSON types; NaN / inf become None (JSON has no spelling for them)."""
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
