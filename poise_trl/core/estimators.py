"""Advantage, baseline, normalization and KL estimators: the math every trainer shares.

Small pure functions on torch tensors. Sequence-level tensors are (B,), consecutive runs of `group_size`
rows sharing a prompt; token-level tensors are (B, T), right-padded, with a 0/1 `mask`; outputs are 0 on
padding. Papers are cited by short name (docs/references.md); each equation as implemented is in
docs/algorithms.md.
"""

from __future__ import annotations

import math

import torch

# ---------------------------------------------------------------------------------------
# Masked statistics
# ---------------------------------------------------------------------------------------


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `values` over positions where `mask` is 1, over all positions or along `dim`.

    A slice with no valid position gives 0 (e.g. an empty completion contributes nothing
    to a per-sequence loss) rather than nan.
    """
    valid = mask.bool()
    # torch.where rather than values * mask: padding may hold inf/nan, and inf * 0 = nan.
    total = torch.where(valid, values, torch.zeros_like(values)).sum(dim=dim)
    count = valid.sum(dim=dim).to(total.dtype)
    return total / count.clamp(min=1)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(values - mean) / (std + eps) with mean and std over the valid positions only.

    The form (x - mean) / (std + eps) is that of the REINFORCE++ paper's Eqs. (5) and (7). The std is the
    Bessel-corrected (unbiased) one, as torch.std and TRL's GRPO statistics use, so at
    least two valid positions are required. Padding positions come back as 0.
    """
    valid = mask.bool()
    count = int(valid.sum())
    if count < 2:
        raise ValueError(f"masked_whiten needs at least 2 valid positions, got {count}")
    mean = masked_mean(values, mask)
    centered = torch.where(valid, values - mean, torch.zeros_like(values))
    std = (centered.pow(2).sum() / (count - 1)).sqrt()
    return centered / (std + eps)


# ---------------------------------------------------------------------------------------
# Group (per-prompt) baselines
# ---------------------------------------------------------------------------------------


def _grouped(rewards: torch.Tensor, group_size: int, min_group_size: int = 1) -> torch.Tensor:
    """(B,) -> (B // G, G), with the checks every group estimator needs."""
    if rewards.dim() != 1:
        raise ValueError(f"expected a (B,) tensor of sequence-level values, got shape {tuple(rewards.shape)}")
    if group_size < min_group_size:
        raise ValueError(f"group_size must be >= {min_group_size} here, got {group_size}")
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"batch size {rewards.numel()} is not a multiple of group_size {group_size}: "
            "rows must come in whole prompt groups (rows 0..G-1 = prompt 0, ...)"
        )
    return rewards.view(-1, group_size)


def _sibling_mean(values: torch.Tensor, group_size: int) -> torch.Tensor:
    """For each row, the mean of the other G-1 rows of its group.

    Gathers the siblings explicitly instead of computing (sum - self) / (G - 1): for G=2
    this returns the partner's value bit-exactly (no add-then-subtract rounding), which is
    what "b_1 = g(z_2)" means, and it avoids cancellation for larger G.
    """
    grouped = _grouped(values, group_size, min_group_size=2)
    others = torch.tensor(
        [[j for j in range(group_size) if j != i] for i in range(group_size)], device=values.device
    )
    return grouped[:, others].mean(dim=-1).reshape(-1)


def group_mean_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """A_i = r_i - mean_group(r): GRPO without std scaling (Dr. GRPO); REINFORCE++ paper, Eq. (6)."""
    grouped = _grouped(rewards, group_size)
    return (grouped - grouped.mean(dim=1, keepdim=True)).reshape(-1)


def group_normalized_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """GRPO: A_i = (r_i - mean_group) / (std_group + eps); REINFORCE++ paper, Eq. (3).

    std is the unbiased torch.std, as TRL's GRPOTrainer uses, and eps=1e-4 is TRL's value.
    A group whose rewards are all equal gets A = 0 (0 / eps): the REINFORCE++ paper, Sec. 2.2 item 2,
    describes how near-equal rewards make this estimator blow up.
    """
    grouped = _grouped(rewards, group_size, min_group_size=2)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    return (centered / (grouped.std(dim=1, keepdim=True) + eps)).reshape(-1)


def leave_one_out_targets(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Mean reward of each row's siblings: the POISE probe's training target.

    POISE paper, Sec. 3.1 ("Probe prediction objective"): the leave-one-out Monte-Carlo target
    excludes the row's own reward, so it stays independent of that row's features given the
    prompt and the probe learns V(prompt), not "is this answer right". For G=2, row i gets r_j.
    """
    return _sibling_mean(rewards, group_size)


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO: A_i = r_i - mean_{j != i} r_j; REINFORCE++ paper, Sec. 2.1 (RLOO bullet).

    Also POISE's bootstrap estimator before the probe exists (docs/algorithms.md, "Bootstrap").
    """
    return rewards - _sibling_mean(rewards, group_size)


# ---------------------------------------------------------------------------------------
# REINFORCE++ global normalization
# ---------------------------------------------------------------------------------------


def reinforce_pp_global_advantages(
    scores: torch.Tensor, mask: torch.Tensor | None = None, eps: float = 1e-8
) -> torch.Tensor:
    """REINFORCE++ Global Advantage Normalization, Eq. (5).

    Centres and scales by the mean/std over the WHOLE batch: over the rows of a (B,)
    tensor, or over the valid tokens of a (B, T) tensor when `mask` is given (e.g. the
    per-token returns of Eq. (4), see `kl_penalized_token_rewards` and `returns_to_go`).
    No per-prompt statistics are used, so this also serves k=1 batches.
    """
    if mask is None:
        mask = torch.ones_like(scores, dtype=torch.bool)
    return masked_whiten(scores, mask, eps)


def reinforce_pp_baseline_advantages(
    rewards: torch.Tensor, group_size: int, eps: float = 1e-8
) -> torch.Tensor:
    """REINFORCE++ w/ Baseline, Sec. 3.2, Eqs. (6)-(7).

    Step 1, Eq. (6): A' = r - mean_group(r). Step 2, Eq. (7):
    A = (A' - mean_batch(A')) / (std_batch(A') + eps), i.e. the std is that of the
    group-centred A' (not of the raw rewards, which is what TRL's scale_rewards="batch"
    divides by) and the batch mean of A' is subtracted again. With whole groups that mean
    is 0 up to rounding, so Eq. (7) reduces to dividing by the global std of A'.
    The statistics run over all B samples (REINFORCE++ paper, App. B.2 "Batch Construction").
    Groups whose rewards are all equal get A' = 0 and so A = 0, while GRPO's local std is
    0 there; a batch in which no group has any spread gives A = 0 (up to rounding)
    everywhere, never inf or nan.
    """
    return reinforce_pp_global_advantages(group_mean_advantages(rewards, group_size), eps=eps)


# ---------------------------------------------------------------------------------------
# POISE cross-rollout baseline
# ---------------------------------------------------------------------------------------


def cross_rollout_baselines(predictions: torch.Tensor, group_size: int = 2) -> torch.Tensor:
    """POISE baseline b_i from the OTHER rollout's probe prediction; POISE paper, Sec. 3.2.

    For G=2: b_1 = g(z_2), b_2 = g(z_1) (a bit-exact swap within each pair). For G>2:
    the mean of the siblings' predictions. b_i depends only on rollouts sampled
    independently of rollout i given the prompt, which is the condition of the POISE paper,
    Sec. 2.2 / Eq. (6) for the baseline term to have zero expectation.
    """
    return _sibling_mean(predictions, group_size)


def cross_rollout_advantages(
    rewards: torch.Tensor, predictions: torch.Tensor, group_size: int = 2
) -> tuple[torch.Tensor, torch.Tensor]:
    """POISE advantages A = r - b with b = `cross_rollout_baselines`; returns (A, b).

    POISE paper, Sec. 3.2 ("Cross-rollout baseline and advantage"); docs/algorithms.md: no std
    division, so all-0 and all-1 groups still carry signal r - g(z_j). Returning b lets the
    caller log it and check the invariant A == r - b.
    """
    if rewards.shape != predictions.shape:
        raise ValueError(
            f"rewards {tuple(rewards.shape)} and predictions {tuple(predictions.shape)} differ in shape"
        )
    baselines = cross_rollout_baselines(predictions, group_size)
    return rewards - baselines, baselines


def variance_reduction_ratio(rewards: torch.Tensor, baselines: torch.Tensor) -> float:
    """1 - Var(r - b) / Var(r): the share of reward variance the baseline removes.

    POISE paper, Sec. 4.2 ("Training dynamics of value estimator"): about 0.30 after the first
    phase. Negative when the baseline adds variance. Returns 0.0 when Var(r) == 0 (e.g. a
    batch where every answer is right), where the ratio is undefined: 0.0 reads as
    "no reduction" and keeps logged curves finite.
    """
    rewards, baselines = rewards.double(), baselines.double()
    reward_var = rewards.var(unbiased=False)
    if reward_var == 0:
        return 0.0
    # Population variances on both sides: the normalization cancels in the ratio anyway.
    return float(1.0 - (rewards - baselines).var(unbiased=False) / reward_var)


# ---------------------------------------------------------------------------------------
# KL estimators (REINFORCE++ paper, App. B.1)
# ---------------------------------------------------------------------------------------
# With delta = pi_ref(y) / pi_theta(y) and y sampled from pi_theta (REINFORCE++ paper, App. B.1):
#   k1 = -log delta,  k2 = 0.5 (log delta)^2,  k3 = delta - 1 - log delta.
# REINFORCE++'s choices: k1 is folded into the reward for the k=1 variant (Eq. (4), see
# `kl_penalized_token_rewards`); k2 is the separate loss term of REINFORCE++ w/ Baseline
# (Eq. (8)), because its expected gradient equals the reverse-KL gradient; k1 as a loss has
# a gradient that ignores pi_ref, and k3 as a loss follows the forward KL (TRL's beta > 0).


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1 = log(pi_theta / pi_ref) per token; REINFORCE++ paper, App. B.1.

    Unbiased for KL(pi_theta || pi_ref) under y ~ pi_theta; used inside the reward (Eq. (4)),
    never as a loss (its gradient does not depend on pi_ref).
    """
    return logp - ref_logp


def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k2 = 0.5 * (log(pi_theta / pi_ref))^2 per token; REINFORCE++ paper, App. B.1 and Eq. (8).

    As a loss, E_{y~pi_theta}[grad k2] = E[log(pi_theta/pi_ref) grad log pi_theta], the
    reverse-KL gradient: REINFORCE++ w/ Baseline's KL loss.
    """
    return 0.5 * (logp - ref_logp).pow(2)


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 = delta - 1 - log delta, delta = pi_ref / pi_theta, per token; REINFORCE++ paper, App. B.1.

    Non-negative and unbiased in value for KL(pi_theta || pi_ref), but as a loss its expected
    gradient is that of the forward KL(pi_ref || pi_theta) (REINFORCE++ paper, "k3 Analysis"). This is
    the estimator TRL's GRPOTrainer adds to the loss when beta > 0.
    """
    log_delta = ref_logp - logp
    return torch.exp(log_delta) - 1 - log_delta


def kl_penalized_token_rewards(
    outcome_rewards: torch.Tensor, kl_per_token: torch.Tensor, mask: torch.Tensor, kl_coef: float
) -> torch.Tensor:
    """Per-token rewards of REINFORCE++ (k=1): outcome on the last valid token, -kl_coef * k1 on every token.

    REINFORCE++ paper, Eq. (4): A_t = r(o, q) - beta * sum_{i>=t} KL(i); `returns_to_go` of these
    rewards (gamma=1) is exactly that A_t, to be normalized by Eq. (5). In Eq. (4) KL(i) is
    k1 of pi_theta_old against pi_ref, so pass `kl_k1(old_logp, ref_logp)`.
    `mask` must be right-padded: row i's last valid token is at index mask[i].sum() - 1.
    """
    lengths = mask.bool().sum(dim=1)
    if bool((lengths == 0).any()):
        raise ValueError("every row needs at least one valid token to carry its outcome reward")
    valid = mask.bool()
    rewards = torch.where(valid, -kl_coef * kl_per_token, torch.zeros_like(kl_per_token))
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    rewards[rows, lengths - 1] += outcome_rewards.to(rewards.dtype)
    return rewards


# ---------------------------------------------------------------------------------------
# Returns and GAE
# ---------------------------------------------------------------------------------------


def returns_to_go(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """G_t = sum_{k>=t, k valid} gamma^(k-t) r_k per row; 0 on padding.

    REINFORCE++ paper, Eq. (4) (the sum over i >= t; gamma=1 there, Sec. 3.3) and the process-rewards post,
    "Pitfall 1, Fix option 2" (a token's advantage is all future reward from that point).
    """
    valid = mask.bool()
    rewards = torch.where(valid, token_rewards, torch.zeros_like(token_rewards))
    out = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + gamma * running
        out[:, t] = running
    return torch.where(valid, out, torch.zeros_like(out))


def gae_advantages(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level GAE with ragged lengths; returns (advantages, returns = advantages + values).

    A_t = sum_{l=0}^{T-t-1} (gamma * lam)^l delta_{t+l},
    delta_t = r_t + gamma * V(s_{t+1}) - V(s_t); the VAPO paper (GAE in the preliminaries) and
    the AsyPPO paper (its A-bar with the mini-critics' mean value). The value after a row's
    last valid token is 0 (the episode has ended), so padding never leaks in.
    `lam` is a float or a (B,) tensor of per-sequence lambdas (VAPO paper, length-adaptive
    GAE, see `length_adaptive_lambda`); VAPO's decoupled GAE calls this twice, with
    lam=1 for the critic's targets and lam_policy for the policy's advantages.
    """
    valid = mask.bool()
    rewards = torch.where(valid, token_rewards, torch.zeros_like(token_rewards))
    vals = torch.where(valid, values, torch.zeros_like(values))
    if isinstance(lam, torch.Tensor):
        # A (B, 1) lambda would silently broadcast the (B,) recursion to (B, B).
        if lam.shape != rewards.shape[:1]:
            raise ValueError(
                f"per-sequence lam must have shape ({rewards.shape[0]},), got {tuple(lam.shape)}"
            )
        lam = lam.to(device=rewards.device, dtype=rewards.dtype)
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])
    next_advantage = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - vals[:, t]
        # On padding the recursion must restart at 0 so the last valid token sees V_next = 0.
        next_advantage = torch.where(valid[:, t], delta + gamma * lam * next_advantage, 0.0)
        next_value = vals[:, t]
        advantages[:, t] = next_advantage
    returns = torch.where(valid, advantages + vals, torch.zeros_like(advantages))
    return advantages, returns


def length_adaptive_lambda(lengths: torch.Tensor, alpha: float = 0.05) -> torch.Tensor:
    """VAPO's length-adaptive GAE lambda: lam = 1 - 1 / (alpha * l), clamped at 0.

    VAPO, "Length-adaptive GAE": choose lam so that
    sum_t lam^t ~ 1/(1 - lam) = alpha * l; alpha = 0.05 in its training details. For
    l < 1/alpha (20 tokens at alpha=0.05) the formula goes negative (and to -inf at l=0); a
    negative lambda makes (gamma*lam)^l alternate in sign, which no longer weights TD errors
    as GAE does, so it is clamped to 0, the one-step TD limit, which is where the formula
    heads as l shrinks. For alpha > 0 and l > 0 the value is already < 1, so the result lies
    in [0, 1).
    """
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    return (1.0 - 1.0 / (alpha * lengths.double())).clamp(min=0.0).to(torch.get_default_dtype())


# ---------------------------------------------------------------------------------------
# AsyPPO critic-disagreement masks
# ---------------------------------------------------------------------------------------


def _disagreement_cut(
    critic_std: torch.Tensor, mask: torch.Tensor, fraction: float, lowest: bool
) -> torch.Tensor:
    """Shared body of the two AsyPPO masks: the lowest or highest `fraction` of valid tokens, by rank."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be in [0, 1], got {fraction}")
    valid = mask.bool()
    pool = critic_std[valid].float()
    n = pool.numel()
    # The epsilon keeps e.g. 0.29 * 100 = 28.999... from flooring to 28.
    k = math.floor(fraction * n + 1e-9)
    selected = torch.zeros(n, dtype=torch.bool, device=pool.device)
    if k > 0:
        # Rank, not threshold: a block of tied values straddling the cut would otherwise be left out
        # whole (bf16 critic values tie often). A stable sort breaks ties by token order (row-major).
        order = torch.sort(pool, descending=not lowest, stable=True).indices
        selected[order[:k]] = True
    out = torch.zeros_like(valid)
    out[valid] = selected
    return out


def low_disagreement_mask(critic_std: torch.Tensor, mask: torch.Tensor, fraction: float) -> torch.Tensor:
    """True on exactly floor(fraction * n_valid) valid tokens: those of lowest critic std in the batch.

    AsyPPO paper, "Advantage masking based on value agreement": I^A_t = 0 when sigma_t is in
    Low_k(sigma) over the whole batch, i.e. multiply advantages by ~this_mask (the ablation's
    best fraction is 20%). Low_k is a rank selection: tokens tied at the cut are taken in
    token order (row-major over the (B, T) tensor) until k are selected, so bf16-quantised
    stds still mask k tokens. Padding is never selected.
    """
    return _disagreement_cut(critic_std, mask, fraction, lowest=True)


def high_disagreement_mask(critic_std: torch.Tensor, mask: torch.Tensor, fraction: float) -> torch.Tensor:
    """True on exactly floor(fraction * n_valid) valid tokens: those of highest critic std in the batch.

    AsyPPO paper, "Entropy filtering based on value divergence": I^H_t = 0 when sigma_t is in
    the top h% (the ablation's best is 20%), i.e. drop these tokens from the entropy bonus.
    Top_h is a rank selection with ties taken in token order, as in `low_disagreement_mask`.
    Padding is never selected.
    """
    return _disagreement_cut(critic_std, mask, fraction, lowest=False)


def filtered_entropy_bonus(entropies: torch.Tensor, keep: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """AsyPPO's entropy term per response, (B,): (1/|o|) sum_t I^H_t H_t; AsyPPO paper, Eq. J_PPO.

    The term sits inside J_PPO's per-response mean (1/|o|) sum_{t=1}^{|o|}, so the
    normaliser is the response's full length |o| (every valid token), not the number of
    tokens the filter keeps: filtering a token removes its entropy from the sum and does not
    re-weight the others. `keep` is I^H (1 = in the bonus). A row with no valid token gives 0.
    The caller averages over responses, as J_PPO's expectation over o does.
    """
    valid = mask.bool()
    kept = torch.where(valid & keep.bool(), entropies, torch.zeros_like(entropies))
    return kept.sum(dim=1) / valid.sum(dim=1).clamp(min=1).to(kept.dtype)


# ---------------------------------------------------------------------------------------
# Length shaping
# ---------------------------------------------------------------------------------------


def overlong_penalty(
    lengths: torch.Tensor, max_length: int, buffer_length: int, penalty: float = 1.0
) -> torch.Tensor:
    """DAPO soft overlong punishment, added to the outcome reward.

    DAPO (Yu et al. 2025, arXiv:2503.14476), Eq. (13); VAPO borrows Clip-Higher and the token-level
    loss from DAPO. With L_max = max_length and
    L_cache = buffer_length:  0 if l <= L_max - L_cache;
    ((L_max - L_cache) - l) / L_cache * penalty if L_max - L_cache < l <= L_max;
    -penalty if l > L_max. `penalty` = 1 is the paper's; it scales the whole curve.
    """
    if not 0 < buffer_length <= max_length:
        raise ValueError(f"need 0 < buffer_length <= max_length, got {buffer_length} and {max_length}")
    if penalty < 0:
        raise ValueError(f"penalty is a magnitude and must be >= 0, got {penalty}")
    expected_max = max_length - buffer_length
    lengths = lengths.to(torch.get_default_dtype())
    ramp = (expected_max - lengths) / buffer_length * penalty
    # Clamping the ramp into [-penalty, 0] gives all three pieces: it is >= 0 up to L_max - L_cache
    # and reaches -penalty exactly at L_max.
    return ramp.clamp(min=-penalty, max=0.0)


def dapo_keep_groups(correct: torch.Tensor, group_size: int) -> torch.Tensor:
    """DAPO dynamic sampling's filter, (B,) correctness -> (B // G,) bool: keep when 0 < #correct < G.

    DAPO (Yu et al. 2025, arXiv:2503.14476), Eq. (11): 0 < |{o_i | is_equivalent(a, o_i)}| < G.
    Counted on correctness, not on the shaped reward: a group that is all right (or all wrong)
    but whose lengths draw different overlong penalties is dropped, as in the paper.
    """
    grouped = _grouped(correct.bool(), group_size).sum(dim=1)
    return (grouped > 0) & (grouped < group_size)


# ---------------------------------------------------------------------------------------
# Critics: data division and fit (AsyPPO, VAPO)
# ---------------------------------------------------------------------------------------


def critic_group_assignment(batch_size: int, group_size: int, num_critics: int) -> torch.Tensor:
    """Which critic trains on each row, (B,) long: AsyPPO paper, "Group-level non-overlap data division".

    The G responses of every prompt are split evenly and disjointly among the M critics:
    within each group, rows 0..G/M-1 go to critic 0, the next G/M to critic 1, and so on.
    Every critic sees every prompt (the "perception synchronisation" the seed keeps) but
    different responses and rewards. Responses within a group are i.i.d. samples, so a split
    by position is as good as a random one, and it is the same on every rank.
    """
    if num_critics < 1:
        raise ValueError(f"num_critics must be >= 1, got {num_critics}")
    if group_size % num_critics:
        raise ValueError(
            f"group_size {group_size} is not a multiple of num_critics {num_critics}: each prompt's responses "
            "must split evenly among the critics"
        )
    if batch_size % group_size:
        raise ValueError(f"batch size {batch_size} is not a multiple of group_size {group_size}")
    per_critic = group_size // num_critics
    within_group = torch.arange(group_size) // per_critic
    return within_group.repeat(batch_size // group_size)


def aggregate_critic_values(values: torch.Tensor, aggregation: str = "mean") -> torch.Tensor:
    """V-bar from M critics' values (M, B, T): their mean (AsyPPO paper, A-bar) or their min.

    AsyPPO's value-aggregation ablation finds the mean better than the min.
    """
    if aggregation == "mean":
        return values.mean(0)
    if aggregation == "min":
        return values.min(0).values
    raise ValueError(f"aggregation must be 'mean' or 'min', got {aggregation!r}")


def cross_fit_values(values: torch.Tensor, assignment: torch.Tensor, aggregation: str = "mean") -> torch.Tensor:
    """Each row's V-bar from the critics that did NOT train on it, (M, B, T) -> (B, T).

    After the critics are fitted on a round (the AsyPPO paper's order: update, then V-bar), critic
    m has seen the returns of the rows with `assignment == m` (`critic_group_assignment`),
    so its value on those rows partly repeats their own outcome and would shrink their
    advantage. The other critics were fitted on the same prompts' OTHER responses: their value
    on row i carries what those siblings showed about the prompt, and does not depend on
    row i's own return, which keeps the baseline's term unbiased (the cross-rollout
    argument of the POISE paper, Sec. 3.2, Eq. (6)). Needs M >= 2.
    """
    num_critics = values.shape[0]
    if num_critics < 2:
        raise ValueError(f"cross-fitting needs at least 2 critics, got {num_critics}")
    own = torch.nn.functional.one_hot(assignment.long(), num_critics).T.bool()  # (M, B)
    own = own.view(num_critics, -1, *([1] * (values.dim() - 2))).expand_as(values)
    if aggregation == "mean":
        others = torch.where(own, torch.zeros_like(values), values)
        return others.sum(0) / (num_critics - 1)
    if aggregation == "min":
        return torch.where(own, torch.full_like(values, float("inf")), values).min(0).values
    raise ValueError(f"aggregation must be 'mean' or 'min', got {aggregation!r}")


def explained_variance(values: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(targets - values) / Var(targets) over the valid positions.

    The value model's fit metric that VAPO's value pretraining ("Value-Pretraining") trains until it is
    good enough, together with the value loss. 1 is a perfect fit, 0 is no better than
    predicting the mean, negative is worse. Population variances (the normalization cancels).
    nan when the targets do not vary (undefined; TRL's logger skips nan values).
    """
    valid = mask.bool()
    targets, values = targets[valid].double(), values[valid].double()
    target_var = targets.var(unbiased=False) if targets.numel() else torch.tensor(0.0)
    if target_var == 0:
        return float("nan")
    return float(1.0 - (targets - values).var(unbiased=False) / target_var)


def sign_agreement(advantages: torch.Tensor, reference: torch.Tensor, mask: torch.Tensor) -> float:
    """Share of valid positions where sign(advantages) == sign(reference), among those where both are non-zero.

    A critic diagnostic: `reference` is the Monte-Carlo advantage r_i - mean_group(r)
    (`group_mean_advantages`) broadcast over each response's tokens; a critic-based A_t that
    pushes a token the other way from its response's group-relative outcome disagrees.
    nan when no position has both non-zero.
    """
    both = mask.bool() & (advantages != 0) & (reference != 0)
    if not bool(both.any()):
        return float("nan")
    return float((torch.sign(advantages[both]) == torch.sign(reference[both])).double().mean())


# ---------------------------------------------------------------------------------------
# Training-free process rewards
# ---------------------------------------------------------------------------------------


def process_reward_advantages(
    process_rewards: torch.Tensor,
    process_mask: torch.Tensor,
    mask: torch.Tensor,
    group_size: int | None,
    eps: float = 1e-8,
) -> torch.Tensor:
    """Per-token advantages from process rewards placed at episode boundaries, (B, T).

    process-rewards post, "Pitfall 2": process rewards (marginal utilities, ~+-0.03) are normalized
    SEPARATELY from the outcome reward, here by the mean and the unbiased std over the
    positions where `process_mask` is 1, within each prompt group of `group_size` rows
    ("id2process[group_idx]") or over the whole batch when `group_size` is None.
    process-rewards post, "Pitfall 1, Fix option 2": the advantage of a token is the return-to-go
    (gamma = 1) of the normalized process rewards, so a token is credited with every later
    episode's progress and the within-sequence structure survives.
    A group holding a single process reward gets 0 there (centred, nothing to scale by);
    tokens after a row's last process reward, and padding, get 0.
    """
    valid = process_mask.bool() & mask.bool()
    rows = process_rewards.shape[0]
    group_size = rows if group_size is None else group_size
    if rows % group_size:
        raise ValueError(f"batch size {rows} is not a multiple of group_size {group_size}")
    normalized = torch.zeros_like(process_rewards)
    for start in range(0, rows, group_size):
        block, block_valid = process_rewards[start : start + group_size], valid[start : start + group_size]
        if int(block_valid.sum()) < 2:
            continue  # no reward, or a single one whose centred value is 0
        normalized[start : start + group_size] = masked_whiten(block, block_valid, eps)
    return returns_to_go(normalized, mask)
