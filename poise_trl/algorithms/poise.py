"""POISE (arXiv 2605.07579): each of 2 rollouts' baseline is a linear probe's prediction from the OTHER
rollout's hidden-state and entropy features, A_1 = r_1 - g(z_2), A_2 = r_2 - g(z_1) (POISE, Sec. 3.2).

In the seam's `compute_advantages` (before TRL's shuffle, groups whole), with the round's features served by the
seam (`FeatureNeed`): predict with the previous round's probe, freeze the advantages, log, append to the buffer
and refit; RLOO while the buffer fills. Details: docs/algorithms.md ("POISE"); the seam: docs/trl.md.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate.utils import gather_object
from trl import GRPOConfig
from trl.models.utils import disable_gradient_checkpointing

from poise_trl.algorithms.base import (
    CompareTable,
    DAPOLoss,
    PromptStream,
    RunCallback,
    Signal,
    logged,
    register_algorithm,
    setting,
)
from poise_trl.algorithms.process_rewards import ProcessRewardArguments, ProcessRewardMixin
from poise_trl.core import estimators
from poise_trl.core.distributed import summed_over_processes
from poise_trl.core.metrics import calibration_bins, mean_or_none
from poise_trl.core.provenance import package_versions, pyplot, write_json
from poise_trl.probe.capture import extract_prompt_vectors
from poise_trl.probe.estimator import PROBE_INPUTS, ProbeEstimator, probe_metrics
from poise_trl.probe.features import FEATURE_SPANS, RolloutFeatures, decoder_layers, pad_sequences, resolve_layer_index
from poise_trl.seam.grpo import FEATURE_SOURCES, FeatureNeed, GRPOSeam
from poise_trl.seam.trainer import checkpoint_folder

PROBE_STATE_FILE = "poise_probe.safetensors"
SELECTION_STATE_FILE = "poise_selection.json"


@dataclass
class POISEConfig(ProcessRewardArguments, DAPOLoss, GRPOConfig):
    """GRPOConfig plus the POISE probe; RL defaults follow the reference run (docs/algorithms.md)."""

    num_generations: int | None = setting(2, "Rollouts per prompt (POISE's pair).")
    scale_rewards: str = setting("none", "No std division of the advantages.")

    probe_layer: float = setting(0.55, "Decoder block whose output feeds the probe: a fraction of depth in (0, 1] "
                                       "(0.55 -> block 19 of Qwen3-4B's 36) or an integer block index.")
    probe_pool_tokens: int = setting(10, "Hidden states averaged for the prompt and the response vector.")
    probe_span: str = setting("last_turn", "With tools, the policy turns the response vector and entropies read "
                                           "(tool results never): 'last_turn' (the answer) or 'all_turns' (the last "
                                           "probe_pool_tokens of each turn, every turn's entropies).")
    probe_prompt_components: int = setting(32, "PCA dims of the prompt vector.")
    probe_response_components: int = setting(64, "PCA dims of the response vector.")
    probe_use_pca: bool = setting(True, "False: ridge on the standardized raw features (no PCA).")
    probe_ridge_alpha: float = setting(100.0, "Ridge penalty (intercept unpenalized).")
    probe_buffer_rows: int = setting(4096, "FIFO buffer capacity in rows; whole prompt groups are evicted.")
    probe_bootstrap_steps: int = setting(16, "Generation rounds trained with RLOO while the buffer fills; the probe "
                                             "is first fit at the end of this round.")
    probe_domain_column: str | None = setting(None, "Dataset column keying a separate probe + buffer per domain.")
    probe_fit: str = setting("fast", "PCA of the probe refit: 'fast' (randomized subspace iteration warm-started "
                                     "from the previous step, O(N d k)) or 'exact' (eigh of the d x d scatter, "
                                     "O(d^3)).")

    probe_inputs: str = setting("full", "What the probe reads: 'full' (prompt + response vectors + entropies, the "
                                        "paper) or 'prompt' (the prompt vector alone: a baseline b(x) of the prompt, "
                                        "a control).")
    prompt_selection: bool = setting(False, "Probe-guided prompt selection: score a larger pool of prompts with a "
                                            "prompt-only probe and roll out those with the highest predicted p(1-p), "
                                            "plus a random floor.")
    prompt_selection_pool: int = setting(2, "Candidate prompts scored per prompt rolled out (an integer >= 2).")
    prompt_selection_random_fraction: float = setting(0.25, "Share of the rolled-out prompts drawn uniformly from "
                                                            "the pool, so that the probe keeps seeing the whole "
                                                            "distribution and every prompt stays possible.")

    def __post_init__(self):
        super().__post_init__()
        if self.num_generations < 2:
            raise ValueError("POISE needs num_generations >= 2: each rollout's baseline comes from another rollout")
        if self.probe_fit not in ("fast", "exact"):
            raise ValueError(f"probe_fit must be 'fast' or 'exact', got {self.probe_fit!r}")
        if self.probe_span not in FEATURE_SPANS:
            raise ValueError(f"probe_span must be one of {FEATURE_SPANS}, got {self.probe_span!r}")
        if self.probe_inputs not in PROBE_INPUTS:
            raise ValueError(f"probe_inputs must be one of {PROBE_INPUTS}, got {self.probe_inputs!r}")
        if self.prompt_selection_pool < 2:
            raise ValueError(f"prompt_selection_pool must be an integer >= 2, got {self.prompt_selection_pool}")
        if not 0.0 <= self.prompt_selection_random_fraction <= 1.0:
            raise ValueError("prompt_selection_random_fraction must be in [0, 1], got "
                             f"{self.prompt_selection_random_fraction}")


def informativeness(predicted: torch.Tensor) -> torch.Tensor:
    """p(1 - p) of each predicted success rate p (clipped to [0, 1]); NaN (no fitted probe for the
    domain) counts as p = 0.5, the most informative."""
    p = torch.nan_to_num(predicted.double(), nan=0.5).clamp(0.0, 1.0)
    return p * (1 - p)


def select_prompts(predicted: torch.Tensor, k: int, random_count: int,
                   generator: torch.Generator) -> tuple[list[int], list[bool]]:
    """The `k` of `len(predicted)` candidate prompts to roll out, and which came from the random floor.

    `random_count` uniform picks (the floor), then the highest predicted p(1 - p), ties in candidate order.
    NaN predictions (domain without a probe) count as p = 0.5, so a new domain gets rolled out.
    """
    n = predicted.numel()
    if not 0 <= random_count <= k <= n:
        raise ValueError(f"need 0 <= random_count ({random_count}) <= k ({k}) <= candidates ({n})")
    floor = torch.randperm(n, generator=generator)[:random_count].tolist()
    scores = informativeness(predicted)
    scores[floor] = -1.0  # already chosen
    # Stable descending sort: among equal scores the earlier candidate wins.
    ranked = torch.sort(scores, descending=True, stable=True).indices[: k - random_count].tolist()
    return floor + ranked, [True] * len(floor) + [False] * len(ranked)


class POISEProbe:
    """POISE's probe, its baselines and prompt selection: the events of `POISETrainer`, and, off-policy, of the
    asynchronous seam (`async_events`, where no prompts are selected: the rollout worker streams them)."""

    @staticmethod
    def off_policy_conflict(config) -> str | None:
        if config.prompt_selection:
            return "its rollout worker streams the prompts, none are selected: set prompt_selection: false"
        if config.probe_domain_column:
            return "its rollout worker hands back prompts without their dataset columns: remove probe_domain_column"
        return None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        cfg = self.args
        self.value_estimator = ProbeEstimator(
            prompt_components=cfg.probe_prompt_components,
            response_components=cfg.probe_response_components,
            ridge_alpha=cfg.probe_ridge_alpha,
            use_pca=cfg.probe_use_pca,
            capacity_rows=cfg.probe_buffer_rows,
            bootstrap_steps=cfg.probe_bootstrap_steps,
            per_domain=cfg.probe_domain_column is not None,
            fit_method=cfg.probe_fit,
            device=self._probe_device(),
            inputs=cfg.probe_inputs,
            prompt_probe=cfg.prompt_selection and cfg.probe_inputs == "full",
        )
        think_end = self.processing_class.convert_tokens_to_ids("</think>")
        # Without a `</think>` token the response vector pools the last completion tokens.
        self.think_end_id = think_end if think_end != self.processing_class.unk_token_id else -1
        blocks = decoder_layers(self.accelerator.unwrap_model(self.model))
        self.probe_layer_index = resolve_layer_index(len(blocks), cfg.probe_layer)
        self.feature_need = FeatureNeed(self.probe_layer_index, cfg.probe_pool_tokens, self.think_end_id,
                                        cfg.probe_span)
        self.probe_history: list[dict] = []
        self.check_groups_stay_on_one_process(
            "a prompt's rollouts would straddle two processes and the cross-rollout pairs would break"
        )
        # Probe-guided selection: the extra-prompt stream's position and the counters (saved with
        # checkpoints), and which rolled-out prompt groups of this step came from the random floor.
        self.selection_batches_drawn = 0
        self.selection_counts = {"candidates_scored": 0, "prompts_skipped": 0, "prefill_tokens": 0}
        self._selection_stream: PromptStream | None = None
        self._step_floor: torch.Tensor | None = None

    def _probe_device(self) -> torch.device:
        """The probe refits on the policy's GPU when it has one (the refit is in the step's critical
        path, and there it takes milliseconds), else on the CPU."""
        device = self.accelerator.device
        return device if device.type == "cuda" else torch.device("cpu")

    def select_round_prompts(self, inputs: list[dict]) -> list[dict]:
        self._step_floor = None
        if self.args.prompt_selection and not self.value_estimator.in_bootstrap:
            return self._select_prompts(inputs)
        return inputs

    # -- probe-guided prompt selection (docs/algorithms.md) -----------------------------------

    def _select_prompts(self, inputs: list[dict]) -> list[dict]:
        """This process's rows (k prompts x num_generations) -> the k prompts chosen from a pool of
        `prompt_selection_pool` x k, each repeated num_generations times."""
        cfg, group_size = self.args, self.num_generations
        own = inputs[::group_size]
        k = len(own)
        if self._selection_stream is None:
            # + 2 on the seed: neither TRL's sampler order nor DAPO's stream.
            self._selection_stream = PromptStream(
                len(self.train_dataset), k, self.accelerator.num_processes, self.accelerator.process_index,
                seed=cfg.seed + 2, start=self.selection_batches_drawn,
            )
        candidates = list(own)
        for _ in range(cfg.prompt_selection_pool - 1):
            candidates += [self.train_dataset[i] for i in next(self._selection_stream)]
            self.selection_batches_drawn += 1
        # Tokenized exactly as TRL tokenizes for generation, left-padded.
        prompt_ids, prompt_mask = pad_sequences(self.tokenize_prompts([row["prompt"] for row in candidates]),
                                                self.processing_class.pad_token_id, left=True)
        with disable_gradient_checkpointing(self.model, cfg.gradient_checkpointing_kwargs):
            vectors = extract_prompt_vectors(self.model, prompt_ids, prompt_mask, self.probe_layer_index,
                                             cfg.per_device_train_batch_size, cfg.probe_pool_tokens)
        domains = None
        if cfg.probe_domain_column is not None:
            domains = [str(row.get(cfg.probe_domain_column, "default")) for row in candidates]
        predicted, _ = self.value_estimator.predict_prompts(vectors, domains)
        generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + self.state.global_step * 1_009
                                                  + self.accelerator.process_index)
        floor_count = min(k, math.ceil(cfg.prompt_selection_random_fraction * k))
        chosen, from_floor = select_prompts(predicted, k, floor_count, generator)
        self._step_floor = torch.tensor(from_floor)
        self._log_selection(predicted, chosen, len(candidates), int(prompt_mask.sum()))
        return [candidates[i] for i in chosen for _ in range(group_size)]

    def _log_selection(self, predicted: torch.Tensor, chosen: list[int], scored: int, prefill_tokens: int) -> None:
        scored_all, skipped_all, tokens_all = summed_over_processes(
            self.accelerator, [scored, scored - len(chosen), prefill_tokens])
        counts = self.selection_counts
        counts["candidates_scored"] += int(scored_all)
        counts["prompts_skipped"] += int(skipped_all)
        counts["prefill_tokens"] += int(tokens_all)
        # The prefill pass is compute spent on prompts: charged to the token budget as generated tokens.
        self.generated_tokens += int(tokens_all)
        self.pending_logs.update({f"selection/{name}": float(value) for name, value in counts.items()})
        scores = informativeness(predicted)
        self.log_metric("selection/informativeness_pool", scores.mean().item())
        self.log_metric("selection/informativeness_rolled_out", scores[chosen].mean().item())

    def _gather_features(self, features: RolloutFeatures) -> RolloutFeatures:
        if self.accelerator.num_processes == 1:
            return features
        parts = (features.prompt, features.response, features.entropy)
        return RolloutFeatures(*[self.accelerator.gather(t.to(self.accelerator.device)).cpu() for t in parts])

    # -- advantages -------------------------------------------------------------------------

    def compute_advantages(self, rewards, output):
        for name in FEATURE_SOURCES:
            self.log_metric(f"probe/features_from_{name}", float(name == self.round.feature_source))
        features = self._gather_features(self.round.features)
        group_size = self.num_generations
        rewards_cpu = rewards.detach().to("cpu", torch.float32)
        domains = self._domains()
        if self._step_floor is not None:
            self._log_selection_outcome(rewards_cpu, group_size)

        # The probe's order (docs/algorithms.md): predict with the previous fit, freeze, log, refit.
        predictions, available = self.value_estimator.predict(features, domains)
        available_groups = available.view(-1, group_size).all(dim=1).repeat_interleave(group_size)
        poise_adv, baselines = estimators.cross_rollout_advantages(
            rewards_cpu, torch.nan_to_num(predictions), group_size
        )
        rloo_adv = estimators.rloo_advantages(rewards_cpu, group_size)
        advantages = torch.where(available_groups, poise_adv, rloo_adv)
        baselines = torch.where(available_groups, baselines, rewards_cpu - rloo_adv)
        self._log_probe_step(predictions, available_groups, rewards_cpu, baselines, advantages, group_size)
        self.round.table_columns["baseline"] = baselines.tolist()
        refit_stats = self.value_estimator.update(features, rewards_cpu, group_size, domains)
        for name, value in refit_stats.items():
            self.log_metric(f"probe/{name}", value)
        return self.local_rows(advantages.to(rewards.device))

    def _log_selection_outcome(self, rewards: torch.Tensor, group_size: int) -> None:
        """Share of zero-signal groups (all rewards equal) among the prompts the probe chose and
        among the random floor's, in this step: the within-run control of what selection buys."""
        floor = self._step_floor.to(self.accelerator.device)
        floor = self.accelerator.gather(floor).cpu() if self.accelerator.num_processes > 1 else floor.cpu()
        grouped = rewards.view(-1, group_size)
        zero_signal = (grouped == grouped[:, :1]).all(dim=1)
        for name, rows in (("floor", floor), ("probe", ~floor)):
            if rows.any():
                self.log_metric(f"selection/zero_signal_{name}", zero_signal[rows].float().mean().item())

    def _domains(self) -> list[str] | None:
        column = self.args.probe_domain_column
        if column is None:
            return None
        local = [str(row.get(column, "default")) for row in self.round.inputs]
        return gather_object(local) if self.accelerator.num_processes > 1 else local

    def _log_probe_step(self, predictions, available, rewards, baselines, advantages, group_size) -> None:
        self.log_metric("probe/active_fraction", available.float().mean().item())
        # A == r - b must hold exactly: the baseline never leaks into anything else.
        self.log_metric("probe/invariant_max_abs_error", (advantages - (rewards - baselines)).abs().max().item())
        record = {"step": self.state.global_step, "probe_active": bool(available.any())}
        if available.any():
            targets = estimators.leave_one_out_targets(rewards, group_size)
            online = probe_metrics(*(t[available] for t in (predictions, targets, rewards, baselines)))
            for name, value in online.items():
                self.log_metric(f"probe/{name}", value)
            record.update(online, predictions=predictions[available].tolist(), targets=targets[available].tolist())
        else:
            vr = estimators.variance_reduction_ratio(rewards, baselines)
            self.log_metric("probe/variance_reduction", vr)
            record["variance_reduction"] = vr
        # Per task, over the rows the pooled figure covers; a task whose rewards there are all equal has nothing
        # to reduce and adds nothing (with a shared probe too: the task column is the data's, not the probe's).
        tasks = self.round.table_columns.get("task")
        counted = available if available.any() else torch.ones_like(available)
        for task in sorted(set(tasks or ())):
            rows = torch.tensor([name == task for name in tasks]) & counted
            if rewards[rows].var(unbiased=False) > 0:
                self.log_metric(f"probe/{task}/variance_reduction",
                                estimators.variance_reduction_ratio(rewards[rows], baselines[rows]))
        self.probe_history.append(record)

    # -- checkpoints ------------------------------------------------------------------------

    def save_side_state(self, checkpoint: Path) -> None:
        self.value_estimator.save(checkpoint)
        if self.args.prompt_selection:
            # Every process draws the same number of stream batches: one state file serves all.
            write_json(checkpoint / SELECTION_STATE_FILE,
                       {"batches_drawn": self.selection_batches_drawn, "counts": self.selection_counts})

    def load_side_state(self, checkpoint: Path) -> None:
        if not (checkpoint / PROBE_STATE_FILE).exists():
            raise FileNotFoundError(
                f"checkpoint {checkpoint} has no POISE probe state ({PROBE_STATE_FILE}): it was not written by "
                "POISETrainer, or was copied without it. Resuming would silently restart the probe; start a fresh "
                "run instead, or resume from a POISE checkpoint."
            )
        self.value_estimator = ProbeEstimator.load(checkpoint, device=self._probe_device())
        if self.args.prompt_selection:
            state_file = checkpoint / SELECTION_STATE_FILE
            if not state_file.exists():
                raise FileNotFoundError(
                    f"checkpoint {checkpoint} has no prompt-selection state ({SELECTION_STATE_FILE}): it was written "
                    "without prompt_selection. Resume it with prompt_selection: false, or start a fresh run.")
            state = json.loads(state_file.read_text())
            self.selection_batches_drawn, self.selection_counts = state["batches_drawn"], state["counts"]
            self._selection_stream = None


PROBE_HISTORY_FILE = "probe_history.json"


class POISETrainer(POISEProbe, ProcessRewardMixin, GRPOSeam):
    """GRPOTrainer whose baseline is a linear probe on the policy's own hidden states."""

    async_events = POISEProbe


class ProbeReport(RunCallback):
    """At the end of training: `probe_report.json` (per-round metrics, config, counters), `probe_values.png`.

    The history is checkpointed, so a resumed run's report covers all its rounds.
    """

    report: dict | None = None

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            write_json(checkpoint_folder(args.output_dir, state.global_step) / PROBE_HISTORY_FILE,
                       {"history": self.trainer.probe_history})

    def on_train_begin(self, args, state, control, **kwargs):
        if self.resume_from:
            self.restore(self.resume_from)

    def restore(self, checkpoint: str) -> None:
        path = Path(checkpoint) / PROBE_HISTORY_FILE
        if path.exists():
            self.trainer.probe_history = json.loads(path.read_text())["history"]
        else:
            warnings.warn(f"{checkpoint} has no {PROBE_HISTORY_FILE}: probe_report.json covers only the "
                          "rounds after it", stacklevel=2)

    def finish(self, args, state, control) -> None:
        self.restore(self.resume_from)  # the report a kill after the last checkpoint may have cut off
        self.on_train_end(args, state, control)

    def on_train_end(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        history = self.trainer.probe_history
        active = [h for h in history if h.get("probe_active")]
        keys = ("mae", "rmse", "pearson", "brier_skill", "pairwise_sign_acc", "variance_reduction")
        estimator = self.trainer.value_estimator
        self.report = {
            "rounds": len(history),
            "probe_active_rounds": len(active),
            "online_mean_after_bootstrap": {k: mean_or_none([h[k] for h in active if k in h]) for k in keys},
            "per_round": [{k: v for k, v in h.items() if k not in ("predictions", "targets")}
                          for h in history],
            "probe_config": estimator.config,
            "probe_layer_index": self.trainer.probe_layer_index,
            "refit_count": estimator.refit_count,
            "calibration": calibration_bins(active),
            "trainer_config": args.to_dict(),
            "versions": package_versions(),
        }
        out = Path(self.output_dir)
        write_json(out / "probe_report.json", self.report)
        if active:
            plot_predicted_vs_realized(self.report["calibration"], active, out / "probe_values.png")

    def closing_note(self) -> str | None:
        if self.report is None or self.report["probe_active_rounds"]:
            return None
        return (f"note: POISE's probe gave no baseline in this run's {self.report['rounds']} rounds (it was fitted "
                f"{self.report['refit_count']} times): every advantage came from the RLOO bootstrap. Train more "
                f"than probe_bootstrap_steps={self.trainer.args.probe_bootstrap_steps} steps, or lower it")

    def summary(self) -> dict:
        if self.report is None:
            return {}
        keys = ("rounds", "probe_active_rounds", "online_mean_after_bootstrap")
        return {"probe": {k: self.report[k] for k in keys}}


def plot_predicted_vs_realized(calibration: list[dict], records: list[dict], path) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    xs = [c["mean_predicted"] for c in calibration]
    ys = [c["mean_realized"] for c in calibration]
    left.plot([0, 1], [0, 1], "k--", lw=1, label="calibrated")
    left.plot(xs, ys, "o-", label="probe")
    for x, y, c in zip(xs, ys, calibration, strict=True):
        left.annotate(str(c["count"]), (x, y), textcoords="offset points", xytext=(0, 6), fontsize=7,
                      ha="center")
    left.set(xlabel="probe prediction (out of sample, binned)", ylabel="mean realized reward",
             title="POISE probe: predicted vs realized", xlim=(0, 1), ylim=(0, 1))
    left.legend()
    steps = [r["step"] for r in records]
    right.plot(steps, [r["mae"] for r in records], label="online MAE")
    right.plot(steps, [r["variance_reduction"] for r in records], label="variance reduction")
    right.set(xlabel="step", title="probe quality over training")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def probe_signal(key: str):
    # the probe's metrics exist only where it gave the baselines (its MAE is logged only then)
    return lambda entry: entry.get(key) if entry.get("probe/mae") is not None else None


register_algorithm(
    "poise", POISEConfig, POISETrainer, "POISE", "2 rollouts, cross-rollout baseline from a hidden-state probe",
    card="POISE: 2 rollouts per prompt, each rollout's baseline predicted by a linear probe on the policy's hidden "
         "states and entropies from the other rollout",
    min_generations_reason="each rollout's baseline comes from another rollout of the same prompt",
    callbacks=(ProbeReport,), run_files=("probe_report.json", "probe_values.png"),
    # one probe and buffer per task, as POISE's official code keeps one per domain (null: one shared probe)
    task_mix_settings={"probe_domain_column": "task"},
    signals={"probe/variance_reduction": Signal("POISE variance reduction", "POISE VR",
                                                 probe_signal("probe/variance_reduction")),
             "probe/mae": Signal("POISE probe MAE", "probe MAE", logged("probe/mae"))},
    compare_tables=(CompareTable("selection", "prompt selection (means over seeds: counters at the end, "
                                 "shares over training)", {
        "selection/candidates_scored": ("candidates scored", "last"),
        "selection/prompts_skipped": ("prompts skipped", "last"),
        "selection/prefill_tokens": ("prefill tokens", "last"),
        "selection/zero_signal_probe": ("zero-signal (probe's picks)", "mean"),
        "selection/zero_signal_floor": ("zero-signal (random floor)", "mean"),
        "selection/informativeness_pool": ("p(1-p) pool", "mean"),
        "selection/informativeness_rolled_out": ("p(1-p) rolled out", "mean")}),),
)
