"""`poise train`: a recipe -> model, data, rewards, trainer -> training -> summary.json."""

from __future__ import annotations

import dataclasses
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch
import yaml

from poise_trl.callbacks import (
    Budget,
    CheckpointMarkerCallback,
    HeldOutEvalCallback,
    ProbeReportCallback,
    RichProgressCallback,
)
from poise_trl.data import load_prompt_dataset
from poise_trl.generation import (
    is_tiny_on_cpu,
    require_chat_template,
    resolve_engine,
    training_generation_record,
)
from poise_trl.provenance import package_versions, write_json, write_text
from poise_trl.recipe import (
    RecipeError,
    RunFolder,
    RunSettings,
    check_model_files,
    checkpoint_problem,
    inspect_run_folder,
    split_recipe,
)
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

    check_model_files(model)
    if not Path(model).exists() and os.environ.get("HF_HUB_OFFLINE", "0") in ("", "0"):
        from poise_trl.hub import hub_unreachable

        if reason := hub_unreachable():
            raise RecipeError(f"model {model!r} is not a local folder and the Hugging Face Hub is unreachable here "
                              f"({reason}): give a local model folder, or set HF_HUB_OFFLINE=1 to use the hub cache")
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
    if "num_generations" in algo.config_class.__dataclass_fields__:  # A*-PO has one rollout per prompt, no groups
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


def save_full_model(trainer, folder: Path) -> None:
    """The whole model, loadable with from_pretrained, on every launch. Under FSDP with sharded
    checkpoints (SHARDED_STATE_DICT) the Trainer's save_model writes no weights; the plugin is
    switched to a full state dict for this one save, accelerate's documented way ("trains with
    sharded, but final save is with full"). Gathering is a collective: every process calls this."""
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    previous = plugin.state_dict_type if plugin is not None else None
    if plugin is not None and "FULL_STATE_DICT" not in str(previous):
        plugin.set_state_dict_type("FULL_STATE_DICT")
    try:
        trainer.save_model(str(folder))
    finally:
        if plugin is not None:
            plugin.set_state_dict_type(previous)


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


def train_from_recipe(recipe: dict, output_dir: str | None = None, show_progress: bool = True,
                      overwrite: bool = False, log=print) -> dict:
    """Run one recipe to completion; returns (and writes) the summary.

    Recipe, model, data and output folder are checked before anything is written. An output
    folder holding an unfinished run of the same recipe resumes from its newest complete
    checkpoint; a finished one is left untouched and its summary returned (with
    `already_finished: True`, not written); one holding another run is refused unless
    `overwrite`. `log` gets the one-line notes (resuming, finished, skipped checkpoints)."""
    algo_name = recipe.get("algo", "grpo")
    settings, config_kwargs = split_recipe(recipe, get_algorithm(algo_name).config_class)
    args = build_config(algo_name, config_kwargs, output_dir)
    from poise_trl.plan import check_memory_plan

    check_memory_plan(recipe)  # on a GPU: one line, before any weights load, when the plan says it cannot fit
    if settings.push_to_hub and not args.hub_model_id:
        raise RecipeError("push_to_hub needs the repository to push to: set hub_model_id: <user>/<name>")
    if getattr(args, "use_vllm", False):  # A*-PO's config has no vLLM switch
        resolve_engine("vllm")  # one line when vLLM is missing or broken, before any model loads
    model_path = resolve_model_path(settings.model)
    tokenizer = load_tokenizer(model_path)
    train_set, eval_set = load_datasets(settings, seed=args.seed)
    algo = get_algorithm(algo_name)
    budget = budget_from(settings)
    reward_funcs = get_reward_functions(settings.rewards)
    peft_config = build_peft_config(settings.peft)

    folder = plan_output_dir(args, recipe, overwrite)
    out = folder.path
    for warning in folder.warnings:
        log(f"warning: {warning}")
    if folder.state == "finished":
        done = folder.summary
        log(f"{out} holds this run, finished ({done.get('steps')} steps, held-out accuracy "
            f"{_fmt(done.get('start_heldout_accuracy'))} -> {_fmt(done.get('final_heldout_accuracy'))}): left untouched; "
            "give --overwrite to train it again")
        return {**done, "already_finished": True}
    resume_from = str(folder.checkpoint) if folder.checkpoint else None
    if resume_from:
        check_model_files(resume_from)
        log(f"resuming from {folder.checkpoint.name} (step {folder.step} of {args.max_steps})")
    eval_callback = HeldOutEvalCallback(
        eval_set, tokenizer, every=settings.eval_every, num_samples=settings.eval_num_samples,
        temperature=settings.eval_temperature, max_new_tokens=settings.eval_max_new_tokens,
        batch_size=settings.eval_batch_size, seed=args.seed, budget=budget, resume_from=resume_from,
    )
    callbacks = [eval_callback] + ([RichProgressCallback(eval_callback)] if show_progress else [])
    trainer = algo.trainer_class(
        model=model_path,
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=train_set,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=callbacks,
    )
    eval_callback.trainer = trainer
    if show_progress:
        from transformers.trainer_callback import PrinterCallback

        trainer.remove_callback(PrinterCallback)  # the live display replaces the raw log dicts
    probe_report = None
    if hasattr(trainer, "probe_history"):
        probe_report = ProbeReportCallback(trainer, args.output_dir, resume_from=resume_from)
        trainer.add_callback(probe_report)
    trainer.add_callback(CheckpointMarkerCallback())  # last: it marks a checkpoint complete

    if trainer.accelerator.is_main_process:
        if folder.clear:  # only now: a setting the trainer rejects leaves the old run in place
            clear_run_folder(out)
        out.mkdir(parents=True, exist_ok=True)
        write_text(out / "recipe.yaml", yaml.safe_dump(recipe, sort_keys=False))
    threads = None  # the torch threads training ran with
    if resume_from and eval_callback.budget_spent_in(resume_from):
        # Nothing is left to train, and Trainer would still take a step: finish from the checkpoint.
        from transformers.trainer_callback import TrainerState

        trainer._load_from_checkpoint(resume_from)
        trainer.state = TrainerState.load_from_json(str(Path(resume_from) / "trainer_state.json"))
        eval_callback.restore(resume_from)
        if probe_report is not None:
            probe_report.restore(resume_from)
            probe_report.on_train_end(args, trainer.state, trainer.control)  # the report a kill may have cut off
    else:
        with training_threads(trainer.model) as threads:
            trainer.train(resume_from_checkpoint=resume_from)
    save_full_model(trainer, out / "final")

    history = eval_callback.history
    summary = {
        "algo": algo_name,
        "model": settings.model,
        "dataset": settings.dataset,
        "steps": trainer.state.global_step,
        "wall_clock_seconds": round(eval_callback.wall_clock_seconds, 1),  # every segment of a resumed run
        "resumed_at_steps": eval_callback.resumed_at_steps,
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
        "torch_threads": threads,
        "generation": training_generation_record(
            args, trainer.policy_forward_passes, trainer.state.global_step - eval_callback.first_step
        ),
        "versions": package_versions(),
    }
    if probe_report is not None and probe_report.report is not None:
        summary["probe"] = {k: probe_report.report[k] for k in ("rounds", "probe_active_rounds",
                                                                  "online_mean_after_bootstrap")}
    if trainer.accelerator.is_main_process:
        from poise_trl.hub import build_model_card

        write_text(out / "final" / "README.md", build_model_card(recipe, summary))
        write_json(out / "summary.json", summary)  # last: its presence marks the run finished
        if settings.push_to_hub:
            from poise_trl.hub import push_final_model

            push_final_model(out / "final", args.hub_model_id, recipe, summary)
    return summary


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:.3f}"


@contextmanager
def training_threads(model):
    """One torch thread for a tiny model on CPU, whatever OMP_NUM_THREADS says: the summed order
    inside a matmul depends on the thread count, so the same seed gave different runs with
    different thread settings. Larger models keep the machine's setting (recorded in the summary)."""
    import torch

    before = torch.get_num_threads()
    if is_tiny_on_cpu(model):
        torch.set_num_threads(1)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def plan_output_dir(args, recipe: dict, overwrite: bool) -> RunFolder:
    """`inspect_run_folder` with TRL's `resume_from_checkpoint` (true: the newest complete
    checkpoint must exist; a folder: that checkpoint; false: never resume)."""
    resume = args.resume_from_checkpoint
    explicit = None
    if resume not in (None, False, "", "false", "False", True, "true", "True"):
        if not Path(resume).is_dir():
            raise RecipeError(f"resume_from_checkpoint: {resume} is not a folder (give a checkpoint-N folder, or true)")
        problem = checkpoint_problem(Path(resume))
        if problem not in (None, "incomplete"):  # no marker: a checkpoint from before markers, or the user's own
            raise RecipeError(f"resume_from_checkpoint: {resume} is damaged: {problem}")
        explicit = str(resume)
    folder = inspect_run_folder(args.output_dir, recipe, overwrite=overwrite, explicit=explicit)
    if resume in (True, "true", "True") and folder.state == "new":
        raise RecipeError(f"resume_from_checkpoint: true, but {args.output_dir} holds no checkpoint to resume from (no complete checkpoint-N folder)")
    if resume in (False, "false", "False") and folder.state == "resume":
        raise RecipeError(f"resume_from_checkpoint: false, but {args.output_dir} holds this run's checkpoints: drop "
                          "the key to resume it, or give --overwrite to start over")
    return folder


def clear_run_folder(path: Path) -> None:
    """--overwrite: the old run's files go (only files poise train writes; inspect_run_folder
    refused folders with others). Renamed first, so the folder never mixes two runs."""
    doomed = path.with_name(f".{path.name}.overwritten-{os.getpid()}")
    path.rename(doomed)
    shutil.rmtree(doomed)


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


def require_hub_if_needed(source: str, split: str | None) -> None:
    """A hub dataset with no network fails here in about a second, with one line. With
    HF_HUB_OFFLINE=1, `datasets` reads its local cache (or fails at once) by itself."""
    from poise_trl.data import DATASETS, DatasetUnavailableError
    from poise_trl.hub import hub_unreachable

    spec = DATASETS.get(source)
    on_hub = spec.hub_id is not None and split not in spec.files if spec else not Path(source).exists()
    if not on_hub or os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0"):
        return
    reason = hub_unreachable()
    if reason:
        raise DatasetUnavailableError(
            f"dataset {source!r} comes from the Hugging Face Hub, which is unreachable here ({reason}): give a local "
            "copy (a .jsonl/.parquet/.csv file or folder) as `dataset`, or set HF_HUB_OFFLINE=1 to use the hub cache")


def load_datasets(settings: RunSettings, seed: int):
    require_hub_if_needed(settings.dataset, settings.dataset_split)
    if settings.eval_dataset:
        require_hub_if_needed(settings.eval_dataset, settings.eval_split)
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
