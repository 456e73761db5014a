"""POISE probe features z_i, read from the policy's own forward pass (docs/algorithms.md, "Features z").

Per rollout and hooked block: a prompt vector, a response vector (ending at the last `</think>`) and three
mean token entropies; this module holds their arithmetic (spans, pooling, entropies), `probe.capture` the hooks
that read them from a forward pass or from `generate`. TRL's layout: prompts left-, completions right-padded;
`completion_mask` must mark the real completion tokens (not a loss mask), or spans become empty.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral, Real

import torch
from torch import nn

ENTROPY_NAMES = ("entropy_completion", "entropy_reasoning", "entropy_answer")


@dataclass
class RolloutFeatures:
    """Probe inputs for B rollouts, float32 on CPU: `prompt` (B, d), `response` (B, d), `entropy` (B, 3)."""

    prompt: torch.Tensor
    response: torch.Tensor
    entropy: torch.Tensor

    def __post_init__(self):
        self.prompt = self.prompt.detach().to("cpu", torch.float32)
        self.response = self.response.detach().to("cpu", torch.float32)
        self.entropy = self.entropy.detach().to("cpu", torch.float32)
        n = self.prompt.shape[0]
        if self.prompt.dim() != 2 or self.response.dim() != 2 or self.response.shape[0] != n:
            raise ValueError(f"prompt and response must be (B, d) with the same B, got {tuple(self.prompt.shape)} "
                             f"and {tuple(self.response.shape)}")
        if tuple(self.entropy.shape) != (n, len(ENTROPY_NAMES)):
            raise ValueError(f"entropy must be ({n}, 3), got {tuple(self.entropy.shape)}")

    def __len__(self) -> int:
        return self.prompt.shape[0]

    def __getitem__(self, index: torch.Tensor | slice) -> RolloutFeatures:
        # A LongTensor, a bool mask or a slice: rows keep their order, so groups stay consecutive.
        return RolloutFeatures(self.prompt[index], self.response[index], self.entropy[index])

    @classmethod
    def cat(cls, parts: Sequence[RolloutFeatures]) -> RolloutFeatures:
        if not parts:
            raise ValueError("RolloutFeatures.cat needs at least one part")
        dims = {(p.prompt.shape[1], p.response.shape[1]) for p in parts}
        if len(dims) > 1:
            raise ValueError(f"cannot concatenate features of different widths (prompt, response): {sorted(dims)}")
        return cls(
            torch.cat([p.prompt for p in parts]),
            torch.cat([p.response for p in parts]),
            torch.cat([p.entropy for p in parts]),
        )

    def to_matrix(self) -> torch.Tensor:
        """(B, 2d + 3): [prompt, response, entropy], the raw input of the no-PCA probe."""
        return torch.cat([self.prompt, self.response, self.entropy], dim=1)


# --- Layers ----------------------------------------------------------------------------------


def resolve_layer_index(num_layers: int, layer: int | float) -> int:
    """0-based block index from an int (negative from the end) or a depth fraction f: block ceil(f * L) - 1.

    f * L is rounded to 9 decimals first, so that 0.5 * 36 is exactly 18 despite float error.
    """
    if isinstance(layer, bool) or not isinstance(layer, Real):
        raise TypeError(f"layer must be an int or a float fraction of depth, got {layer!r}")
    if isinstance(layer, Integral):
        if -num_layers <= layer < num_layers:
            return int(layer) % num_layers
    elif 0.0 < layer <= 1.0:
        return math.ceil(round(float(layer) * num_layers, 9)) - 1
    raise ValueError(f"layer {layer!r} is out of range for a model with {num_layers} decoder layers: use an int block "
                     f"index in [{-num_layers}, {num_layers - 1}] or a float fraction of depth in (0, 1]")


def unwrap_model(model: nn.Module) -> nn.Module:
    """Strip DDP/accelerate (`.module`), torch.compile (`._orig_mod`) and PEFT wrappers."""
    while True:
        if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)) or type(
            model
        ).__name__ in (
            "FullyShardedDataParallel",
            "DeepSpeedEngine",
        ):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif callable(getattr(model, "get_base_model", None)) and hasattr(model, "peft_config"):
            # LoRA layers are injected in place, so hooks on the base model's blocks see them.
            model = model.get_base_model()
        else:
            return model


# Where HF keeps the decoder blocks: *ForCausalLM / *ForTokenClassification (`model.layers`),
# bare decoders (`layers`), multimodal wrappers (`language_model.layers`), GPT-2 style (`transformer.h`).
_LAYER_PATHS = (
    "model.layers",
    "layers",
    "model.language_model.layers",
    "language_model.layers",
    "transformer.h",
)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The ModuleList of decoder blocks of an HF causal LM, through PEFT/DDP/compile wrappers."""
    base = unwrap_model(model)
    for path in _LAYER_PATHS:
        module = base
        for name in path.split("."):
            module = getattr(module, name, None)
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            return module
    raise ValueError(
        f"cannot find the decoder blocks of {type(base).__name__}: looked for a non-empty nn.ModuleList at "
        f"{', '.join(_LAYER_PATHS)}"
    )


# --- Spans (by token id, never by decoding: docs/algorithms.md, "Features z") ----------------


def last_think_end(
    completion_ids: torch.Tensor, completion_mask: torch.Tensor, think_end_id: int
) -> torch.Tensor:
    """(B,) index of the LAST valid `</think>` token per row, -1 where there is none."""
    T = completion_ids.shape[1]
    hit = (completion_ids == think_end_id) & completion_mask.bool()
    pos = torch.arange(T, device=completion_ids.device).expand_as(completion_ids)
    return (
        torch.where(hit, pos, -1).amax(dim=1)
        if T > 0
        else completion_ids.new_full((completion_ids.shape[0],), -1)
    )


def span_masks(
    completion_ids: torch.Tensor, completion_mask: torch.Tensor, think_end_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(completion, reasoning, answer) bool masks (B, T), split at the last `</think>`."""
    valid = completion_mask.bool()
    end = last_think_end(completion_ids, completion_mask, think_end_id)[:, None]
    pos = torch.arange(completion_ids.shape[1], device=completion_ids.device)[None, :]
    reasoning = valid & ((pos < end) | (end < 0))
    answer = valid & (pos > end) & (end >= 0)
    return valid, reasoning, answer


def entropy_span_means(
    entropies: torch.Tensor, completion_ids: torch.Tensor, completion_mask: torch.Tensor, think_end_id: int
) -> torch.Tensor:
    """(B, 3) float32 mean token entropy over (completion, reasoning, answer); an empty span gives 0."""
    masks = torch.stack(span_masks(completion_ids, completion_mask, think_end_id), dim=1)  # (B, 3, T)
    ent = entropies.detach().float().to(masks.device)[:, None, :]
    # where, not a product: padding may hold anything, and nan * 0 = nan.
    return (torch.where(masks, ent, 0.0).sum(-1) / masks.sum(-1).clamp(min=1)).cpu()


def build_rollout_features(
    prompt: torch.Tensor,
    response: torch.Tensor,
    entropies: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    think_end_id: int,
) -> RolloutFeatures:
    """RolloutFeatures from pooled (B, d) vectors and per-token (B, T) entropies (the trainer path)."""
    return RolloutFeatures(
        prompt, response, entropy_span_means(entropies, completion_ids, completion_mask, think_end_id)
    )


# --- Pooling ---------------------------------------------------------------------------------


def last_n(select: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions of the last n True entries per row of `select` (B, S): (B, k) index, (B, k) valid."""
    pos = torch.arange(select.shape[1], device=select.device).expand_as(select)
    key = torch.where(select, pos, -1)
    top = key.topk(min(n, select.shape[1]), dim=1).values  # largest positions = the last selected ones
    return top.clamp(min=0), top >= 0


def pooling_positions(
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    think_end_id: int,
    n_pool: int = 10,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(prompt_index, prompt_valid, response_index, response_valid), each (B, k): where to pool. The response
    pools the last `n_pool` tokens of each run of `completion_mask` (a policy turn, `policy_span`), ending at
    the run's last `</think>`; a single-turn completion is one run."""
    P = prompt_mask.shape[1]
    prompt_index, prompt_valid = last_n(prompt_mask.bool(), n_pool)
    valid = completion_mask.bool()
    pos = torch.arange(valid.shape[1], device=valid.device).expand_as(valid)
    turn = turns(valid)
    last = torch.full(valid.shape[:1] + (valid.shape[1] + 1,), -1, device=valid.device)
    last_think = last.scatter_reduce(1, turn, torch.where(valid & (completion_ids == think_end_id), pos, -1), "amax")
    end = torch.where(last_think >= 0, last_think, last.scatter_reduce(1, turn, torch.where(valid, pos, -1), "amax"))
    end = end.gather(1, turn)  # the position each token's window ends at
    seen = torch.cumsum(valid, dim=1)
    window = valid & (pos <= end) & (seen.gather(1, end.clamp(min=0)) - seen < n_pool)
    response_index, response_valid = last_n(window, max([n_pool, *window.sum(1).tolist()]))
    return prompt_index, prompt_valid, response_index + P, response_valid


FEATURE_SPANS = ("last_turn", "all_turns")


def policy_span(completion_mask: torch.Tensor, tool_mask: torch.Tensor | None, span: str) -> torch.Tensor:
    """(B, T) the completion tokens the features read: the policy's own (`tool_mask` 1, TRL's mask of tool
    results in the loss; None: every token), of its last turn or of all its turns (docs/algorithms.md)."""
    own = completion_mask.bool() if tool_mask is None else completion_mask.bool() & tool_mask.bool()
    if span not in FEATURE_SPANS:
        raise ValueError(f"the feature span must be one of {FEATURE_SPANS}, got {span!r}")
    if span == "all_turns":
        return own
    turn = turns(own)
    return turn == turn.amax(dim=1, keepdim=True).clamp(min=1)


def turns(mask: torch.Tensor) -> torch.Tensor:
    """(B, T) long: 1, 2, ... numbering the runs of True in each row of `mask` (B, T) bool, 0 outside them."""
    starts = mask & ~torch.nn.functional.pad(mask[:, :-1], (1, 0))
    return torch.cumsum(starts, dim=1) * mask


def pool_hidden(hidden: torch.Tensor, index: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean of `hidden` (b, S, d) at `index` (b, k) where `valid`: (b, d) float32; no valid -> 0."""
    index, valid = index.to(hidden.device), valid.to(hidden.device)
    picked = hidden.gather(1, index[:, :, None].expand(-1, -1, hidden.shape[-1])).float()  # only (b, k, d)
    # Invalid slots point at position 0, which may be a pad holding nan: mask with where.
    picked = torch.where(valid[:, :, None], picked, 0.0)
    return picked.sum(1) / valid.sum(1, keepdim=True).clamp(min=1)


# --- Entropies ----------------------------------------------------------------------------




ENTROPY_CHUNK_ELEMENTS = 1 << 22  # float32 temporaries of at most 16 MB each


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy (nats, float32) of softmax(logits / temperature) over the last dim, in bounded chunks."""
    flat = logits.reshape(-1, logits.shape[-1])
    rows = max(1, ENTROPY_CHUNK_ELEMENTS // max(1, flat.shape[1]))
    if flat.shape[0] <= rows:
        return _entropy(flat, temperature).view(logits.shape[:-1])
    chunks = [_entropy(flat[start : start + rows], temperature) for start in range(0, flat.shape[0], rows)]
    return torch.cat(chunks).view(logits.shape[:-1])


def _entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    scaled = logits.float()
    if temperature != 1.0:  # dividing by 1 changes nothing: skip the op (once per decode step)
        scaled = scaled / temperature
    # H = log Z - E_p[z - max z], with Z = sum exp(z - max z): one exp over the vocabulary where log_softmax and p
    # take two (benchmarks/entropy_cost.py).
    shifted = scaled - scaled.amax(-1, keepdim=True)
    weights = shifted.exp()
    total = weights.sum(-1)
    return total.log() - weights.mul_(shifted).sum(-1) / total


def pad_sequences(seqs: list[list[int]], pad_id: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (ids, attention mask), left- or right-padded with `pad_id`."""
    width = max((len(s) for s in seqs), default=0)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        cols = slice(width - len(s), width) if left else slice(0, len(s))
        ids[i, cols], mask[i, cols] = torch.tensor(s, dtype=torch.long), 1
    return ids, mask
