"""A user's install: `pip install .` (not editable) into a fresh environment, then `poise train` of a toy
recipe copied to another directory, with no source tree on the path."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_a_non_editable_install_trains_a_copied_toy_recipe_from_another_directory(tmp_path):
    venv = tmp_path / "venv"
    # The dependencies come from this interpreter (installing torch again would take minutes); poise-trl
    # itself is built from a copy of the source tree and installed as a regular package.
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    source = tmp_path / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".git", "runs", "*.egg-info", "__pycache__", "build"))
    python = venv / "bin" / "python"
    install = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", str(source)],
                             capture_output=True, text=True)
    assert install.returncode == 0, install.stderr[-3000:]
    shutil.rmtree(source)  # nothing may be read from the source tree after the install

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(REPO / "recipes" / "toy" / "poise.yaml", elsewhere / "poise.yaml")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"HF_HUB_OFFLINE": "1"}
    located = subprocess.run([str(python), "-c", "import poise_trl; print(poise_trl.__file__)"], cwd=elsewhere,
                             env=env, capture_output=True, text=True, check=True)
    assert str(venv) in located.stdout, located.stdout
    run = subprocess.run(
        [str(venv / "bin" / "poise"), "train", "poise.yaml", "max_steps=1", "eval_every=0", "eval_num_samples=1",
         "-o", "runs/poise"],
        cwd=elsewhere, env=env, capture_output=True, text=True, timeout=900,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert (elsewhere / "runs" / "poise" / "summary.json").is_file()
    assert (elsewhere / "runs" / "poise" / "final" / "model.safetensors").is_file()
