"""Exact checks of the core math, written where mutation testing (benchmarks/mutation_report.py) found
code whose change no test noticed: boundaries, defaults, dtypes, the probe's standardization and PCA
trimming, the answer extraction's box rules, and the POISE / AsyPPO trainers' `compute_advantages`.

Each test asserts what the math or the docstring promises; seeds are cited as in poise_trl.core.estimators.
"""

from __future__ import annotations

import pytest
import torch
from helpers import build_trainer

from poise_trl.core import estimators as est
from poise_trl.core.metrics import pearson
from poise_trl.probe.estimator import GroupBuffer, LinearValueProbe, ProbeEstimator, _fit_pca, _fit_pca_fast
from poise_trl.probe.features import RolloutFeatures
from poise_trl.seam.grpo import Round
from poise_trl.tasks.family import answer_part, extract_tagged_answer
from poise_trl.tasks.math_grader import all_boxed, normalize_gold_answer

pytestmark = pytest.mark.usefixtures("single_thread")


def exact(actual, expected):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=0, rtol=0)


# ---------------------------------------------------------------------------------------
# estimators: defaults, boundaries, dtypes
# ---------------------------------------------------------------------------------------


def test_masked_whiten_default_eps_and_two_positions():
    # Two valid positions are enough (Bessel's n - 1 = 1). Values 0 and 2e-8: mean 1e-8, centred +-1e-8,
    # std sqrt(2e-16) = 1.41421356e-8; with eps 1e-8: 1e-8 / 2.41421356e-8 = 0.41421356 (Eq. (5)).
    values = torch.tensor([0.0, 2e-8, 5.0], dtype=torch.float64)
    mask = torch.tensor([1, 1, 0])
    torch.testing.assert_close(est.masked_whiten(values, mask), torch.tensor([-0.41421356, 0.41421356, 0.0],
                                                                           dtype=torch.float64))


def test_reinforce_pp_eps_is_passed_through():
    # [1, 3]: mean 2, unbiased std sqrt(2); with eps 1: +-1 / (1.41421356 + 1) = +-0.41421356
    torch.testing.assert_close(est.reinforce_pp_global_advantages(torch.tensor([1.0, 3.0]), eps=1.0),
                               torch.tensor([-0.41421356, 0.41421356]))
    # Eq. (6)-(7) on two groups of 2: A' = [-1, 1, -1, 1], std_batch 1.15470054; eps 1: 1 / 2.15470054
    torch.testing.assert_close(est.reinforce_pp_baseline_advantages(torch.tensor([0.0, 2.0, 5.0, 7.0]), 2, eps=1.0),
                               torch.tensor([-0.46410162, 0.46410162, -0.46410162, 0.46410162]))


def test_group_errors_name_the_fix():
    with pytest.raises(ValueError, match=r"^batch size 3 is not a multiple of group_size 2: rows must come in whole "
                                         r"prompt groups \(rows 0\.\.G-1 = prompt 0, \.\.\.\)$"):
        est.group_mean_advantages(torch.tensor([1.0, 0.0, 1.0]), 2)
    # GRPO's std needs two rows per group (REINFORCE++ paper, Eq. (3)).
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        est.group_normalized_advantages(torch.tensor([1.0, 0.0]), 1)


def test_cross_rollout_advantages_with_groups_of_four():
    # POISE paper, Sec. 3.2 for G > 2: b_i = mean of the 3 siblings' predictions
    rewards, predictions = torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.tensor([0.2, 0.4, 0.6, 0.8])
    advantages, baselines = est.cross_rollout_advantages(rewards, predictions, group_size=4)
    torch.testing.assert_close(baselines, torch.tensor([0.6, 1.6 / 3, 1.4 / 3, 0.4]))
    torch.testing.assert_close(advantages, rewards - baselines)


def test_kl_penalized_token_rewards_error_message():
    with pytest.raises(ValueError, match="^every row needs at least one valid token to carry its outcome reward$"):
        est.kl_penalized_token_rewards(torch.ones(2), torch.zeros(2, 3), torch.tensor([[1, 0, 0], [0, 0, 0]]), 0.1)


def test_single_token_completions():
    # T = 1: each row's one token carries the whole return (REINFORCE++, Eq. (4)); GAE: A = r - V.
    rewards, mask = torch.tensor([[2.0], [3.0]]), torch.ones(2, 1)
    exact(est.returns_to_go(rewards, mask), [[2.0], [3.0]])
    advantages, returns = est.gae_advantages(rewards, torch.tensor([[0.5], [1.0]]), mask, gamma=1.0, lam=0.9)
    exact(advantages, [[1.5], [2.0]])
    exact(returns, [[2.0], [3.0]])


def test_gae_per_sequence_lambda_dtype_and_shape_message():
    g = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(3, 6, generator=g), torch.randn(3, 6, generator=g)
    mask = torch.ones(3, 6)
    lam = torch.tensor([0.3, 0.7, 0.95])
    # lambda's dtype does not change the float32 recursion
    by_float32 = est.gae_advantages(rewards, values, mask, 0.99, lam)[0]
    by_float64 = est.gae_advantages(rewards, values, mask, 0.99, lam.double())[0]
    assert by_float64.dtype == torch.float32 and torch.equal(by_float32, by_float64)
    with pytest.raises(ValueError, match=r"must have shape \(3,\), got \(3, 1\)"):
        est.gae_advantages(rewards, values, mask, 0.99, lam[:, None])


def test_length_adaptive_lambda_dtype():
    assert est.length_adaptive_lambda(torch.tensor([40, 100])).dtype == torch.get_default_dtype()


def test_disagreement_masks_break_ties_in_token_order_at_scale():
    # AsyPPO's Low_k / Top_h as rank selections: among tied stds the earlier token (row-major) goes first,
    # also past the sizes where an unstable sort starts to reorder ties.
    g = torch.Generator().manual_seed(0)
    std = torch.randint(0, 3, (10, 30), generator=g).float()
    mask = torch.ones(10, 30)
    flat = std.flatten().tolist()
    for mask_fn, sign in ((est.low_disagreement_mask, 1.0), (est.high_disagreement_mask, -1.0)):
        chosen = sorted(range(300), key=lambda i: (sign * flat[i], i))[:90]
        expected = torch.zeros(300, dtype=torch.bool)
        expected[chosen] = True
        assert torch.equal(mask_fn(std, mask, 0.3).flatten(), expected)


def test_filtered_entropy_bonus_single_token_row():
    # (1/|o|) sum_t I^H_t H_t with |o| = 1 (AsyPPO paper, J_PPO)
    exact(est.filtered_entropy_bonus(torch.tensor([[3.0, 9.0]]), torch.ones(1, 2), torch.tensor([[1, 0]])), [3.0])


def test_overlong_penalty_edge_parameters():
    lengths = torch.tensor([0, 5, 10, 11])
    # buffer_length = 1 and = max_length are both allowed (DAPO Eq. (13): 0 < L_cache <= L_max)
    exact(est.overlong_penalty(torch.tensor([8, 9, 10, 11]), 10, 1), [0.0, 0.0, -1.0, -1.0])
    exact(est.overlong_penalty(lengths, 10, 10), [0.0, -0.5, -1.0, -1.0])
    # penalty 0 switches it off; 0.5 halves the curve
    exact(est.overlong_penalty(lengths, 10, 10, penalty=0.0), [0.0, 0.0, 0.0, 0.0])
    exact(est.overlong_penalty(lengths, 10, 10, penalty=0.5), [0.0, -0.25, -0.5, -0.5])
    assert est.overlong_penalty(lengths.double(), 10, 10).dtype == torch.get_default_dtype()


def test_critic_assignment_is_long_and_errors_name_the_fix():
    assignment = est.critic_group_assignment(8, 4, 2)
    assert assignment.dtype == torch.long
    exact(assignment, [0, 0, 1, 1, 0, 0, 1, 1])
    with pytest.raises(ValueError, match="^num_critics must be >= 1, got 0$"):
        est.critic_group_assignment(8, 4, 0)
    with pytest.raises(ValueError, match="must split evenly among the critics$"):
        est.critic_group_assignment(8, 4, 3)
    for fn in (est.aggregate_critic_values, lambda v, a: est.cross_fit_values(v, torch.tensor([0, 1]), a)):
        with pytest.raises(ValueError, match="^aggregation must be 'mean' or 'min', got 'max'$"):
            fn(torch.zeros(2, 2, 1), "max")


def test_cross_fit_values_when_one_critic_trained_on_every_row():
    # Every row fitted by critic 0: each row's value comes from critics 1 and 2 only.
    values = torch.tensor([[[1.0], [2.0]], [[10.0], [20.0]], [[30.0], [40.0]]])
    exact(est.cross_fit_values(values, torch.tensor([0, 0])), [[20.0], [30.0]])
    exact(est.cross_fit_values(values, torch.tensor([0, 0]), "min"), [[10.0], [20.0]])


def test_explained_variance_edge_cases():
    # Var(targets) = 1 exactly (population variance of [0, 2]) is defined; no valid position gives nan.
    assert est.explained_variance(torch.tensor([0.0, 2.0]), torch.tensor([0.0, 2.0]), torch.ones(2)) == 1.0
    assert est.explained_variance(torch.tensor([1.0, 1.0]), torch.tensor([0.0, 2.0]), torch.ones(2)) == 0.0
    empty = est.explained_variance(torch.zeros(2), torch.zeros(2), torch.zeros(2))
    assert empty != empty


def test_process_reward_advantages_group_edges():
    # B = 4 rows, T = 3 tokens, groups of 2: group 0 holds no process reward, group 1 exactly two.
    rewards = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 3.0, 0.0]])
    process_mask = torch.tensor([[0, 0, 0], [0, 0, 0], [1, 0, 0], [0, 1, 0]])
    mask = torch.ones(4, 3)
    # group 1: values {1, 3}, mean 2, unbiased std sqrt(2); eps 1: -1 / 2.41421356 and +1 / 2.41421356
    out = est.process_reward_advantages(rewards, process_mask, mask, 2, eps=1.0)
    third = 0.41421356
    torch.testing.assert_close(out, torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [-third, 0.0, 0.0],
                                                  [third, third, 0.0]]))
    # the batch as one group (group_size None) with 4 rows and 3 tokens; default eps 1e-8 on a tiny spread
    tiny = torch.zeros(4, 3)
    tiny[0, 0], tiny[1, 0] = 0.0, 2e-8
    flat = est.process_reward_advantages(tiny, process_mask.flip(0), mask, None)
    torch.testing.assert_close(flat[:2, 0], torch.tensor([-0.41421356, 0.41421356]))


# ---------------------------------------------------------------------------------------
# the probe: PCA trimming, ridge, predict, buffer, online estimator
# ---------------------------------------------------------------------------------------


def random_features(n: int, d: int, seed: int, offset: float = 3.0) -> tuple[RolloutFeatures, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    latent = torch.randn(n, 2, generator=g)
    prompt = offset + latent @ torch.randn(2, d, generator=g) + 0.1 * torch.randn(n, d, generator=g)
    response = -offset + latent.flip(1) @ torch.randn(2, d, generator=g) + 0.1 * torch.randn(n, d, generator=g)
    entropy = 1.0 + torch.rand(n, 3, generator=g)
    target = (0.5 + 0.3 * latent[:, 0] + 0.1 * torch.randn(n, generator=g)).clamp(0, 1)
    return RolloutFeatures(prompt, response, entropy), target


def test_pca_components_are_orthonormal_with_positive_pivots_and_trim_rank():
    g = torch.Generator().manual_seed(0)
    column = torch.randn(30, 1, generator=g, dtype=torch.float64)
    rank_one = column @ torch.randn(1, 4, generator=g, dtype=torch.float64)
    _, comps, _ = _fit_pca(rank_one + 5.0, 3)
    # one direction of spread: components 2 and 3 are beyond the numerical rank and set to 0
    assert comps[1:].abs().sum() == 0
    torch.testing.assert_close(comps[0].norm(), torch.tensor(1.0, dtype=torch.float64))
    full = torch.randn(30, 4, generator=g, dtype=torch.float64)
    _, comps, _ = _fit_pca(full, 4)
    torch.testing.assert_close(comps @ comps.T, torch.eye(4, dtype=torch.float64))
    pivots = comps.gather(1, comps.abs().argmax(1, keepdim=True))
    assert (pivots > 0).all()


def test_pca_is_scale_invariant_and_ignores_rounding_noise():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(20, 5, generator=g, dtype=torch.float64)
    _, comps, _ = _fit_pca(x, 3)
    for scale in (1e-12, 1e6):
        torch.testing.assert_close(_fit_pca(x * scale, 3)[1], comps)
    # identical rows far from the origin: x - mean is rounding noise, never a component
    same = torch.full((7, 5), 1000.1, dtype=torch.float64) + torch.arange(5, dtype=torch.float64) / 3
    assert _fit_pca(same, 3)[1].abs().sum() == 0
    assert _fit_pca(torch.zeros(6, 4, dtype=torch.float64), 2)[1].abs().sum() == 0


def ridge_reference(x: torch.Tensor, y: torch.Tensor, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Ridge on population-standardized columns, intercept unpenalized (docs/algorithms.md, "The probe"):
    (coefficients, in-sample predictions)."""
    mean, std = x.mean(0), x.std(0, unbiased=False)
    xs = (x - mean) / std
    coef = torch.linalg.solve(xs.T @ xs + alpha * torch.eye(x.shape[1], dtype=x.dtype), xs.T @ (y - y.mean()))
    return coef, y.mean() + xs @ coef


def test_probe_without_pca_is_ridge_on_standardized_features():
    features, target = random_features(40, 3, seed=2)
    target = 0.25 + 0.5 * target  # away from the clip at 0 and 1
    probe = LinearValueProbe(use_pca=False, ridge_alpha=0.3).fit(features, target)
    x = torch.cat([features.prompt, features.response, features.entropy], 1).double()
    coef, expected = ridge_reference(x, target.double(), 0.3)
    torch.testing.assert_close(probe.state_dict()["coef"], coef, rtol=1e-10, atol=0)
    assert 0 < expected.min() and expected.max() < 1  # no clipping in play
    torch.testing.assert_close(probe.insample_predictions, expected.float())
    torch.testing.assert_close(probe.predict(features), expected.float())


def test_probe_insample_predictions_equal_predict_and_are_clipped():
    features, target = random_features(60, 6, seed=3)
    steep = (target > 0.5).float()
    probe = LinearValueProbe(prompt_components=2, response_components=2, ridge_alpha=0.01).fit(features, steep)
    assert probe.insample_predictions.min() == 0.0 and probe.insample_predictions.max() == 1.0
    torch.testing.assert_close(probe.insample_predictions, probe.predict(features))
    raw = probe.predict(features)
    assert raw.dtype == torch.float32


def test_probe_errors_name_the_problem():
    features, target = random_features(10, 4, seed=4)
    probe = LinearValueProbe(prompt_components=2, response_components=2).fit(features, target)
    narrow = RolloutFeatures(features.prompt[:, :3], features.response[:, :3], features.entropy)
    with pytest.raises(ValueError, match="^features give 9 regression inputs, the probe was fit on 11$"):
        LinearValueProbe(use_pca=False).fit(features, target).predict(narrow)
    bad = RolloutFeatures(features.prompt.clone(), features.response, features.entropy)
    bad.prompt[0, 0] = float("inf")
    with pytest.raises(ValueError, match="^fit got non-finite features or targets$"):
        LinearValueProbe().fit(bad, target)
    with pytest.raises(ValueError, match="^prompt_pca was fitted on 10 rows, not these 6$"):
        LinearValueProbe().fit(RolloutFeatures(*(t[:6] for t in (features.prompt, features.response,
                                                                  features.entropy))),
                               target[:6], prompt_pca=probe.fitted_prompt_pca)


def test_probe_pca_method_choice():
    # "exact" always runs eigh; "fast" does too up to d = 512, then the randomized PCA, warm-started
    # from the previous fit's components (docs/algorithms.md, "The probe").
    for d, method in ((520, "exact"), (512, "fast")):
        features, target = random_features(24, d, seed=5)
        probe = LinearValueProbe(prompt_components=3, response_components=3, fit_method=method).fit(features, target)
        exact(probe.state_dict()["prompt_components"], _fit_pca(features.prompt, 3)[1])
    features, target = random_features(24, 520, seed=6)
    later, _ = random_features(24, 520, seed=7)
    probe = LinearValueProbe(prompt_components=3, response_components=3, fit_method="fast").fit(features, target)
    first = probe.state_dict()["prompt_components"]
    exact(first, _fit_pca_fast(features.prompt, 3)[1])
    probe.fit(later, target)
    exact(probe.state_dict()["prompt_components"], _fit_pca_fast(later.prompt, 3, first)[1])
    assert all(t.dtype == torch.float64 for t in probe.state_dict().values())  # the saved state is float64
    # the prompt PCA a probe hands on is the one it fitted, and a probe handed one uses it as it is
    exact(probe.fitted_prompt_pca[1], probe.state_dict()["prompt_components"])
    handed = _fit_pca(later.prompt, 3)
    reused = LinearValueProbe(prompt_components=3, response_components=3, fit_method="fast")
    reused.fit(later, target, prompt_pca=handed)
    exact(reused.state_dict()["prompt_components"], handed[1])
    exact(reused.state_dict()["response_components"], _fit_pca_fast(later.response, 3)[1])


def test_fast_pca_warm_start_uses_the_nonzero_previous_components():
    # Orthogonal centred columns with slowly decaying spread: the principal directions are the first basis
    # vectors. Started from them, one iteration stays there exactly; trimmed (zero) rows of the previous
    # fit are not start vectors.
    g = torch.Generator().manual_seed(0)
    a = torch.randn(60, 40, generator=g, dtype=torch.float64)
    q = torch.linalg.qr(a - a.mean(0)).Q  # combinations of centred columns: centred themselves
    x = (q * torch.linspace(10.0, 9.0, 40, dtype=torch.float64)).float()
    init = torch.eye(40, dtype=torch.float64)[:3]
    _, comps, _ = _fit_pca_fast(x, 3, init)
    torch.testing.assert_close(comps.abs(), init, atol=1e-5, rtol=0)
    with_trimmed = torch.cat([init, torch.zeros(1, 40, dtype=torch.float64)])
    exact(_fit_pca_fast(x, 3, with_trimmed)[1], comps)


def test_prompt_only_probe_reads_the_prompt_alone():
    features, target = random_features(30, 6, seed=8)
    probe = LinearValueProbe(prompt_components=3, inputs="prompt").fit(features, target)
    assert probe.state_dict()["coef"].shape == (3,)
    shuffled = RolloutFeatures(features.prompt, features.response.flip(0), features.entropy.flip(0))
    exact(probe.predict(shuffled), probe.insample_predictions)


def test_group_buffer_edges():
    features, target = random_features(6, 2, seed=9)
    buffer = GroupBuffer(capacity_rows=4)
    buffer.append(features[torch.arange(4)], target[:4].double(), group_size=4)  # a group the size of the buffer
    assert buffer.targets.dtype == torch.float32 and buffer.group_ids.dtype == torch.long
    single = GroupBuffer(capacity_rows=3)
    single.append(features[torch.arange(2)], target[:2], group_size=1)
    single.append(features[torch.arange(2)], target[:2], group_size=1)
    assert single.next_group_id == 4 and isinstance(single.next_group_id, int)
    exact(single.group_ids, [1, 2, 3])


def test_estimator_update_with_domains_and_stats():
    features, target = random_features(8, 4, seed=10)
    rewards = (target > 0.5).float()
    est_ = ProbeEstimator(prompt_components=2, response_components=2, bootstrap_steps=1, per_domain=True,
                          prompt_probe=True)
    stats = est_.update(features, rewards, 2, domains=["a"] * 4 + ["b"] * 4)
    buffer, probe = est_.buffers["a"], est_.probes["a"]
    fitted, observed = probe.insample_predictions.double(), buffer.targets.double()
    assert stats["a/insample_mae"] == pytest.approx(float((fitted - observed).abs().mean()))
    assert stats["a/insample_pearson"] == pytest.approx(pearson(fitted, observed), nan_ok=True)
    predictions, available = est_.predict(features, domains=["a"] * 4 + ["c"] * 4)
    assert available.dtype == torch.bool
    exact(available, [True] * 4 + [False] * 4)
    # the prompt-only probe is fitted on the same buffer rows and targets, reusing the prompt PCA
    reference = LinearValueProbe(prompt_components=2, response_components=2, inputs="prompt")
    reference.fit(buffer.features, buffer.targets)
    exact(est_.predict_prompts(features.prompt[:4], ["a"] * 4)[0], reference.predict(features[torch.arange(4)]))
    with pytest.raises(ValueError, match="one domain per group"):
        est_.update_from_targets(features, target, 2, domains=["a", "a", "a", "a", "a", "b", "b", "b"])


# ---------------------------------------------------------------------------------------
# reward extraction
# ---------------------------------------------------------------------------------------


def test_adjacent_and_nearby_boxes():
    assert all_boxed(r"\boxed{1}\boxed{2}") == ["1", "2"]
    # math-verify's rule: boxes less than 10 characters apart are one answer
    assert normalize_gold_answer(r"\boxed{1}123456789\boxed{2}") == "1, 2"
    assert normalize_gold_answer(r"\boxed{1}1234567890\boxed{2}") == "2"
    # ... or less than 70 with a separator (",", ";", "and", "or") and different contents
    gap = "x" * 66
    assert normalize_gold_answer(r"\boxed{1}" + gap + r" or\boxed{2}") == "1, 2"
    assert normalize_gold_answer(r"\boxed{1}" + gap + r"x or\boxed{2}") == "2"
    assert normalize_gold_answer(r"\boxed{1}, and then also \boxed{1}") == "1"
    assert normalize_gold_answer(r"\boxed{1} x; y = \boxed{2}; z = \boxed{3}") == "1, 2, 3"
    assert normalize_gold_answer(r"\boxed{1} no no no \boxed{2}") == "2"
    assert normalize_gold_answer(r"\boxed{1} orange juice \boxed{2}") == "2"  # "or" only as a word


def test_extract_tagged_answer():
    assert extract_tagged_answer("<answer> 1 </answer> then <answer>\n2\n</answer>") == "2"
    assert extract_tagged_answer("<think><answer>1</answer></think><answer>3</answer>") == "3"
    assert extract_tagged_answer("<think><answer>1</answer>") is None
    assert extract_tagged_answer("no tags") is None
    assert answer_part("<think>a</think>b</think>c") == "c"


# ---------------------------------------------------------------------------------------
# trainers: compute_advantages on a built trainer
# ---------------------------------------------------------------------------------------


def poise_trainer(model_dir, out, **overrides):
    recipe = {"algo": "poise", "model": str(model_dir), "dataset": "toy-arith", "dataset_size": 16, "eval_limit": 4,
              "per_device_train_batch_size": 4, "num_generations": 2, "max_completion_length": 8, "max_steps": 1,
              "probe_bootstrap_steps": 1, "probe_prompt_components": 2, "probe_response_components": 2, "seed": 0,
              **overrides}
    return build_trainer(recipe, out)


def poise_round(trainer, features, rewards, inputs=(), columns=None):
    """One generation round's advantages, the features delivered as TRL's own no-grad pass delivers them."""
    trainer.round = Round(list(inputs), features=features, feature_source="trl_pass", table_columns=columns or {})
    return trainer.compute_advantages(rewards, {})


def test_poise_compute_advantages_bootstrap_then_cross_rollout(tmp_path, tiny_random_model_dir):
    trainer = poise_trainer(tiny_random_model_dir, tmp_path / "run")
    metrics = trainer._metrics["train"]
    first, _ = random_features(4, 4, seed=11)
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    # bootstrap round (docs/algorithms.md, "Bootstrap"): RLOO, A_1 = r_1 - r_2
    trainer._step_floor = torch.tensor([True, False])  # prompt selection: group 0 from the random floor
    exact(poise_round(trainer, first, rewards.double()), [1.0, -1.0, 0.0, 0.0])
    assert trainer.round.table_columns["baseline"] == [0.0, 1.0, 1.0, 1.0]  # b = r - A, RLOO's partner reward
    # share of zero-signal groups (all rewards equal) among the floor's and the probe's prompts
    assert metrics["selection/zero_signal_floor"] == [0.0] and metrics["selection/zero_signal_probe"] == [1.0]
    assert metrics["probe/active_fraction"] == [0.0] and metrics["probe/features_from_trl_pass"] == [1.0]
    assert metrics["probe/refit_count"] == [1.0] and metrics["probe/buffer_rows"] == [4.0]
    assert trainer.value_estimator.refit_count == 1
    # next round: A_1 = r_1 - g(z_2), A_2 = r_2 - g(z_1) with the probe fitted at the end of the previous round
    second, _ = random_features(4, 4, seed=12)
    rewards = torch.tensor([0.0, 1.0, 1.0, 1.0])
    predictions, available = trainer.value_estimator.predict(second)
    assert available.all()
    trainer._step_floor = None
    advantages = poise_round(trainer, second, rewards.double())
    assert advantages.dtype == torch.float32  # the probe's float32 arithmetic, whatever the rewards' dtype
    exact(advantages, rewards - predictions.view(-1, 2).flip(1).reshape(-1))
    exact(torch.tensor(trainer.round.table_columns["baseline"]), predictions.view(-1, 2).flip(1).reshape(-1))
    assert metrics["probe/active_fraction"][-1] == 1.0 and metrics["probe/invariant_max_abs_error"][-1] == 0.0
    assert metrics["probe/buffer_rows"][-1] == 8.0 and trainer.value_estimator.refit_count == 2
    record = trainer.probe_history[-1]
    assert record["probe_active"] and record["predictions"] == predictions.tolist()
    assert record["targets"] == [1.0, 0.0, 1.0, 1.0]  # leave-one-out: each row's partner


def test_poise_compute_advantages_mixes_probe_and_rloo_by_group(tmp_path, tiny_random_model_dir):
    trainer = poise_trainer(tiny_random_model_dir, tmp_path / "run", probe_domain_column="task", num_generations=4,
                            per_device_train_batch_size=8)
    features, _ = random_features(8, 4, seed=13)
    poise_round(trainer, features, torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0]),
                inputs=[{"task": "a"}] * 4 + [{"task": "b"}] * 4)
    # domain "c" has no fitted probe: its group falls back to RLOO, domain "a"'s uses the probe with
    # b_i = the mean of the 3 siblings' predictions (POISE paper, Sec. 3.2 for G > 2)
    second, _ = random_features(8, 4, seed=14)
    predictions, _ = trainer.value_estimator.predict(second, ["a"] * 4 + ["c"] * 4)
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    advantages = poise_round(trainer, second, rewards, inputs=[{"task": "a"}] * 4 + [{"task": "c"}] * 4)
    exact(advantages[:4], rewards[:4] - est.cross_rollout_baselines(predictions[:4], 4))
    exact(advantages[4:], [1.0, -1.0 / 3, -1.0 / 3, -1.0 / 3])
    assert trainer._metrics["train"]["probe/active_fraction"][-1] == 0.5


def test_poise_logs_the_variance_reduction_of_each_task_over_the_probes_rows(tmp_path, tiny_random_model_dir):
    trainer = poise_trainer(tiny_random_model_dir, tmp_path / "run", num_generations=2, per_device_train_batch_size=8)
    metrics = trainer._metrics["train"]
    tasks = {"task": ["a", "a", "b", "b", "c", "c", "a", "a"]}
    poise_round(trainer, random_features(8, 4, seed=15)[0], torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0]),
                columns=tasks)
    # bootstrap round (RLOO, every row counted): b's rewards are all equal, nothing to reduce, no entry
    assert "probe/b/variance_reduction" not in metrics
    assert metrics["probe/a/variance_reduction"] == [pytest.approx(est.variance_reduction_ratio(
        torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0.0, 1.0, 1.0, 1.0])))]
    rewards = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0])
    features = random_features(8, 4, seed=16)[0]
    predictions, available = trainer.value_estimator.predict(features)
    assert available.all()
    poise_round(trainer, features, rewards, columns=tasks)
    baselines = predictions.view(-1, 2).flip(1).reshape(-1)
    for task, rows in (("a", [0, 1, 6, 7]), ("b", [2, 3]), ("c", [4, 5])):
        assert metrics[f"probe/{task}/variance_reduction"][-1] == pytest.approx(
            est.variance_reduction_ratio(rewards[rows], baselines[rows]))


def test_poise_compute_advantages_with_its_own_feature_pass(tmp_path, tiny_random_model_dir):
    # No TRL no-grad pass this round: the seam runs one of its own over prompt + completion.
    trainer = poise_trainer(tiny_random_model_dir, tmp_path / "run")
    g = torch.Generator().manual_seed(0)
    vocab = len(trainer.processing_class)
    output = {"prompt_ids": torch.randint(3, vocab, (4, 3), generator=g), "prompt_mask": torch.ones(4, 3).long(),
              "completion_ids": torch.randint(3, vocab, (4, 4), generator=g),
              "completion_mask": torch.ones(4, 4).long()}
    trainer.round = Round([])
    trainer.round.features, trainer.round.feature_source = trainer.round_features(output)
    exact(trainer.compute_advantages(torch.tensor([0.0, 1.0, 1.0, 0.0]), output), [-1.0, 1.0, 1.0, -1.0])
    assert trainer._metrics["train"]["probe/features_from_extra_pass"] == [1.0]
    assert len(trainer.value_estimator.buffers["all"]) == 4


ASYPPO_VARIANTS = {
    "before_update": {},
    "after_update": {"critic_values": "after_update", "lambda_critic": 0.9, "length_adaptive_alpha": 0.5,
                     "whiten_advantages": False, "critic_aggregation": "min", "gamma": 0.95},
    "cross_fit": {"critic_values": "cross_fit", "adv_mask_fraction": 0.4, "entropy_filter_fraction": 0.1,
                  "positive_reward_threshold": 0.5, "critic_aggregation": "min", "gamma": 0.9},
}


def asyppo_batch(vocab: int):
    """8 rows (2 prompts x 4 responses), ragged right-padded completions, one of them empty."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([5, 3, 4, 1, 5, 2, 0, 4])
    completion_mask = (torch.arange(5)[None, :] < lengths[:, None]).long()
    output = {"prompt_ids": torch.randint(3, vocab, (8, 3), generator=g), "prompt_mask": torch.ones(8, 3).long(),
              "completion_ids": torch.randint(3, vocab, (8, 5), generator=g), "completion_mask": completion_mask}
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.5])
    return output, rewards


@pytest.mark.parametrize("variant", sorted(ASYPPO_VARIANTS))
def test_asyppo_compute_advantages_follows_the_paper(tmp_path, tiny_random_model_dir, variant):
    cfg_overrides = ASYPPO_VARIANTS[variant]
    recipe = {"algo": "asyppo", "model": str(tiny_random_model_dir), "dataset": "toy-arith", "dataset_size": 16,
              "eval_limit": 4, "per_device_train_batch_size": 8, "num_generations": 4, "max_completion_length": 5,
              "max_steps": 1, "critic_learning_rate": 1e-2, "seed": 0, **cfg_overrides}
    trainer = build_trainer(recipe, tmp_path / "run")
    cfg = trainer.args
    output, rewards = asyppo_batch(len(trainer.processing_class))
    ids = torch.cat([output["prompt_ids"], output["completion_ids"]], 1)
    attention = torch.cat([output["prompt_mask"], output["completion_mask"]], 1)
    mask = output["completion_mask"]
    prior = trainer.critics.values(ids, attention, 5)
    fits = []
    update = trainer.critics.update

    def recording_update(*args):
        fits.append((args, update(*args)))
        return fits[-1][1]

    trainer.critics.update = recording_update
    advantages = trainer.compute_advantages(rewards, output)

    # outcome reward on the last valid token; the empty row carries nothing (AsyPPO paper, step 1)
    token_rewards = torch.zeros(8, 5)
    for row, length in enumerate(mask.sum(1).tolist()):
        if length:
            token_rewards[row, length - 1] = rewards[row]
    prior_value = est.aggregate_critic_values(prior, cfg.critic_aggregation)
    (_, _, width, fit_targets, fit_mask, assignment), fit = fits[0]
    assert len(fits) == 1 and width == 5 and torch.equal(fit_mask, mask)
    if cfg.lambda_critic == 1.0:
        # GAE(lambda=1)'s return is the Monte-Carlo return itself, bit for bit (no (G - V) + V rounding)
        targets = est.returns_to_go(token_rewards, mask, cfg.gamma)
        assert torch.equal(fit_targets, targets)
    else:
        targets = est.gae_advantages(token_rewards, prior_value, mask, cfg.gamma, cfg.lambda_critic)[1]
        torch.testing.assert_close(fit_targets, targets)
    exact(assignment, [0, 0, 1, 1, 0, 0, 1, 1])  # group-level non-overlap division

    values = prior if cfg.critic_values == "before_update" else trainer.critics.values(ids, attention, 5)
    if cfg.critic_values == "cross_fit":
        value = est.cross_fit_values(values, assignment, cfg.critic_aggregation)
    else:
        value = est.aggregate_critic_values(values, cfg.critic_aggregation)
    lam = cfg.lambda_policy if cfg.length_adaptive_alpha is None else est.length_adaptive_lambda(
        mask.sum(1), cfg.length_adaptive_alpha)
    raw = est.gae_advantages(token_rewards, value, mask, cfg.gamma, lam)[0]
    expected = est.masked_whiten(raw, mask) if cfg.whiten_advantages else raw
    critic_std = values.std(0, correction=0)
    low = est.low_disagreement_mask(critic_std, mask, cfg.adv_mask_fraction)
    high = est.high_disagreement_mask(critic_std, mask, cfg.entropy_filter_fraction)
    expected = torch.where(low, torch.zeros_like(expected), expected)
    torch.testing.assert_close(advantages, expected)
    assert low.sum() == int(cfg.adv_mask_fraction * 24 + 1e-9)  # 24 valid tokens

    exact(output["entropy_filter"], high.float())
    positive = (rewards >= cfg.positive_reward_threshold).float()
    exact(output["positive"], positive)
    assert output["num_positive_tokens"] == (mask * positive[:, None]).sum()
    metrics = trainer._metrics["train"]
    assert metrics["vapo/positive_fraction"] == [positive.mean().item()]
    assert metrics["vapo/actor_frozen"] == [0.0]
    assert metrics["critic/value_loss"] == [fit["value_loss"]]
    # sigma_t: the population std over the critics (|V1 - V2| / 2 for two)
    quantiles = torch.quantile(critic_std[mask.bool()], torch.tensor([0.1, 0.5, 0.9])).tolist()
    assert [metrics[f"critic/std_{q}"][0] for q in ("p10", "p50", "p90")] == pytest.approx(quantiles)
    if cfg.length_adaptive_alpha is not None:
        assert metrics["vapo/lambda_policy_mean"] == [pytest.approx(lam.mean().item())]
    else:
        assert "vapo/lambda_policy_mean" not in metrics
    record = trainer.critic_history[-1]
    assert record["value_loss"] == fit["value_loss"]
    assert record["advantage_raw_std"] == pytest.approx(raw[mask.bool()].std().item())
    assert record["adv_masked_fraction"] == pytest.approx(low.sum().item() / 24)
    assert record["entropy_filtered_fraction"] == pytest.approx(high.sum().item() / 24)
    assert record["explained_variance_prior"] == pytest.approx(est.explained_variance(prior_value, targets, mask),
                                                               nan_ok=True)
    assert record["explained_variance"] == pytest.approx(est.explained_variance(value, targets, mask), nan_ok=True)


def test_asyppo_raw_std_with_one_and_two_valid_tokens(tmp_path, tiny_random_model_dir):
    recipe = {"algo": "asyppo", "model": str(tiny_random_model_dir), "dataset": "toy-arith", "dataset_size": 16,
              "eval_limit": 4, "per_device_train_batch_size": 8, "num_generations": 4, "max_completion_length": 5,
              "max_steps": 1, "seed": 0, "whiten_advantages": False}
    trainer = build_trainer(recipe, tmp_path / "run")
    output, rewards = asyppo_batch(len(trainer.processing_class))
    for valid_tokens in (1, 2):
        mask = torch.zeros(8, 5).long()
        mask[:valid_tokens, 0] = 1
        advantages = trainer.compute_advantages(rewards, {**output, "completion_mask": mask})
        # the spread of the raw advantages: none with a single token (0, not nan), the sample std with two
        raw = advantages[mask.bool()]
        expected = 0.0 if valid_tokens == 1 else (raw[0] - raw[1]).abs().item() / 2**0.5
        assert trainer.critic_history[-1]["advantage_raw_std"] == pytest.approx(expected)
    assert expected > 0
