"""`poise train`: a recipe -> its run plan (`recipe.parse_recipe`) -> a built run (`build.build_run`) ->
training -> summary.json."""

from __future__ import annotations

import dataclasses
import functools
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
import yaml
from transformers.trainer_callback import TrainerState

from poise_trl.core.distributed import naming_a_lost_rank
from poise_trl.core.provenance import package_versions, write_json, write_text
from poise_trl.engines.generation import is_tiny_on_cpu, training_generation_record
from poise_trl.engines.vllm_server import server_errors, server_url
from poise_trl.run.build import build_run
from poise_trl.run.hub import build_model_card, push_final_model
from poise_trl.run.plan import check_memory_plan
from poise_trl.run.recipe import parse_recipe
from poise_trl.run.run_folder import clear_run_folder, rerun_outcome
from poise_trl.seam.trainer import TASK_REWARD_PREFIX


def save_full_model(trainer, folder: Path) -> None:
    """The whole model, loadable with from_pretrained, also under sharded FSDP; every process must call it."""
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    previous = plugin.state_dict_type if plugin is not None else None
    if plugin is not None and "FULL_STATE_DICT" not in str(previous):
        plugin.set_state_dict_type("FULL_STATE_DICT")
    try:
        trainer.save_model(str(folder))
    finally:
        if plugin is not None:
            plugin.set_state_dict_type(previous)


def train_from_recipe(recipe: dict, output_dir: str | None = None, show_progress: bool = True,
                      overwrite: bool = False, log=print, callbacks: list | None = None) -> dict:
    """Run one recipe to completion; returns (and writes) the summary.

    Everything is checked before anything is written. An unfinished run of the same recipe resumes from its
    newest complete checkpoint; a finished one is returned untouched (`already_finished: True`); another run's
    folder is refused unless `overwrite`. `log` gets one-line notes; `callbacks` go to `build.build_run`.
    """
    plan = parse_recipe(recipe, output_dir)
    check_memory_plan(plan)  # on a GPU: one line, before any weights load, when the plan says it cannot fit
    rerun = functools.partial(rerun_outcome, plan.args.output_dir, recipe)  # what a rerun would do
    with server_errors(server_url(plan.args), rerun):  # vllm_mode: server: one line when the server does not answer
        run = build_run(plan, overwrite=overwrite, show_progress=show_progress, callbacks=callbacks)
    settings, args, folder = plan.settings, plan.args, run.folder
    out = folder.path
    for warning in folder.warnings:
        log(f"warning: {warning}")
    if folder.state == "finished":
        done = folder.summary
        log(f"{out} holds this run, finished ({done.get('steps')} steps, held-out accuracy "
            f"{_fmt(done.get('start_heldout_accuracy'))} -> {_fmt(done.get('final_heldout_accuracy'))}): left "
            "untouched; give --overwrite to train it again")
        return {**done, "already_finished": True}
    resume_from = run.resume_from
    if resume_from:
        log(f"resuming from {folder.checkpoint.name} (step {folder.step} of {args.max_steps})")
    trainer, eval_callback = run.trainer, run.eval_callback

    if trainer.accelerator.is_main_process:
        if folder.clear:  # only now: a setting the trainer rejects leaves the old run in place
            clear_run_folder(out)
        out.mkdir(parents=True, exist_ok=True)
        write_text(out / "recipe.yaml", yaml.safe_dump(recipe, sort_keys=False))
    threads = None  # the torch threads training ran with
    if resume_from and (folder.step >= args.max_steps or eval_callback.budget_spent_in(resume_from)):
        # Nothing is left to train, and Trainer would still take a step: finish from the checkpoint (with
        # the closing evaluation, which runs after the last save).
        trainer.load_checkpoint_weights(resume_from)
        trainer.state = TrainerState.load_from_json(str(Path(resume_from) / "trainer_state.json"))
        eval_callback.restore(resume_from)
        eval_callback.on_train_end(args, trainer.state, trainer.control, model=trainer.model)
        for callback in run.algorithm_callbacks:
            callback.finish(args, trainer.state, trainer.control)
    else:
        url = trainer.args.vllm_server_base_url if settings.asynchronous else server_url(args)
        with (run.server or nullcontext(), training_threads(trainer.model) as threads,
              server_errors(url, rerun, run.server),
              naming_a_lost_rank(args.ddp_timeout)):
            trainer.train(resume_from_checkpoint=resume_from)
    save_full_model(trainer, out / "final")

    history = eval_callback.history
    summary = {
        "algo": plan.algorithm.name,
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
        "train_reward_by_task": last_task_rewards(trainer.state.log_history),
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
    for callback in run.algorithm_callbacks:
        summary.update(callback.summary())
    rewards = [entry["reward"] for entry in trainer.state.log_history if entry.get("reward") is not None]
    notes = [callback.closing_note() for callback in run.algorithm_callbacks]
    if rewards and not any(rewards):
        notes.append(f"note: the training reward was 0 at every logged step ({len(rewards)}): the policy got no "
                     "signal; check the reward functions on a few completions, or give an easier dataset")
    for note in filter(None, notes):
        log(note)
    if trainer.accelerator.is_main_process:
        write_text(out / "final" / "README.md", build_model_card(recipe, summary, plan.algorithm.card))
        write_json(out / "summary.json", summary)  # last: its presence marks the run finished
        if settings.push_to_hub:
            push_final_model(out / "final", args.hub_model_id, recipe, summary,
                             algorithm_line=plan.algorithm.card)
    return summary


def last_task_rewards(log_history: list[dict]) -> dict[str, float]:
    """Each task's mean training reward in the last logging window that held its rows (the trainer's
    `rewards/task/<task>/mean`, averaged over `logging_steps` steps); empty without a `task` column."""
    suffix = "/mean"
    found = {}
    for entry in log_history:
        for key, value in entry.items():
            if key.startswith(TASK_REWARD_PREFIX) and key.endswith(suffix) and value is not None:
                found[key[len(TASK_REWARD_PREFIX) : -len(suffix)]] = value
    return dict(sorted(found.items()))


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:.3f}"


@contextmanager
def training_threads(model):
    """One torch thread for a tiny model on CPU, whatever OMP_NUM_THREADS says: the summed order
    inside a matmul depends on the thread count, so the same seed gave different runs with
    different thread settings. Larger models keep the machine's setting (recorded in the summary)."""
    before = torch.get_num_threads()
    if is_tiny_on_cpu(model):
        torch.set_num_threads(1)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


