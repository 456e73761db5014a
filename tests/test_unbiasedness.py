"""Statistical check that POISE's cross-rollout baseline keeps the policy gradient unbiased.

A contextual bandit where the exact gradient is known in closed form:
- C contexts (prompts), K actions (answers), softmax policy pi_c = softmax(theta_c);
- reward r ~ Bernoulli(p[c, a]);
- rollout features z = one-hot(c, a) + Gaussian noise, and a FIXED linear probe
  g(z) = p . z that reads "is my own answer right" off its input.

With 2 rollouts per context, the POISE estimator (r_i - g(z_j)) grad log pi(a_i) has
expectation grad J, because z_j is independent of a_i given the context (POISE paper,
Sec. 2.2). The own-feature estimator (r_i - g(z_i)) grad log pi(a_i) subtracts
E[g(z_i) grad log pi(a_i)] = grad E[p(c, a)] = grad J from it: its expectation is 0, i.e.
fully biased. Everything is float64, seeded, and vectorized (well under a second).
"""

from __future__ import annotations

import pytest
import torch

from poise_trl.core.estimators import cross_rollout_advantages

THETA = torch.tensor(
    [[1.0, 0.0, -0.5, 0.5], [0.0, 0.8, 0.0, -1.0], [-0.5, 0.3, 1.2, 0.0]], dtype=torch.float64
)
REWARD_PROB = torch.tensor(
    [[0.9, 0.1, 0.3, 0.6], [0.2, 0.8, 0.1, 0.5], [0.4, 0.0, 0.7, 1.0]], dtype=torch.float64
)
N_CONTEXTS, N_ACTIONS = THETA.shape
N_BATCHES = 20_000
NOISE = 0.5


def exact_gradient() -> torch.Tensor:
    """grad_theta of J = mean_c sum_a pi_c(a) p[c, a]: pi_c(a) (p[c, a] - V_c) / C, flattened."""
    pi = THETA.softmax(-1)
    value = (pi * REWARD_PROB).sum(-1, keepdim=True)
    return (pi * (REWARD_PROB - value) / N_CONTEXTS).reshape(-1)


def score_function(actions: torch.Tensor) -> torch.Tensor:
    """grad_{theta_c} log pi_c(a) = one-hot(a) - pi_c, for actions of shape (..., C, R)."""
    pi = THETA.softmax(-1)
    return torch.nn.functional.one_hot(actions, N_ACTIONS).double() - pi[:, None, :]


def sample_rollouts(policy: torch.Tensor, seed: int):
    """(N, C, 2) actions drawn from `policy` (two independent rollouts per context per batch), their rewards, and
    the fixed probe's predictions g(z) from their noisy one-hot features."""
    gen = torch.Generator().manual_seed(seed)
    actions = torch.multinomial(policy, 2 * N_BATCHES, replacement=True, generator=gen)
    actions = actions.view(N_CONTEXTS, N_BATCHES, 2).permute(1, 0, 2).contiguous()
    contexts = torch.arange(N_CONTEXTS).view(1, N_CONTEXTS, 1)
    rewards = torch.bernoulli(REWARD_PROB[contexts, actions], generator=gen)
    cell = contexts * N_ACTIONS + actions
    noise = NOISE * torch.randn(*cell.shape, N_CONTEXTS * N_ACTIONS, generator=gen, dtype=torch.float64)
    features = torch.nn.functional.one_hot(cell, N_CONTEXTS * N_ACTIONS).double() + noise
    return actions, rewards, features @ REWARD_PROB.reshape(-1)


@pytest.fixture(scope="module")
def rollouts():
    return sample_rollouts(THETA.softmax(-1), seed=1234)


def per_batch_gradients(advantages: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    """(N, C*K): for each batch, mean over contexts and rollouts of A * grad log pi."""
    grads = (advantages.unsqueeze(-1) * score_function(actions)).mean(dim=2) / N_CONTEXTS
    return grads.reshape(advantages.shape[0], -1)


def z_scores(grads: torch.Tensor) -> torch.Tensor:
    """(mean - exact) / standard error, per coordinate."""
    standard_error = grads.std(dim=0) / grads.shape[0] ** 0.5
    return (grads.mean(dim=0) - exact_gradient()) / standard_error


def test_score_function_matches_autograd():
    theta = THETA.clone().requires_grad_(True)
    actions = torch.tensor([[2, 0], [1, 1], [3, 0]])
    logp = torch.log_softmax(theta, dim=-1).gather(1, actions).sum()
    logp.backward()
    torch.testing.assert_close(score_function(actions).sum(dim=1), theta.grad)


def test_poise_cross_rollout_gradient_is_unbiased(rollouts):
    actions, rewards, predictions = rollouts
    # rows ordered (batch, context, rollout): consecutive pairs share a prompt
    advantages, _ = cross_rollout_advantages(rewards.reshape(-1), predictions.reshape(-1), group_size=2)
    z = z_scores(per_batch_gradients(advantages.view_as(rewards), actions))
    assert z.abs().max() < 4.0, f"POISE gradient deviates from the exact one: z = {z}"


def test_own_feature_baseline_is_biased(rollouts):
    actions, rewards, predictions = rollouts
    z = z_scores(per_batch_gradients(rewards - predictions, actions))
    assert z.abs().max() > 6.0, f"own-feature baseline should be measurably biased: z = {z}"


# --- Off-policy (`async: true`): rollouts of a policy k updates old --------------------------
# The behaviour policy mu = softmax(theta - k * STEP); the trainer is at THETA. Features of the other rollout
# are independent of a_i given the context under mu too, so with the importance weight pi(a_i) / mu(a_i)
# (what TRL's asynchronous loss applies, against vLLM's log-probs, inside its clip) the POISE estimator
# stays unbiased for grad J(THETA); without it, it estimates another gradient.
STEP = torch.tensor([[0.4, -0.4, 0.0, 0.0], [0.0, 0.4, -0.4, 0.0], [0.4, 0.0, 0.0, -0.4]], dtype=torch.float64)


def stale_rollouts(staleness: int):
    behaviour = (THETA - staleness * STEP).softmax(-1)
    actions, rewards, predictions = sample_rollouts(behaviour, seed=4321 + staleness)
    contexts = torch.arange(N_CONTEXTS).view(1, N_CONTEXTS, 1)
    weights = THETA.softmax(-1)[contexts, actions] / behaviour[contexts, actions]
    advantages, _ = cross_rollout_advantages(rewards.reshape(-1), predictions.reshape(-1), group_size=2)
    return actions, advantages.view_as(rewards), weights


@pytest.mark.parametrize("staleness", [1, 2])
def test_poise_stays_unbiased_off_policy_with_the_importance_weight(staleness):
    actions, advantages, weights = stale_rollouts(staleness)
    z = z_scores(per_batch_gradients(weights * advantages, actions))
    assert z.abs().max() < 4.0, f"off-policy POISE gradient deviates from the exact one: z = {z}"


@pytest.mark.parametrize("staleness", [1, 2])
def test_stale_rollouts_without_the_importance_weight_are_biased(staleness):
    actions, advantages, _ = stale_rollouts(staleness)
    z = z_scores(per_batch_gradients(advantages, actions))
    assert z.abs().max() > 6.0, f"stale rollouts taken as on-policy should be measurably biased: z = {z}"
