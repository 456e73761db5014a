"""The POISE value probe g(z), its row buffer, the online estimator and its metrics.

PCA of prompt (32 dims) and response vectors (64) plus 3 entropies, standardized, ridge (alpha 100),
clipped to [0, 1], refit every step on a FIFO buffer of leave-one-out targets; the state is CPU float64,
saved as safetensors + JSON. Details: docs/algorithms.md ("The probe").
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path

import safetensors
import safetensors.torch
import torch

from poise_trl.core.estimators import leave_one_out_targets
from poise_trl.core.metrics import pearson
from poise_trl.core.provenance import package_versions
from poise_trl.probe.features import ENTROPY_NAMES, RolloutFeatures

_F64 = torch.float64


# --- The probe -------------------------------------------------------------------------------


FIT_METHODS = ("fast", "exact")
# "full": [prompt, response, entropy] (docs/algorithms.md); "prompt": the prompt vector alone, a value of the
# prompt that can be read before any rollout exists (the prompt-only baseline, probe-guided selection).
PROBE_INPUTS = ("full", "prompt")
# At d <= 512 the exact eigh costs milliseconds: "fast" uses it there.
EXACT_PCA_MAX_DIM = 512
# Randomized PCA: error ~ (sigma_{k+p+1} / sigma_k)^(2q+1) (Halko et al. 2011, Thm. 9.2); a warm start
# adds 1 iteration per step, so the iteration keeps converging as the buffer drifts.
PCA_OVERSAMPLE = 16
PCA_COLD_ITERS = 6
PCA_WARM_ITERS = 1
PCA_SEED = 0


def _orient_and_trim(
    eigvals: torch.Tensor, comps: torch.Tensor, mean: torch.Tensor, n: int, rounding: float = 1e-24
) -> torch.Tensor:
    """Deterministic signs (largest-|loading| entry positive); components beyond the numerical rank set to 0.

    Their projections are rounding noise that standardization would blow up; `eigvals` ascending.
    """
    variances = eigvals.flip(0)[: comps.shape[0]]
    # sum of x^2 over the rows (the Ritz values only bound it from below, which is enough here)
    sq_sum = n * mean.dot(mean) + eigvals.clamp(min=0).sum()
    top_variance = eigvals[-1]
    pivot = comps.abs().argmax(1, keepdim=True)
    comps = comps * torch.where(comps.gather(1, pivot) < 0, -1.0, 1.0).to(comps.dtype)
    # The second term covers data with no real spread at all (e.g. identical rows), where
    # x - mean is pure rounding noise and the first term is noise too.
    keep = variances > 1e-10 * top_variance.clamp(min=0) + rounding * sq_sum
    return torch.where(keep[:, None], comps, 0.0).contiguous()


def _fit_pca(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact float64 PCA by `eigh`: (mean (d,), components (k', d), projections (N, k')), k' <= k."""
    mean = x.mean(0, dtype=_F64)
    centered = x - mean  # promoted to float64
    k = min(k, *x.shape)
    eigvals, eigvecs = torch.linalg.eigh(centered.T @ centered)  # ascending
    comps = _orient_and_trim(eigvals, eigvecs.flip(1)[:, :k].T, mean, x.shape[0])
    return mean, comps, centered @ comps.T


def _fit_pca_fast(
    x: torch.Tensor, k: int, init: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Randomized subspace-iteration PCA + Rayleigh-Ritz, contract of `_fit_pca` (Halko et al., Alg. 4.4).

    Warm-started from `init` (the previous components); products in the dtype of `x`, the rest in float64.
    """
    mean = x.sum(0).to(_F64) / x.shape[0]  # in the dtype of x: 15x faster than mean(dtype=float64)
    centered = x - mean.to(x.dtype)
    n, d = centered.shape
    k, width = min(k, n, d), min(k + PCA_OVERSAMPLE, n, d)
    generator = torch.Generator(device=x.device).manual_seed(PCA_SEED)
    omega = torch.randn(d, width, generator=generator, device=x.device, dtype=_F64)
    iters = PCA_COLD_ITERS
    if init is not None and init.shape[1] == d:
        warm = init[init.abs().sum(1) > 0][:width].to(x.device, _F64)
        omega[:, : warm.shape[0]] = warm.T
        iters = PCA_WARM_ITERS
    q = torch.linalg.qr(omega).Q
    for _ in range(iters):
        # (Y^T X)^T rather than X^T Y: the same product, twice as fast on a row-major X.
        scatter_q = ((centered @ q.to(x.dtype)).T @ centered).T
        q = torch.linalg.qr(scatter_q.to(_F64)).Q
    projected = (centered @ q.to(x.dtype)).to(_F64)
    eigvals, w = torch.linalg.eigh(projected.T @ projected)  # ascending Ritz values
    w = w.flip(1)[:, :k]
    # float32 centering leaves each row off by up to an ulp of the mean: noise of relative
    # variance ~eps^2 (1e-14), far above float64's.
    rounding = max(1e-24, (16 * torch.finfo(x.dtype).eps) ** 2)
    comps = _orient_and_trim(eigvals, (q @ w).T, mean, n, rounding)
    # Same sign flips and zeroed rows as `comps`: project through the oriented components.
    return mean, comps, projected @ (q.T @ comps.T)


class LinearValueProbe:
    """Ridge regression of the leave-one-out target on [PCA(prompt), PCA(response), entropy].

    `use_pca=False`: the standardized raw features; `inputs="prompt"`: the prompt vector alone. Zero-variance
    features are dropped; the intercept is unpenalized. `device`: where the fit runs (the state is on CPU).
    """

    def __init__(
        self,
        prompt_components: int = 32,
        response_components: int = 64,
        ridge_alpha: float = 100.0,
        use_pca: bool = True,
        fit_method: str = "fast",
        device: str | torch.device = "cpu",
        inputs: str = "full",
    ):
        if ridge_alpha <= 0:
            raise ValueError(f"ridge_alpha must be > 0, got {ridge_alpha}")
        if fit_method not in FIT_METHODS:
            raise ValueError(f"fit_method must be one of {FIT_METHODS}, got {fit_method!r}")
        if inputs not in PROBE_INPUTS:
            raise ValueError(f"inputs must be one of {PROBE_INPUTS}, got {inputs!r}")
        self.inputs = inputs
        self.prompt_components = prompt_components
        self.response_components = response_components
        self.ridge_alpha = float(ridge_alpha)
        self.use_pca = use_pca
        self.fit_method = fit_method
        self.device = torch.device(device)
        self._state: dict[str, torch.Tensor] | None = None
        # In-sample predictions of the last fit (not state): saves the estimator a second pass.
        self.insample_predictions: torch.Tensor | None = None
        # (mean, components, projections) of the last fit's prompt PCA (not state): a prompt-only
        # probe fitted on the same rows takes it instead of computing the identical PCA again.
        self.fitted_prompt_pca: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def config(self) -> dict:
        return {
            "prompt_components": self.prompt_components,
            "response_components": self.response_components,
            "ridge_alpha": self.ridge_alpha,
            "use_pca": self.use_pca,
            "fit_method": self.fit_method,
            "inputs": self.inputs,
        }

    @property
    def _parts(self) -> tuple[str, ...]:
        return ("prompt",) if self.inputs == "prompt" else ("prompt", "response")

    @property
    def is_fitted(self) -> bool:
        return self._state is not None

    @property
    def feature_names(self) -> list[str]:
        """Names of the regression inputs, in order (after PCA when `use_pca`)."""
        state = self._fitted_state()
        if self.inputs == "prompt":
            k = state["prompt_components"].shape[0] if self.use_pca else state["coef"].shape[0]
            return [f"prompt_pc{i}" if self.use_pca else f"prompt_{i}" for i in range(k)]
        if self.use_pca:
            kp, kr = state["prompt_components"].shape[0], state["response_components"].shape[0]
            names = [f"prompt_pc{i}" for i in range(kp)] + [f"response_pc{i}" for i in range(kr)]
        else:
            d = (state["coef"].shape[0] - len(ENTROPY_NAMES)) // 2
            names = [f"prompt_{i}" for i in range(d)] + [f"response_{i}" for i in range(d)]
        return names + list(ENTROPY_NAMES)

    def _fitted_state(self) -> dict[str, torch.Tensor]:
        if self._state is None:
            raise RuntimeError("LinearValueProbe is not fitted: call fit(...) or load_state_dict(...) first")
        return self._state

    def _inputs(self, features: RolloutFeatures, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """Unstandardized regression inputs (N, D) in float64."""
        columns = []
        for name in self._parts:
            x = getattr(features, name).to(_F64)
            columns.append((x - state[f"{name}_mean"]) @ state[f"{name}_components"].T if self.use_pca else x)
        if self.inputs == "full":
            columns.append(features.entropy.to(_F64))
        return torch.cat(columns, dim=1)

    def fit(
        self,
        features: RolloutFeatures,
        targets: torch.Tensor,
        prompt_pca: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> LinearValueProbe:
        """Fit on all rows (closed-form ridge); `prompt_pca`: a probe's `fitted_prompt_pca` of these rows."""
        y = targets.detach().to("cpu", _F64).flatten()
        if len(features) == 0 or y.numel() != len(features):
            raise ValueError(f"fit needs N > 0 rows and N targets, got {len(features)} rows and {y.numel()} targets")
        if prompt_pca is not None and prompt_pca[2].shape[0] != len(features):
            raise ValueError(f"prompt_pca was fitted on {prompt_pca[2].shape[0]} rows, not these {len(features)}")
        # A column sum is finite iff its column is (and a sum is 20x cheaper than isfinite on 4096 x 2560).
        sums = (features.prompt.sum(0), features.response.sum(0), features.entropy.sum(0))
        if not (torch.isfinite(y).all() and all(torch.isfinite(t).all() for t in sums)):
            raise ValueError("fit got non-finite features or targets")
        state: dict[str, torch.Tensor] = {}
        inputs = []
        components = {"prompt": self.prompt_components, "response": self.response_components}
        for name in self._parts:
            k, x = components[name], getattr(features, name).to(self.device)
            if not self.use_pca:
                inputs.append(x.to(_F64))
                continue
            if name == "prompt" and prompt_pca is not None:
                mean, comps, projections = prompt_pca
            elif self.fit_method == "exact" or x.shape[1] <= EXACT_PCA_MAX_DIM:
                mean, comps, projections = _fit_pca(x, k)
            else:
                previous = self._state[f"{name}_components"] if self._state is not None else None
                mean, comps, projections = _fit_pca_fast(x, k, previous)
            inputs.append(projections)
            state[f"{name}_mean"], state[f"{name}_components"] = mean.cpu(), comps.cpu()
            if name == "prompt":
                self.fitted_prompt_pca = (mean, comps, projections)
        entropy = [features.entropy.to(_F64)] if self.inputs == "full" else []
        x = torch.cat([t.cpu() for t in inputs] + entropy, dim=1)
        mean, std = x.mean(0), x.std(0, unbiased=False)
        # A constant column (std at rounding level of its mean) carries no signal: scale it to 0.
        inv_scale = torch.where(std > 1e-12 * mean.abs(), 1.0 / std, 0.0)
        xs = (x - mean) * inv_scale
        gram = xs.T @ xs + self.ridge_alpha * torch.eye(xs.shape[1], dtype=_F64)
        state["feature_mean"], state["feature_inv_scale"] = mean, inv_scale
        state["coef"] = torch.linalg.solve(gram, xs.T @ (y - y.mean()))
        state["intercept"] = y.mean()
        self._state = state
        self.insample_predictions = (state["intercept"] + xs @ state["coef"]).clamp(0.0, 1.0).float()
        return self

    def predict(self, features: RolloutFeatures) -> torch.Tensor:
        """(N,) float32 predicted expected reward, clipped to [0, 1]."""
        state = self._fitted_state()
        x = self._inputs(features, state)
        if x.shape[1] != state["coef"].shape[0]:
            raise ValueError(
                f"features give {x.shape[1]} regression inputs, the probe was fit on {state['coef'].shape[0]}"
            )
        xs = (x - state["feature_mean"]) * state["feature_inv_scale"]
        return (state["intercept"] + xs @ state["coef"]).clamp(0.0, 1.0).float()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: t.clone() for name, t in self._fitted_state().items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        expected = {"feature_mean", "feature_inv_scale", "coef", "intercept"}
        if self.use_pca:
            expected |= {f"{name}_{part}" for name in self._parts for part in ("mean", "components")}
        if set(state) != expected:
            raise ValueError(
                f"probe state (use_pca={self.use_pca}) needs keys {sorted(expected)}, got {sorted(state)}"
            )
        self._state = {name: t.detach().to("cpu", _F64).clone() for name, t in state.items()}


# --- The buffer ------------------------------------------------------------------------------


class GroupBuffer:
    """FIFO of probe rows (features, targets, group ids); evicts whole groups, oldest first."""

    def __init__(self, capacity_rows: int = 4096):
        self.capacity_rows = capacity_rows
        self.features: RolloutFeatures | None = None
        self.targets = torch.zeros(0)
        self.group_ids = torch.zeros(0, dtype=torch.long)
        self.next_group_id = 0

    def __len__(self) -> int:
        return self.targets.numel()

    @property
    def num_groups(self) -> int:
        return self.group_ids.unique().numel()

    def append(self, features: RolloutFeatures, targets: torch.Tensor, group_size: int) -> None:
        """Add rows in consecutive groups of `group_size`, then evict the oldest groups over capacity."""
        n = len(features)
        if group_size < 1 or group_size > self.capacity_rows or n % group_size or targets.numel() != n:
            raise ValueError(f"append needs whole groups that fit the buffer: {n} rows, {targets.numel()} targets, "
                             f"group_size {group_size}, capacity {self.capacity_rows} rows")
        ids = self.next_group_id + torch.arange(n) // group_size
        self.next_group_id += n // group_size
        self.features = features if self.features is None else RolloutFeatures.cat([self.features, features])
        self.targets = torch.cat([self.targets, targets.detach().to("cpu", torch.float32).flatten()])
        self.group_ids = torch.cat([self.group_ids, ids])
        excess = len(self) - self.capacity_rows
        if excess > 0:
            # First group boundary at or after `excess`: drop everything before it.
            starts = torch.ones(len(self), dtype=torch.bool)
            starts[1:] = self.group_ids[1:] != self.group_ids[:-1]
            boundaries = torch.cat([starts.nonzero().flatten(), torch.tensor([len(self)])])
            cut = int(boundaries[boundaries >= excess][0])
            self.features, self.targets, self.group_ids = (
                self.features[cut:],
                self.targets[cut:],
                self.group_ids[cut:],
            )

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = {
            "targets": self.targets.clone(),
            "group_ids": self.group_ids.clone(),
            "next_group_id": torch.tensor(self.next_group_id),
        }
        if self.features is not None:
            state |= {
                "prompt": self.features.prompt.clone(),
                "response": self.features.response.clone(),
                "entropy": self.features.entropy.clone(),
            }
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.targets = state["targets"].clone()
        self.group_ids = state["group_ids"].clone()
        self.next_group_id = int(state["next_group_id"])
        self.features = (
            RolloutFeatures(state["prompt"].clone(), state["response"].clone(), state["entropy"].clone())
            if "prompt" in state
            else None
        )


# --- The online estimator --------------------------------------------------------------------

DEFAULT_DOMAIN = "all"
STATE_FILE = "poise_probe.safetensors"
META_FILE = "poise_probe.json"
FORMAT_VERSION = 1


class ProbeEstimator:
    """The online POISE value estimator: probe(s) + buffer(s) + counters (docs/algorithms.md, "The probe").

    Per step: `predict` (probe of the previous step), freeze advantages, log `probe_metrics`, then `update`.
    Before the first fit (end of step `bootstrap_steps`) rows are unavailable and the caller uses RLOO;
    unavailable rows predict NaN so a missed `available` check fails loudly. `per_domain=True`: a probe and
    buffer per domain key. `prompt_probe=True`: a second, prompt-only probe per domain (`predict_prompts`).
    `probe_settings`: each probe's `LinearValueProbe` arguments (prompt_components, ..., inputs), by name.
    """

    def __init__(
        self,
        capacity_rows: int = 4096,
        bootstrap_steps: int = 16,
        per_domain: bool = False,
        device: str | torch.device = "cpu",
        prompt_probe: bool = False,
        **probe_settings,
    ):
        self.probe_config = LinearValueProbe(**probe_settings).config
        self.prompt_probe = prompt_probe
        self.device = torch.device(device)
        self.capacity_rows = capacity_rows
        self.bootstrap_steps = bootstrap_steps
        self.per_domain = per_domain
        self.steps_seen = 0
        self.probes: dict[str, LinearValueProbe] = {}
        self.prompt_probes: dict[str, LinearValueProbe] = {}
        self.buffers: dict[str, GroupBuffer] = {}
        self.domain_steps: dict[str, int] = {}
        self.refit_counts: dict[str, int] = {}

    @property
    def config(self) -> dict:
        return {
            **self.probe_config,
            "capacity_rows": self.capacity_rows,
            "bootstrap_steps": self.bootstrap_steps,
            "per_domain": self.per_domain,
            "prompt_probe": self.prompt_probe,
        }

    def _new_probe(self, inputs: str | None = None) -> LinearValueProbe:
        config = self.probe_config if inputs is None else {**self.probe_config, "inputs": inputs}
        return LinearValueProbe(**config, device=self.device)

    @property
    def in_bootstrap(self) -> bool:
        """True until some probe has been fitted (the first `bootstrap_steps` updates)."""
        return not any(probe.is_fitted for probe in self.probes.values())

    @property
    def refit_count(self) -> int:
        return sum(self.refit_counts.values())

    def _domain_keys(self, n: int, domains: Sequence[str] | None) -> list[str]:
        if not self.per_domain:
            if domains is not None:
                raise ValueError("this ProbeEstimator has per_domain=False: pass domains=None")
            return [DEFAULT_DOMAIN] * n
        if domains is None or len(domains) != n:
            raise ValueError(f"per_domain=True needs one domain per row ({n}), got {domains!r}")
        return [str(d) for d in domains]

    @staticmethod
    def _rows_by_domain(keys: list[str]) -> dict[str, torch.Tensor]:
        rows: dict[str, list[int]] = {}
        for i, key in enumerate(keys):
            rows.setdefault(key, []).append(i)
        return {key: torch.tensor(idx) for key, idx in rows.items()}

    def predict(
        self, features: RolloutFeatures, domains: Sequence[str] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(predictions (B,) float32, available (B,) bool) from the CURRENT fit; NaN where unavailable."""
        return self._predict_with(self.probes, features, domains)

    def _predict_with(
        self, probes: dict[str, LinearValueProbe], features: RolloutFeatures, domains: Sequence[str] | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row predicted by its domain's probe in `probes`; NaN and unavailable where it has none fitted."""
        predictions = torch.full((len(features),), float("nan"))
        available = torch.zeros(len(features), dtype=torch.bool)
        for key, idx in self._rows_by_domain(self._domain_keys(len(features), domains)).items():
            probe = probes.get(key)
            if probe is not None and probe.is_fitted:
                predictions[idx] = probe.predict(features[idx])
                available[idx] = True
        return predictions, available

    def predict_prompts(
        self, prompt_vectors: torch.Tensor, domains: Sequence[str] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Like `predict`, from prompt vectors (B, d) alone: a prompt's expected reward before its rollout."""
        if self.prompt_probe:
            probes = self.prompt_probes
        elif self.probe_config["inputs"] == "prompt":
            probes = self.probes
        else:
            raise RuntimeError("this ProbeEstimator has no prompt-only probe: construct it with prompt_probe=True "
                               "or inputs='prompt'")
        n, d = prompt_vectors.shape
        # The prompt-only probe reads the prompt vector alone; the other inputs are placeholders.
        features = RolloutFeatures(prompt_vectors, torch.zeros(n, d), torch.zeros(n, len(ENTROPY_NAMES)))
        return self._predict_with(probes, features, domains)

    def update(
        self,
        features: RolloutFeatures,
        rewards: torch.Tensor,
        group_size: int,
        domains: Sequence[str] | None = None,
    ) -> dict[str, float]:
        """Append the batch with leave-one-out targets and refit (step 5 of the probe's order)."""
        targets = leave_one_out_targets(rewards.detach().to("cpu", torch.float32).flatten(), group_size)
        return self.update_from_targets(features, targets, group_size, domains)

    def update_from_targets(
        self,
        features: RolloutFeatures,
        targets: torch.Tensor,
        group_size: int,
        domains: Sequence[str] | None = None,
    ) -> dict[str, float]:
        """`update` with precomputed targets; returns buffer rows, refit count, in-sample MAE/Pearson."""
        keys = self._domain_keys(len(features), domains)
        if len(features) % group_size or any(
            len(set(keys[i : i + group_size])) > 1 for i in range(0, len(keys), group_size)
        ):
            raise ValueError(f"{len(features)} rows must form whole groups of {group_size} with one domain per group")
        self.steps_seen += 1
        present = self._rows_by_domain(keys)
        for key, idx in present.items():
            self.buffers.setdefault(key, GroupBuffer(self.capacity_rows)).append(
                features[idx], targets[idx], group_size
            )
            self.probes.setdefault(key, self._new_probe())
            if self.prompt_probe:
                self.prompt_probes.setdefault(key, self._new_probe("prompt"))
            self.domain_steps[key] = self.domain_steps.get(key, 0) + 1
            self.refit_counts.setdefault(key, 0)
        # The step that ends the bootstrap fits every domain collected so far, later steps the
        # domains they contain.
        if self.steps_seen < self.bootstrap_steps:
            to_fit = []
        elif self.steps_seen == self.bootstrap_steps:
            to_fit = list(self.buffers)
        else:
            to_fit = list(present)
        stats: dict[str, float] = {}
        for key in to_fit:
            buffer, probe = self.buffers[key], self.probes[key]
            probe.fit(buffer.features, buffer.targets)
            if self.prompt_probe:
                self.prompt_probes[key].fit(buffer.features, buffer.targets, prompt_pca=probe.fitted_prompt_pca)
            self.refit_counts[key] += 1
            fitted, observed = probe.insample_predictions.double(), buffer.targets.double()
            prefix = f"{key}/" if self.per_domain else ""
            stats[prefix + "insample_mae"] = float((fitted - observed).abs().mean())
            stats[prefix + "insample_pearson"] = pearson(fitted, observed)
        for key in present:
            prefix = f"{key}/" if self.per_domain else ""
            stats[prefix + "buffer_rows"] = float(len(self.buffers[key]))
            stats[prefix + "refit_count"] = float(self.refit_counts[key])
        return stats

    def save(self, directory: str | os.PathLike) -> None:
        """Write `poise_probe.safetensors` (all tensors) and `poise_probe.json` (config, counters)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors, domains = {}, []
        for i, key in enumerate(self.buffers):
            probe = self.probes[key]
            if probe.is_fitted:
                tensors |= {f"domain{i}.probe.{name}": t for name, t in probe.state_dict().items()}
            if self.prompt_probe and self.prompt_probes[key].is_fitted:
                prompt_state = self.prompt_probes[key].state_dict()
                tensors |= {f"domain{i}.prompt_probe.{name}": t for name, t in prompt_state.items()}
            tensors |= {f"domain{i}.buffer.{name}": t for name, t in self.buffers[key].state_dict().items()}
            domains.append(
                {
                    "name": key,
                    "steps": self.domain_steps[key],
                    "refit_count": self.refit_counts[key],
                    "fitted": probe.is_fitted,
                }
            )
        meta = {
            "format": "poise_probe",
            "format_version": FORMAT_VERSION,
            "config": self.config,
            "steps_seen": self.steps_seen,
            "domains": domains,
            "versions": _versions(),
        }
        # Write-then-rename so an interrupted save never leaves a half-written file behind; the
        # step count is repeated in the safetensors metadata to detect a mismatched pair.
        state_tmp, meta_tmp = directory / (STATE_FILE + ".tmp"), directory / (META_FILE + ".tmp")
        safetensors.torch.save_file(
            {k: t.contiguous() for k, t in tensors.items()},
            str(state_tmp),
            metadata={"steps_seen": str(self.steps_seen)},
        )
        meta_tmp.write_text(json.dumps(meta, indent=2))
        os.replace(state_tmp, directory / STATE_FILE)
        os.replace(meta_tmp, directory / META_FILE)

    @classmethod
    def load(cls, directory: str | os.PathLike, device: str | torch.device = "cpu") -> ProbeEstimator:
        """Restore an estimator written by `save` (its later fits run on `device`); raises with the
        offending file named."""
        directory = Path(directory)
        meta_path, state_path = directory / META_FILE, directory / STATE_FILE
        hint = ("it is written by ProbeEstimator.save() into every POISE checkpoint; resume from such a "
                "checkpoint, or start a fresh run (the probe then bootstraps from scratch)")
        for path in (meta_path, state_path):
            if not path.is_file():
                raise FileNotFoundError(f"POISE probe state missing: {path} does not exist ({hint})")
        try:
            meta = json.loads(meta_path.read_text())
            config, domains, steps_seen = meta["config"], meta["domains"], int(meta["steps_seen"])
            # Files written before `fit_method` existed were fit exactly: keep resuming them so.
            config.setdefault("fit_method", "exact")
            # ... and before prompt-only probes existed, on the full features with none beside them.
            config.setdefault("inputs", "full")
            config.setdefault("prompt_probe", False)
            if meta.get("format") != "poise_probe" or meta.get("format_version") != FORMAT_VERSION:
                raise ValueError(f"format {meta.get('format')!r} v{meta.get('format_version')}, expected "
                                 f"poise_probe v{FORMAT_VERSION}")
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
            raise ValueError(f"corrupt POISE probe metadata {meta_path}: {err} ({hint})") from err
        try:
            with safetensors.safe_open(str(state_path), framework="pt") as f:
                file_steps = (f.metadata() or {}).get("steps_seen")
                tensors = {name: f.get_tensor(name) for name in f.keys()}
        except (safetensors.SafetensorError, OSError) as err:
            raise ValueError(f"corrupt POISE probe tensors {state_path}: {err} ({hint})") from err
        if file_steps != str(steps_seen):
            raise ValueError(f"{state_path} (steps_seen={file_steps}) does not belong with {meta_path} "
                             f"(steps_seen={steps_seen}) ({hint})")
        est = cls(**config, device=device)
        est.steps_seen = steps_seen
        try:
            for i, entry in enumerate(domains):
                key = entry["name"]
                est.buffers[key] = GroupBuffer(est.capacity_rows)
                est.buffers[key].load_state_dict(_with_prefix(tensors, f"domain{i}.buffer."))
                est.probes[key] = est._new_probe()
                if entry["fitted"]:
                    est.probes[key].load_state_dict(_with_prefix(tensors, f"domain{i}.probe."))
                if est.prompt_probe:
                    est.prompt_probes[key] = est._new_probe("prompt")
                    if entry["fitted"]:
                        est.prompt_probes[key].load_state_dict(_with_prefix(tensors, f"domain{i}.prompt_probe."))
                est.domain_steps[key] = int(entry["steps"])
                est.refit_counts[key] = int(entry["refit_count"])
        except (KeyError, ValueError, TypeError) as err:
            raise ValueError(
                f"POISE probe state in {state_path} does not match {meta_path}: {err!r} ({hint})"
            ) from err
        return est


def _with_prefix(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {name[len(prefix) :]: t for name, t in tensors.items() if name.startswith(prefix)}


def _versions() -> dict[str, str]:
    return {
        "poise_trl": package_versions().get("poise-trl"),  # the installed version (the package root is the API)
        "torch": torch.__version__,
        "safetensors": safetensors.__version__,
    }


# --- Online metrics (docs/algorithms.md, "Metrics") ------------------------------------------


def probe_metrics(
    predictions: torch.Tensor, targets: torch.Tensor, rewards: torch.Tensor, baselines: torch.Tensor
) -> dict[str, float]:
    """Out-of-sample quality of the probe on one batch of (B,) tensors, before the refit; undefined -> NaN."""
    p, t, r, b = (x.detach().to("cpu", _F64).flatten() for x in (predictions, targets, rewards, baselines))
    nan = float("nan")
    if p.numel() == 0:
        keys = (
            "mae",
            "rmse",
            "bias",
            "pearson",
            "brier_skill",
            "pairwise_sign_acc",
            "frac_clip_0",
            "frac_clip_1",
        )
        return dict.fromkeys(keys + ("adv_mean", "adv_std", "baseline_mean", "variance_reduction"), nan)
    err = p - t
    mse, var_t, var_r = float(err.pow(2).mean()), float(t.var(unbiased=False)), float(r.var(unbiased=False))
    dt, dp = t[:, None] - t[None, :], p[:, None] - p[None, :]
    pairs = torch.ones_like(dt, dtype=torch.bool).triu(1) & (dt != 0)
    adv = r - b
    return {
        "mae": float(err.abs().mean()),
        "rmse": math.sqrt(mse),
        "bias": float(err.mean()),
        "pearson": pearson(p, t),
        "brier_skill": 1.0 - mse / var_t if var_t > 0 else nan,
        "pairwise_sign_acc": float((dp.sign() == dt.sign())[pairs].double().mean()) if pairs.any() else nan,
        "frac_clip_0": float((p <= 0).double().mean()),
        "frac_clip_1": float((p >= 1).double().mean()),
        "adv_mean": float(adv.mean()),
        "adv_std": float(adv.std(unbiased=False)),
        "baseline_mean": float(b.mean()),
        "variance_reduction": 1.0 - float(adv.var(unbiased=False)) / var_r if var_r > 0 else nan,
    }
