"""Hand-computed checks of poise_trl.core.estimators.

Expected numbers are written out literally (worked by hand in the comments), never
recomputed with the formula under test.
"""

from __future__ import annotations

import pytest
import torch

from poise_trl.core import estimators as est

NAN = float("nan")
INF = float("inf")


def t(*rows):
    return torch.tensor(rows if len(rows) > 1 else rows[0], dtype=torch.float32)


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


# ---------------------------------------------------------------------------------------
# Masked statistics
# ---------------------------------------------------------------------------------------


def test_masked_mean_ignores_padding_even_if_inf_or_nan():
    values = t([1.0, 2.0, INF], [4.0, NAN, NAN])
    mask = t([1, 1, 0], [1, 0, 0])
    close(est.masked_mean(values, mask), 7.0 / 3.0)
    close(est.masked_mean(values, mask, dim=1), [1.5, 4.0])
    close(est.masked_mean(values, mask, dim=0), [2.5, 2.0, 0.0])  # empty column -> 0


def test_masked_whiten_over_valid_tokens_only():
    # valid {1, 2, 3}: mean 2, unbiased var (1 + 0 + 1) / 2 = 1
    values = t([1.0, 2.0, 100.0], [3.0, NAN, -7.0])
    mask = t([1, 1, 0], [1, 0, 0])
    close(est.masked_whiten(values, mask, eps=0.0), [[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    with pytest.raises(ValueError, match="at least 2"):
        est.masked_whiten(values, t([1, 0, 0], [0, 0, 0]))


# ---------------------------------------------------------------------------------------
# Group baselines
# ---------------------------------------------------------------------------------------

R8 = t([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0])  # two groups of 4: means 0.75 and 0.25


def test_group_mean_advantages():
    close(est.group_mean_advantages(R8, 4), [0.25, -0.75, 0.25, 0.25, -0.25, -0.25, 0.75, -0.25])
    close(est.group_mean_advantages(t([3.0, 5.0]), 1), [0.0, 0.0])


def test_group_normalized_advantages():
    # group 1: centred [.25, -.75, .25, .25], unbiased var (3 * .0625 + .5625) / 3 = .25 -> std .5
    # group 2: centred [-.25, -.25, .75, -.25], same std .5
    close(est.group_normalized_advantages(R8, 4, eps=0.0), [0.5, -1.5, 0.5, 0.5, -0.5, -0.5, 1.5, -0.5])
    # default eps = 1e-4 (TRL's): .25 / .5001 = .49990002, .75 / .5001 = 1.49970006
    close(
        est.group_normalized_advantages(R8, 4),
        [0.49990002, -1.49970006, 0.49990002, 0.49990002, -0.49990002, -0.49990002, 1.49970006, -0.49990002],
    )
    # a zero-std group gets 0 / eps = 0; [0, 1] has std sqrt(.5) = .70710678: .5 / .70720678 = .70700680
    close(est.group_normalized_advantages(t([1.0, 1.0, 0.0, 1.0]), 2), [0.0, 0.0, -0.7070068, 0.7070068])


def test_rloo_advantages():
    # group 1: 1 - 2/3, 0 - 1, 1 - 2/3, 1 - 2/3; group 2: 0 - 1/3, 0 - 1/3, 1 - 0, 0 - 1/3
    third = 1.0 / 3.0
    close(est.rloo_advantages(R8, 4), [third, -1.0, third, third, -third, -third, 1.0, -third])
    close(est.rloo_advantages(t([1.0, 0.0, 1.0, 1.0]), 2), [1.0, -1.0, 0.0, 0.0])


def test_leave_one_out_targets():
    # G=2: row i gets r_j exactly
    assert torch.equal(
        est.leave_one_out_targets(t([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.3, 0.7]), 2),
        t([0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.7, 0.3]),
    )
    # G=3: [(0 + .5)/2, (1 + .5)/2, (1 + 0)/2]
    close(est.leave_one_out_targets(t([1.0, 0.0, 0.5]), 3), [0.25, 0.75, 0.5])


@pytest.mark.parametrize(
    "fn",
    [
        est.group_mean_advantages,
        est.group_normalized_advantages,
        est.rloo_advantages,
        est.leave_one_out_targets,
        est.reinforce_pp_baseline_advantages,
        est.cross_rollout_baselines,
    ],
)
def test_group_functions_reject_partial_groups(fn):
    with pytest.raises(ValueError, match="not a multiple of group_size 2"):
        fn(t([1.0, 0.0, 1.0]), 2)


def test_group_functions_reject_bad_shapes_and_sizes():
    with pytest.raises(ValueError, match=r"\(B,\)"):
        est.group_mean_advantages(t([1.0, 0.0], [1.0, 0.0]), 2)
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        est.rloo_advantages(t([1.0, 0.0]), 1)
    with pytest.raises(ValueError, match="differ in shape"):
        est.cross_rollout_advantages(t([1.0, 0.0]), t([0.5, 0.5, 0.5, 0.5]))


# ---------------------------------------------------------------------------------------
# REINFORCE++
# ---------------------------------------------------------------------------------------


def test_reinforce_pp_global_advantages_rows():
    # mean 2.5, unbiased var (2.25 + .25 + .25 + 2.25) / 3 = 5/3, std 1.29099445
    # 1.5 / 1.29099445 = 1.16189500, .5 / 1.29099445 = .38729833
    close(
        est.reinforce_pp_global_advantages(t([1.0, 2.0, 3.0, 4.0])),
        [-1.161895, -0.3872983, 0.3872983, 1.161895],
    )


def test_reinforce_pp_global_advantages_tokens():
    # valid tokens {1, 2, 3}: mean 2, std 1; padding (even nan) gives 0
    scores = t([1.0, 2.0, NAN], [3.0, 50.0, 50.0])
    mask = t([1, 1, 0], [1, 0, 0])
    close(est.reinforce_pp_global_advantages(scores, mask, eps=0.0), [[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])


def test_reinforce_pp_baseline_divides_by_std_of_group_centred_rewards():
    # A' = r - group mean = [0, 0, -.5, .5]; unbiased std of A' = sqrt(.5 / 3) = .40824829
    # .5 / .40824829 = 1.22474487. (Dividing by the std of the RAW rewards, .5, would give +-1.)
    close(est.reinforce_pp_baseline_advantages(t([1.0, 1.0, 0.0, 1.0]), 2), [0.0, 0.0, -1.2247449, 1.2247449])


def test_reinforce_pp_baseline_with_zero_std_groups():
    # groups [1,1], [0,1], [0,0], [1,0]: two have zero local std
    rewards = t([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    # A' = [0, 0, -.5, .5, 0, 0, .5, -.5]; unbiased var = 4 * .25 / 7 = 1/7, std .37796447
    # .5 / .37796447 = 1.32287566
    adv = est.reinforce_pp_baseline_advantages(rewards, 2)
    close(adv, [0.0, 0.0, -1.3228757, 1.3228757, 0.0, 0.0, 1.3228757, -1.3228757])
    # GRPO's local std is 0 there: with no eps it is 0/0
    assert torch.isnan(est.group_normalized_advantages(rewards, 2, eps=0.0)[:2]).all()
    # a batch in which EVERY group has zero spread stays finite (all zeros)
    flat = est.reinforce_pp_baseline_advantages(t([1.0, 1.0, 0.0, 0.0, 1.0, 1.0]), 2)
    assert torch.equal(flat, torch.zeros(6))
    # G=4 mixed: groups [1,1,1,1] and [1,0,0,0] -> A' = [0,0,0,0, .75,-.25,-.25,-.25]
    # mean 0; unbiased var = (.5625 + 3 * .0625) / 7 = .75 / 7, std .32732684
    # .75 / .32732684 = 2.29128785, .25 / .32732684 = .76376262
    close(
        est.reinforce_pp_baseline_advantages(t([1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]), 4),
        [0.0, 0.0, 0.0, 0.0, 2.2912878, -0.7637626, -0.7637626, -0.7637626],
    )


# ---------------------------------------------------------------------------------------
# POISE cross-rollout baseline
# ---------------------------------------------------------------------------------------


def test_cross_rollout_baselines_swap_pairs_exactly():
    preds = t([0.2, 0.7, 0.4, 0.9, 1e-8, 1.0])
    assert torch.equal(est.cross_rollout_baselines(preds), t([0.7, 0.2, 0.9, 0.4, 1.0, 1e-8]))
    # G=3: [(.4 + .7)/2, (.1 + .7)/2, (.1 + .4)/2]
    close(est.cross_rollout_baselines(t([0.1, 0.4, 0.7]), 3), [0.55, 0.4, 0.25])


def test_cross_rollout_advantages():
    rewards = t([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    preds = t([0.2, 0.7, 0.4, 0.9, 0.3, 0.1])
    adv, base = est.cross_rollout_advantages(rewards, preds)
    # b = [.7, .2, .9, .4, .1, .3]; A = [1-.7, 0-.2, 1-.9, 1-.4, 0-.1, 0-.3], no std division
    close(base, [0.7, 0.2, 0.9, 0.4, 0.1, 0.3])
    close(adv, [0.3, -0.2, 0.1, 0.6, -0.1, -0.3])
    # all-1 and all-0 groups still carry signal (r - g, not 0)
    assert (adv[2:] != 0).all()
    assert torch.equal(adv, rewards - base)


def test_cross_rollout_advantages_equal_r_minus_b_exactly_on_random_data():
    gen = torch.Generator().manual_seed(0)
    for group_size in (2, 3, 4):
        rewards = torch.bernoulli(torch.full((48,), 0.5), generator=gen)
        preds = torch.rand(48, generator=gen)
        adv, base = est.cross_rollout_advantages(rewards, preds, group_size)
        assert torch.equal(adv, rewards - base)


@pytest.mark.parametrize("group_size", [2, 3, 4])
@pytest.mark.parametrize("fn", [est.leave_one_out_targets, est.cross_rollout_baselines])
def test_sibling_functions_are_permutation_equivariant(fn, group_size):
    gen = torch.Generator().manual_seed(group_size)
    n_groups = 6
    values = torch.rand(n_groups * group_size, generator=gen)
    out = fn(values, group_size)
    # reorder whole groups
    group_perm = torch.randperm(n_groups, generator=gen)
    rows = (group_perm[:, None] * group_size + torch.arange(group_size)).reshape(-1)
    torch.testing.assert_close(fn(values[rows], group_size), out[rows], atol=0, rtol=0)
    # reorder rows inside every group the same way: siblings are a set, so outputs follow
    inner = torch.randperm(group_size, generator=gen)
    rows = (torch.arange(n_groups)[:, None] * group_size + inner).reshape(-1)
    torch.testing.assert_close(fn(values[rows], group_size), out[rows], atol=1e-7, rtol=0)


def test_variance_reduction_ratio():
    r = t([1.0, 0.0, 1.0, 0.0])  # Var(r) = .25
    assert est.variance_reduction_ratio(r, t([0.5, 0.5, 0.5, 0.5])) == pytest.approx(0.0)
    assert est.variance_reduction_ratio(r, r.clone()) == pytest.approx(1.0)
    # r - b = [.2, -.2, .4, -.4], Var = .1 -> 1 - .1 / .25 = .6
    assert est.variance_reduction_ratio(r, t([0.8, 0.2, 0.6, 0.4])) == pytest.approx(0.6)
    # r - b = [1, -1], Var = 1 vs Var(r) = .25 -> 1 - 4 = -3 (the baseline adds variance)
    assert est.variance_reduction_ratio(t([1.0, 0.0]), t([0.0, 1.0])) == pytest.approx(-3.0)
    # Var(r) == 0 -> 0.0 by convention
    assert est.variance_reduction_ratio(t([1.0, 1.0, 1.0]), t([0.2, 0.5, 0.9])) == 0.0


# ---------------------------------------------------------------------------------------
# KL estimators
# ---------------------------------------------------------------------------------------


def test_kl_estimators_values():
    # pi = .5, ref = .25: k1 = log 2 = .69314718, k2 = .5 * log(2)^2 = .24022651,
    # k3 = delta - 1 - log delta with delta = .5 -> -.5 + log 2 = .19314718
    # pi = .25, ref = .5: k1 = -log 2, k2 = .24022651, k3 = 2 - 1 - log 2 = .30685282
    logp = torch.log(t([0.5, 0.25, 0.3]))
    ref = torch.log(t([0.25, 0.5, 0.3]))
    close(est.kl_k1(logp, ref), [0.6931472, -0.6931472, 0.0])
    close(est.kl_k2(logp, ref), [0.2402265, 0.2402265, 0.0])
    close(est.kl_k3(logp, ref), [0.1931472, 0.3068528, 0.0])


def _expected_surrogate_grad(kl_fn, logits, ref_logp):
    """grad of sum_y sg(pi(y)) * kl(y): the exact expectation over y ~ pi of the per-sample loss gradient."""
    logits = logits.clone().requires_grad_(True)
    logp = torch.log_softmax(logits, dim=-1)
    (logp.exp().detach() * kl_fn(logp, ref_logp)).sum().backward()
    return logits.grad


def _true_kl_grad(logits, ref_logp, reverse):
    logits = logits.clone().requires_grad_(True)
    logp = torch.log_softmax(logits, dim=-1)
    kl = (logp.exp() * (logp - ref_logp)).sum() if reverse else (ref_logp.exp() * (ref_logp - logp)).sum()
    kl.backward()
    return logits.grad


def test_k2_gradient_equals_reverse_kl_gradient():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, generator=gen, dtype=torch.float64)
    ref_logp = torch.log_softmax(torch.randn(6, generator=gen, dtype=torch.float64), dim=-1)
    reverse = _true_kl_grad(logits, ref_logp, reverse=True)
    forward = _true_kl_grad(logits, ref_logp, reverse=False)
    assert reverse.abs().max() > 1e-2 and (reverse - forward).abs().max() > 1e-2
    # REINFORCE++ paper, App. B.1: k2 as a loss -> reverse-KL gradient
    torch.testing.assert_close(_expected_surrogate_grad(est.kl_k2, logits, ref_logp), reverse)
    # ... k3 as a loss -> forward-KL gradient; k1 as a loss -> 0 (ignores pi_ref)
    torch.testing.assert_close(_expected_surrogate_grad(est.kl_k3, logits, ref_logp), forward)
    torch.testing.assert_close(
        _expected_surrogate_grad(est.kl_k1, logits, ref_logp), torch.zeros(6, dtype=torch.float64)
    )


def test_kl_penalized_token_rewards_and_eq4_returns():
    outcome = t([1.0, 0.0])
    kl = t([0.1, 0.2, 0.3], [0.4, 0.5, NAN])
    mask = t([1, 1, 1], [1, 1, 0])
    rewards = est.kl_penalized_token_rewards(outcome, kl, mask, kl_coef=0.5)
    # -.5 * kl everywhere, outcome added on the last valid token, 0 on padding
    close(rewards, [[-0.05, -0.1, 0.85], [-0.2, -0.25, 0.0]])
    # Eq. (4): A_t = r - beta * sum_{i>=t} KL(i): row 0: 1 - .5 * [.6, .5, .3]; row 1: -.5 * [.9, .5]
    close(est.returns_to_go(rewards, mask), [[0.7, 0.75, 0.85], [-0.45, -0.25, 0.0]])
    with pytest.raises(ValueError, match="at least one valid token"):
        est.kl_penalized_token_rewards(outcome, kl, t([1, 1, 1], [0, 0, 0]), kl_coef=0.5)


# ---------------------------------------------------------------------------------------
# Returns and GAE
# ---------------------------------------------------------------------------------------


def test_returns_to_go():
    rewards = t([1.0, 2.0, 4.0], [3.0, NAN, 9.0])
    mask = t([1, 1, 1], [1, 0, 0])
    # gamma = .5: row 0: [1 + .5 * 2 + .25 * 4, 2 + .5 * 4, 4] = [3, 4, 4]
    close(est.returns_to_go(rewards, mask, gamma=0.5), [[3.0, 4.0, 4.0], [3.0, 0.0, 0.0]])
    close(est.returns_to_go(rewards, mask), [[7.0, 6.0, 4.0], [3.0, 0.0, 0.0]])


def test_gae_hand_computed():
    rewards = t([0.0, 0.0, 1.0], [0.0, 2.0, 0.0])
    values = t([0.5, 0.6, 0.8], [1.0, 0.5, NAN])
    mask = t([1, 1, 1], [1, 1, 0])
    # row 0, gamma 1, lam .5: deltas [.6-.5, .8-.6, 1-.8] = [.1, .2, .2]
    #   A2 = .2, A1 = .2 + .5 * .2 = .3, A0 = .1 + .5 * .3 = .25; returns = A + V = [.75, .9, 1]
    # row 1 (length 2, V after the end = 0): deltas [0 + .5 - 1, 2 + 0 - .5] = [-.5, 1.5]
    #   A1 = 1.5, A0 = -.5 + .5 * 1.5 = .25; returns [1.25, 2.0]
    adv, ret = est.gae_advantages(rewards, values, mask, gamma=1.0, lam=0.5)
    close(adv, [[0.25, 0.3, 0.2], [0.25, 1.5, 0.0]])
    close(ret, [[0.75, 0.9, 1.0], [1.25, 2.0, 0.0]])
    # gamma .9, lam .5, row 1: deltas [.9 * .5 - 1, 2 - .5] = [-.55, 1.5]; A0 = -.55 + .45 * 1.5 = .125
    adv, _ = est.gae_advantages(rewards, values, mask, gamma=0.9, lam=0.5)
    close(adv[1], [0.125, 1.5, 0.0])


def _ragged_batch(seed=0, batch=5, width=7):
    gen = torch.Generator().manual_seed(seed)
    lengths = [7, 1, 4, 6, 3][:batch]
    mask = torch.zeros(batch, width)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    rewards = torch.randn(batch, width, generator=gen, dtype=torch.float64)
    values = torch.randn(batch, width, generator=gen, dtype=torch.float64)
    # garbage on padding must not leak anywhere
    rewards[mask == 0] = NAN
    values[mask == 0] = INF
    return rewards, values, mask, lengths


def _gae_double_loop(rewards, values, lengths, gamma, lams):
    out = torch.zeros_like(rewards)
    for i, n in enumerate(lengths):
        for s in range(n):
            total = 0.0
            for k in range(s, n):
                next_v = values[i, k + 1].item() if k + 1 < n else 0.0
                delta = rewards[i, k].item() + gamma * next_v - values[i, k].item()
                total += (gamma * lams[i]) ** (k - s) * delta
            out[i, s] = total
    return out


@pytest.mark.parametrize("gamma", [1.0, 0.9])
@pytest.mark.parametrize("lam", [0.0, 0.5, 0.95, 1.0])
def test_gae_matches_double_loop_with_ragged_lengths(lam, gamma):
    rewards, values, mask, lengths = _ragged_batch()
    adv, ret = est.gae_advantages(rewards, values, mask, gamma=gamma, lam=lam)
    expected = _gae_double_loop(rewards, values, lengths, gamma, [lam] * len(lengths))
    torch.testing.assert_close(adv, expected)
    valid = mask.bool()
    torch.testing.assert_close(ret[valid], (expected + values)[valid])
    assert (adv[~valid] == 0).all() and (ret[~valid] == 0).all()


def test_gae_per_sequence_lambda():
    rewards, values, mask, lengths = _ragged_batch(seed=1)
    lams = [0.0, 0.5, 0.95, 1.0, 0.3]
    adv, _ = est.gae_advantages(rewards, values, mask, gamma=0.97, lam=torch.tensor(lams))
    torch.testing.assert_close(adv, _gae_double_loop(rewards, values, lengths, 0.97, lams))
    with pytest.raises(ValueError, match="per-sequence lam"):
        est.gae_advantages(rewards, values, mask, gamma=1.0, lam=torch.tensor(lams)[:, None])


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_gae_lambda_one_is_monte_carlo_return_minus_value(gamma):
    rewards, values, mask, _ = _ragged_batch(seed=2)
    adv, ret = est.gae_advantages(rewards, values, mask, gamma=gamma, lam=1.0)
    mc = est.returns_to_go(rewards, mask, gamma=gamma)
    valid = mask.bool()
    torch.testing.assert_close(adv[valid], (mc - values)[valid])
    torch.testing.assert_close(ret[valid], mc[valid])


def test_length_adaptive_lambda():
    # 1 - 1 / (.05 * l): l=40 -> .5, l=100 -> .8, l=1000 -> .98; l <= 20 clamps to 0
    close(
        est.length_adaptive_lambda(torch.tensor([0, 10, 20, 40, 100, 1000])), [0.0, 0.0, 0.0, 0.5, 0.8, 0.98]
    )
    close(est.length_adaptive_lambda(torch.tensor([200, 50]), alpha=0.01), [0.5, 0.0])
    with pytest.raises(ValueError, match="alpha"):
        est.length_adaptive_lambda(torch.tensor([10]), alpha=0.0)


# ---------------------------------------------------------------------------------------
# AsyPPO masks
# ---------------------------------------------------------------------------------------

# valid stds {.5, .1, .9, .3, .7, .2}; padding holds values that would win both cuts
STD = t([0.5, 0.1, 0.9, -1.0], [0.3, 0.7, 0.2, 1e9])
STD_MASK = t([1, 1, 1, 0], [1, 1, 1, 0])


def _bool(*rows):
    return torch.tensor(rows, dtype=torch.bool)


def test_low_disagreement_mask():
    # half of 6 valid tokens -> the 3 lowest: .1, .2, .3
    assert torch.equal(est.low_disagreement_mask(STD, STD_MASK, 0.5), _bool([0, 1, 0, 0], [1, 0, 1, 0]))
    # floor(6 / 3) = 2 lowest: .1, .2
    assert torch.equal(est.low_disagreement_mask(STD, STD_MASK, 1 / 3), _bool([0, 1, 0, 0], [0, 0, 1, 0]))
    assert torch.equal(est.low_disagreement_mask(STD, STD_MASK, 0.0), _bool([0, 0, 0, 0], [0, 0, 0, 0]))
    assert torch.equal(est.low_disagreement_mask(STD, STD_MASK, 1.0), _bool([1, 1, 1, 0], [1, 1, 1, 0]))


def test_high_disagreement_mask():
    # the 3 highest: .5, .9, .7
    assert torch.equal(est.high_disagreement_mask(STD, STD_MASK, 0.5), _bool([1, 0, 1, 0], [0, 1, 0, 0]))
    # the 2 highest: .9, .7
    assert torch.equal(est.high_disagreement_mask(STD, STD_MASK, 1 / 3), _bool([0, 0, 1, 0], [0, 1, 0, 0]))
    assert torch.equal(est.high_disagreement_mask(STD, STD_MASK, 1.0), _bool([1, 1, 1, 0], [1, 1, 1, 0]))


def test_disagreement_masks_select_exactly_k_with_ties_in_token_order():
    std = t([[0.1, 0.2, 0.2, 0.9]])
    ones = torch.ones(1, 4)
    # k = 2; the 2nd and 3rd lowest tie at .2: .1 and the first .2 (token order) are selected
    assert torch.equal(est.low_disagreement_mask(std, ones, 0.5), _bool([1, 1, 0, 0]))
    # k = 2 from the top: .9, then the first of the tied .2s
    assert torch.equal(est.high_disagreement_mask(std, ones, 0.5), _bool([0, 1, 0, 1]))
    # all equal: floor(0.2 * 6) = 1 token, the first valid one (row-major); padding is skipped
    flat = torch.full((2, 3), 0.4)
    holes = t([0, 1, 1], [1, 1, 1])
    assert torch.equal(est.low_disagreement_mask(flat, holes, 0.2), _bool([0, 1, 0], [0, 0, 0]))
    assert torch.equal(est.high_disagreement_mask(flat, holes, 0.2), _bool([0, 1, 0], [0, 0, 0]))


def test_disagreement_masks_hit_the_target_fraction_on_bf16_values():
    # Critic values in bf16 (the GPU recipe's critic_dtype): |V1 - V2| / 2 takes few distinct
    # values, so thousands of tokens tie; a strict cut at the quantile selected 0-20% here.
    gen = torch.Generator().manual_seed(0)
    # two critics' values near 0.6, where bf16's spacing is 2^-8
    v1, v2 = ((0.55 + 0.1 * torch.rand(40, 50, generator=gen)).to(torch.bfloat16) for _ in range(2))
    std = torch.stack([v1, v2]).float().std(0, correction=0).to(torch.bfloat16)
    mask = torch.ones(40, 50)
    mask[:, 45:] = 0  # 1800 valid tokens
    valid = mask.bool()
    assert std[valid].unique().numel() < 30  # heavy ties
    # a strict cut below the 361st smallest value leaves the whole tied block out
    assert int((std[valid] < std[valid].kthvalue(361).values).sum()) < 360
    low = est.low_disagreement_mask(std, mask, 0.2)
    high = est.high_disagreement_mask(std, mask, 0.2)
    assert int(low.sum()) == int(high.sum()) == 360  # exactly 20% of 1800
    assert not (low & ~mask.bool()).any() and not (high & ~mask.bool()).any()
    # every selected low token is <= every unselected valid one (rank selection)
    assert std[low].float().max() <= std[valid & ~low].float().min()
    assert std[high].float().min() >= std[valid & ~high].float().max()


def test_disagreement_masks_count_and_validation():
    std = torch.arange(100, dtype=torch.float32).view(4, 25)
    ones = torch.ones(4, 25)
    # .29 * 100 is 28.999... in floating point; the cut is still 29 tokens
    assert int(est.low_disagreement_mask(std, ones, 0.29).sum()) == 29
    assert int(est.high_disagreement_mask(std, ones, 0.29).sum()) == 29
    assert est.low_disagreement_mask(std, ones, 0.29).view(-1)[:29].all()
    assert est.high_disagreement_mask(std, ones, 0.29).view(-1)[71:].all()
    with pytest.raises(ValueError, match="fraction"):
        est.low_disagreement_mask(std, ones, 1.5)
    assert not est.high_disagreement_mask(std, torch.zeros(4, 25), 0.5).any()


def test_filtered_entropy_bonus_is_a_per_response_mean_over_the_full_length():
    entropies = t([1.0, 2.0, 3.0, float("nan")], [4.0, 4.0, 7.0, 7.0])
    mask = t([1, 1, 1, 0], [1, 1, 0, 0])
    keep = t([1, 0, 1, 1], [0, 1, 1, 1])  # I^H: token (0, 1) and (1, 0) filtered out
    # row 0: (1 + 3) / |o| = 4 / 3 (not / 2 kept tokens); row 1: 4 / 2
    bonus = est.filtered_entropy_bonus(entropies, keep, mask)
    assert torch.allclose(bonus, t(4 / 3, 2.0))
    # mean over responses 5/3, where a token mean over kept tokens would give (1 + 3 + 4) / 3
    assert torch.isclose(bonus.mean(), torch.tensor(5 / 3))
    # nothing filtered: the plain per-response mean entropy; an empty row gives 0
    assert torch.allclose(est.filtered_entropy_bonus(entropies, torch.ones(2, 4), mask), t(2.0, 4.0))
    assert est.filtered_entropy_bonus(t([[5.0, 5.0]]), t([[1, 1]]), t([[0, 0]])).item() == 0.0


def test_aggregate_and_cross_fit_critic_values():
    # 2 critics, 4 rows (one group of 4: rows 0-1 trained critic 0, rows 2-3 critic 1), 1 token
    values = torch.tensor([[[1.0], [2.0], [3.0], [4.0]], [[10.0], [20.0], [30.0], [40.0]]])
    assignment = est.critic_group_assignment(4, 4, 2)
    assert assignment.tolist() == [0, 0, 1, 1]
    close(est.aggregate_critic_values(values), [[5.5], [11.0], [16.5], [22.0]])
    close(est.aggregate_critic_values(values, "min"), [[1.0], [2.0], [3.0], [4.0]])
    # each row from the critic that did not train on it
    close(est.cross_fit_values(values, assignment), [[10.0], [20.0], [3.0], [4.0]])
    # 3 critics: the mean (or min) of the two others, e.g. row 3 (critic 0): (40 + 7) / 2
    three = torch.stack([values[0], values[1], torch.full((4, 1), 7.0)])
    close(est.cross_fit_values(three, torch.tensor([0, 1, 2, 0])), [[8.5], [4.5], [16.5], [23.5]])
    close(est.cross_fit_values(three, torch.tensor([0, 1, 2, 0]), "min"), [[7.0], [2.0], [3.0], [7.0]])
    with pytest.raises(ValueError, match="at least 2"):
        est.cross_fit_values(values[:1], assignment)


def test_sign_agreement():
    adv = t([0.5, -0.2, 0.0, 9.0], [-1.0, -1.0, 1.0, 0.0])
    ref = t([1.0, 1.0, 1.0, -1.0], [-1.0, -1.0, -1.0, 0.0])
    mask = t([1, 1, 1, 0], [1, 1, 1, 1])
    # both non-zero and valid: (0,0) +/+, (0,1) -/+, (1,0) -/-, (1,1) -/-, (1,2) +/- -> 3 of 5
    assert est.sign_agreement(adv, ref, mask) == pytest.approx(0.6)
    assert torch.tensor(est.sign_agreement(torch.zeros(2, 4), ref, mask)).isnan()


def test_dapo_keep_groups_counts_correctness():
    # DAPO Eq. (11): keep when 0 < #correct < G
    correct = torch.tensor([1, 1, 0, 0, 1, 0, 0, 1], dtype=torch.bool)
    assert est.dapo_keep_groups(correct, 2).tolist() == [False, False, True, True]
    assert est.dapo_keep_groups(correct, 4).tolist() == [True, True]
    assert est.dapo_keep_groups(torch.ones(4, dtype=torch.bool), 4).tolist() == [False]
    with pytest.raises(ValueError, match="multiple"):
        est.dapo_keep_groups(correct, 3)


# ---------------------------------------------------------------------------------------
# DAPO overlong penalty
# ---------------------------------------------------------------------------------------


def test_overlong_penalty_piecewise():
    lengths = torch.tensor([50, 80, 81, 90, 100, 101, 500])
    # L_max 100, L_cache 20: 0 up to 80, (80 - l) / 20 on (80, 100], -1 beyond
    close(est.overlong_penalty(lengths, 100, 20), [0.0, 0.0, -0.05, -0.5, -1.0, -1.0, -1.0])
    close(est.overlong_penalty(lengths, 100, 20, penalty=2.0), [0.0, 0.0, -0.1, -1.0, -2.0, -2.0, -2.0])
    with pytest.raises(ValueError, match="buffer_length"):
        est.overlong_penalty(lengths, 100, 0)
    with pytest.raises(ValueError, match="penalty"):
        est.overlong_penalty(lengths, 100, 20, penalty=-1.0)


# ---------------------------------------------------------------------------------------
# Critic data division and fit
# ---------------------------------------------------------------------------------------


def test_critic_group_assignment_splits_every_group_evenly_and_disjointly():
    # 2 prompts x 4 responses, 2 critics: per prompt the first two responses -> critic 0
    assert est.critic_group_assignment(8, 4, 2).tolist() == [0, 0, 1, 1, 0, 0, 1, 1]
    # 4 critics: one response each
    assert est.critic_group_assignment(8, 4, 4).tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    assert est.critic_group_assignment(4, 2, 1).tolist() == [0, 0, 0, 0]
    assignment = est.critic_group_assignment(48, 8, 2).view(6, 8)
    # every response goes to exactly one critic; each critic gets half of every prompt
    assert ((assignment == 0).sum(dim=1) == 4).all() and ((assignment == 1).sum(dim=1) == 4).all()
    with pytest.raises(ValueError, match="split evenly"):
        est.critic_group_assignment(6, 3, 2)
    with pytest.raises(ValueError, match="multiple of group_size"):
        est.critic_group_assignment(6, 4, 2)


def test_explained_variance():
    targets = t([1.0, 0.0, NAN], [1.0, 0.0, 5.0])
    mask = t([1, 1, 0], [1, 1, 0])
    # valid targets [1, 0, 1, 0]: var .25; a perfect fit -> 1
    assert est.explained_variance(targets, targets, mask) == pytest.approx(1.0)
    # predicting the mean .5 everywhere: residuals +-.5, var .25 -> 0
    assert est.explained_variance(torch.full((2, 3), 0.5), targets, mask) == pytest.approx(0.0)
    # values [.5, .5, 1, 0]: residuals [.5, -.5, 0, 0], mean 0, var .125 -> 1 - .5 = .5
    assert est.explained_variance(t([0.5, 0.5, 9.0], [1.0, 0.0, 9.0]), targets, mask) == pytest.approx(0.5)
    # residuals [-1, 1, -1, 1] (values flipped): var 1 -> 1 - 4 = -3
    assert est.explained_variance(t([0.0, 1.0, 0.0], [0.0, 1.0, 0.0]), targets, mask) == pytest.approx(-3.0)
    # constant targets: undefined
    assert torch.tensor(est.explained_variance(torch.zeros(2, 3), torch.ones(2, 3), torch.ones(2, 3))).isnan()


# ---------------------------------------------------------------------------------------
# REINFORCE++ (k >= 1, no group baseline) and process rewards
# ---------------------------------------------------------------------------------------


def test_reinforce_pp_global_normalization_where_a_group_has_zero_local_std():
    rewards = t([1.0, 1.0, 0.0, 1.0])  # G=2: group [1, 1] has zero local std
    # GRPO: 0 / eps there
    close(est.group_normalized_advantages(rewards, 2)[:2], [0.0, 0.0])
    # Eq. (5): mean .75, unbiased var (3 * .0625 + .5625) / 3 = .25, std .5
    # -> [.25 / .5, .25 / .5, -.75 / .5, .25 / .5]: the all-correct group still gets credit
    close(est.reinforce_pp_global_advantages(rewards, eps=0.0), [0.5, 0.5, -1.5, 0.5])


def test_process_reward_advantages_separate_normalization_and_return_to_go():
    rewards = t([0.0, 0.3, 0.0, -0.1], [0.1, 0.0, 0.0, NAN], [0.0, 0.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0])
    at = t([0, 1, 0, 1], [1, 0, 0, 0], [0, 0, 1, 0], [0, 0, 0, 0])
    mask = t([1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0])
    # group_size 2. Group 0 holds {.3, -.1, .1}: mean .1, unbiased std .2 -> {1, -1, 0}
    # row 0: [0, 1, 0, -1] -> return-to-go [0, 0, -1, -1]; row 1: [0, 0, 0] -> 0
    # group 1 holds a single reward: centred to 0
    close(
        est.process_reward_advantages(rewards, at, mask, group_size=2, eps=0.0),
        [[0.0, 0.0, -1.0, -1.0], [0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]],
    )
    # whole batch: {.3, -.1, .1, .5}: mean .2, unbiased var .2 / 3, std .25819889
    # -> {.3872983, -1.1618950, -.3872983, 1.1618950}
    # row 0: [0, .387, 0, -1.162] -> [-.7745967, -.7745967, -1.161895, -1.161895]
    # row 1: [-.387, 0, 0] -> [-.3872983, 0, 0, pad 0]; row 2: 1.162 at t=2 -> [1.162] * 3 then 0
    close(
        est.process_reward_advantages(rewards, at, mask, group_size=None, eps=0.0),
        [
            [-0.7745967, -0.7745967, -1.161895, -1.161895],
            [-0.3872983, 0.0, 0.0, 0.0],
            [1.161895, 1.161895, 1.161895, 0.0],
            [0.0, 0.0, 0.0, 0.0],
        ],
    )
    with pytest.raises(ValueError, match="multiple of group_size"):
        est.process_reward_advantages(rewards, at, mask, group_size=3)
