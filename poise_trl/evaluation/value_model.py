"""The value-model baseline of `poise probe-eval` (POISE paper, Sec. 3.1 and App. D.1, in spirit): an LM
with a scalar head fine-tuned on (prompt + response) -> reward with MSE, the critic a probe is compared
against."""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch
from transformers import AutoConfig, AutoModelForTokenClassification

from poise_trl.core.loading import RecipeError, quiet_transformers
from poise_trl.probe.features import pad_sequences


def load_value_model(path: str):
    """A float32 LM with a fresh 1-output token head (the critic baseline), on the GPU when there is one."""
    try:
        # No dropout on the pooled state: the regression target is already noisy (0/1 rewards).
        config = AutoConfig.from_pretrained(path, num_labels=1, classifier_dropout=0.0)
        with quiet_transformers():
            model = AutoModelForTokenClassification.from_pretrained(path, config=config, dtype=torch.float32)
    except OSError as exc:
        raise RecipeError(f"cannot load the model {path!r}: {exc.__class__.__name__}: {exc}") from None
    return model.to("cuda" if torch.cuda.is_available() else "cpu")


def last_token_values(model, seqs: list[list[int]], pad_id: int) -> torch.Tensor:
    """The scalar head's output at each sequence's last token (right padding): a (b,) tensor."""
    ids, mask = pad_sequences(seqs, pad_id, left=False)
    device = next(model.parameters()).device
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    with autocast:
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False).logits[..., 0]
    return logits.float()[torch.arange(len(seqs), device=device), mask.sum(1).to(device) - 1]


def train_value_model(
    model, seqs: list[list[int]], targets: torch.Tensor, pad_id: int, epochs: int, lr: float, batch_size: int,
    seed: int, progress=None,
) -> list[float]:
    """Fit an LM with a scalar head in place on (prompt + response) -> target (MSE); returns epoch losses.

    The head's bias starts at the target mean, so training starts from the constant baseline.
    """
    head = getattr(model, "score", None) or getattr(model, "classifier", None)
    if getattr(head, "bias", None) is not None:
        with torch.no_grad():
            head.bias.fill_(float(targets.mean()))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    steps = math.ceil(len(seqs) / batch_size)
    task = progress.add_task("value model", total=epochs * steps) if progress else None
    targets = targets.float().to(next(model.parameters()).device)
    losses = []
    model.train()
    for _ in range(epochs):
        total = 0.0
        for batch in torch.randperm(len(seqs), generator=generator).split(batch_size):
            loss = torch.nn.functional.mse_loss(last_token_values(model, [seqs[i] for i in batch], pad_id),
                                                targets[batch.to(targets.device)])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            total += loss.item() * len(batch)
            if progress:
                progress.advance(task)
        losses.append(total / len(seqs))
    model.eval()
    return losses


@torch.no_grad()
def predict_value_model(model, seqs: list[list[int]], pad_id: int, batch_size: int) -> torch.Tensor:
    """(N,) predictions clipped to [0, 1], like the probe's (rewards are 0/1)."""
    out = [last_token_values(model, seqs[i : i + batch_size], pad_id) for i in range(0, len(seqs), batch_size)]
    return torch.cat(out).clamp(0.0, 1.0).cpu() if out else torch.zeros(0)
