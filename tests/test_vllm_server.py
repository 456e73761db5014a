"""Training against a real vLLM server (`vllm_mode: server`; vLLM's CPU build on a machine without a GPU).

One server for the module (`python -m poise_trl.engines.vllm_server`, a tiny random model, a free local port), started
once and once more after the last test kills it. Without CUDA the weights reach the server through a file
and vLLM's `/collective_rpc` (poise_trl.engines.vllm_server): the tests check that the server then samples from the
trainer's weights, full and LoRA-merged. Skipped, with the reason, when vLLM does not import.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import (
    SEQUENCE_TEXT,
    VARYING_REWARD,
    assert_parameters_moved,
    build_trainer,
    model_logprobs,
    server_logprobs,
    trainable_parameters,
)

from poise_trl.engines.generation import vllm_import_error
from poise_trl.engines.vllm_server import LocalServer
from poise_trl.run.run_folder import CHECKPOINT_MARKER

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(vllm_import_error() is not None, reason=f"{vllm_import_error()} (docs/install.md)"),
]

# Small enough for a second or two per step; a reward that differs between the rollouts of a group.
COMMON = {"rewards": [VARYING_REWARD], "dataset_size": 64, "per_device_train_batch_size": 8,
          "max_completion_length": 32, "eval_every": 0, "eval_limit": 8, "logging_steps": 1, "save_strategy": "no",
          "seed": 0}
@pytest.fixture(scope="module")
def server(random_model_dir, tmp_path_factory):
    server = LocalServer(random_model_dir, tmp_path_factory.mktemp("vllm-server") / "server.log")
    try:
        server.start()
        yield server
    finally:
        server.stop()


def server_recipe(server, algo: str, **overrides) -> dict:
    return {"algo": algo, "model": str(server.model), "dataset": "toy-arith", "use_vllm": True,
            "vllm_mode": "server", "vllm_server_host": "127.0.0.1", "vllm_server_port": server.port,
            **COMMON, **overrides}


def assert_server_samples_trainer_weights(server, trainer) -> None:
    """After TRL's weight sync (what it runs before each generation round), the server's log-probabilities
    of a fixed sequence are the trainer's (a LoRA adapter merged), and they moved from the start."""
    ids = trainer.processing_class(SEQUENCE_TEXT)["input_ids"]
    before = server_logprobs(server.url, ids)  # synced at step 0: the starting weights
    trainer.vllm_generation.sync_weights()
    after, wanted = server_logprobs(server.url, ids), model_logprobs(trainer.model, ids)
    assert (after - wanted).abs().max() < 1e-3, (after, wanted)  # float32 on both sides
    assert (after - before).abs().max() > 1e-2, "the server's log-probabilities did not move"


def test_grpo_trains_through_the_server_which_samples_its_weights(server, tmp_path):
    trainer = build_trainer(server_recipe(server, "grpo", max_steps=2, num_generations=2, learning_rate=1e-3),
                            tmp_path)
    before = trainable_parameters(trainer)
    trainer.train()
    assert trainer.state.global_step == 2
    assert_parameters_moved(before, trainer)
    assert trainer.generated_rollouts == 2 * 8
    # Importance-sampling correction (TRL's default): one no-grad pass and one training pass per step.
    assert trainer.policy_forward_passes == 2 * 2
    assert_server_samples_trainer_weights(server, trainer)


def test_poise_rides_trls_pass_with_a_server(server, tmp_path):
    """A remote engine hands back tokens only, so POISE reads its features from TRL's no-grad pass (the
    importance-sampling correction's): no pass of its own, the same count as GRPO above."""
    trainer = build_trainer(server_recipe(server, "poise", max_steps=3, probe_bootstrap_steps=1), tmp_path)
    before = trainable_parameters(trainer)
    trainer.train()
    assert_parameters_moved(before, trainer)
    assert trainer.feature_sources == {"trl_pass": 3, "generation": 0, "extra_pass": 0}
    assert trainer.policy_forward_passes == 2 * 3
    logged = [e for e in trainer.state.log_history if "probe/features_from_trl_pass" in e]
    assert [e["probe/features_from_trl_pass"] for e in logged] == [1.0, 1.0, 1.0]
    assert all(e["probe/features_from_extra_pass"] == 0.0 for e in logged)


def test_lora_weights_reach_the_server_merged(server, tmp_path):
    # Two steps: PEFT starts lora_B at zero, so lora_A has no gradient before the second.
    recipe = server_recipe(server, "grpo", max_steps=2, num_generations=2, learning_rate=5e-2,
                           peft={"r": 8, "lora_alpha": 16})
    trainer = build_trainer(recipe, tmp_path)
    before = trainable_parameters(trainer)
    trainer.train()
    assert_parameters_moved(before, trainer)
    assert all("lora_" in name for name in before)
    assert_server_samples_trainer_weights(server, trainer)


def poise_train(recipe: Path, out: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "poise_trl.cli.main", "train", str(recipe), "-o", str(out), "--no-progress"]
    tests = str(Path(__file__).parent)  # the recipe's reward lives in tests/helpers.py
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_server_killed_mid_run_one_error_line_then_rerun_resumes(server, tmp_path):
    """Runs last: it kills the module's server. The run stops with one `error:` line naming the server and
    the checkpoint the rerun resumes from; the same command, once the server is back, finishes the run
    with every step logged once."""
    max_steps = 6
    recipe = tmp_path / "recipe.yaml"
    settings = {**server_recipe(server, "grpo", num_generations=2), "max_steps": max_steps, "save_strategy": "steps",
                "save_steps": 2}
    recipe.write_text("\n".join(f"{k}: {json.dumps(v)}" for k, v in settings.items()))
    out = tmp_path / "run"
    process = poise_train(recipe, out)
    deadline = time.time() + 300
    while not (out / "checkpoint-2" / CHECKPOINT_MARKER).exists():
        assert process.poll() is None, process.communicate()[1][-4000:]
        assert time.time() < deadline, "checkpoint-2 never appeared"
        time.sleep(0.2)
    server.stop()
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 2, stderr[-4000:]
    assert "Traceback" not in stderr
    # The libraries' progress bars and warnings of the steps before come first; the failure is one last line.
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    assert [line for line in lines if line.startswith("error:")] == lines[-1:], stderr
    newest = max(int(p.parent.name.split("-")[1]) for p in out.glob(f"checkpoint-*/{CHECKPOINT_MARKER}"))
    assert newest < max_steps, "the run finished before the server was stopped"
    assert f"vLLM server at http://127.0.0.1:{server.port} does not answer" in lines[-1], lines[-1]
    assert f"resumes from checkpoint-{newest} (step {newest})" in lines[-1], lines[-1]

    server.start()
    process = poise_train(recipe, out)
    stdout, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr[-4000:]
    assert f"resuming from checkpoint-{newest}" in stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == max_steps and summary["resumed_at_steps"] == [newest]
    assert [e["step"] for e in summary["train_log"] if "loss" in e] == list(range(1, max_steps + 1))
