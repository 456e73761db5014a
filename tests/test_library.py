"""The package root as a library (docs/library.md): the page's script runs as written, trains POISE with its own
conversational dataset and reward and writes the probe report and checkpoints, with no warning; `import
poise_trl` stays cheap; an algorithm registered in a module of the working directory trains from a recipe."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LIBRARY_PAGE = REPO / "docs" / "library.md"


def documented_code(marker: str) -> str:
    """The python block right after `<!--marker-->` in docs/library.md."""
    after = LIBRARY_PAGE.read_text().split(f"<!--{marker}-->", 1)[1]
    return re.search(r"```python\n(.*?)```", after, re.S).group(1)


def run_python(args: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_the_library_page_script_trains_poise_with_its_own_data_and_reward_without_a_warning(tmp_path):
    (tmp_path / "script.py").write_text(documented_code("library-script"))
    run = run_python(["script.py"], tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    warned = [line for line in run.stderr.splitlines() if re.search(r"\w+Warning\b", line)]
    assert not warned, warned
    out = tmp_path / "runs" / "my_poise"
    report = json.loads((out / "probe_report.json").read_text())
    assert report["rounds"] == 6 and report["refit_count"] > 0 and report["probe_active_rounds"] > 0
    assert (out / "probe_values.png").is_file()
    for step in (3, 6):  # TRL's checkpoint with the probe's state beside it
        assert (out / f"checkpoint-{step}" / "model.safetensors").is_file()
        assert (out / f"checkpoint-{step}" / "probe_history.json").is_file()
    sources = re.search(r"probe features from: (\{.*\})", run.stdout).group(1)
    assert eval(sources) == {"trl_pass": 0, "generation": 6, "extra_pass": 0}  # noqa: S307 (a dict it printed)


def test_import_is_cheap_and_the_root_exports_every_registered_pair():
    loaded = run_python(["-c", "import sys, poise_trl; print(sorted({'torch', 'trl', 'transformers', 'datasets'} "
                               "& set(sys.modules)))"], REPO)
    assert loaded.stdout.strip() == "[]", loaded.stdout + loaded.stderr[-2000:]

    import poise_trl
    from poise_trl import AsyPPOConfig, AsyPPOTrainer, POISEConfig, POISETrainer  # noqa: F401 (the issue's import)
    from poise_trl.algorithms import algorithms

    for algorithm in algorithms().values():
        for cls in (algorithm.config_class, algorithm.trainer_class):
            assert getattr(poise_trl, cls.__name__) is cls and cls.__name__ in dir(poise_trl)
    with pytest.raises(AttributeError, match="has no attribute 'POISETrainr'.*POISETrainer"):
        poise_trl.POISETrainr  # noqa: B018


@pytest.mark.slow
def test_an_algorithm_from_the_working_directory_trains_from_a_recipe(tmp_path):
    (tmp_path / "my_algos.py").write_text(documented_code("algorithm-example"))
    (tmp_path / "my_recipe.yaml").write_text(
        "algo: my_algos:MyAlgorithm\ndataset: toy-arith\ndataset_size: 16\neval_limit: 4\neval_every: 0\n"
        "eval_num_samples: 1\neval_max_new_tokens: 8\nper_device_train_batch_size: 8\nmax_completion_length: 16\n"
        "max_steps: 2\nlogging_steps: 1\nsave_steps: 2\nlearning_rate: 1.0e-3\nseed: 0\n")
    # The console script's import path: its own folder, not the working directory (which `python -m` would add).
    poise = ("import sys; sys.path[:] = [p for p in sys.path if p not in ('', '.')]; sys.argv[0] = 'poise'; "
             "from poise_trl.cli.main import app; app()")
    run = run_python(["-c", poise, "train", "my_recipe.yaml", "-o", "runs/mine", "--no-progress"], tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((tmp_path / "runs" / "mine" / "summary.json").read_text())
    assert summary["algo"] == "mean_baseline" and summary["steps"] == 2
    assert summary["trainer_config"]["num_generations"] == 2  # the module's config, not GRPO's default



def test_an_import_path_to_anything_but_a_registered_algorithm_is_refused(tmp_path, monkeypatch):
    from poise_trl.algorithms import get_algorithm
    from poise_trl.core.loading import RecipeError

    (tmp_path / "not_algos.py").write_text("class MeanBaselineTrainer:\n    pass\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "not_algos", raising=False)
    with pytest.raises(RecipeError, match="is a type, not a registered algorithm"):
        get_algorithm("not_algos:MeanBaselineTrainer")
    with pytest.raises(RecipeError, match="module 'not_algos' has no 'Missing'"):
        get_algorithm("not_algos:Missing")
