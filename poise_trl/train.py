"""`poise train`: a recipe -> model, data, rewards, trainer -> training -> summary.json."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch
import yaml

from poise_trl.callbacks import Budget, HeldOutEvalCallback, ProbeReportCallback, RichProgressCallback
from poise_trl.data import load_prompt_dataset
from poise_trl.generation import is_tiny_on_cpu, one_cpu_thread, require_chat_template
from poise_trl.provenance import package_versions, write_json
from poise_trl.recipe import RecipeError, RunSettings, split_recipe
from poise_trl.rewards import get_reward_functions
from poise_trl.trainers import get_algorithm

REPO_ROOT = Path(__file__).resolve().parents[1]


def resolve_model_path(model: str) -> str:
    """Recipes name the bundled model relative to the repository (`data/tiny-qwen3`);
    anything else is a local path or a hub id handed to transformers as is."""
    if not Path(model).exists() and (REPO_ROOT / model).exists():
        return str(REPO_ROOT / model)
    return model


def load_tokenizer(model: str):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model)
    except OSError as exc:
        raise RecipeError(
            f"cannot load a tokenizer from {model!r}: {exc.__class__.__name__}. Give a local model folder or a hub id "
            "(offline runs need the model in the local cache; the bundled tiny model is data/tiny-qwen3)"
        ) from None
    require_chat_template(tokenizer, f"model {model!r}")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def build_config(algo_name: str, config_kwargs: dict, output_dir: str | None):
    algo = get_algorithm(algo_name)
    kwargs = {**algo.defaults, **config_kwargs}
    if output_dir is not None:
        kwargs["output_dir"] = output_dir
    kwargs.setdefault("output_dir", f"runs/{algo_name}")
    kwargs.setdefault("report_to", "none")
    kwargs["disable_tqdm"] = True  # the rich display replaces tqdm
    if not torch.cuda.is_available():
        kwargs.update(use_cpu=True, bf16=False)
        kwargs.setdefault("gradient_checkpointing", False)
    check_batch_geometry(kwargs)
    try:
        return algo.config_class(**kwargs)
    except (ValueError, TypeError) as exc:
        raise RecipeError(f"invalid settings for algo {algo_name!r}: {exc}") from None


def check_batch_geometry(kwargs: dict) -> None:
    """Catch the batch sizes TRL would reject later, with the fix spelled out."""
    num_generations = kwargs.get("num_generations", 8)
    per_device = kwargs.get("per_device_train_batch_size", 8)
    steps = kwargs.get("steps_per_generation") or kwargs.get("gradient_accumulation_steps", 1)
    generation_batch = kwargs.get("generation_batch_size") or per_device * steps
    if generation_batch % num_generations:
        raise RecipeError(
            f"generation batch size {generation_batch} (per_device_train_batch_size={per_device} x "
            f"steps_per_generation={steps}) is not divisible by num_generations={num_generations}: every prompt needs "
            f"its {num_generations} rollouts in the same batch. Make per_device_train_batch_size x steps_per_generation "
            f"a multiple of {num_generations} (e.g. per_device_train_batch_size={num_generations * max(1, per_device // num_generations)})"
        )


def build_peft_config(peft: dict | None):
    if not peft:
        return None
    from peft import LoraConfig

    settings = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": "all-linear", "task_type": "CAUSAL_LM"}
    settings.update(peft)
    try:
        return LoraConfig(**settings)
    except TypeError as exc:
        raise RecipeError(f"invalid peft settings {peft}: {exc}") from None


def train_from_recipe(recipe: dict, output_dir: str | None = None, show_progress: bool = True) -> dict:
    """Run one recipe to completion; returns (and writes) the summary."""
    algo_name = recipe.get("algo", "grpo")
    settings, config_kwargs = split_recipe(recipe, get_algorithm(algo_name).config_class)
    args = build_config(algo_name, config_kwargs, output_dir)
    if settings.push_to_hub and not args.hub_model_id:
        raise RecipeError("push_to_hub needs the repository to push to: set hub_model_id: <user>/<name>")
    model_path = resolve_model_path(settings.model)
    tokenizer = load_tokenizer(model_path)
    train_set, eval_set = load_datasets(settings, seed=args.seed)
    algo = get_algorithm(algo_name)

    resume_from = resolve_resume_checkpoint(args)
    eval_callback = HeldOutEvalCallback(
        eval_set, tokenizer, every=settings.eval_every, num_samples=settings.eval_num_samples,
        temperature=settings.eval_temperature, max_new_tokens=settings.eval_max_new_tokens,
        batch_size=settings.eval_batch_size, seed=args.seed, budget=budget_from(settings), resume_from=resume_from,
    )
    callbacks = [eval_callback] + ([RichProgressCallback(eval_callback)] if show_progress else [])
    trainer = algo.trainer_class(
        model=model_path,
        reward_funcs=get_reward_functions(settings.rewards),
        args=args,
        train_dataset=train_set,
        processing_class=tokenizer,
        peft_config=build_peft_config(settings.peft),
        callbacks=callbacks,
    )
    eval_callback.trainer = trainer
    if show_progress:
        from transformers.trainer_callback import PrinterCallback

        trainer.remove_callback(PrinterCallback)  # the live display replaces the raw log dicts
    if hasattr(trainer, "probe_history"):
        trainer.add_callback(ProbeReportCallback(trainer, args.output_dir))

    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    started = time.time()
    if resume_from and eval_callback.budget_spent_in(resume_from):
        # Nothing is left to train, and Trainer would still take a step: finish from the checkpoint.
        from transformers.trainer_callback import TrainerState

        trainer._load_from_checkpoint(resume_from)
        trainer.state = TrainerState.load_from_json(str(Path(resume_from) / "trainer_state.json"))
        eval_callback.restore(resume_from)
    else:
        with one_cpu_thread(is_tiny_on_cpu(trainer.model)):
            trainer.train(resume_from_checkpoint=resume_from)
    seconds = time.time() - started
    trainer.save_model(str(out / "final"))

    history = eval_callback.history
    summary = {
        "algo": algo_name,
        "model": settings.model,
        "dataset": settings.dataset,
        "steps": trainer.state.global_step,
        "wall_clock_seconds": round(seconds, 1),
        "train_seconds": round(eval_callback.train_seconds, 3),
        "start_heldout_accuracy": history[0]["accuracy"] if history else None,
        "final_heldout_accuracy": history[-1]["accuracy"] if history else None,
        "final_heldout_stderr": history[-1]["stderr"] if history else None,
        "generated_tokens": trainer.generated_tokens,
        "generated_rollouts": trainer.generated_rollouts,
        "budget": dataclasses.asdict(eval_callback.budget) if eval_callback.budget else None,
        "budget_reached": eval_callback.budget_reached if eval_callback.budget else None,
        "heldout_history": history,
        "train_log": trainer.state.log_history,
        "recipe": recipe,
        "run_settings": dataclasses.asdict(settings),
        "trainer_config": args.to_dict(),
        "versions": package_versions(),
    }
    if trainer.accelerator.is_main_process:
        write_json(out / "summary.json", summary)
        if settings.push_to_hub:
            from poise_trl.hub import push_final_model

            push_final_model(out / "final", args.hub_model_id, recipe, summary)
    return summary


def budget_from(settings: RunSettings) -> Budget | None:
    if settings.budget_tokens is not None and settings.budget_rollouts is not None:
        raise RecipeError("set budget_tokens or budget_rollouts, not both")
    unit, amount = ("tokens", settings.budget_tokens) if settings.budget_tokens is not None else ("rollouts", settings.budget_rollouts)
    if amount is None:
        return None
    try:
        return Budget(unit, int(amount), int(settings.budget_eval_points))
    except ValueError as exc:
        raise RecipeError(f"invalid budget: {exc}") from None


def resolve_resume_checkpoint(args) -> str | None:
    """TRL's `resume_from_checkpoint`: a folder, or true for the newest checkpoint in output_dir."""
    resume = args.resume_from_checkpoint
    if resume in (None, False, "", "false", "False"):
        return None
    if resume in (True, "true", "True"):
        from transformers.trainer_utils import get_last_checkpoint

        last = get_last_checkpoint(args.output_dir) if Path(args.output_dir).is_dir() else None
        if last is None:
            raise RecipeError(f"resume_from_checkpoint: true, but {args.output_dir} holds no checkpoint-N folder")
        return last
    if not Path(resume).is_dir():
        raise RecipeError(f"resume_from_checkpoint: {resume} is not a folder (give a checkpoint-N folder, or true)")
    return str(resume)


def load_datasets(settings: RunSettings, seed: int):
    columns = settings.dataset_columns
    common = dict(columns=columns, prompt_suffix=settings.prompt_suffix, system_prompt=settings.system_prompt)
    train_kwargs = dict(split=settings.dataset_split, seed=seed, **common)
    if settings.dataset_size is not None:
        train_kwargs["limit"] = settings.dataset_size
    train_set = load_prompt_dataset(settings.dataset, **train_kwargs)
    eval_source = settings.eval_dataset or settings.dataset
    eval_split = settings.eval_split or "test"
    eval_set = load_prompt_dataset(eval_source, split=eval_split, limit=settings.eval_limit, seed=seed, **common)
    return train_set, eval_set
