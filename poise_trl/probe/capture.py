"""Reading POISE's features from the policy (docs/algorithms.md, "Features z"): forward hooks on a decoder
block that pool the features inside a forward pass (`HiddenStateCapture`, `extract_features`,
`extract_prompt_vectors`), or while `generate` samples the completions (`GenerationCapture`). The arithmetic
of the features is `probe.features`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from numbers import Real

import torch
from torch import nn

from poise_trl.probe.features import (
    RolloutFeatures,
    build_rollout_features,
    decoder_layers,
    last_n,
    pool_hidden,
    pooling_positions,
    resolve_layer_index,
    token_entropy,
    unwrap_model,
)

# During generation, next-token logits wait (at most this many values) to have their entropies computed
# together: one batch of ops per few dozen decode steps at a small vocabulary.
PENDING_LOGITS_ELEMENTS = 1 << 17


class ForwardHooks:
    """Module hooks that live for one `with` block: `_register` returns the handles, and every one is removed
    on exit, also after an exception or a failure halfway through registering."""

    def __init__(self):
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def _register(self) -> Iterator[torch.utils.hooks.RemovableHandle]:
        raise NotImplementedError

    def __enter__(self):
        try:
            for handle in self._register():
                self._handles.append(handle)
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


class HiddenStateCapture(ForwardHooks):
    """Forward hooks on one or several decoder blocks that pool inside the hook.

    Usage (the same for the trainer, where TRL chunks the batch internally, and for
    `extract_features`)::

        with HiddenStateCapture(model, layers=[19]) as cap:
            cap.set_batch(prompt_mask, completion_ids, completion_mask, think_end_id)
            with cap.capturing():
                ...one or more forward passes over the rows, in order...
            pooled = cap.pop()  # {19: (prompt (B, d), response (B, d))}

    Each firing of a hook consumes the next rows, so the batch may be forwarded whole or in chunks. Hooks
    record only inside `capturing()`: they also fire in generate, the PEFT reference pass and
    gradient-checkpoint recomputation. Every hook is removed on exit, also after an exception.
    """

    def __init__(self, model: nn.Module, layers: Sequence[int | float], n_pool: int = 10):
        super().__init__()
        self.blocks = decoder_layers(model)
        self.layers = list(dict.fromkeys(resolve_layer_index(len(self.blocks), layer) for layer in layers))
        self.n_pool = n_pool
        self.active = False
        self._positions: tuple[torch.Tensor, ...] | None = None
        self._width = 0
        self._cursor: dict[int, int] = {}
        self._pooled: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def _register(self):
        for layer in self.layers:
            yield self.blocks[layer].register_forward_hook(self._make_hook(layer))

    def remove(self) -> None:
        super().remove()
        self.active = False

    @contextmanager
    def capturing(self) -> Iterator[HiddenStateCapture]:
        self.active = True
        try:
            yield self
        finally:
            self.active = False

    def set_batch(
        self,
        prompt_mask: torch.Tensor,
        completion_ids: torch.Tensor,
        completion_mask: torch.Tensor,
        think_end_id: int,
    ) -> None:
        """Arm the capture for the next B rows (drops anything captured and not popped)."""
        self._positions = pooling_positions(prompt_mask, completion_ids, completion_mask, think_end_id, self.n_pool)
        self._width = prompt_mask.shape[1] + completion_ids.shape[1]
        self._cursor = dict.fromkeys(self.layers, 0)
        self._pooled = {layer: [] for layer in self.layers}

    def _make_hook(self, layer: int):
        def hook(module, args, output):
            if not self.active:
                return None
            if self._positions is None:
                raise RuntimeError("HiddenStateCapture: call set_batch(...) before the captured forward pass")
            hidden = output[0] if isinstance(output, (tuple, list)) else output
            start, rows = self._cursor[layer], hidden.shape[0]
            total = self._positions[0].shape[0]
            if start + rows > total or hidden.shape[1] != self._width:
                raise RuntimeError(f"HiddenStateCapture: block {layer} saw rows [{start}, {start + rows}) of width "
                                   f"{hidden.shape[1]}, but set_batch armed {total} rows of width {self._width}")
            p_idx, p_ok, r_idx, r_ok = (t[start : start + rows] for t in self._positions)
            with torch.no_grad():
                pooled = (pool_hidden(hidden, p_idx, p_ok).cpu(), pool_hidden(hidden, r_idx, r_ok).cpu())
            self._pooled[layer].append(pooled)
            self._cursor[layer] = start + rows
            return None

        return hook

    def pop(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """{layer: (prompt (B, d), response (B, d))} float32 CPU for the armed batch; disarms."""
        if self._positions is None:
            raise RuntimeError("HiddenStateCapture.pop: nothing armed, call set_batch(...) first")
        total = self._positions[0].shape[0]
        missing = {layer: n for layer, n in self._cursor.items() if n != total}
        if missing:
            raise RuntimeError(f"HiddenStateCapture.pop: expected {total} rows per block, got {missing}")
        out = {
            layer: (torch.cat([p for p, _ in chunks]), torch.cat([r for _, r in chunks]))
            for layer, chunks in self._pooled.items()
        }
        self._positions, self._pooled, self._cursor = None, {}, {}
        return out


def extract_features(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    think_end_id: int,
    layers: int | float | Sequence[int | float],
    batch_size: int,
    temperature: float = 1.0,
    n_pool: int = 10,
    feature_mask: torch.Tensor | None = None,
) -> dict[int, RolloutFeatures]:
    """{block index: RolloutFeatures} of B rollouts from ONE chunked no-grad pass in eval mode; the features read
    the completion tokens of `feature_mask` (default: `completion_mask`; `probe.features.policy_span`)."""
    layer_list = [layers] if isinstance(layers, Real) else list(layers)
    device = next(model.parameters()).device
    T = completion_ids.shape[1]
    was_training = model.training
    read = completion_mask if feature_mask is None else feature_mask
    model.eval()
    try:
        with torch.no_grad(), HiddenStateCapture(model, layer_list, n_pool) as cap:
            cap.set_batch(prompt_mask, completion_ids, read, think_end_id)
            entropies = []
            for start in range(0, prompt_ids.shape[0], batch_size):
                rows = slice(start, start + batch_size)
                input_ids = torch.cat([prompt_ids[rows], completion_ids[rows]], dim=1).to(device)
                attention_mask = torch.cat([prompt_mask[rows], completion_mask[rows]], dim=1).to(device)
                with cap.capturing():
                    # logits_to_keep=T+1 skips the LM head on the prompt; slicing from the end also
                    # holds for models that return every position.
                    logits = model(
                        input_ids=input_ids,
                        attention_mask=attention_mask,
                        use_cache=False,
                        logits_to_keep=T + 1,
                    ).logits
                entropies.append(token_entropy(logits[:, logits.shape[1] - T - 1 : -1], temperature).cpu())
            pooled = cap.pop()
    finally:
        model.train(was_training)
    entropy = torch.cat(entropies)
    return {
        layer: build_rollout_features(prompt, response, entropy, completion_ids, read, think_end_id)
        for layer, (prompt, response) in pooled.items()
    }


def extract_prompt_vectors(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    layer: int,
    batch_size: int,
    n_pool: int = 10,
) -> torch.Tensor:
    """Prompt vectors (B, d) float32 CPU from a prefill-only no-grad pass (causal: as in rollout)."""
    device = next(model.parameters()).device
    empty = prompt_ids.new_zeros(prompt_ids.shape[0], 0)
    with torch.no_grad(), HiddenStateCapture(model, [layer], n_pool) as cap:
        cap.set_batch(prompt_mask, empty, empty, think_end_id=-1)
        with cap.capturing():
            for start in range(0, prompt_ids.shape[0], batch_size):
                rows = slice(start, start + batch_size)
                model(input_ids=prompt_ids[rows].to(device), attention_mask=prompt_mask[rows].to(device),
                      use_cache=False, logits_to_keep=1)
        ((prompt, _),) = cap.pop().values()
    return prompt


# --- Features read while generating (the trainer's transformers path: no pass of their own) ---


class CaptureUnavailable(RuntimeError):
    """A generation capture cannot give this round's features: the caller runs the full pass instead."""


class _ClosingStepRead(Exception):
    """Raised by the capture's block hook in the closing decode step, once it has read the block: stops
    the forward there (the layers above and the LM head would compute nothing the capture reads)."""


def _can_select_rows(cache) -> bool:
    """Whether the KV cache can keep some of its rows (a dynamic cache's layers can; a static one's cannot)."""
    layers = getattr(cache, "layers", [])
    return hasattr(cache, "batch_select_indices") and all(hasattr(layer, "batch_select_indices") for layer in layers)


def _fit_width(x: torch.Tensor, width: int) -> torch.Tensor:
    """(B, T) -> (B, width): cut, or right-pad with zeros (TRL may pad completions to a multiple)."""
    return x[:, :width] if x.shape[1] >= width else torch.nn.functional.pad(x, (0, width - x.shape[1]))


class GenerationCapture(ForwardHooks):
    """The features `extract_features` computes, read while `model.generate` samples the completions.

    Usage (the trainer wraps TRL's generate call; the tests call generate directly)::

        with GenerationCapture(model, layer, eos_token_ids, think_end_id, temperature) as cap:
            model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, ...)  # with its KV cache
            cap.finish(completions, pad_token_id)  # token lists cut after the first EOS, as TRL keeps them
        features = cap.features(completion_ids, completion_mask)  # TRL's padded tensors

    The prefill gives the prompt vector; decode step j feeds completion token j - 1, whose block output
    enters a ring of the last `n_pool` + 1 states (one copy per step, all rows in the same slot). A row's
    ring is held when it feeds `</think>`, or its EOS without one. `finish` runs one closing decode step
    for the last sampled token, which generate never feeds back. A generate call that does not run the
    block once per token (beam search, static cache, ...) or completions that are not the generated ones
    make `features` raise CaptureUnavailable with the reason; nothing is raised inside generate.
    """

    def __init__(self, model: nn.Module, layer: int | float, eos_token_ids: Sequence[int], think_end_id: int,
                 temperature: float = 1.0, n_pool: int = 10):
        super().__init__()
        self.lm = unwrap_model(model)
        blocks = decoder_layers(model)
        self.block = blocks[resolve_layer_index(len(blocks), layer)]
        self.eos_token_ids = list(eos_token_ids)
        self.think_end_id, self.temperature, self.n_pool = think_end_id, temperature, n_pool
        self.error: str | None = None
        self.finished = False
        self._step_kwargs: dict | None = None  # the LM forward now running (after generate: the last one)
        self._closing = False
        self._closing_hidden: torch.Tensor | None = None  # the closing step's block output
        self._prompt: torch.Tensor | None = None
        self._fed: list[torch.Tensor] = []  # the (B,) completion tokens the rows fed at each decode step
        self._pending_logits: list[torch.Tensor] = []  # next-token logits (B, vocabulary) awaiting their entropy
        self._entropies: list[torch.Tensor] = []  # (B, steps) entropies of each step's next-token distribution
        self._entropy_steps = 0

    def _register(self):
        yield self.lm.register_forward_pre_hook(self._before_step, with_kwargs=True)
        yield self.block.register_forward_hook(self._after_block)
        yield self.lm.register_forward_hook(self._after_step)

    def remove(self) -> None:
        super().remove()
        self._step_kwargs = None  # holds generate's KV cache

    # -- hooks ---------------------------------------------------------------------------------

    def _before_step(self, module, args, kwargs):
        self._step_kwargs = kwargs
        return None

    def _after_block(self, module, args, output):
        if self.error is not None:
            return None
        hidden = output[0] if isinstance(output, (tuple, list)) else output
        if self._closing:
            self._closing_hidden = hidden.detach()
            raise _ClosingStepRead  # the closing step needs nothing above this block
        kwargs = self._step_kwargs or {}
        mask, ids = kwargs.get("attention_mask"), kwargs.get("input_ids")
        try:
            with torch.no_grad():
                if self._prompt is None:
                    self._read_prefill(hidden, mask)
                else:
                    self._read_decode(hidden, ids, mask)
        except CaptureUnavailable as reason:
            self.error = str(reason)
        return None

    def _after_step(self, module, args, output):
        if self.error is None:
            logits = output.logits if hasattr(output, "logits") else output[0]
            last = logits[:, -1].detach()
            self._pending_logits.append(last)
            self._entropy_steps += 1
            # A view of (B, 1, vocabulary) logits holds nothing more; of a wider block (no logits_to_keep),
            # all of it: compute at once.
            if logits.shape[1] != 1 or len(self._pending_logits) * last.numel() >= PENDING_LOGITS_ELEMENTS:
                self._compute_pending_entropies()
        return None

    def _compute_pending_entropies(self) -> None:
        if self._pending_logits:
            self._entropies.append(token_entropy(torch.stack(self._pending_logits, dim=1), self.temperature))
            self._pending_logits = []

    def _read_prefill(self, hidden: torch.Tensor, mask) -> None:
        if mask is None:  # transformers >= 5.24 passes no mask where no prompt is padded: every position counts
            mask = torch.ones(hidden.shape[:2], dtype=torch.long, device=hidden.device)
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or tuple(mask.shape) != tuple(hidden.shape[:2]):
            raise CaptureUnavailable(
                "generate's first forward is not one prefill of the whole prompts with a 2D attention mask "
                "(chunked prefill, or a static/compiled cache)"
            )
        rows, d = hidden.shape[0], hidden.shape[-1]
        index, valid = last_n(mask.bool(), self.n_pool)
        self._prompt = pool_hidden(hidden, index, valid)
        self._prompt_width = mask.shape[1]
        self._ring = torch.zeros(rows, self.n_pool + 1, d, dtype=torch.float32, device=hidden.device)
        self._slots = self._ring.unbind(1)  # a view per slot: a decode step's write is one copy
        self._held = torch.zeros_like(self._ring)  # the ring at the row's last `</think>`, else at its EOS
        # Per row, on the device, so that a decode step never waits for it (`_feed`).
        self._held_written = torch.zeros(rows, dtype=torch.long, device=hidden.device)  # states written when held
        self._ended_at = torch.zeros_like(self._held_written)  # tokens fed up to and including its EOS
        self._marks = torch.tensor([*self.eos_token_ids, self.think_end_id], device=hidden.device)

    def _read_decode(self, hidden: torch.Tensor, ids, mask) -> None:
        rows = self._ring.shape[0]
        written = len(self._fed) + 1  # completion tokens every live row has fed, this one included
        if mask is None:  # as in `_read_prefill`
            mask = torch.ones(rows, self._prompt_width + written, dtype=torch.long)
        if (
            tuple(hidden.shape[:2]) != (rows, 1)
            or not isinstance(ids, torch.Tensor)
            or tuple(ids.shape) != (rows, 1)
            or not isinstance(mask, torch.Tensor)
            or tuple(mask.shape) != (rows, self._prompt_width + written)
        ):
            raise CaptureUnavailable(
                "generate did not feed one token per row per step over a growing 2D mask (beam search, assisted "
                "decoding, or a static/compiled cache)"
            )
        self._slots[(written - 1) % (self.n_pool + 1)].copy_(hidden[:, 0])
        self._feed(ids[:, 0], written)

    def _feed(self, tokens: torch.Tensor, written: int) -> None:
        """One decode step's bookkeeping as elementwise device ops: no `.item()`/`.tolist()` and no branch
        on a token's value, so the capture never makes the host wait for the device inside generate's
        loop (tests/test_features_from_generation.py counts). A row holds its ring where it feeds
        `</think>`, or its first EOS without one; TRL keeps each completion up to and including its
        first EOS, so a finished row's later tokens are padding."""
        self._fed.append(tokens)
        think = tokens == self.think_end_id
        live_mark = torch.isin(tokens, self._marks) & (self._ended_at == 0)
        hold = live_mark & (think | (self._held_written == 0))
        self._held_written.masked_fill_(hold, written)
        self._ended_at.masked_fill_(live_mark & ~think, written)
        torch.where(hold[:, None, None], self._ring, self._held, out=self._held)  # one pass over the ring

    # -- after generate ------------------------------------------------------------------------

    def finish(self, completions: Sequence[Sequence[int]], pad_token_id: int) -> None:
        """Feed the last sampled token back (the closing step) where it is a real token; call right after
        generate, inside the `with`, under no_grad, with `completions` cut after the first EOS."""
        self.finished = True
        if self.error is None and self._prompt is None:
            self.error = "the hooked decoder block did not run during generate"
        if self.error is not None:
            return
        width = max((len(c) for c in completions), default=0)
        if (len(completions) != self._ring.shape[0] or width == 0 or self._entropy_steps < width
                or len(self._fed) < width - 1):
            self.error = (f"generate ran {self._entropy_steps} steps over {self._ring.shape[0]} rows, but returned "
                          f"{len(completions)} completions of up to {width} tokens")
            return
        self._compute_pending_entropies()
        self._entropy = torch.cat(self._entropies, dim=1)[:, :width]
        self._entropies = []
        if len(self._fed) == width - 1:
            self._close([c[-1] if len(c) == width else pad_token_id for c in completions])
        # A row still generating has fed every token generate fed.
        self._lengths = torch.where(self._ended_at > 0, self._ended_at, len(self._fed)).cpu()
        self._fed = self._fed[:width]
        self._step_kwargs = None

    def _close(self, last_tokens: list[int]) -> None:
        """Feeds the rows still generating their last sampled token, from their rows of the KV cache, up to
        the hooked block."""
        kwargs = dict(self._step_kwargs or {})
        mask = kwargs.get("attention_mask")
        if mask is None and self._prompt is not None:  # as in `_read_prefill`: the mask of the last step fed
            mask = torch.ones(len(self._ended_at), self._prompt_width + len(self._fed), dtype=torch.long,
                              device=self._ring.device)
        # generate passes its KV cache as `past_key_values` (transformers < 5.24) or `cache` (>= 5.24)
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        if cache is None or not isinstance(mask, torch.Tensor) or mask.dim() != 2:
            self.error = "generate ran without a KV cache and a 2D mask: no closing decode step possible"
            return
        rows = [row for row, ended in enumerate(self._ended_at.tolist()) if not ended]  # generate is done: no wait
        if len(rows) < len(self._ended_at) and not _can_select_rows(cache):
            rows = list(range(len(self._ended_at)))  # a finished row's state lands in its ring, never read
        written = len(self._fed) + 1
        if rows:
            on = torch.tensor(rows, device=mask.device)
            if len(rows) < len(self._ended_at):
                cache.batch_select_indices(on)  # generate is done with its cache
            kwargs.pop("inputs_embeds", None)
            kwargs["input_ids"] = torch.tensor([[last_tokens[row]] for row in rows], device=mask.device)
            kwargs["attention_mask"] = torch.cat([mask[on], mask.new_ones(len(rows), 1)], dim=1)
            if kwargs.get("position_ids") is not None:
                kwargs["position_ids"] = kwargs["position_ids"][..., on, -1:] + 1
            self._closing = True
            try:
                self.lm(**kwargs)
            except _ClosingStepRead:
                pass
            finally:
                self._closing = False
            hidden, self._closing_hidden = self._closing_hidden, None
            if hidden is None or tuple(hidden.shape[:2]) != (len(rows), 1):
                self.error = "the closing decode step did not run the hooked block once per row"
                return
            self._ring[rows, (written - 1) % (self.n_pool + 1)] = hidden[:, 0].to(self._ring)
        self._feed(torch.tensor(last_tokens, device=self._ended_at.device), written)

    def features(self, completion_ids: torch.Tensor, completion_mask: torch.Tensor) -> RolloutFeatures:
        """RolloutFeatures of the rows as TRL scores them (right-padded ids and mask, any width); equal to
        `extract_features` on the finished sequences up to KV-cache rounding."""
        if self.error is None and not self.finished:
            self.error = "finish() was not called after generate"
        if self.error is not None:
            raise CaptureUnavailable(self.error)
        width = completion_ids.shape[1]
        fed = torch.stack(self._fed, 1).cpu() if self._fed else torch.zeros(len(self._lengths), 0, dtype=torch.long)
        generated = _fit_width(fed, width)
        lengths = self._lengths
        kept = completion_mask.sum(1).cpu()
        # A row TRL masks out entirely (mask_truncated_completions) keeps no response token.
        scored = kept > 0
        if completion_ids.shape[0] != lengths.shape[0] or not ((kept == lengths) | ~scored).all() or not torch.equal(
            generated[completion_mask.bool().cpu()], completion_ids[completion_mask.bool()].cpu()
        ):
            raise CaptureUnavailable("the completions TRL scores are not the tokens generate fed back")
        held_written = self._held_written
        held = held_written > 0
        states = torch.where(held[:, None, None], self._held, self._ring)
        written = torch.where(held, held_written, self._lengths.to(held.device))[:, None]
        # The last n_pool states: every slot written so far but the spare one, where the next would go.
        slot = torch.arange(self.n_pool + 1, device=states.device)[None, :]
        slots = (slot < written) & (slot != written % (self.n_pool + 1))
        response = torch.where(slots[:, :, None], states, 0.0).sum(1) / slots.sum(1).clamp(min=1)[:, None]
        response = torch.where(scored.to(response.device)[:, None], response, 0.0)
        entropies = _fit_width(self._entropy.cpu(), width)
        return build_rollout_features(self._prompt, response, entropies, completion_ids, completion_mask,
                                      self.think_end_id)
