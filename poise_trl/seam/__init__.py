"""The seam to TRL: the only place that overrides or calls a private method of TRL's or transformers' classes.

One module per class it adapts: `trainer` (transformers' `Trainer`: checkpoints, logging), `grpo` (TRL's
`GRPOTrainer`: rounds, rewards, advantages, features, loss), `async_grpo` (TRL's experimental
`AsyncGRPOTrainer`: the same advantage event off-policy), `a2po` (TRL's experimental `A2POTrainer`),
`vllm` (TRL's `VLLMGeneration` and `VLLMClient` in server mode). Algorithms implement the seam's named
events and call its public helpers; `tests/test_seam.py` fails on any private TRL name outside this package.
docs/trl.md lists every internal touched here and why: a TRL upgrade is a change to this package alone.
"""
