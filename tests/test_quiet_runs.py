"""A successful run is quiet: a toy `poise train` and its resume, run as a user runs them (the console script,
Python's default warning filters), print no Python warning on stderr, no transformers progress bar and no
report of the tied LM head as a missing key. Third-party warnings that we cannot fix are filtered by their
text in poise_trl/cli/main.py, each with its reason; every other one fails this test."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
WARNING_LINE = re.compile(r"^\S.*:\d+: \w*Warning: ", re.MULTILINE)  # warnings.formatwarning's first line


@pytest.mark.slow
def test_a_toy_run_and_its_resume_print_no_warning(tmp_path, bundled_model_dir):
    poise = Path(sys.executable).parent / "poise"
    if not poise.is_file():
        pytest.skip(f"no `poise` console script beside {sys.executable}")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "PYTHONPATH")}
    env["HF_HUB_OFFLINE"] = "1"
    command = [str(poise), "train", str(REPO / "recipes" / "toy" / "poise.yaml"), "max_steps=2",
               "save_steps=1", "eval_every=0", "eval_limit=8", "eval_num_samples=1",
               "per_device_train_batch_size=16", "--no-progress", "-o", "run"]
    first = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stderr[-3000:]
    (tmp_path / "run" / "summary.json").unlink()  # as if the run had been killed after its last checkpoint
    shutil.rmtree(tmp_path / "run" / "final")
    second = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming from checkpoint-2" in second.stdout, second.stdout[-3000:]
    for run in (first, second):
        assert not WARNING_LINE.search(run.stderr), run.stderr[-3000:]
        for noise in ("missing keys", "Writing model shards", "Loading weights"):
            assert noise not in run.stderr, run.stderr[-3000:]
