"""The seam to TRL's `GRPOTrainer`: one generation round becomes named events an algorithm implements.

A training round, in order (`_generate_and_score_completions`, which TRL's `_prepare_inputs` calls every
`steps_per_generation * num_iterations` micro-steps, before its shuffle):

1. `select_round_prompts(inputs) -> inputs`: which prompts to roll out (POISE's probe-guided selection).
2. `collect_round(inputs) -> output`: by default one `score_round(inputs)`; DAPO's dynamic sampling calls
   it again on fresh prompts and merges the kept groups.
   `score_round` runs TRL's generation, rewards and metrics (whatever its rollout mode: single turn,
   `tools=`, `environment_factory=`, `rollout_func=`), with `self.round` (a `Round`) filled on the way:
   the inputs, the gathered rewards per function, completion lengths, tasks and, when the algorithm
   declares a `feature_need`, the policy's features of each rollout. Then
   `compute_advantages(rewards, output)` (None keeps TRL's group-normalized ones), logged, and the row of
   the completion table.
3. `finish_round(output, inputs) -> output`: after all rounds (process rewards add to the advantages).

In the loss, `policy_loss(model, inputs)` (default: TRL's; `trl_loss` runs TRL's with another KL coefficient
and returns the forward it made). Features come, in this order of preference, from TRL's own no-grad pass
(when it runs one), from the generate call (transformers generation of one turn), or from one extra chunked
pass; `feature_sources` counts each round's source.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from accelerate.utils import gather_object
from trl import GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing

from poise_trl.core.completions import per_completion_advantages
from poise_trl.core.distributed import summed_over_processes
from poise_trl.probe.capture import CaptureUnavailable, GenerationCapture, HiddenStateCapture
from poise_trl.probe.features import RolloutFeatures, build_rollout_features, policy_span
from poise_trl.seam.trainer import TrainerSeam

FEATURE_SOURCES = ("trl_pass", "generation", "extra_pass")


@dataclass(frozen=True)
class FeatureNeed:
    """What an algorithm reads from the policy every training round: the output of decoder block `layer`,
    pooled over the last `pool_tokens` prompt tokens and the last `pool_tokens` response tokens of each policy
    turn in `span` ending at its last `think_end_id` (-1: the turn's end), and the token entropies of the
    policy's own tokens in `span` (`probe.features`; tool results are never read)."""

    layer: int
    pool_tokens: int
    think_end_id: int
    span: str = "last_turn"  # or "all_turns" (FEATURE_SPANS)


@dataclass
class Round:
    """What the seam keeps of one generation round, for the algorithm's events."""

    inputs: list[dict]  # this process's rows, after prompt selection
    rewards_per_func: torch.Tensor | None = None  # (B_global, n_reward_functions), in generation order
    weighted_rewards: torch.Tensor | None = None  # (B_global,): the reward functions' weighted sum, None as 0
    rewards: list[float] = field(default_factory=list)  # the weighted reward TRL logs, all processes' rows
    completion_lengths: torch.Tensor | None = None  # (B_global,)
    features: RolloutFeatures | None = None  # this process's rows, when the algorithm declares a feature_need
    feature_source: str | None = None
    table_columns: dict[str, list] = field(default_factory=dict)  # extra completion-table columns, all rows


def into_trl_table(trl_logs: dict, advantages: Sequence[float], columns: dict[str, Sequence]) -> None:
    """`trl_logs` is a GRPOTrainer's `_logs`, to which TRL has just appended a round's prompts, completions and
    its own advantages: those become `advantages`, and `columns` (task, baseline) extra columns of the table."""
    for _ in advantages:
        trl_logs["advantages"].pop()
    trl_logs["advantages"].extend(advantages)
    for name, values in columns.items():
        trl_logs["extra"][name].extend(values)


class GRPOSeam(TrainerSeam, GRPOTrainer):
    """TRL's GRPOTrainer with exact global counts of the completion tokens and rollouts generated (every
    round, DAPO's dropped ones included) and the round events of the module docstring."""

    feature_need: FeatureNeed | None = None  # set by an algorithm that reads the policy's features
    async_events: type | None = None  # the class of its events that run off-policy (`seam.async_grpo`)
    off_policy_refusal = "it names no events that run off-policy (`async_events`)"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.init_counters()
        self.round: Round | None = None
        self.feature_sources = dict.fromkeys(FEATURE_SOURCES, 0)  # generation rounds per feature source
        self.generation_capture_blocker = self._generation_capture_blocked_by()
        self._features_in_pass = False  # the next no-grad policy pass reads the features
        self._capture_generation = False  # the next generate call reads the features
        self._pass_features: RolloutFeatures | None = None
        self._tool_mask: list[list[int]] | None = None  # this round's, from TRL's `_generate` (1: the policy's)
        self._generation_capture: GenerationCapture | None = None
        self._fallback_warned: set[str] = set()
        self._keep_loss_forward = False
        self._loss_forward = None

    # -- events (algorithms override these) ------------------------------------------------------

    def select_round_prompts(self, inputs: list[dict]) -> list[dict]:
        return inputs

    def collect_round(self, inputs: list[dict]) -> dict:
        return self.score_round(inputs)

    def compute_advantages(self, rewards: torch.Tensor, output: dict) -> torch.Tensor | None:
        """Advantages for this process's rows, (B_local,) or (B_local, T), from all rows' rewards (B_global,) in
        generation order (consecutive runs of `num_generations` rows share a prompt); None keeps TRL's."""
        return None

    def finish_round(self, output: dict, inputs: list[dict]) -> dict:
        return output

    def policy_loss(self, model, inputs: dict) -> torch.Tensor:
        return self.trl_loss(model, inputs)[0]

    # -- helpers (algorithms call these) ---------------------------------------------------------

    def score_round(self, inputs: list[dict]) -> dict:
        """One TRL generation round on `inputs` with this algorithm's advantages (see the module docstring)."""
        self.round = Round(inputs)
        self._arm_feature_capture()
        output = super()._generate_and_score_completions(inputs)
        if self.feature_need is not None:
            self.round.features, self.round.feature_source = self.round_features(output)
        advantages = self.compute_advantages(self.round.weighted_rewards, output)
        if advantages is not None:
            self.log_advantages(advantages, output["completion_mask"])
            output["advantages"] = advantages
        if self.completion_table is not None:
            self._record_completions(output)
        return output

    def trl_loss(self, model, inputs: dict, beta: float | None = None) -> tuple[torch.Tensor, tuple]:
        """TRL's policy loss on this micro-batch (with KL coefficient `beta` instead of the config's, when given),
        and the (log-probs, entropies, aux) of the grad-carrying forward pass it made."""
        config_beta = self.beta
        self.beta = config_beta if beta is None else beta
        self._keep_loss_forward = True
        try:
            loss = super()._compute_loss(model, inputs)
        finally:
            self.beta, self._keep_loss_forward = config_beta, False
        forward, self._loss_forward = self._loss_forward, None
        return loss, forward

    def aggregate_like_trl(self, per_token: torch.Tensor, mask: torch.Tensor, inputs: dict) -> torch.Tensor:
        """TRL 1.16's reduction of `per_token_loss` for `self.loss_type` (grpo_trainer.py, `_compute_loss`),
        including its gradient-accumulation scaling, so an extra per-token term enters the loss
        exactly as TRL's own KL term would."""
        accumulation = self.current_gradient_accumulation_steps if self.model.training else 1.0
        mask = mask.to(per_token.dtype)
        if self.loss_type in ("grpo", "sapo"):
            return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / accumulation
        if self.loss_type == "bnpo":
            return (per_token * mask).sum() / mask.sum().clamp(min=1.0) / accumulation
        if self.loss_type == "dr_grpo":
            return (per_token * mask).sum() / (per_token.size(0) * self.max_completion_length) / accumulation
        if self.loss_type in ("cispo", "dapo", "vespo"):
            normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if self.model.training:
                normalizer = normalizer * self.current_gradient_accumulation_steps / self.args.steps_per_generation
            return (per_token * mask).sum() / normalizer
        if self.loss_type == "luspo":
            return (per_token * mask).sum(-1).mean() / accumulation
        raise ValueError(f"Unknown loss type: {self.loss_type}")

    def old_policy_logps(self, output: dict) -> torch.Tensor:
        """log pi_old of the sampled tokens: TRL's when it computed them, else one chunked no-grad pass."""
        if output.get("old_per_token_logps") is not None:
            return output["old_per_token_logps"]
        return self._no_grad_policy_pass(output)[0]

    def disable_trl_entropy_bonus(self) -> None:
        """An algorithm that adds its own entropy term (AsyPPO's filtered one) in place of TRL's."""
        self._entropy_bonus_enabled = False

    def tokenize_prompts(self, prompts: list) -> list[list[int]]:
        """Token ids of prompts, as TRL tokenizes them for generation (chat template included)."""
        return self._tokenize_prompts(prompts)[0]

    def push_weights_to_engine(self) -> None:
        """Give the colocated vLLM engine this step's weights, once per step (as TRL does before generating)."""
        if self._last_loaded_step != self.state.global_step:
            self.vllm_generation.sync_weights()
            self._last_loaded_step = self.state.global_step

    def local_rows(self, global_tensor: torch.Tensor) -> torch.Tensor:
        """This process's slice of a tensor gathered over processes (TRL's process_slice)."""
        n_local = global_tensor.shape[0] // self.accelerator.num_processes
        start = self.accelerator.process_index * n_local
        return global_tensor[start : start + n_local]

    def check_groups_stay_on_one_process(self, consequence: str) -> None:
        """Whole prompt groups must be generated on one process (rows of a group are consecutive)."""
        rows = self.args.per_device_train_batch_size * self.args.steps_per_generation
        if rows % self.num_generations:
            raise ValueError(
                f"each process generates {rows} rows per round (per_device_train_batch_size x steps_per_generation), "
                f"not a multiple of num_generations={self.num_generations}: {consequence}. "
                "Make it a multiple of num_generations."
            )

    def log_advantages(self, advantages: torch.Tensor, completion_mask: torch.Tensor) -> None:
        # Per-token advantages select a different number of tokens on each rank: gather sums,
        # which have one shape everywhere, not the ragged selections.
        values = advantages.float() if advantages.dim() == 1 else advantages[completion_mask.bool()].float()
        stats = torch.stack([values.new_tensor(float(values.numel())), values.sum(), values.pow(2).sum()])
        count, total, squares = summed_over_processes(self.accelerator, stats)
        mean = total / max(count, 1.0)
        variance = (squares - count * mean**2) / (count - 1) if count > 1 else 0.0
        self.log_metric("advantages/mean", mean)
        self.log_metric("advantages/std", max(variance, 0.0) ** 0.5)

    # -- features ------------------------------------------------------------------------------

    def trl_runs_no_grad_pass(self) -> bool:
        """Mirrors TRL's condition for computing `old_per_token_logps` (grpo_trainer.py)."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        return self.args.gradient_accumulation_steps % generate_every != 0 or (
            self.use_vllm and self.vllm_importance_sampling_correction
        )

    def _generation_capture_blocked_by(self) -> str | None:
        """Why this run cannot read the features while TRL generates (None: it can)."""
        if self.use_vllm:
            return "vLLM generates the completions"
        if self.use_transformers_continuous_batching:
            return "transformers continuous batching generates the completions"
        if self.rollout_func is not None or self.tools or self.environment_factories is not None:
            return ("a rollout function or tool calls build the completions from several generate calls, each "
                    "fed the previous turns and tool results as its prompt")
        if self._is_vlm:
            return "a vision-language model"
        if self.is_fsdp_enabled or self.is_deepspeed_enabled:
            return "sharded weights: the closing decode step would run outside TRL's gathering context"
        return None

    def _arm_feature_capture(self) -> None:
        need = self.feature_need is not None
        self._pass_features = self._generation_capture = None
        self._features_in_pass = need and self.trl_runs_no_grad_pass()
        self._capture_generation = need and not self._features_in_pass and self.generation_capture_blocker is None

    def round_features(self, output: dict) -> tuple[RolloutFeatures, str]:
        """This round's features: from TRL's own no-grad pass, from its generate call, or from one chunked pass."""
        features, source = self._pass_features, "trl_pass"
        if features is None and self._generation_capture is not None:
            try:
                features = self._generation_capture.features(output["completion_ids"], output["completion_mask"])
                source = "generation"
            except CaptureUnavailable as reason:
                self._warn_fallback(str(reason))
        elif features is None and self.generation_capture_blocker is not None:
            self._warn_fallback(self.generation_capture_blocker)
        if features is None:
            self._features_in_pass = True
            self._no_grad_policy_pass(output)
            features, source = self._pass_features, "extra_pass"
        self._pass_features = self._generation_capture = None
        self._features_in_pass = self._capture_generation = False
        self.feature_sources[source] += 1
        return features, source

    def _warn_fallback(self, reason: str) -> None:
        if reason not in self._fallback_warned:
            self._fallback_warned.add(reason)
            warnings.warn(f"features: {reason}; running one extra policy pass per round instead", stacklevel=2)

    def _no_grad_policy_pass(self, output: dict) -> tuple:
        """One chunked no-grad policy pass over prompt + completion (the feature hooks ride on it when armed)."""
        ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            return self._get_per_token_logps_and_entropies(
                self.model, ids, mask, output["completion_ids"].size(1),
                batch_size=self.args.per_device_train_batch_size,
            )

    # -- TRL's private methods -------------------------------------------------------------------

    def _generate_and_score_completions(self, inputs):
        if not self.model.training:
            self.round = Round(inputs)
            return super()._generate_and_score_completions(inputs)
        inputs = self.select_round_prompts(inputs)
        return self.finish_round(self.collect_round(inputs), inputs)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        # Called once per generation round, after truncation at EOS.
        lengths = [len(ids) for ids in completion_ids_list]
        if self.model.training:
            tokens, rollouts = summed_over_processes(self.accelerator, [sum(lengths), len(lengths)])
            self.generated_tokens += int(tokens)
            self.generated_rollouts += int(rollouts)
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if self.round is None:  # called outside a round (TRL calls it inside one; tests call it alone)
            self.round = Round(inputs)
        record = self.round
        record.rewards_per_func = rewards_per_func
        record.completion_lengths = self.accelerator.gather(torch.tensor(lengths, device=self.accelerator.device))
        weights = self.reward_weights.to(rewards_per_func.device).unsqueeze(0)
        record.weighted_rewards = (rewards_per_func * weights).nansum(dim=1)
        unscored = torch.isnan(rewards_per_func).all(dim=1)  # every function said None: logged as NaN
        record.rewards = torch.where(unscored, torch.nan, record.weighted_rewards).tolist()
        if "task" in inputs[0]:
            tasks = gather_object([row["task"] for row in inputs])
            self.log_task_rewards(tasks, record.rewards)
            record.table_columns["task"] = tasks
        return rewards_per_func

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                           batch_size=None, compute_entropy=False, **kwargs):
        # Forward passes of the policy, with and without grad: how POISE shows that its features
        # ride on a pass every algorithm makes.
        if model is self.model:
            self.policy_forward_passes += 1
        if self._features_in_pass and model is self.model and not torch.is_grad_enabled():
            self._features_in_pass = False  # one capture per round: later passes (reference) are not read
            return self._pass_with_features(model, input_ids, attention_mask, logits_to_keep, batch_size,
                                            compute_entropy, **kwargs)
        out = super()._get_per_token_logps_and_entropies(  # by keyword: TRL 1.14 takes them so only
            model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size, compute_entropy=compute_entropy,
            **kwargs)
        if self._keep_loss_forward and torch.is_grad_enabled():  # the loss's own forward, armed by trl_loss
            self._loss_forward, self._keep_loss_forward = out, False
        return out

    def _pass_with_features(self, model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                            **kwargs):
        need = self.feature_need
        completion_ids = input_ids[:, -logits_to_keep:]
        completion_mask = self._policy_span(attention_mask[:, -logits_to_keep:], need.span)
        with HiddenStateCapture(self.accelerator.unwrap_model(model), [need.layer], need.pool_tokens) as capture:
            capture.set_batch(attention_mask[:, :-logits_to_keep], completion_ids, completion_mask, need.think_end_id)
            with capture.capturing():
                logps, entropies, aux = super()._get_per_token_logps_and_entropies(
                    model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size, compute_entropy=True,
                    **kwargs)
            prompt_vec, response_vec = capture.pop()[need.layer]
        self._pass_features = build_rollout_features(
            prompt_vec, response_vec, entropies, completion_ids, completion_mask, need.think_end_id)
        return logps, entropies if compute_entropy else None, aux

    def _policy_span(self, completion_mask: torch.Tensor, span: str) -> torch.Tensor:
        """The tokens of this round's completions the features read: TRL's `tool_mask` (tool results 0, as in
        its loss) padded as TRL pads it, then the span (`probe.features.policy_span`)."""
        tool_mask = None
        if self._tool_mask is not None:
            tool_mask = torch.ones_like(completion_mask)
            for row, own in enumerate(self._tool_mask):
                tool_mask[row, : len(own)] = torch.tensor(own[: tool_mask.shape[1]])
        return policy_span(completion_mask, tool_mask, span)

    def _generate(self, prompts):
        out = super()._generate(prompts)
        self._tool_mask = out[2]  # TRL 1.16: tool_mask (or a rollout function's env_mask) is the third
        return out

    def _generate_single_turn(self, *args, **kwargs):
        if not self._capture_generation:
            return super()._generate_single_turn(*args, **kwargs)
        self._capture_generation = False  # one generate call per round in this path
        need = self.feature_need
        with GenerationCapture(self.accelerator.unwrap_model(self.model), need.layer, self.stop_token_ids,
                               need.think_end_id, self.temperature, need.pool_tokens) as capture:
            completion_ids, logprobs = super()._generate_single_turn(*args, **kwargs)
            with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
                capture.finish(completion_ids, self._tokenizer.pad_token_id)
        self._generation_capture = capture
        return completion_ids, logprobs

    def _compute_loss(self, model, inputs):
        return self.policy_loss(model, inputs)

    def _record_completions(self, output: dict) -> None:
        local = per_completion_advantages(output["advantages"], output["completion_mask"])
        advantages = self.accelerator.gather(local).tolist()
        n = len(advantages)  # TRL has just appended this round's gathered prompts and completions to `_logs`
        prompts, completions = list(self._logs["prompt"])[-n:], list(self._logs["completion"])[-n:]
        into_trl_table(self._logs, advantages, self.round.table_columns)
        self.completion_table.add_round(self.state.global_step + 1, prompts, completions, self.round.rewards,
                                        advantages, self.round.table_columns)
