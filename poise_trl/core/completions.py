"""The completion table of a training run (`log_completions: true`): one row per training completion.

It goes to the tracker through TRL's own table (`seam.grpo.into_trl_table`) and to
`<output_dir>/completions.jsonl`; a resumed run first drops the lines after its checkpoint. Details:
docs/training.md ("The completion table").
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import torch

from poise_trl.core.provenance import write_text

COMPLETIONS_FILE = "completions.jsonl"


def per_completion_advantages(advantages: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """(B,) advantages as they are; (B, T) per-token ones -> their mean over each completion's tokens."""
    if advantages.dim() == 1:
        return advantages.float()
    mask = completion_mask.float()
    return (advantages.float() * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)


def _number(value: float) -> float | None:
    return None if math.isnan(value) else value  # JSON has no NaN


class CompletionTable:
    """The rows of completions.jsonl not yet written. Every column comes gathered over processes, so only
    the process that `writes` keeps them."""

    def __init__(self, output_dir: str | Path, writes: bool):
        self.path = Path(output_dir) / COMPLETIONS_FILE
        self.writes = writes
        self.pending: list[dict] = []

    def add_round(self, step: int, prompts: Sequence, completions: Sequence, rewards: Sequence[float],
                  advantages: Sequence[float], columns: dict[str, Sequence]) -> None:
        """One generation round, every column over all processes in generation order."""
        if not self.writes:
            return
        for i in range(len(rewards)):
            row = {"step": step, "prompt": prompts[i], "completion": completions[i],
                   "reward": _number(rewards[i]), "advantage": advantages[i]}
            row.update({name: values[i] for name, values in columns.items()})
            self.pending.append(row)

    def flush(self) -> None:
        """Append the pending rows to the JSONL file."""
        if not self.pending:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as file:
            file.writelines(json.dumps(row) + "\n" for row in self.pending)
        self.pending = []


def truncate_after(path: str | Path, step: int) -> None:
    """Keep the lines of steps <= `step` (and drop a last line cut short by a crash): what a run resumed
    from checkpoint-`step` has written before it."""
    path = Path(path)
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines(keepends=True)
            if line.endswith("\n") and json.loads(line)["step"] <= step]
    write_text(path, "".join(kept))
