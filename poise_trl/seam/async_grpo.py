"""The seam to TRL's experimental `AsyncGRPOTrainer` (docs/trl.md, "AsyncGRPOTrainer"): what it needs to run
on a machine without CUDA.

- `tree_attention`: TRL's packed-trie attention (`tree_fa3`, a FlashAttention-3 kernel from the hub, Hopper
  only) in plain torch where the tensors are not on CUDA, registered over TRL's while a trainer is built.
- `FileWeightTransfer`: TRL's `WeightTransferProtocol` through the safetensors file the server's workers
  reload (`seam.vllm`), naming the policy version the server then serves.
- `ServerVersionWorker`: TRL's rollout worker whose samples carry, beside TRL's `model_version` (the version
  the worker asked for), the version the server served when the rollout was scored.
- `AsyncGRPOSeam`: TRL's `AsyncGRPOTrainer` on these, with the counters and side state of `TrainerSeam` and
  the round events of `seam.grpo` that run off-policy: `RoundQueue` hands each optimizer step's prompt
  groups, whole, to `compute_advantages` (rewards, and the features `feature_need` asks for read by the
  trainer's current policy) before TRL's batcher splits them. An algorithm's trainer names the class that
  holds those events (`async_events`); `async_trainer_class` puts it on this seam.
"""

from __future__ import annotations

import dataclasses
import queue
import shutil
import tempfile
import threading
import warnings
from collections import deque
from contextlib import contextmanager
from pathlib import Path

import requests
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from trl.experimental.async_grpo import AsyncGRPOConfig
from trl.experimental.async_grpo import async_grpo_trainer as trainer_module
from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker, _AsyncRolloutLoop
from trl.experimental.async_grpo.packing import TREE_ATTENTION
from trl.experimental.async_grpo.packing import tree_attention as kernel_tree_attention

from poise_trl.engines.vllm_server import WEIGHTS_FILE, ServerFault
from poise_trl.probe.capture import HiddenStateCapture
from poise_trl.probe.features import build_rollout_features
from poise_trl.seam.grpo import FEATURE_SOURCES, FeatureNeed, Round
from poise_trl.seam.trainer import TrainerSeam
from poise_trl.seam.vllm import push_weights_through_file, require_weight_reload

SERVER_VERSION = "rollout/server_policy_version"
STOP_SECONDS = 30.0  # TRL's stop waits 15 s for its child to exit, then 5 s after terminating it


def tree_attention(module, query, key, value, attention_mask, *, tree_kv_index=None, tree_cu_seqlens_q=None,
                   tree_cu_seqlens_k=None, tree_max_seqlen_q=None, tree_max_seqlen_k=None, scaling=None,
                   sliding_window=None, softcap=None, **kwargs):
    """TRL's `packing.tree_attention` on CUDA; elsewhere the same varlen causal attention in torch, and
    transformers' SDPA for padded batches (generation, the feature pass), which come without a tree.

    Segment s holds query rows q0:q1 of the packed row and attends to the keys of its root-to-segment path,
    `tree_kv_index[k0:k1]`, whose last q1 - q0 entries are the segment itself: query i sees path keys
    j <= i + (k1 - k0) - (q1 - q0) (FlashAttention's bottom-right causal alignment), and with a sliding window
    of w only the last w of them.
    """
    if tree_kv_index is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      sliding_window=sliding_window, softcap=softcap, **kwargs)
    if query.device.type == "cuda":
        return kernel_tree_attention(
            module, query, key, value, attention_mask, tree_kv_index=tree_kv_index,
            tree_cu_seqlens_q=tree_cu_seqlens_q, tree_cu_seqlens_k=tree_cu_seqlens_k,
            tree_max_seqlen_q=tree_max_seqlen_q, tree_max_seqlen_k=tree_max_seqlen_k, scaling=scaling,
            sliding_window=sliding_window, softcap=softcap, **kwargs)
    q = query[0]  # (H_q, N, D)
    groups = q.shape[0] // key.shape[1]  # grouped-query attention: each key head serves `groups` query heads
    k = key[0].index_select(1, tree_kv_index).repeat_interleave(groups, dim=0)  # (H_q, K, D)
    v = value[0].index_select(1, tree_kv_index).repeat_interleave(groups, dim=0)
    scale = q.shape[-1] ** -0.5 if scaling is None else scaling
    out = torch.empty_like(q)
    bounds = zip(tree_cu_seqlens_q.tolist(), tree_cu_seqlens_q[1:].tolist(),
                 tree_cu_seqlens_k.tolist(), tree_cu_seqlens_k[1:].tolist(), strict=False)
    for q0, q1, k0, k1 in bounds:
        scores = q[:, q0:q1] @ k[:, k0:k1].transpose(-1, -2) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        i = torch.arange(q1 - q0, device=q.device)[:, None] + (k1 - k0) - (q1 - q0)
        j = torch.arange(k1 - k0, device=q.device)[None, :]
        visible = (j <= i) & (j > i - sliding_window) if sliding_window else j <= i
        weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[:, q0:q1] = weights.to(v.dtype) @ v[:, k0:k1]
    return out.transpose(0, 1).unsqueeze(0), None  # (1, N, H_q, D), as the kernel returns it


class FileWeightTransfer:
    """TRL's `WeightTransferProtocol` without NCCL: pause the server, write the weights to one file its workers
    reload (`engines.vllm_server.WeightReload`, which keeps the policy version it is told), resume. Server and
    trainer share a file system."""

    def __init__(self, base_url: str, timeout: float, reload_timeout: float):
        self.base_url, self.timeout, self.reload_timeout = base_url, timeout, reload_timeout
        self.next_version = lambda: None  # the version being sent: set by the trainer

    def init_weight_transfer(self) -> None:
        from trl.generation.vllm_client import VLLMClient  # noqa: PLC0415 (imports vLLM)

        self.client = VLLMClient(base_url=self.base_url, connection_timeout=self.timeout)
        require_weight_reload(self.client)
        self.folder = Path(tempfile.mkdtemp(prefix="poise-vllm-weights-"))

    # pause and resume are tried once, like the reload (`seam.vllm.collective_rpc`): a server that refuses the
    # connection is gone, and retrying it for a minute only delays the error line.
    def pause(self) -> None:  # "keep": requests in flight finish on the new weights, as with TRL's NCCL sync
        requests.post(f"{self.base_url}/pause", params={"mode": "keep"}, timeout=self.timeout).raise_for_status()

    def send_weights(self, iterator) -> None:
        weights = {name: tensor.detach().to("cpu").contiguous().clone() for name, tensor in iterator}
        try:
            push_weights_through_file(self.client, weights, self.folder / WEIGHTS_FILE, self.next_version(),
                                      timeout=self.reload_timeout)
        except requests.Timeout:
            raise ServerFault(f"the vLLM server at {self.base_url} did not load the new weights in "
                              f"{self.reload_timeout:.0f} s (weight_sync_timeout): raise weight_sync_timeout, or "
                              "see what the server's output says") from None

    def resume(self) -> None:
        requests.post(f"{self.base_url}/resume", timeout=self.timeout).raise_for_status()

    def destroy(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


class ServerVersionLoop(_AsyncRolloutLoop):
    """TRL's rollout loop (in its spawned process) that asks the server which policy version it serves when a
    group is scored: a rollout whose generation spanned a sync finished on that version."""

    async def _score_group(self, group):
        samples = await super()._score_group(group)
        results = await self._post("/collective_rpc", {"method": "served_policy_version", "args": []},
                                   self.request_timeout)
        served = results["results"][0]
        for sample in samples:
            sample.metrics[SERVER_VERSION] = float("nan") if served is None else float(served)
        return samples


class StoppableWorker(AsyncRolloutWorker):
    """TRL's rollout worker, whose `stop` also returns when its child process has died (its server gone, or its
    own error): TRL's stop sets a multiprocessing Event the dead child's watcher thread was waiting on, and
    `Event.set` then waits forever for that waiter to wake. So TRL's stop runs in a thread given its own
    join timeouts and a margin; past them the child is killed and the thread left behind."""

    def stop(self) -> None:
        process = self._process
        if process is None:
            return
        if process.exitcode is None:
            stopping = threading.Thread(target=AsyncRolloutWorker.stop, args=(self,), daemon=True)
            stopping.start()
            stopping.join(timeout=STOP_SECONDS)
            if not stopping.is_alive():
                return
            process.kill()
        process.join()
        self._process = None


class ServerVersionWorker(StoppableWorker):
    _loop_cls = ServerVersionLoop


@contextmanager
def cpu_ready_construction():
    """While an `AsyncGRPOTrainer` is built: TRL registers its kernel-only `tree_fa3` (with no mask: a padded
    batch would see its padding), asks CUDA for the device's peak FLOPs (an AssertionError on a CPU build of
    torch) and builds `AsyncRolloutWorker` by its module name. This registers `tree_attention` and SDPA's mask
    (packed rows ignore it; padded ones, in generation and the feature pass, need it) after TRL's, and off
    CUDA reports no peak (MFU unlogged) and builds `ServerVersionWorker` (its server reloads weights from a
    file and keeps their version), on CUDA `StoppableWorker`."""
    register, peak = trainer_module.register_tree_attention, trainer_module.get_peak_flops_per_device
    cpu = not torch.cuda.is_available()

    def register_then_ours():
        register()
        AttentionInterface.register(TREE_ATTENTION, tree_attention)
        AttentionMaskInterface.register(TREE_ATTENTION, sdpa_mask)

    trainer_module.register_tree_attention = register_then_ours
    trainer_module.get_peak_flops_per_device = lambda accelerator, dtype: (
        peak(accelerator, dtype) if accelerator.device.type == "cuda" else None)
    trainer_module.AsyncRolloutWorker = ServerVersionWorker if cpu else StoppableWorker
    try:
        yield
    finally:
        trainer_module.register_tree_attention, trainer_module.get_peak_flops_per_device = register, peak
        trainer_module.AsyncRolloutWorker = AsyncRolloutWorker


class RoundQueue:
    """The `rollout_queue` TRL's `RolloutQueueDataset` reads, on the main process: samples of the worker's queue
    gathered into whole prompt groups, groups older than `max_staleness` dropped, and each step's groups
    given the algorithm's advantages (`AsyncGRPOSeam.score_groups`) with the policy that trains on them."""

    def __init__(self, source, trainer: AsyncGRPOSeam, groups_per_round: int):
        self.source, self.trainer, self.groups_per_round = source, trainer, groups_per_round
        self.open: dict[int, list] = {}  # group id -> its samples so far
        self.whole: list[list] = []  # groups of the round being gathered
        self.ready: deque = deque()
        self.dropped = 0  # rollouts older than max_staleness

    def get(self, timeout: float | None = None):
        while not self.ready:
            try:
                sample = self.source.get(timeout=timeout)
            except queue.Empty:  # TRL would check only its worker's heartbeat, and ask again
                self.trainer.check_rollouts()
                raise
            group = self.open.setdefault(sample.group_id, [])
            group.append(sample)
            if len(group) < self.trainer.num_generations:
                continue
            del self.open[sample.group_id]
            self.trainer.generated_rollouts += len(group)  # the budget counts dropped rollouts too
            self.trainer.generated_tokens += sum(int(member.completion_mask.sum()) for member in group)
            staleness = self.trainer.model_version - sample.model_version
            if staleness > self.trainer.args.max_staleness:
                self.trainer.log_metric("sample/dropped_stale_total", float(len(group)))
                if not self.dropped:
                    warnings.warn(f"async: dropped a group generated {staleness} policy versions before the one "
                                  f"training (max_staleness {self.trainer.args.max_staleness}); dropped rollouts "
                                  "count against the budget (sample/dropped_stale_total): raise max_staleness to "
                                  "train on them", stacklevel=2)
                self.dropped += len(group)
                continue
            self.whole.append(group)
            if len(self.whole) == self.groups_per_round:
                self.ready.extend(self.trainer.score_groups(self.whole))
                self.whole = []
        return self.ready.popleft()

    def put_nowait(self, sample) -> None:
        self.source.put_nowait(sample)

    def qsize(self) -> int:
        return len(self.ready) + self.source.qsize()


class AsyncGRPOSeam(TrainerSeam, trainer_module.AsyncGRPOTrainer):
    """TRL's AsyncGRPOTrainer that runs where there is no CUDA (weights through a file when no GPU can reach
    the server over NCCL), with the `TrainerSeam` counters and the off-policy round events."""

    feature_need: FeatureNeed | None = None

    def __init__(self, *args, weight_transfer=None, **kwargs):
        config = kwargs["args"]
        if weight_transfer is None and not torch.cuda.is_available():
            weight_transfer = FileWeightTransfer(config.vllm_server_base_url, config.vllm_server_timeout,
                                                 config.weight_sync_timeout)
        with cpu_ready_construction():
            super().__init__(*args, weight_transfer=weight_transfer, **kwargs)
        if isinstance(weight_transfer, FileWeightTransfer):
            weight_transfer.next_version = lambda: self.model_version + 1
        self.init_counters()
        self.num_generations = self.args.num_generations
        self.round: Round | None = None
        self.feature_sources = dict.fromkeys(FEATURE_SOURCES, 0)
        if self.accelerator.is_main_process:
            samples_per_step = self.args.per_device_train_batch_size * self.args.gradient_accumulation_steps
            self.rollout_queue = RoundQueue(self.rollout_queue, self, samples_per_step // self.num_generations)

    # -- events (the algorithm's `async_events` override these) ----------------------------------

    def compute_advantages(self, rewards: torch.Tensor, output: dict) -> torch.Tensor | None:
        """As `GRPOSeam.compute_advantages` (rows of a group consecutive); None keeps the worker's (TRL's async
        GRPO: group mean over the population std + 1e-8)."""
        return None

    # -- helpers ---------------------------------------------------------------------------------

    def check_rollouts(self) -> None:
        """While no rollout arrives: the server must answer (else requests' error, which `poise train` turns
        into one line), and TRL's worker must be alive and not hung (else a `ServerFault` naming its error)."""
        requests.get(f"{self.args.vllm_server_base_url}/health",
                     timeout=self.args.vllm_server_timeout).raise_for_status()  # 503: its engine died
        try:
            self.rollout_worker.check_health(self.args.heartbeat_stale_after_s)
        except RuntimeError as exc:  # TRL chains the worker's own error, its traceback after the first line
            cause = str(exc.__cause__ or exc).splitlines()[0]
            raise ServerFault(f"the rollout worker stopped ({cause}) while the vLLM server at "
                              f"{self.args.vllm_server_base_url} answers: fix what it says") from None

    def local_rows(self, global_tensor: torch.Tensor) -> torch.Tensor:
        return global_tensor  # the main process scores every row; TRL's dispatcher splits the batches

    def check_groups_stay_on_one_process(self, consequence: str) -> None:
        """Groups are scored whole on the main process."""

    def score_groups(self, groups: list[list]) -> list:
        """One step's prompt groups -> their samples with this algorithm's advantages, logged."""
        samples = [sample for group in groups for sample in group]
        rewards = torch.tensor([sample.metrics["reward"] for sample in samples], dtype=torch.float32)
        output = self.padded_rollouts(samples)
        lengths = output["completion_mask"].sum(1)
        self.round = Round([{"prompt": sample.prompt} for sample in samples], weighted_rewards=rewards,
                           rewards=rewards.tolist(), completion_lengths=lengths)
        if self.feature_need is not None:
            self.round.features, self.round.feature_source = self.policy_features(output), "extra_pass"
            self.feature_sources["extra_pass"] += 1
        advantages = self.compute_advantages(rewards, output)
        if advantages is not None:
            if advantages.dim() != 1:
                raise ValueError("the asynchronous trainer takes one advantage per rollout, not per token")
            for sample, advantage in zip(samples, advantages.tolist(), strict=True):
                sample.advantage = advantage
        final = torch.tensor([sample.advantage for sample in samples])
        self.log_metric("advantages/mean", final.mean().item())
        self.log_metric("advantages/std", final.std().item() if len(final) > 1 else 0.0)
        return samples

    def padded_rollouts(self, samples: list) -> dict:
        """Prompts left-padded and completions right-padded, as TRL's GRPOTrainer lays out a round."""
        from trl.trainer.utils import pad  # noqa: PLC0415 (kept beside its one use)

        prompts, completions = [], []
        for sample in samples:
            ids = torch.as_tensor(sample.input_ids)
            start = int(torch.as_tensor(sample.completion_mask).argmax())  # one turn: the prompt, then the answer
            prompts.append(ids[:start])
            completions.append(ids[start:])
        pad_id = self.processing_class.pad_token_id
        ones = [torch.ones_like(row) for row in prompts], [torch.ones_like(row) for row in completions]
        return {"prompt_ids": pad(prompts, padding_value=pad_id, padding_side="left"),
                "prompt_mask": pad(ones[0], padding_value=0, padding_side="left"),
                "completion_ids": pad(completions, padding_value=pad_id),
                "completion_mask": pad(ones[1], padding_value=0),
                "model_version": torch.tensor([sample.model_version for sample in samples])}

    def policy_features(self, output: dict):
        """`feature_need`'s features of these rollouts read by the policy now training: one no-grad pass, as
        GRPOTrainer's (padded, TRL's fused LM head for the temperature-scaled entropies)."""
        need, model = self.feature_need, self.accelerator.unwrap_model(self.model)
        ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1).to(self.accelerator.device)
        mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1).to(self.accelerator.device)
        width = output["completion_ids"].shape[1]
        labels = ids.masked_fill(mask == 0, -100)
        labels[:, :-width] = -100  # only the completion is scored
        with torch.no_grad(), HiddenStateCapture(model, [need.layer], need.pool_tokens) as capture:
            capture.set_batch(output["prompt_mask"], output["completion_ids"], output["completion_mask"],
                              need.think_end_id)
            with capture.capturing():
                entropies = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True).entropy
            prompt_vec, response_vec = capture.pop()[need.layer]
        self.policy_forward_passes += 1
        return build_rollout_features(prompt_vec.cpu(), response_vec.cpu(), entropies[:, -width:].cpu(),
                                      output["completion_ids"], output["completion_mask"], need.think_end_id)


def async_trainer_class(trainer_class: type) -> type:
    """`trainer_class`'s off-policy events (its `async_events` class) on `AsyncGRPOSeam`."""
    return type(f"Async{trainer_class.__name__}", (trainer_class.async_events, AsyncGRPOSeam),
                {"run_callback_classes": trainer_class.run_callback_classes})


def async_config(config, max_staleness: int, server_url: str) -> AsyncGRPOConfig:
    """An algorithm's checked config as TRL's AsyncGRPOConfig: the fields both have, then the algorithm's own
    settings as attributes, which its events read. A fixed number of samples per micro-batch
    (`token_budget: 0`) keeps each optimizer step's samples one round of `RoundQueue`."""
    own = {field.name for field in dataclasses.fields(AsyncGRPOConfig) if field.init}
    shared = {name: getattr(config, name) for name in own if hasattr(config, name)}
    converted = AsyncGRPOConfig(**{**shared, "max_staleness": max_staleness, "vllm_server_base_url": server_url,
                                   "token_budget": 0})
    for field in dataclasses.fields(config):
        if field.name not in own:
            setattr(converted, field.name, getattr(config, field.name))
    return converted


def off_policy_conflict(config, events: type) -> str | None:
    """What of an algorithm's config TRL's asynchronous trainer cannot do, and the fix (None: nothing): what no
    algorithm can do so, then what its `events` class refuses of its own settings (`off_policy_conflict`)."""
    get = lambda name, default=None: getattr(config, name, default)  # noqa: E731 (each config has some fields)
    if get("beta", 0.0):
        return "beta is not 0, but the asynchronous trainer has no reference model and no KL term: set beta: 0"
    if get("loss_type", "dapo") != "dapo":
        return f"its loss is TRL's token-level one, not loss_type {get('loss_type')!r}: set loss_type: dapo"
    if get("num_iterations", 1) != 1:
        return "it takes one optimizer step per rollout batch: set num_iterations: 1"
    if any(weight != 1 for weight in get("reward_weights") or []):
        return "its rollout worker sums the reward functions unweighted: remove reward_weights"
    if get("process_rewards", False):
        return "it takes one advantage per rollout, not per-token process advantages: set process_rewards: false"
    own = getattr(events, "off_policy_conflict", None)
    return own(config) if own else None
