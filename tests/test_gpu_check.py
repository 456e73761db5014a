"""benchmarks/gpu_check.py: its preparation resolves the wheels the GPU node lacks, its device command
fits the device tool's 2,000 characters, and the whole check runs on the CPU at a tiny shape."""

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_check  # noqa: E402  (a script under benchmarks/, not a package)


def index_reachable() -> bool:
    try:
        urllib.request.urlopen("https://pypi.org/simple/trl/", timeout=10).close()
        return True
    except OSError:
        return False


def test_missing_requirements_are_what_the_node_lacks():
    pins = gpu_check.missing_requirements()
    assert {"trl", "datasets", "math-verify", "dill", "multiprocess", "latex2sympy2-extended"} <= set(pins)
    # what the node's packages (torch, transformers, accelerate, peft, pandas, pyarrow, ...) bring is there already
    assert not {"torch", "transformers", "accelerate", "peft", "numpy", "huggingface-hub", "safetensors",
                "pyyaml", "packaging", "tqdm", "pandas", "pyarrow", "xxhash"} & set(pins)


@pytest.mark.skipif(not index_reachable(), reason="no package index reachable")
def test_preparation_resolves_a_wheel_for_every_missing_package():
    pins = gpu_check.missing_requirements()
    wheels = gpu_check.resolve_wheels(pins)
    assert {w["name"]: w["version"] for w in wheels} == pins
    for wheel in wheels:
        assert wheel["file"].endswith(".whl")
        tags = wheel["file"].removesuffix(".whl").split("-")[-3:]
        python, abi, platform = tags
        assert abi in ("cp312", "abi3", "none") and (platform == "any" or "x86_64" in platform), wheel["file"]


def test_device_command_fits_the_device_tool():
    shown = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "command"], cwd=REPO,
                           capture_output=True, text=True, check=True)
    device = json.loads(shown.stdout)
    assert len(device["command"]) <= 2000
    assert "gpu_check.py run" in device["command"] and "$OUT/" in device["command"]
    assert device["carry"] == [".gpu_check_wheels"]
    assert "/.gpu_check_wheels/" in (REPO / ".gitignore").read_text().splitlines()


def test_whole_check_runs_on_the_cpu_at_a_tiny_shape(tmp_path):
    output = tmp_path / "gpu_check.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    subprocess.run([sys.executable, "benchmarks/gpu_check.py", "run", "--device", "cpu", "--shape", "tiny",
                    "--prompts", "2", "--completion-length", "8", "--micro-batch", "2", "--steps", "2",
                    "--capture-rounds", "1", "--fit-rows", "256", "--fit-width", "32", "--output", str(output)],
                   cwd=REPO, env=env, check=True, timeout=900)
    result = json.loads(output.read_text())
    assert result["model"]["vocab_size"] == 151936 and result["model"]["hidden_size"] == 64
    pair = result["poise_vs_grpo"]
    assert pair["arm_a"]["recipe"].endswith("poise.yaml") and pair["arm_b"]["recipe"].endswith("grpo_2.yaml")
    assert pair["measured_steps"] == 2 and pair["ratio_of_mean_step_seconds"] > 0
    [steps] = pair["arm_a"]["phase_seconds_by_step"]  # every step's phases, the warmup's first
    assert len(steps) == 3 and all(step["generate_with_capture"] > 0 for step in steps)
    assert pair["arm_a"]["probe_buffer_bytes"] > 0
    for algo in ("poise", "grpo"):
        compared = result["plan_vs_measured"][algo]
        assert compared["measured"] == "peak_rss_mib" and compared["plan_bytes_without_cuda_runtime"] > 0
    assert result["probe_fit"]["rows"] == 256 and result["probe_fit"]["fast_seconds"] > 0
    capture = result["capture_cost"]  # 4 generations (ABBA), 7 decode steps each, every one timed
    assert [len(g) for g in capture["decode_step_ms"]["plain"] + capture["decode_step_ms"]["capture"]] == [7] * 4
    assert capture["plain_ms_per_decode_step"] > 0 and len(capture["order_effect_ms"]) == 1
    by_phases = result["poise_over_grpo_by_phases"]
    low, high = by_phases["ratio_95_interval"]
    assert low <= by_phases["ratio"] <= high and len(by_phases["grpo_step_seconds"]) == 2


@pytest.mark.skipif(not (gpu_check.WHEELS / "manifest.json").is_file(), reason="no wheels prepared here")
def test_prepared_pure_python_wheels_install_offline(tmp_path, monkeypatch):
    # the cp312 wheels (binaries, multiprocess) install on the node's Python 3.12 only; the py3 ones on any
    wheels = json.loads((gpu_check.WHEELS / "manifest.json").read_text())
    assert sum(w["bytes"] for w in wheels) + gpu_check.tracked_bytes() <= gpu_check.CARRY_LIMIT_BYTES
    pure = [w for w in wheels
            if w["file"].split("-")[-3] in ("py3", "py2.py3") and w["file"].endswith("-none-any.whl")]
    assert {"trl", "datasets", "math-verify"} <= {w["name"] for w in pure}
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "")
    gpu_check.install_wheels(tmp_path, pure)
    assert sys.path[0] == str(tmp_path) and os.environ["PYTHONPATH"] == str(tmp_path)
    assert (tmp_path / "trl" / "__init__.py").is_file() and (tmp_path / "math_verify").is_dir()
    gpu_check.check_node_versions(tmp_path)  # this machine's pyarrow, pandas, ... meet what they require


def test_a_node_package_too_old_for_the_carried_wheels_is_named(tmp_path):
    # a carried package whose requirement on a node package (pyarrow) the node's version cannot meet
    info = tmp_path / "needs_new_arrow-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: needs-new-arrow\nVersion: 1.0\n"
                                   "Requires-Dist: pyarrow>=999\nRequires-Dist: trl\n")
    with pytest.raises(SystemExit, match=r"needs-new-arrow needs pyarrow>=999, the node has \d"):
        gpu_check.check_node_versions(tmp_path)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: needs-new-arrow\nVersion: 1.0\n"
                                   "Requires-Dist: pyarrow>=1\n")
    gpu_check.check_node_versions(tmp_path)
