"""Helpers several test modules share (pytest puts tests/ on sys.path)."""

import os
import subprocess
import sys
from pathlib import Path

import torch

SEQUENCE_TEXT = "12+34=<think>4+2=6</think>46"  # a fixed prompt + completion whose log-probabilities are compared


def server_logprobs(url: str, ids: list[int]) -> torch.Tensor:
    """A vLLM server's log-probability of each token of `ids` after the ones before it."""
    import requests  # comes with vLLM

    model = requests.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}
    choice = requests.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    return torch.tensor([choice["prompt_logprobs"][i][str(ids[i])]["logprob"] for i in range(1, len(ids))])


def model_logprobs(model, ids: list[int]) -> torch.Tensor:
    """The same from a transformers model, by one plain forward."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


# A recipe's `rewards` entry naming digit_parity_reward (pytest puts tests/ on sys.path; a `poise train`
# subprocess needs tests/ on PYTHONPATH).
VARYING_REWARD = "helpers:digit_parity_reward"


def digit_parity_reward(completions, **kwargs) -> list[float]:
    """1.0 where a completion holds an odd number of digits. A random model never solves a problem, so
    `math_accuracy` scores every rollout 0: equal rewards, zero advantages, no gradient. This one varies
    between the rollouts of a random model, so a training step has something to learn from."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [float(sum(ch.isdigit() for ch in text) % 2) for text in texts]


def length_parity_reward(completions, **kwargs) -> list[float]:
    """1.0 where a completion's text has an odd length: digit_parity_reward for a random model at Qwen3's
    vocabulary, which writes hardly any digit (10 of its 151,936 tokens)."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [float(len(text) % 2) for text in texts]


def assert_one_line_error(result, output, pattern):
    """A CLI failure the way users should see it: exit code 2 and one `error:` line, no traceback."""
    assert result.exit_code == 2, output
    assert "Traceback" not in output
    lines = [line for line in output.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), output
    assert pattern in output, output


def run_two_cpu_ranks(script, *args, timeout: int = 300) -> None:
    """Run `script` in 2 CPU processes (gloo) and fail with its stderr if it fails.

    torchrun, not `accelerate launch --cpu`, which starts several CPU processes only through
    mpirun; the Trainer's accelerate then picks MULTI_CPU with gloo."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(script), *map(str, args)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-4000:]


def run_accelerate_launch(config, script, *args, launch_args=(), timeout: int = 600) -> None:
    """`accelerate launch --config_file CONFIG --num_processes 2 [LAUNCH_ARGS] SCRIPT ARGS` on the CPU
    (gloo), in fp32 (the configs' bf16 autocast only slows a CPU down), on a free port; fails with
    its stderr."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--num_processes", "2",
           "--mixed_precision", "no", "--main_process_port", str(port), *launch_args, str(script), *map(str, args)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-4000:]


def build_trainer(recipe: dict, out, *, reward_funcs=None, trainer_class=None):
    """A ready trainer for `recipe` in the fresh folder `out`, built the way `poise train` builds it
    (`poise_trl.run.build.build_run`, held-out evaluation and checkpoint callbacks included)."""
    from poise_trl.run.build import build_run
    from poise_trl.run.recipe import parse_recipe

    recipe = {"eval_max_new_tokens": 8, "eval_num_samples": 1, **recipe}
    # overwrite: a test may build a second trainer over the first one's checkpoints to resume from them
    return build_run(parse_recipe(recipe, str(out)), overwrite=True, reward_funcs=reward_funcs,
                     trainer_class=trainer_class).trainer


def trainable_parameters(trainer) -> dict:
    """A copy of every trainable parameter of the trainer's model, by name."""
    return {name: p.detach().clone() for name, p in trainer.model.named_parameters() if p.requires_grad}


def assert_parameters_moved(before: dict, trainer) -> None:
    """TRL's own check after training: every trainable tensor changed (an optimizer step reached it)."""
    after = dict(trainer.model.named_parameters())
    unchanged = [name for name, value in before.items() if torch.equal(value, after[name].detach())]
    assert not unchanged, f"{len(unchanged)} of {len(before)} trainable tensors did not change, e.g. {unchanged[:3]}"


def assert_parameters_unchanged(before: dict, trainer) -> None:
    """After a run with nothing to learn from (no reward signal): not one trainable tensor moved."""
    after = dict(trainer.model.named_parameters())
    moved = [name for name, value in before.items() if not torch.equal(value, after[name].detach())]
    assert not moved, f"{len(moved)} of {len(before)} trainable tensors changed, e.g. {moved[:3]}"


def saved_tensors(folder) -> dict:
    from safetensors.torch import load_file

    files = sorted(Path(folder).glob("*.safetensors"))
    assert files, f"no .safetensors file in {folder}"
    return {name: tensor for path in files for name, tensor in load_file(path).items()}


def assert_saved_weights_moved(start_model_dir, final_dir) -> None:
    """The weights a run saved in `final_dir` differ, tensor by tensor, from the model it started from.
    A LoRA run saves only its adapter: PEFT starts every lora_B at zero, so each one must have left it."""
    final = saved_tensors(final_dir)
    if (Path(final_dir) / "adapter_model.safetensors").exists():
        lora_b = {name: t for name, t in final.items() if "lora_B" in name}
        assert lora_b, f"{final_dir} holds an adapter without lora_B tensors"
        still_zero = [name for name, t in lora_b.items() if not t.any()]
        assert not still_zero, f"{len(still_zero)} of {len(lora_b)} lora_B tensors still zero, e.g. {still_zero[:3]}"
        return
    start = saved_tensors(start_model_dir)
    shared = sorted(set(start) & set(final))
    assert shared, f"{final_dir} and {start_model_dir} hold no tensor of the same name"
    unchanged = [name for name in shared if torch.equal(start[name], final[name])]
    assert not unchanged, f"{len(unchanged)} of {len(shared)} saved tensors did not change, e.g. {unchanged[:3]}"


def machine_failure(completions, trainer_state=None, **kwargs) -> list[float]:
    """A reward of 0.0 for every completion (it changes nothing), and a fault injector: on the machine
    whose environment sets POISE_TEST_FAILURE=kill|stop, once the run has finished step
    POISE_TEST_FAILURE_STEP, `kill` SIGKILLs this machine's torchrun agent and this rank (the machine
    dies), `stop` SIGSTOPs this rank (it hangs)."""
    import signal

    failure, step = os.environ.get("POISE_TEST_FAILURE"), int(os.environ.get("POISE_TEST_FAILURE_STEP", "2"))
    if failure and trainer_state is not None and trainer_state.global_step == step:
        if failure == "kill":
            os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGSTOP)
    return [0.0] * len(completions)


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
