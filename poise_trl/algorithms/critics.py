"""Value models for AsyPPO's mini-critics (arXiv 2510.01656) and PPO / VAPO's critic (arXiv 2504.05118).

A critic is `AutoModelForTokenClassification(num_labels=1)` from `critic_model`, an extra learner with its
own AdamW outside `accelerator.prepare` (docs/trl.md, "Extra learners"). Every rank holds all critics and
gradients are summed over ranks, so the replicas stay identical. Checkpoints: `critics/` (safetensors and
JSON, no pickle). More: docs/algorithms.md ("Critics").
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForTokenClassification, PreTrainedModel
from transformers.utils import logging as hf_logging

from poise_trl.core.distributed import broadcast_from_main, summed_in_place

STATE_FILE = "state.json"
RNG_FILE = "rng.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"


def _is_value_model(config) -> bool:
    return any(name.endswith("ForTokenClassification") for name in (config.architectures or []))


def enable_activation_checkpointing(model: PreTrainedModel) -> None:
    """transformers 5.24 renamed gradient checkpointing to activation checkpointing and warns on the old name."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def load_critic(path: str, seed: int, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A value model from a causal LM or a saved critic; a fresh head is drawn from `seed`."""
    config = AutoConfig.from_pretrained(path, num_labels=1)
    # GenericForTokenClassification falls back to 0.1 dropout on the hidden states: a value
    # regression wants deterministic outputs, and the policy has no dropout either.
    config.classifier_dropout = 0.0
    fresh_head = not _is_value_model(config)
    verbosity = hf_logging.get_verbosity()
    if fresh_head:
        hf_logging.set_verbosity_error()  # the "score.* MISSING" load report: the head is drawn just below
    try:
        critic = AutoModelForTokenClassification.from_pretrained(path, config=config, dtype=dtype)
    finally:
        hf_logging.set_verbosity(verbosity)
    if fresh_head:
        # A missing head is drawn from the critic's own seed (M critics start apart, every rank identical),
        # as new tensors: under FSDP's CPU-RAM-efficient loading, transformers >= 5.23 leaves it on meta.
        generator = torch.Generator().manual_seed(seed)
        weight, bias = critic.score.weight, critic.score.bias
        head = torch.randn(weight.shape, generator=generator) * config.initializer_range
        critic.score.weight = torch.nn.Parameter(head.to(weight.dtype))
        critic.score.bias = torch.nn.Parameter(torch.zeros(bias.shape, dtype=bias.dtype))
    return critic


def token_values(critic: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 logits_to_keep: int) -> torch.Tensor:
    """V(s_t) for every completion token, (B, T) float32, read where the logits predict token t.

    Position ids count real tokens only, so values do not depend on the batch's left padding.
    """
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    logits = critic(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    return logits[:, -logits_to_keep - 1 : -1, 0].float()


class CriticEnsemble:
    """M critics, each with its own AdamW, trained on disjoint rows (AsyPPO paper, L_critic)."""

    def __init__(self, model_path: str, num_critics: int, *, learning_rate: float, weight_decay: float = 0.0,
                 max_grad_norm: float = 1.0, epochs: int = 1, mini_batch_size: int = 8,
                 micro_batch_size: int | None = None, dtype: torch.dtype = torch.float32,
                 autocast_dtype: torch.dtype | None = None, gradient_checkpointing: bool = False,
                 device: torch.device | str = "cpu", seed: int = 0):
        if num_critics < 1:
            raise ValueError(f"num_critics must be >= 1, got {num_critics}")
        self.model_path = model_path
        self.critics = [load_critic(model_path, seed + m, dtype).to(device) for m in range(num_critics)]
        for critic in self.critics:
            # Replicas stay identical only if they start identical (their gradients are summed). Under
            # FSDP with cpu_ram_efficient_loading (recipes/accelerate/fsdp2.yaml) transformers reads
            # the weights on process 0 alone and leaves other processes' from_pretrained weights
            # uninitialised, relying on FSDP's broadcast, which the critics never get: they get this one.
            broadcast_from_main(critic)
            if gradient_checkpointing:
                enable_activation_checkpointing(critic)
            critic.config.use_cache = False
        self.optimizers = [
            torch.optim.AdamW(critic.parameters(), lr=learning_rate, weight_decay=weight_decay)
            for critic in self.critics
        ]
        self.max_grad_norm = max_grad_norm
        self.epochs = epochs
        self.mini_batch_size = mini_batch_size
        self.micro_batch_size = micro_batch_size or mini_batch_size
        self.autocast_dtype = autocast_dtype
        self.device = torch.device(device)
        self.generator = torch.Generator().manual_seed(seed)
        self.updates = 0

    def __len__(self) -> int:
        return len(self.critics)

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for critic in self.critics for p in critic.parameters())

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None)

    @torch.no_grad()
    def values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
        """Every critic's V(s_t) on every row, (M, B, T), in chunks of `micro_batch_size` rows."""
        out = []
        for critic in self.critics:
            critic.eval()
            chunks = []
            for rows in torch.arange(input_ids.size(0)).split(self.micro_batch_size):
                with self._autocast():
                    chunks.append(token_values(critic, input_ids[rows], attention_mask[rows], logits_to_keep))
            out.append(torch.cat(chunks))
        return torch.stack(out)

    def update(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
               targets: torch.Tensor, mask: torch.Tensor, assignment: torch.Tensor) -> dict[str, float]:
        """Fit critic m to `targets` on the rows with `assignment == m` (AsyPPO paper, L_critic).

        Per step: squared error summed over a mini-batch's valid tokens / their count on all processes;
        every rank takes the same number of steps. Returns the mean value loss per critic and over critics.
        """
        metrics = {}
        valid = mask.bool()
        with torch.enable_grad():  # callers may sit inside TRL's no-grad generation code
            for m in range(len(self)):
                metrics[f"value_loss_{m}"] = self._fit_one(m, input_ids, attention_mask, logits_to_keep, targets,
                                                           valid, assignment == m)
        self.updates += 1
        metrics["value_loss"] = sum(metrics.values()) / len(self)
        return metrics

    def _fit_one(self, m, input_ids, attention_mask, logits_to_keep, targets, valid, selected) -> float:
        critic, optimizer = self.critics[m], self.optimizers[m]
        critic.train()
        rows = selected.nonzero().squeeze(1)
        if rows.numel() == 0:
            return float("nan")  # no data for this critic: no step, and no loss to report
        losses = []
        for _ in range(self.epochs):
            order = rows[torch.randperm(rows.numel(), generator=self.generator).to(rows.device)]
            for batch in order.split(self.mini_batch_size):
                tokens = summed_in_place(valid[batch].sum().float())
                optimizer.zero_grad(set_to_none=True)
                squared_error = torch.zeros((), device=self.device)
                for micro in batch.split(self.micro_batch_size):
                    with self._autocast():
                        pred = token_values(critic, input_ids[micro], attention_mask[micro], logits_to_keep)
                    error = torch.where(valid[micro], pred - targets[micro].float(), torch.zeros_like(pred))
                    loss = error.pow(2).sum()
                    (loss / tokens.clamp(min=1)).backward()
                    squared_error += loss.detach()
                for param in critic.parameters():
                    if param.grad is not None:
                        summed_in_place(param.grad)
                torch.nn.utils.clip_grad_norm_(critic.parameters(), self.max_grad_norm)
                optimizer.step()
                losses.append((summed_in_place(squared_error) / tokens.clamp(min=1)).item())
        optimizer.zero_grad(set_to_none=True)
        return sum(losses) / len(losses)

    # -- checkpoints ------------------------------------------------------------------------

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        param_groups = []
        for m, (critic, optimizer) in enumerate(zip(self.critics, self.optimizers, strict=True)):
            folder = directory / f"critic_{m}"
            # One shard whatever the size: `load` reads model.safetensors back directly.
            critic.save_pretrained(folder, safe_serialization=True, max_shard_size="1000GB")
            state = optimizer.state_dict()
            tensors = {}
            for index, entry in state["state"].items():
                for name, value in entry.items():
                    if not isinstance(value, torch.Tensor):
                        raise TypeError(f"optimizer state {name!r} is a {type(value).__name__}, not a tensor")
                    tensors[f"state.{index}.{name}"] = value.detach().contiguous().cpu()
            save_file(tensors, folder / OPTIMIZER_FILE)
            param_groups.append(state["param_groups"])
        save_file({"generator": self.generator.get_state()}, directory / RNG_FILE)
        info = {"num_critics": len(self), "model_path": self.model_path, "updates": self.updates,
                "param_groups": param_groups}
        (directory / STATE_FILE).write_text(json.dumps(info, indent=2) + "\n")

    def load(self, directory: str | Path) -> None:
        """Restore weights, optimizer states, the update counter and the shuffling generator."""
        directory = Path(directory)
        info = json.loads((directory / STATE_FILE).read_text())
        if info["num_critics"] != len(self):
            raise ValueError(f"{directory} holds {info['num_critics']} critics, this run has {len(self)}")
        # safetensors names a CPU "cpu", never "cpu:0" (what an indexed CPU device prints as)
        device = "cpu" if self.device.type == "cpu" else str(self.device)
        for m, (critic, optimizer) in enumerate(zip(self.critics, self.optimizers, strict=True)):
            folder = directory / f"critic_{m}"
            critic.load_state_dict(load_file(folder / "model.safetensors", device=device))
            entries: dict[int, dict[str, torch.Tensor]] = {}
            for key, value in load_file(folder / OPTIMIZER_FILE, device=device).items():
                _, index, name = key.split(".", 2)
                entries.setdefault(int(index), {})[name] = value
            optimizer.load_state_dict({"state": entries, "param_groups": info["param_groups"][m]})
        self.generator.set_state(load_file(directory / RNG_FILE)["generator"])
        self.updates = info["updates"]
