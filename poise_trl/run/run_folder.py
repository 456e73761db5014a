"""Output folders and checkpoints: what a folder holds and what `poise train` does with it, decided
before anything is written, and the marker that makes a checkpoint complete."""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from poise_trl.algorithms import algorithms
from poise_trl.core.provenance import write_json
from poise_trl.run.recipe import RecipeError, read_yaml

CHECKPOINT_MARKER = "checkpoint_complete.json"  # written last into a checkpoint: its presence means complete
# Keys that do not change what a run computes: a rerun may differ in them and still be the same run.
NOT_SETTINGS = {"resume_from_checkpoint", "push_to_hub", "hub_model_id", "output_dir"}
# What `poise train` writes into an output folder, beside the files an algorithm declares
# (`Algorithm.run_files`, see `run_entries`); --overwrite removes nothing else.
RUN_ENTRIES = ("recipe.yaml", "summary.json", "README.md", "final", "completions.jsonl", "completions",
               "checkpoint-*", "*.tmp")


def run_entries() -> tuple[str, ...]:
    """Every name a run folder may hold: a folder may hold a run of any algorithm before --overwrite."""
    return RUN_ENTRIES + tuple(name for algorithm in algorithms().values() for name in algorithm.run_files)


def _flatten(recipe: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in recipe.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def differing_settings(recorded: dict, wanted: dict) -> list[str]:
    """Recipe keys (dotted for nested ones, e.g. peft.r) whose values differ between the
    recipe a run folder was made with and the one asked for now."""
    old, new = _flatten(recorded), _flatten(wanted)
    keys = old.keys() | new.keys()
    return sorted(k for k in keys if k.split(".")[0] not in NOT_SETTINGS and old.get(k) != new.get(k))


def checkpoint_step(path: Path) -> int:
    return int(path.name.rsplit("-", 1)[1])


def checkpoint_problem(folder: Path) -> str | None:
    """None for a complete checkpoint; otherwise what is wrong with it. The marker lists every
    file with its size, so a file truncated or replaced after the write is caught too."""
    marker = folder / CHECKPOINT_MARKER
    if not marker.is_file():
        return "incomplete"
    try:
        files = json.loads(marker.read_text())["files"]
    except (ValueError, KeyError, TypeError):
        return f"{marker} is unreadable"
    for name, size in files.items():
        path = folder / name
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != size:
            return f"{path} is truncated or corrupt ({path.stat().st_size} bytes, {size} when it was written)"
    return None


def write_checkpoint_marker(folder: Path, step: int) -> None:
    """Call after everything else of the checkpoint is written (write then rename)."""
    files = {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*"))
             if p.is_file() and p.name != CHECKPOINT_MARKER and not p.name.endswith(".tmp")}
    write_json(folder / CHECKPOINT_MARKER, {"step": step, "files": files})


@dataclass
class RunFolder:
    """What an output folder holds, and what `poise train` does with it: "new" (start at step
    0), "resume" (from `checkpoint`) or "finished" (report `summary`, touch nothing)."""

    path: Path
    state: str
    checkpoint: Path | None = None
    summary: dict | None = None
    warnings: list[str] = field(default_factory=list)
    clear: bool = False  # --overwrite: the old run's files go before the new run writes

    @property
    def step(self) -> int | None:
        return checkpoint_step(self.checkpoint) if self.checkpoint else None


def check_output_dir(path: Path) -> None:
    """A file, or a folder that cannot be created or written, fails before anything runs."""
    if path.exists() and not path.is_dir():
        raise RecipeError(f"output folder {path} is a file: give a folder path with --output-dir")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise RecipeError(f"output folder {path} cannot be created: {existing} is a file. Give another --output-dir")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise RecipeError(f"output folder {path} is not writable (no write permission on {existing}): give another "
                          "--output-dir")


def _foreign_entries(path: Path) -> list[str]:
    entries = run_entries()
    return sorted(p.name for p in path.iterdir() if not any(fnmatch.fnmatch(p.name, pat) for pat in entries))


def inspect_run_folder(path: str | Path, recipe: dict, overwrite: bool = False,
                       explicit: str | None = None) -> RunFolder:
    """Decide what to do with an output folder, reading only. A folder holding another run
    (different settings) or files that are not a run is refused; `overwrite` lets the new run
    replace the old one (never foreign files). `explicit` is a checkpoint folder the user named."""
    path = Path(path)
    check_output_dir(path)
    if not path.exists() or not any(path.iterdir()):
        return RunFolder(path, "new")
    foreign = _foreign_entries(path)
    if foreign:
        raise RecipeError(f"output folder {path} holds files that are not from poise train ({', '.join(foreign[:3])}"
                          f"{', ...' if len(foreign) > 3 else ''}): give an empty or new --output-dir")
    if overwrite:  # the new run replaces whatever run is there, readable or not
        return RunFolder(path, "new", clear=True)
    summary_path, recipe_path = path / "summary.json", path / "recipe.yaml"
    summary = None
    if summary_path.exists():
        try:
            summary = json.loads(summary_path.read_text())
        except ValueError:
            raise RecipeError(f"{summary_path} is unreadable (truncated?): move it away to resume the run, or give "
                              "--overwrite to start over") from None
    if recipe_path.exists():
        try:
            recorded = read_yaml(recipe_path.read_text()) or {}
        except yaml.YAMLError:
            raise RecipeError(f"{recipe_path} is unreadable (truncated?): give --overwrite to start over, or another "
                              "--output-dir") from None
    elif summary is not None:
        recorded = summary.get("recipe", {})
    else:
        raise RecipeError(f"output folder {path} holds run files but no recipe.yaml, so its settings are unknown: "
                          "give --overwrite to start over, or another --output-dir")
    differing = differing_settings(recorded, recipe)
    if differing:
        shown = ", ".join(f"{k} ({_flatten(recorded).get(k)!r} -> {_flatten(recipe).get(k)!r})" for k in differing[:4])
        raise RecipeError(f"output folder {path} holds a run made with other settings ({shown}"
                          f"{', ...' if len(differing) > 4 else ''}): give another --output-dir, or --overwrite to "
                          "replace that run")
    if summary is not None:
        return RunFolder(path, "finished", summary=summary)
    if explicit is not None:
        return RunFolder(path, "resume", checkpoint=Path(explicit))
    folder = RunFolder(path, "new")
    checkpoints = sorted((p for p in path.glob("checkpoint-*") if p.is_dir() and p.name.rsplit("-", 1)[1].isdigit()),
                         key=checkpoint_step, reverse=True)
    for checkpoint in checkpoints:
        problem = checkpoint_problem(checkpoint)
        if problem is None:
            folder.state, folder.checkpoint = "resume", checkpoint
            break
        if problem != "incomplete":
            raise RecipeError(f"checkpoint {checkpoint.name} is damaged: {problem}. Delete {checkpoint} to resume "
                              "from the checkpoint before it, or give --overwrite to start over")
        folder.warnings.append(f"{checkpoint.name} is incomplete (interrupted while it was written): skipped")
    return folder


def plan_output_dir(args, recipe: dict, overwrite: bool) -> RunFolder:
    """`inspect_run_folder` with TRL's `resume_from_checkpoint` (true: the newest complete
    checkpoint must exist; a folder: that checkpoint; false: never resume)."""
    resume = args.resume_from_checkpoint
    explicit = None
    if resume not in (None, False, "", "false", "False", True, "true", "True"):
        if not Path(resume).is_dir():
            raise RecipeError(f"resume_from_checkpoint: {resume} is not a folder (give a checkpoint-N folder, or "
                              "true)")
        problem = checkpoint_problem(Path(resume))
        if problem not in (None, "incomplete"):  # no marker: a checkpoint from before markers, or the user's own
            raise RecipeError(f"resume_from_checkpoint: {resume} is damaged: {problem}")
        explicit = str(resume)
    folder = inspect_run_folder(args.output_dir, recipe, overwrite=overwrite, explicit=explicit)
    if resume in (True, "true", "True") and folder.state == "new":
        raise RecipeError(f"resume_from_checkpoint: true, but {args.output_dir} holds no checkpoint to resume from "
                          "(no complete checkpoint-N folder)")
    if resume in (False, "false", "False") and folder.state == "resume":
        raise RecipeError(f"resume_from_checkpoint: false, but {args.output_dir} holds this run's checkpoints: drop "
                          "the key to resume it, or give --overwrite to start over")
    return folder


def clear_run_folder(path: Path) -> None:
    """--overwrite: the old run's files go (only files poise train writes; inspect_run_folder
    refused folders with others). Renamed first, so the folder never mixes two runs."""
    doomed = path.with_name(f".{path.name}.overwritten-{os.getpid()}")
    path.rename(doomed)
    shutil.rmtree(doomed)


def rerun_outcome(output_dir: str, recipe: dict) -> str:
    """What running the same command again does with `output_dir` (for error lines)."""
    try:
        folder = inspect_run_folder(output_dir, recipe)
    except ValueError as exc:
        return f"it will refuse the output folder ({exc})"
    if folder.state == "resume":
        return f"the run resumes from {folder.checkpoint.name} (step {folder.step})"
    return "the run starts over (no complete checkpoint yet)"
