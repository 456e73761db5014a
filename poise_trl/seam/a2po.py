"""The seam to TRL's experimental `A2POTrainer` (A*-PO): its two stages become events.

- `run_stage1(estimate)`: around stage 1 (`_estimate_optimal_values`: V* from reference samples); call
  `estimate()` to run TRL's.
- `on_stage2_batch(inputs, output)`: after TRL built a stage-2 training batch (`_prepare_inputs`).
- `optimal_values`: V* by chat-templated prompt, as TRL keys it (None until stage 1 ran or was restored).
"""

from __future__ import annotations

from trl.import_utils import suppress_experimental_warning

from poise_trl.seam.trainer import TrainerSeam

with suppress_experimental_warning():  # as TRL's own imports of trl.experimental; the registry says "experimental"
    from trl.experimental.a2po import A2POTrainer


class A2POSeam(TrainerSeam, A2POTrainer):
    """TRL's A2POTrainer with the Trainer seam (counters, side state, log entry) and the events above."""

    def run_stage1(self, estimate) -> None:
        estimate()

    def on_stage2_batch(self, inputs: list[dict], output: dict) -> None:
        """Called on every training and evaluation batch; `self.model.training` tells which."""

    @property
    def optimal_values(self) -> dict[str, float] | None:
        return self._optimal_values

    @optimal_values.setter
    def optimal_values(self, values: dict[str, float]) -> None:
        self._optimal_values = values

    def _estimate_optimal_values(self):
        self.run_stage1(super()._estimate_optimal_values)

    def _prepare_inputs(self, inputs):
        output = super()._prepare_inputs(inputs)
        self.on_stage2_batch(inputs, output)
        return output
