"""`poise plan`: the estimate against the measured peak of real training steps on this CPU, the
shipped GPU recipes against 80 GB cards (stored configs, no network), and the CLI."""

import weakref
from pathlib import Path

import pytest
import torch
from helpers import (
    VARYING_REWARD,
    assert_one_line_error,
    assert_parameters_moved,
    build_trainer,
    trainable_parameters,
)
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves
from transformers import TrainerCallback
from typer.testing import CliRunner

from poise_trl.run.plan import (
    GIB,
    ModelShape,
    Sharding,
    build_plan,
    load_model_config,
    parse_memory,
    plan_inputs,
    plan_recipe,
    sharding_from_accelerate_config,
    sharding_from_environment,
)
from poise_trl.run.recipe import RecipeError, load_recipe, parse_recipe

REPO = Path(__file__).resolve().parents[1]
GPU_RECIPES = sorted((REPO / "recipes" / "gpu").glob("*.yaml"))
ACCELERATE_CONFIGS = sorted((REPO / "recipes" / "accelerate").glob("*.yaml"))


class LiveTensorBytes(TorchDispatchMode):
    """Bytes of live CPU tensor storages created under the mode, and their peak: on the CPU the
    counterpart of CUDA's `max_memory_allocated` (allocator slack and Python objects excluded).
    A storage is counted once when an op first returns it and released when it is freed."""

    def __init__(self):
        super().__init__()
        self.current = self.peak = 0
        self.sizes = {}

    def _release(self, key):
        self.current -= self.sizes.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
                storage = tensor.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.sizes:
                    self.sizes[key] = storage.nbytes()
                    self.current += storage.nbytes()
                    self.peak = max(self.peak, self.current)
                    weakref.finalize(storage, self._release, key)
        return out


class StepPeak(TrainerCallback):
    """Tracks each optimizer step (forward, backward, AdamW, zero_grad) but not its generation and
    scoring, which `_prepare_inputs` runs with the mode off; weights and AdamW state that exist
    before the step are added as they are, being allocated outside it."""

    def __init__(self, trainer):
        self.trainer, self.steps, self.mode = trainer, [], None
        prepare = trainer._prepare_inputs

        def untracked_prepare(*args, **kwargs):
            with _disable_current_modes():
                batch = prepare(*args, **kwargs)
            self.shape = (batch["prompt_ids"].shape, batch["completion_ids"].shape)
            return batch

        trainer._prepare_inputs = untracked_prepare

    def on_step_begin(self, args, state, control, **kwargs):
        model, optimizer = self.trainer.model, self.trainer.optimizer
        states = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        self.static = sum(p.numel() * p.element_size() for p in model.parameters())
        self.static += sum(t.numel() * t.element_size() for t in states)
        self.mode = LiveTensorBytes()
        self.mode.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        self.mode.__exit__(None, None, None)
        self.steps.append({"peak": self.static + self.mode.peak, "shape": self.shape})


def measured_step_peak(recipe: dict, output_dir: Path) -> dict:
    """Peak live tensor bytes of the 2nd optimizer step of a real TRL run of `recipe` (AdamW state exists by then)."""
    recipe = {**recipe, "max_steps": 2, "save_steps": 100, "logging_steps": 1, "dataset_size": 256, "eval_limit": 4,
              "eval_num_samples": 1, "eval_max_new_tokens": 8}
    trainer = build_trainer(recipe, output_dir)
    tracker = StepPeak(trainer)
    trainer.add_callback(tracker)
    before = trainable_parameters(trainer)
    trainer.train()
    assert_parameters_moved(before, trainer)
    return tracker.steps[-1]


def cpu_plan(recipe: dict, shape) -> int:
    (rows, prompt), (_, completion) = shape
    inputs = plan_inputs(parse_recipe(recipe), prompt_length=prompt)
    inputs.rows, inputs.completion_length = rows, completion
    model = ModelShape.from_config(load_model_config(inputs.model))
    return build_plan(inputs, model, gpus=1, gpu_bytes=64 * GIB, sharding=Sharding(), device="cpu").total


@pytest.mark.slow
def test_plan_matches_the_measured_peak_of_a_toy_training_step(tmp_path, bundled_model_dir, single_thread):
    recipe = load_recipe(REPO / "recipes" / "toy" / "poise.yaml")
    step = measured_step_peak(recipe, tmp_path / "run")
    planned = cpu_plan(recipe, step["shape"])
    error = planned / step["peak"] - 1
    print(f"toy POISE step {step['shape']}: planned {planned / 2**20:.0f} MiB, measured {step['peak'] / 2**20:.0f} "
          f"MiB, error {error:+.1%}")
    assert abs(error) < 0.25


@pytest.mark.slow
def test_plan_matches_the_measured_peak_for_a_wider_random_qwen3(tmp_path, single_thread):
    """A random-init Qwen3 with 4x the toy model's width, so weights, gradients and AdamW state weigh in."""
    from poise_trl.run.toy import build_model, build_tokenizer

    tokenizer = build_tokenizer()
    build_model(tokenizer, seed=0, hidden_size=512, num_layers=4).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    recipe = {**load_recipe(REPO / "recipes" / "toy" / "grpo.yaml"), "model": str(tmp_path / "model"),
              "per_device_train_batch_size": 16, "max_completion_length": 32, "num_generations": 8,
              "rewards": [VARYING_REWARD]}  # a random model answers nothing: math_accuracy gives no gradient
    step = measured_step_peak(recipe, tmp_path / "run")
    planned = cpu_plan(recipe, step["shape"])
    error = planned / step["peak"] - 1
    print(f"random Qwen3 (h=512) step {step['shape']}: planned {planned / 2**20:.0f} MiB, measured "
          f"{step['peak'] / 2**20:.0f} MiB, error {error:+.1%}")
    assert abs(error) < 0.25


@pytest.mark.slow
def test_a_recipe_with_tools_plans_the_schema_trl_renders_into_each_prompt_and_its_turns(tmp_path,
                                                                                        tiny_random_model_dir):
    """The multi-turn context of a row: the prompt, the tools' schema in it (as long as in the prompt ids TRL's
    trainer builds), then every turn and tool result within max_completion_length (TRL's cut)."""
    recipe = {"model": str(tiny_random_model_dir), "dataset": "toy-arith", "dataset_size": 4, "eval_limit": 2,
              "per_device_train_batch_size": 4, "num_generations": 2, "max_completion_length": 96,
              "rewards": [VARYING_REWARD], "save_strategy": "no"}
    tools = {"tools": ["fixtures.user_rollouts:add", "fixtures.user_rollouts:hang"], "max_tool_calling_iterations": 3,
             "tool_result_tokens": 64}
    plain, tooled = (build_trainer(recipe | extra, tmp_path / name) for name, extra in (("a", {}), ("b", tools)))
    prompts = [plain.train_dataset[i]["prompt"] for i in range(4)]
    rendered = [[len(ids) for ids in trainer._tokenize_prompts(prompts)[0]] for trainer in (plain, tooled)]
    inputs = plan_inputs(parse_recipe(recipe | tools), prompt_length=max(rendered[0]))
    assert [b - a for a, b in zip(*rendered, strict=True)] == [inputs.tool_schema_tokens] * 4
    assert inputs.tool_schema_tokens > 100 and (inputs.tool_turns, inputs.tool_result_tokens) == (3, 64)
    shape = ModelShape.from_config(load_model_config(inputs.model))
    memory = build_plan(inputs, shape, gpus=1, gpu_bytes=64 * GIB, sharding=Sharding(), device="cpu")
    assert memory.tokens_per_micro_batch == 4 * (max(rendered[1]) + 96)
    activations = next(item for item in memory.items if item.name == "activations")
    assert "4 turns and 3 rounds of tool results of <= 64 tokens, all within max_completion_length 96" in \
        activations.note
    without = build_plan(plan_inputs(parse_recipe(recipe), prompt_length=max(rendered[0])), shape, gpus=1,
                         gpu_bytes=64 * GIB, sharding=Sharding(), device="cpu")
    assert next(i for i in without.items if i.name == "activations").bytes < activations.bytes


@pytest.mark.parametrize("path", GPU_RECIPES, ids=lambda p: p.stem)
def test_every_gpu_recipe_fits_80gb_cards_with_the_launch_it_states(path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # stored configs only
    recipe = load_recipe(path)
    assert recipe.get("gpus") and recipe.get("accelerate_config"), f"{path.name} must state gpus and accelerate_config"
    sharding = sharding_from_accelerate_config(REPO / recipe["accelerate_config"])
    plan = plan_recipe(parse_recipe(recipe), gpus=recipe["gpus"], sharding=sharding,
                       gpu_bytes=parse_memory("80GB"))
    assert plan.fits, plan.verdict()


def test_sharding_divides_weights_gradients_and_optimizer_by_the_gpu_count():
    recipe = load_recipe(REPO / "recipes" / "gpu" / "poise_qwen3-4b.yaml")
    items = {}
    for kind, gpus in (("ddp", 4), ("zero2", 4), ("zero3", 4), ("fsdp2", 4)):
        plan = plan_recipe(parse_recipe(recipe), gpus=gpus, sharding=Sharding(kind, "bf16"))
        items[kind] = {item.name: item.bytes for item in plan.items}
    params = 4_022_468_096  # Qwen3-4B, counted from its config on the meta device
    assert items["zero2"]["optimizer state"] == pytest.approx(12 * params / 4, rel=1e-6)
    assert items["zero2"]["gradients"] == pytest.approx(2 * params / 4, rel=1e-6)
    assert items["zero2"]["weights"] == pytest.approx(2 * params, rel=1e-6)
    assert items["zero3"]["weights"] < items["zero2"]["weights"] / 3
    assert items["ddp"]["optimizer state"] == pytest.approx(8 * params, rel=1e-6)  # fp32 load, AdamW moments
    assert items["fsdp2"]["optimizer state"] == pytest.approx(8 * params / 4, rel=1e-6)
    assert items["ddp"]["activations"] > items["zero3"]["activations"]  # fp32 vs bf16 residual stream


def test_gradient_checkpointing_and_micro_batch_shrink_activations():
    recipe = load_recipe(REPO / "recipes" / "gpu" / "poise_qwen3-4b.yaml")
    act = {}
    for checkpointing in (True, False):
        for rows in (64, 8):
            plan = plan_recipe(parse_recipe({**recipe, "gradient_checkpointing": checkpointing,
                                              "per_device_train_batch_size": rows}))
            act[checkpointing, rows] = next(i.bytes for i in plan.items if i.name == "activations")
    assert act[True, 64] == pytest.approx(8 * act[True, 8], rel=1e-6)
    assert act[False, 64] > 5 * act[True, 64]


def test_a_plan_that_does_not_fit_names_the_changes_that_make_it_fit():
    recipe = load_recipe(REPO / "recipes" / "gpu" / "poise_qwen3-4b.yaml")
    plan = plan_recipe(parse_recipe({**recipe, "per_device_train_batch_size": 64}), gpus=1)
    assert not plan.fits and plan.suggestions
    assert "does NOT fit" in plan.verdict()
    fixed = plan_recipe(parse_recipe({**recipe, "per_device_train_batch_size": 64}), gpus=8,
                        sharding=Sharding("zero3", "bf16"))
    assert fixed.total < plan.total


def test_accelerate_configs_are_read_and_environment_matches():
    kinds = {p.stem: sharding_from_accelerate_config(p).kind for p in ACCELERATE_CONFIGS}
    assert kinds == {"ddp": "ddp", "fsdp2": "fsdp2", "zero2": "zero2", "zero3": "zero3"}
    env = {"WORLD_SIZE": "8", "ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
           "ACCELERATE_MIXED_PRECISION": "bf16"}
    assert sharding_from_environment(env) == Sharding("zero3", "bf16", num_processes=8)
    env = {"WORLD_SIZE": "2", "ACCELERATE_USE_FSDP": "true", "FSDP_RESHARD_AFTER_FORWARD": "true"}
    assert sharding_from_environment(env).kind == "fsdp2"
    assert sharding_from_environment({"WORLD_SIZE": "2"}).kind == "ddp"
    assert sharding_from_environment({}).kind == "single"


def test_parse_memory_and_bad_inputs():
    assert parse_memory("80GB") == parse_memory("80GiB") == 80 * GIB
    assert parse_memory("512MiB") == 512 * 2**20
    with pytest.raises(ValueError, match="write it like 80GB"):
        parse_memory("lots")
    with pytest.raises(RecipeError, match="data/model_configs/nobody--nothing"):
        load_model_config("nobody/nothing")


def test_cli_plan_answers_offline_with_a_table(monkeypatch):
    from poise_trl.cli.main import app

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = CliRunner().invoke(app, ["plan", str(REPO / "recipes/gpu/poise_qwen3-4b.yaml"), "--gpus", "1",
                                      "--gpu-memory", "80GB"])
    output = result.output
    for item in ("weights", "gradients", "optimizer state", "activations", "LM head", "vLLM"):
        assert item in output, output
    assert "GiB per GPU" in output


def test_cli_plan_bad_input_is_one_line(tmp_path):
    from poise_trl.cli.main import app

    result = CliRunner().invoke(app, ["plan", str(tmp_path / "missing.yaml")])
    assert_one_line_error(result, result.output, "not found")
    result = CliRunner().invoke(app, ["plan", str(REPO / "recipes/toy/poise.yaml"), "--gpu-memory", "big"])
    assert_one_line_error(result, result.output, "80GB")


def test_cli_plan_of_a_multi_machine_launch_is_that_of_all_its_gpus(monkeypatch):
    from poise_trl.cli.main import app

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    recipe = str(REPO / "recipes/gpu/poise_qwen3-4b.yaml")
    layout = CliRunner().invoke(app, ["plan", recipe, "--machines", "2", "--gpus-per-machine", "4"])
    total = CliRunner().invoke(app, ["plan", recipe, "--gpus", "8"])
    assert layout.exit_code == 0 and layout.output == total.output and "on 8 GPU(s)" in layout.output
    for args, pattern in ((["--machines", "0"], "Invalid value for '--machines'"),
                          (["--machines", "2", "--gpus-per-machine", "-1"], "Invalid value for '--gpus-per-machine'"),
                          (["--machines", "2", "--gpus", "8"], "either the total")):
        result = CliRunner().invoke(app, ["plan", recipe, *args])
        assert_one_line_error(result, result.output, pattern)


def test_train_check_stops_on_a_gpu_when_the_launch_cannot_fit(monkeypatch):
    """`poise train`'s check reads the launch from accelerate's environment and the card from torch
    (both stubbed: no GPU here); on a CPU it does nothing."""
    from types import SimpleNamespace

    from poise_trl.run.plan import check_memory_plan

    recipe = load_recipe(REPO / "recipes" / "gpu" / "poise_qwen3-4b.yaml")
    # parsed on this CPU machine, before the GPU is stubbed in (the config object is built for the machine)
    parsed, skipping = parse_recipe(recipe), parse_recipe({**recipe, "skip_memory_plan": True})
    assert check_memory_plan(parsed) is None  # no GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(total_memory=80 * GIB))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for key in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")  # a plain one-GPU launch of a recipe planned for ZeRO-3 on 2
    with pytest.raises(RecipeError, match="does NOT fit.*skip_memory_plan: true"):
        check_memory_plan(parsed)
    assert check_memory_plan(skipping) is None
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    assert check_memory_plan(parsed).fits
