"""Advantage, baseline, normalization and KL estimators: the math every trainer shares.

Small pure functions on torch tensors. Sequence-level tensors are (B,), consecutive runs of `group_size`
rows sharing a prompt; token-level tensors are (B, T), right-padded, with a 0/1 `mask`; outputs are 0 on
padding. Papers are cited by short name (docs/references.md); each equation as implemented is in
docs/algorithms.md.
"""

from __future__ import annotations

import math

import torch

# --- Masked statistics -----------------------------------------------------------------


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `values` where `mask` is 1, overall or along `dim`; a slice with no valid position gives 0."""
    valid = mask.bool()
    # torch.where rather than values * mask: padding may hold inf/nan, and inf * 0 = nan.
    total = torch.where(valid, values, torch.zeros_like(values)).sum(dim=dim)
    count = valid.sum(dim=dim).to(total.dtype)
    return total / count.clamp(min=1)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(values - mean) / (std + eps) over >= 2 valid positions, unbiased std (REINFORCE++, Eqs. 5, 7)."""
    valid = mask.bool()
    count = int(valid.sum())
    if count < 2:
        raise ValueError(f"masked_whiten needs at least 2 valid positions, got {count}")
    mean = masked_mean(values, mask)
    centered = torch.where(valid, values - mean, torch.zeros_like(values))
    std = (centered.pow(2).sum() / (count - 1)).sqrt()
    return centered / (std + eps)


# --- Group (per-prompt) baselines ------------------------------------------------------


def _grouped(rewards: torch.Tensor, group_size: int, min_group_size: int = 1) -> torch.Tensor:
    """(B,) -> (B // G, G), with the checks every group estimator needs."""
    if rewards.dim() != 1:
        raise ValueError(f"expected a (B,) tensor of sequence-level values, got shape {tuple(rewards.shape)}")
    if group_size < min_group_size:
        raise ValueError(f"group_size must be >= {min_group_size} here, got {group_size}")
    if rewards.numel() % group_size != 0:
        raise ValueError(f"batch size {rewards.numel()} is not a multiple of group_size {group_size}: "
                         "rows must come in whole prompt groups (rows 0..G-1 = prompt 0, ...)")
    return rewards.view(-1, group_size)


def _sibling_mean(values: torch.Tensor, group_size: int) -> torch.Tensor:
    """Each row's mean of the other G-1 rows of its group (gathered: for G=2 the partner, bit-exactly)."""
    grouped = _grouped(values, group_size, min_group_size=2)
    others = torch.tensor([[j for j in range(group_size) if j != i] for i in range(group_size)], device=values.device)
    return grouped[:, others].mean(dim=-1).reshape(-1)


def group_mean_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """A_i = r_i - mean_group(r): GRPO without std scaling (Dr. GRPO); REINFORCE++ paper, Eq. (6)."""
    grouped = _grouped(rewards, group_size)
    return (grouped - grouped.mean(dim=1, keepdim=True)).reshape(-1)


def group_normalized_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """GRPO (REINFORCE++ paper, Eq. 3): A_i = (r_i - mean_group) / (std_group + eps), TRL's std and eps."""
    grouped = _grouped(rewards, group_size, min_group_size=2)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    return (centered / (grouped.std(dim=1, keepdim=True) + eps)).reshape(-1)


def leave_one_out_targets(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Mean reward of each row's siblings: the POISE probe's training target (POISE, Sec. 3.1).

    Leaving the row's own reward out makes the probe learn V(prompt), not "is this answer right".
    """
    return _sibling_mean(rewards, group_size)


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO: A_i = r_i - mean_{j != i} r_j (REINFORCE++ paper, Sec. 2.1); POISE's bootstrap estimator."""
    return rewards - _sibling_mean(rewards, group_size)


# --- REINFORCE++ global normalization --------------------------------------------------


def reinforce_pp_global_advantages(
    scores: torch.Tensor, mask: torch.Tensor | None = None, eps: float = 1e-8
) -> torch.Tensor:
    """REINFORCE++ Global Advantage Normalization (Eq. 5): whiten over the batch (valid tokens: `mask`)."""
    if mask is None:
        mask = torch.ones_like(scores, dtype=torch.bool)
    return masked_whiten(scores, mask, eps)


def reinforce_pp_baseline_advantages(
    rewards: torch.Tensor, group_size: int, eps: float = 1e-8
) -> torch.Tensor:
    """REINFORCE++ w/ Baseline, Eqs. (6)-(7): A' = r - mean_group(r), then A' whitened over the batch.

    The std is that of A', not of the raw rewards (TRL's scale_rewards="batch"); equal groups get A = 0.
    """
    return reinforce_pp_global_advantages(group_mean_advantages(rewards, group_size), eps=eps)


# Outcome advantages a recipe chooses by name (`advantage:`): rewards (B,) in generation order, where consecutive
# runs of `group_size` rows share a prompt -> advantages (B,).
OUTCOME_ADVANTAGES = {
    "grpo": group_normalized_advantages,
    "group_mean": group_mean_advantages,
    "rloo": rloo_advantages,
    "reinforce_pp": lambda rewards, group_size: reinforce_pp_global_advantages(rewards),
    "reinforce_pp_baseline": reinforce_pp_baseline_advantages,
}


# --- POISE cross-rollout baseline ------------------------------------------------------


def cross_rollout_baselines(predictions: torch.Tensor, group_size: int = 2) -> torch.Tensor:
    """POISE baseline b_i from the OTHER rollouts' probe predictions (POISE, arXiv 2605.07579, Sec. 3.2).

    G=2: b_1 = g(z_2), b_2 = g(z_1); G>2: the siblings' mean. Unbiased by POISE Eq. (6).
    """
    return _sibling_mean(predictions, group_size)


def cross_rollout_advantages(
    rewards: torch.Tensor, predictions: torch.Tensor, group_size: int = 2
) -> tuple[torch.Tensor, torch.Tensor]:
    """POISE advantages A = r - b (POISE, Sec. 3.2; no std division); returns (A, b) so b can be logged."""
    if rewards.shape != predictions.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and predictions {tuple(predictions.shape)} differ in shape")
    baselines = cross_rollout_baselines(predictions, group_size)
    return rewards - baselines, baselines


def variance_reduction_ratio(rewards: torch.Tensor, baselines: torch.Tensor) -> float:
    """1 - Var(r - b) / Var(r), the variance the baseline removes (POISE, Sec. 4.2); 0.0 when Var(r) == 0."""
    rewards, baselines = rewards.double(), baselines.double()
    reward_var = rewards.var(unbiased=False)
    if reward_var == 0:
        return 0.0
    # Population variances on both sides: the normalization cancels in the ratio anyway.
    return float(1.0 - (rewards - baselines).var(unbiased=False) / reward_var)


# --- KL estimators (REINFORCE++ paper, App. B.1) ---------------------------------------


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1 = log(pi_theta / pi_ref) per token (REINFORCE++, App. B.1); a reward term, never a loss."""
    return logp - ref_logp


def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k2 = 0.5 * (log(pi_theta / pi_ref))^2 per token: REINFORCE++ w/ Baseline's KL loss, Eq. (8)."""
    return 0.5 * (logp - ref_logp).pow(2)


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 = delta - 1 - log delta, delta = pi_ref / pi_theta, per token: TRL's GRPO KL term (beta > 0)."""
    log_delta = ref_logp - logp
    return torch.exp(log_delta) - 1 - log_delta


def kl_penalized_token_rewards(
    outcome_rewards: torch.Tensor, kl_per_token: torch.Tensor, mask: torch.Tensor, kl_coef: float
) -> torch.Tensor:
    """Per-token rewards of REINFORCE++ (k=1), Eq. (4): outcome on the last valid token, -kl_coef * KL on all.

    Pass `kl_k1(old_logp, ref_logp)`; `returns_to_go` of the result is Eq. (4)'s A_t. `mask` is right-padded.
    """
    lengths = mask.bool().sum(dim=1)
    if bool((lengths == 0).any()):
        raise ValueError("every row needs at least one valid token to carry its outcome reward")
    valid = mask.bool()
    rewards = torch.where(valid, -kl_coef * kl_per_token, torch.zeros_like(kl_per_token))
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    rewards[rows, lengths - 1] += outcome_rewards.to(rewards.dtype)
    return rewards


# --- Returns and GAE -------------------------------------------------------------------


def returns_to_go(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """G_t = sum_{k>=t, k valid} gamma^(k-t) r_k per row, 0 on padding (REINFORCE++, Eq. (4))."""
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

    The value after a row's last valid token is 0. `lam` is a float or a (B,) tensor of per-sequence
    lambdas (`length_adaptive_lambda`).
    """
    valid = mask.bool()
    rewards = torch.where(valid, token_rewards, torch.zeros_like(token_rewards))
    vals = torch.where(valid, values, torch.zeros_like(values))
    if isinstance(lam, torch.Tensor):
        # A (B, 1) lambda would silently broadcast the (B,) recursion to (B, B).
        if lam.shape != rewards.shape[:1]:
            raise ValueError(f"per-sequence lam must have shape ({rewards.shape[0]},), got {tuple(lam.shape)}")
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
    """VAPO's length-adaptive GAE lambda: lam = 1 - 1 / (alpha * l), in [0, 1).

    Clamped at 0 (one-step TD) for l < 1/alpha, where a negative lambda would alternate the TD weights' sign.
    """
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    return (1.0 - 1.0 / (alpha * lengths.double())).clamp(min=0.0).to(torch.get_default_dtype())


# --- AsyPPO critic-disagreement masks --------------------------------------------------


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
    """True on exactly floor(fraction * n_valid) valid tokens, those of lowest critic std (AsyPPO's I^A).

    Multiply advantages by ~mask. Ties at the cut are taken in token order; padding is never selected.
    """
    return _disagreement_cut(critic_std, mask, fraction, lowest=True)


def high_disagreement_mask(critic_std: torch.Tensor, mask: torch.Tensor, fraction: float) -> torch.Tensor:
    """As `low_disagreement_mask`, the highest critic std (AsyPPO's I^H): tokens out of the entropy bonus."""
    return _disagreement_cut(critic_std, mask, fraction, lowest=False)


def filtered_entropy_bonus(entropies: torch.Tensor, keep: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """AsyPPO's entropy term per response, (B,): (1/|o|) sum_t I^H_t H_t (AsyPPO, J_PPO).

    |o| counts every valid token, so filtering does not re-weight the kept ones; `keep` is I^H.
    """
    valid = mask.bool()
    kept = torch.where(valid & keep.bool(), entropies, torch.zeros_like(entropies))
    return kept.sum(dim=1) / valid.sum(dim=1).clamp(min=1).to(kept.dtype)


# --- Length shaping --------------------------------------------------------------------


def overlong_penalty(
    lengths: torch.Tensor, max_length: int, buffer_length: int, penalty: float = 1.0
) -> torch.Tensor:
    """DAPO soft overlong punishment (DAPO, arXiv 2503.14476, Eq. 13), added to the outcome reward."""
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
    """DAPO dynamic sampling (Eq. 11): keep a group when 0 < #correct < G; (B,) correct -> (B // G,) bool."""
    grouped = _grouped(correct.bool(), group_size).sum(dim=1)
    return (grouped > 0) & (grouped < group_size)


# --- Critics: data division and fit (AsyPPO, VAPO) -------------------------------------


def critic_group_assignment(batch_size: int, group_size: int, num_critics: int) -> torch.Tensor:
    """Which critic trains on each row, (B,) long: AsyPPO's group-level non-overlap data division.

    Within each group, rows 0..G/M-1 go to critic 0, the next G/M to critic 1, ...; responses are i.i.d.,
    so a split by position is as good as a random one and is the same on every rank.
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
    """V-bar from M critics' values (M, B, T): their mean (AsyPPO's A-bar, the ablation's best) or min."""
    if aggregation == "mean":
        return values.mean(0)
    if aggregation == "min":
        return values.min(0).values
    raise ValueError(f"aggregation must be 'mean' or 'min', got {aggregation!r}")


def cross_fit_values(values: torch.Tensor, assignment: torch.Tensor, aggregation: str = "mean") -> torch.Tensor:
    """Each row's V-bar from the critics that did NOT train on it, (M, B, T) -> (B, T); needs M >= 2.

    Their value does not depend on the row's own return, so the baseline stays unbiased (POISE Eq. (6)).
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
    """1 - Var(targets - values) / Var(targets) on valid positions (VAPO's value fit); nan if constant."""
    valid = mask.bool()
    targets, values = targets[valid].double(), values[valid].double()
    target_var = targets.var(unbiased=False) if targets.numel() else torch.tensor(0.0)
    if target_var == 0:
        return float("nan")
    return float(1.0 - (targets - values).var(unbiased=False) / target_var)


def sign_agreement(advantages: torch.Tensor, reference: torch.Tensor, mask: torch.Tensor) -> float:
    """Share of valid positions, both non-zero, where sign(advantages) == sign(reference); nan if none."""
    both = mask.bool() & (advantages != 0) & (reference != 0)
    if not bool(both.any()):
        return float("nan")
    return float((torch.sign(advantages[both]) == torch.sign(reference[both])).double().mean())


# --- Training-free process rewards -----------------------------------------------------


def process_reward_advantages(
    process_rewards: torch.Tensor,
    process_mask: torch.Tensor,
    mask: torch.Tensor,
    group_size: int | None,
    eps: float = 1e-8,
) -> torch.Tensor:
    """Per-token advantages, (B, T), from process rewards placed at episode boundaries.

    The rewards are whitened apart from the outcome, per group (whole batch when `group_size` is None), and
    each token gets their return-to-go (process-rewards post, "Pitfall 2" and "Pitfall 1, Fix option 2").
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
