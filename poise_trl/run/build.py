"""The one way a run is built: a run plan (`recipe.parse_recipe`) -> model, tokenizer, data, rewards ->
output folder decision -> a ready trainer with poise-trl's callbacks and its algorithm's. `poise train`,
the tests and the benchmarks all build through `build_run`; nothing is written here (`train.py` writes).
"""

from __future__ import annotations

import importlib.util
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import trl
from packaging.version import Version
from peft import LoraConfig
from transformers.trainer_callback import PrinterCallback

from poise_trl.algorithms.base import RunCallback
from poise_trl.core.loading import (
    check_model_files,
    import_callable,
    load_tokenizer,
    offline_if_hub_unreachable,
    resolve_model_path,
)
from poise_trl.engines.generation import keep_cpu_engine_weights_reloadable, resolve_engine
from poise_trl.engines.tools import ToolRuntime, environment_class
from poise_trl.engines.vllm_server import LocalServer
from poise_trl.evaluation.agent import RecipeTools, Toolbox
from poise_trl.run.callbacks import Budget, CheckpointMarkerCallback, HeldOutEvalCallback, RichProgressCallback
from poise_trl.run.recipe import RecipeError, RunPlan, RunSettings, tool_limits
from poise_trl.run.run_folder import RunFolder, plan_output_dir
from poise_trl.seam.grpo import GRPOSeam
from poise_trl.seam.vllm import server_generation
from poise_trl.tasks import is_task, load_prompt_dataset, refuse_near_miss
from poise_trl.tasks.prompts import DATASETS
from poise_trl.tasks.rewards import check_reward_functions, get_reward_functions


def build_peft_config(peft: dict | None):
    if not peft:
        return None
    settings = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": "all-linear",
                "task_type": "CAUSAL_LM", **peft}
    try:
        return LoraConfig(**settings)
    except TypeError as exc:
        raise RecipeError(f"invalid peft settings {peft}: {exc}") from None


def budget_from(settings: RunSettings) -> Budget | None:
    if settings.budget_tokens is not None and settings.budget_rollouts is not None:
        raise RecipeError("set budget_tokens or budget_rollouts, not both")
    tokens = settings.budget_tokens is not None
    unit, amount = ("tokens", settings.budget_tokens) if tokens else ("rollouts", settings.budget_rollouts)
    if amount is None:
        return None
    try:
        return Budget(unit, int(amount), int(settings.budget_eval_points))
    except ValueError as exc:
        raise RecipeError(f"invalid budget: {exc}") from None


def hub_or_offline(source: str | list, split: str | None) -> None:
    """A dataset name one typo from a local one gets "did you mean" at once; a hub dataset with no network is read
    from the local cache (`loading.offline_if_hub_unreachable`), failing at once when it is not there."""
    if is_task(source):  # generated or bundled with the task's package
        return
    refuse_near_miss(source)  # a local name first: offline, the hub would answer any name with a network error
    spec = DATASETS.get(source)
    if spec.hub_id is not None and split not in spec.files if spec else not Path(source).exists():
        offline_if_hub_unreachable()


def load_datasets(settings: RunSettings, seed: int):
    hub_or_offline(settings.dataset, settings.dataset_split)
    if settings.eval_dataset:
        hub_or_offline(settings.eval_dataset, settings.eval_split)
    columns = settings.dataset_columns
    common = dict(columns=columns, prompt_suffix=settings.prompt_suffix, system_prompt=settings.system_prompt,
                  task_config=settings.task_config)
    train_kwargs = dict(split=settings.dataset_split, seed=seed, **common)
    if settings.dataset_size is not None:
        train_kwargs["limit"] = settings.dataset_size
    train_set = load_prompt_dataset(settings.dataset, **train_kwargs)
    eval_source = settings.eval_dataset or settings.dataset
    eval_split = settings.eval_split or "test"
    eval_set = load_prompt_dataset(eval_source, split=eval_split, limit=settings.eval_limit, seed=seed, **common)
    if is_task(eval_source):
        # A generated task's test split is drawn from another seed, but a small question space can repeat a
        # question at any size: the held-out set keeps none that the training rows hold.
        seen = {json.dumps(prompt, sort_keys=True) for prompt in train_set["prompt"]}
        eval_set = eval_set.filter(lambda row: json.dumps(row["prompt"], sort_keys=True) not in seen)
        if len(eval_set) == 0:
            raise RecipeError(f"every held-out question of {eval_source} is also a training question (its question "
                              "space is small): lower dataset_size or widen the task's config")
    return train_set, eval_set


@dataclass
class Run:
    """A built run. `trainer` is None when the output folder holds this run finished (`folder.state`)."""

    plan: RunPlan
    model_path: str
    tokenizer: object
    train_set: object
    eval_set: object
    folder: RunFolder
    trainer: object = None
    eval_callback: HeldOutEvalCallback | None = None
    algorithm_callbacks: list[RunCallback] = field(default_factory=list)  # `Algorithm.callbacks`, made
    server: LocalServer | None = None  # the vLLM server `poise train` starts for `async: true`, and stops

    @property
    def resume_from(self) -> str | None:
        return str(self.folder.checkpoint) if self.folder.checkpoint else None


def rollout_mode(settings, algorithm, tokenizer) -> tuple[dict, ToolRuntime | None]:
    """The recipe's `tools`, `environment` and `rollout_func`, imported, as TRL's GRPOTrainer takes them; tools and
    environments run in worker processes within the recipe's limits (`engines/tools.py`)."""
    given = {key: path for key, path in (("tools", settings.tools), ("environment_factory", settings.environment),
                                         ("rollout_func", settings.rollout_func)) if path}
    if given and not issubclass(algorithm.trainer_class, GRPOSeam):
        raise RecipeError(f"algo {algorithm.name} cannot take tools, an environment or a rollout function (its TRL "
                          "trainer has no rollout modes): use a GRPO-based algo, or remove them from the recipe")
    if "rollout_func" in given:
        given["rollout_func"] = import_callable(given["rollout_func"], "rollout function")
    if "tools" not in given and "environment_factory" not in given:
        return given, None
    tool_paths = [settings.tools] if isinstance(settings.tools, str) else list(settings.tools or [])
    runtime = ToolRuntime(tool_paths, settings.environment, settings.tool_timeout, settings.tool_result_tokens,
                          tokenizer)
    if tool_paths:
        given["tools"] = runtime.tools([import_callable(path, "tool") for path in tool_paths])
    if settings.environment:
        given["environment_factory"] = runtime.environment_factory(environment_class(settings.environment))
    return given, runtime


def asynchronous_run(settings, algorithm, args, model_path: str, rollout: dict):
    """`async: true`: the algorithm's off-policy events on TRL's AsyncGRPOTrainer (seam/async_grpo.py), its
    config, and the local vLLM server to start when the recipe names none; one line when it cannot run so."""
    events = getattr(algorithm.trainer_class, "async_events", None)
    reason = getattr(algorithm.trainer_class, "off_policy_refusal", "its TRL trainer is not GRPO's")
    if events is None or rollout:
        reason = "tools, environments and rollout functions are not wired to its worker" if rollout else reason
        raise RecipeError(f"algo {algorithm.name} cannot run with async: true: {reason}")
    if importlib.util.find_spec("trl.experimental.async_grpo") is None or Version(trl.__version__) < Version("1.16"):
        raise RecipeError(f"async: true needs TRL 1.16's AsyncGRPOTrainer (its packed attention), but TRL "
                          f"{trl.__version__} is installed: pip install 'trl==1.16.*'")
    resolve_engine("vllm")  # one line when vLLM is missing or broken
    from poise_trl.seam import async_grpo  # noqa: PLC0415 (TRL's experimental trainer loads vLLM's client)

    conflict = async_grpo.off_policy_conflict(args, events)
    if conflict:
        raise RecipeError(f"async: true: {conflict}")
    server = None if args.vllm_server_base_url else LocalServer(model_path, Path(tempfile.mkstemp(
        prefix="poise-vllm-server-", suffix=".log")[1]))
    url = args.vllm_server_base_url or server.url
    return (async_grpo.async_trainer_class(algorithm.trainer_class),
            async_grpo.async_config(args, settings.max_staleness, url), server)


def build_run(plan: RunPlan, *, overwrite: bool = False, show_progress: bool = False,
              reward_funcs: list | None = None, trainer_class: type | None = None,
              callbacks: list | None = None) -> Run:
    """Run plan -> checked model, data, rewards and output folder -> trainer with all its callbacks.

    Every check (the reward functions on a dry batch included) runs before the trainer is built; nothing is
    written. `reward_funcs` replaces the recipe's rewards, `trainer_class` subclasses the algorithm's trainer,
    `callbacks` run before poise-trl's own.
    """
    settings, args, algorithm = plan.settings, plan.args, plan.algorithm
    if settings.push_to_hub and not args.hub_model_id:
        raise RecipeError("push_to_hub needs the repository to push to: set hub_model_id: <user>/<name>")
    if getattr(args, "use_vllm", False):  # A*-PO's config has no vLLM switch
        resolve_engine("vllm")  # one line when vLLM is missing or broken, before any model loads
        if args.vllm_mode == "colocate":
            keep_cpu_engine_weights_reloadable()
    model_path = resolve_model_path(settings.model)
    tokenizer = load_tokenizer(model_path)
    train_set, eval_set = load_datasets(settings, seed=args.seed)
    budget = budget_from(settings)
    reward_names = settings.rewards if reward_funcs is None else None  # the recipe's spelling, for errors
    reward_funcs = reward_funcs if reward_funcs is not None else get_reward_functions(settings.rewards)
    check_reward_functions(reward_funcs, train_set, tokenizer, reward_names)  # one line, before the folder
    rollout, tool_runtime = rollout_mode(settings, algorithm, tokenizer)
    if tool_runtime is not None:
        reward_funcs = tool_runtime.counting_turns(reward_funcs)
    peft_config = build_peft_config(settings.peft)
    folder = plan_output_dir(args, plan.recipe, overwrite)
    run = Run(plan, model_path, tokenizer, train_set, eval_set, folder)
    if folder.state == "finished":
        return run
    if run.resume_from:
        check_model_files(run.resume_from)

    run.eval_callback = HeldOutEvalCallback(
        eval_set, tokenizer, every=settings.eval_every, num_samples=settings.eval_num_samples,
        temperature=settings.eval_temperature, max_new_tokens=settings.eval_max_new_tokens,
        batch_size=settings.eval_batch_size, seed=args.seed, budget=budget, resume_from=run.resume_from,
        toolbox=tool_runtime and Toolbox(tokenizer, RecipeTools(**tool_limits(plan.recipe))),
    )
    callbacks = [*(callbacks or []), run.eval_callback] + (
        [RichProgressCallback(run.eval_callback)] if show_progress else [])
    trainer_class = trainer_class or algorithm.trainer_class
    if not issubclass(trainer_class, algorithm.trainer_class):
        raise TypeError(f"trainer_class {trainer_class.__name__} does not extend "
                        f"{algorithm.trainer_class.__name__}")
    if settings.asynchronous:
        trainer_class, args, run.server = asynchronous_run(settings, algorithm, args, model_path, rollout)
    with server_generation(args):
        trainer = trainer_class(
            model=model_path, reward_funcs=reward_funcs, args=args, train_dataset=train_set,
            processing_class=tokenizer, peft_config=peft_config, callbacks=callbacks, **rollout,
        )
    run.eval_callback.trainer = trainer
    if tool_runtime is not None:
        tool_runtime.attach(trainer)
    if show_progress:
        trainer.remove_callback(PrinterCallback)  # the live display replaces the raw log dicts
    run.algorithm_callbacks = trainer.run_callbacks  # the trainer added them (`TrainerSeam.init_counters`)
    for callback in run.algorithm_callbacks:
        callback.resume_from = run.resume_from
    trainer.add_callback(CheckpointMarkerCallback())  # last: it marks a checkpoint complete
    run.trainer = trainer
    return run
