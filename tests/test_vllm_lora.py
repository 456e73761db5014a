"""LoRA training with vLLM colocated (the CPU build on a machine without a GPU): after a step, the engine
samples from the base weights with the adapter merged in; and full fine-tuning, whose sync must reach every
layer the engine samples with, the tied LM head included.

The trainer runs in a subprocess (this file as a script): TRL's colocate mode initialises torch.distributed
in its process, which a test process must not keep. The script writes log-probabilities of one fixed
sequence, from the engine and from the trainer's model, to a JSON file the test reads. Server mode with LoRA:
tests/test_vllm_server.py. Skipped, with the reason, when vLLM does not import.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from poise_trl.engines.generation import vllm_import_error

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(vllm_import_error() is not None, reason=f"{vllm_import_error()} (docs/install.md)"),
]

SEQUENCE_TEXT = "12+34=<think>4+2=6</think>46"  # a fixed prompt + completion to score
# The colocated engine runs a float32 checkpoint in bfloat16 on a CPU (vLLM's default; TRL passes no dtype),
# the trainer in float32: per-token log-probabilities agree to a few 1e-3 here.
BFLOAT16_TOLERANCE = 0.02


def engine_logprobs(llm, ids: list[int]) -> list[float]:
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)
    output = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
    return [output.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]


def model_logprobs(model, ids: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


def measure(out: Path, mode: str) -> None:
    """Train recipes/toy/grpo_lora.yaml two steps on a random model with vLLM colocated (`mode` "full":
    without its `peft` section); write the log-probabilities of SEQUENCE_TEXT from the engine (before
    training, after TRL's weight sync) and from the trainer's model (adapter applied) to out/logprobs.json."""
    from helpers import VARYING_REWARD, assert_parameters_moved, build_trainer, trainable_parameters

    from poise_trl.run.recipe import load_recipe
    from poise_trl.run.toy import build_model, build_tokenizer

    model_dir = out / "random-qwen3"  # the bundled model's head size (vLLM's CPU attention kernels)
    tokenizer = build_tokenizer()
    build_model(tokenizer, seed=0, hidden_size=128, num_layers=2).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    recipe = load_recipe(Path(__file__).parents[1] / "recipes" / "toy" / "grpo_lora.yaml", [])
    recipe.update(model=str(model_dir), rewards=[VARYING_REWARD], use_vllm=True, vllm_mode="colocate",
                  max_steps=2, per_device_train_batch_size=16, max_completion_length=32, learning_rate=5e-2,
                  dataset_size=64, eval_every=0, eval_limit=8, save_strategy="no")
    if mode == "full":
        del recipe["peft"]
        recipe["learning_rate"] = 1e-3
    trainer = build_trainer(recipe, out / "run")
    ids = trainer.processing_class(SEQUENCE_TEXT)["input_ids"]
    llm = trainer.vllm_generation.llm
    record = {"engine_before": engine_logprobs(llm, ids), "model_before": model_logprobs(trainer.model, ids)}
    before = trainable_parameters(trainer)
    trainer.train()
    assert_parameters_moved(before, trainer)  # two steps: PEFT starts lora_B at zero, lora_A moves at the second
    trainer.vllm_generation.sync_weights()  # what TRL runs before each generation round
    record.update(engine_after=engine_logprobs(llm, ids), model_after=model_logprobs(trainer.model, ids),
                  trainable=sorted(before))
    (out / "logprobs.json").write_text(json.dumps(record))


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_colocated_engine_samples_the_trained_weights(tmp_path, mode):
    """LoRA: the engine samples the merged adapter. Full fine-tuning: the sync reaches the tied LM head too
    (vLLM's CPU build packs it at load; before it was kept in place, the engine's log-probs stayed up to 1.05
    away from the trainer's after two steps)."""
    tests = str(Path(__file__).parent)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, __file__, str(tmp_path), mode], env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-5000:]
    record = json.loads((tmp_path / "logprobs.json").read_text())
    assert record["trainable"] and all(("lora_" in name) == (mode == "lora") for name in record["trainable"])
    engine_before, model_before, engine_after, model_after = (
        torch.tensor(record[key]) for key in ("engine_before", "model_before", "engine_after", "model_after"))
    assert (engine_before - model_before).abs().max() < BFLOAT16_TOLERANCE
    assert (model_after - model_before).abs().max() > 10 * BFLOAT16_TOLERANCE, "training barely moved the model"
    assert (engine_after - model_after).abs().max() < BFLOAT16_TOLERANCE, (engine_after, model_after)


if __name__ == "__main__":
    measure(Path(sys.argv[1]), sys.argv[2])
