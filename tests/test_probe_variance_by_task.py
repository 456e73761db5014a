"""benchmarks/probe_variance_by_task.py: per-task variance reduction from study summaries, with intervals that
resolve a known difference and hold 0 where there is none."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def write_run(folder: Path, values: dict[str, np.ndarray], bootstrap_steps: int = 2, per_task: bool = True):
    steps = len(next(iter(values.values())))
    # bootstrap steps (RLOO's baselines, no probe/mae): logged, and not the probe's to count
    log = [{"generated_tokens": 100 * (i + 1), "probe/variance_reduction": -1.0,
            **({f"probe/{task}/variance_reduction": -1.0 for task in values} if per_task else {})}
           for i in range(bootstrap_steps)]
    for i in range(steps):
        entry = {"generated_tokens": 100 * (bootstrap_steps + i + 1), "probe/mae": 0.3,
                 "probe/variance_reduction": 0.1}
        if per_task:
            entry.update({f"probe/{task}/variance_reduction": float(v[i]) for task, v in values.items()})
        log.append(entry)
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps({"train_log": log, "budget": {"amount": 100 * len(log)}}))


def test_a_known_difference_resolves_and_none_holds_zero(tmp_path):
    rng = np.random.default_rng(1)
    for seed in range(3):
        noise = {task: rng.normal(0, 0.05, size=(2, 40)) for task in ("math:a", "b")}
        write_run(tmp_path / "runs" / "per_task" / f"seed{seed}",
                  {"math:a": 0.3 + noise["math:a"][0], "b": 0.1 + noise["b"][0]})
        write_run(tmp_path / "runs" / "shared" / f"seed{seed}",
                  {"math:a": 0.1 + noise["math:a"][1], "b": 0.1 + noise["b"][1]})
    write_run(tmp_path / "runs" / "shared" / "seed3", {"math:a": np.zeros(40)}, per_task=False)
    output = tmp_path / "out.json"
    subprocess.run([sys.executable, "benchmarks/probe_variance_by_task.py", str(tmp_path / "runs"), "--arms",
                    "per_task", "shared", "--output", str(output)], cwd=REPO, check=True, capture_output=True)
    result = json.loads(output.read_text())
    assert result["seeds_without_per_task_entries"] == {"shared": ["seed3"]}
    a = result["arms"]["per_task"]["by_task"]["math:a"]
    assert abs(a["mean"] - 0.3) < 0.02 and a["ci95"][0] < a["mean"] < a["ci95"][1]
    assert a["steps_per_seed"] == [40, 40, 40]  # the bootstrap steps (no probe/mae) are left out
    assert len(a["by_budget_slice"]) == 5 and all(abs(v - 0.3) < 0.05 for v in a["by_budget_slice"])
    # the steps' pooled figure beside the tasks', over the same steps
    assert result["arms"]["per_task"]["by_task"]["all tasks"]["mean"] == 0.1
    known = result["differences"]["per_task - shared"]["math:a"]
    assert known["resolved"] and 0.17 < known["mean"] < 0.23 and known["ci95"][0] > 0.1
    none = result["differences"]["per_task - shared"]["b"]
    assert not none["resolved"] and none["ci95"][0] < 0 < none["ci95"][1]
