"""`[algo]`: the RL objective. Its choices are the algorithm's own names (cadence.choices), which
algo/'s registries hold too: one list for both."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from cadence.choices import (
    ADVANTAGES,
    CORRECTION_MODES,
    DPO_LOSSES,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    LOSSES,
    PROXIMAL_POLICIES,
    STD_MODES,
    loss_kind,
)
from cadence.config.base import Section, changed


class AlgoConfig(Section):
    loss: Literal[LOSSES] = "ppo_clip"
    """Loss (registry name): ppo_clip (clipped surrogate), pg (REINFORCE), rloo (REINFORCE with
    leave-one-out advantages), online_dpo (each group's best vs worst response, against the frozen
    reference), gspo (one clipped geometric-mean ratio per sequence; loss_agg 'seq-mean' unless
    set), cispo (REINFORCE weighted by the clipped, detached ratio)."""
    advantage: Literal[ADVANTAGES] = "grpo"
    """Advantage estimator (registry name). reinforce_pp: REINFORCE++, rewards normalised over the
    whole batch's tokens; reinforce_pp_baseline: each group's mean subtracted first. With loss
    'rloo' it must be 'rloo' (the default there); online_dpo uses none."""
    scale_by_std: bool = True
    """GRPO: divide by the group's reward std."""
    std: Literal[STD_MODES] = "unbiased"
    """GRPO and REINFORCE++: the std divides by n - 1 (unbiased, verl's and TRL's) or by n
    (population, which makes GRPO's advantages sqrt(G / (G - 1)) larger)."""
    std_eps: float = Field(1e-4, ge=0.0)
    """Added to that std (TRL's 1e-4; verl's is 1e-6): reward differences far below it stay far
    below 1 in advantage. Set it to the reward's resolution."""
    clip_low: float = Field(0.2, ge=0.0, le=1.0)
    """Ratio floor is 1 - clip_low (1: no floor)."""
    clip_high: float = Field(0.2, ge=0.0)
    """Ratio ceiling is 1 + clip_high."""
    clip_ratio_c: float = Field(0.0, ge=0.0)
    """Dual-clip PPO (loss 'ppo_clip'): a token with a negative advantage A has a loss of at most -A
    * clip_ratio_c (> 1; verl's default is 3). 0: off."""
    mask_truncated: bool = False
    """Drop responses cut at their length cap (finish_reason 'length') from the loss (TRL's
    mask_truncated_completions): they train no token but still count in their group's advantages
    and, like empty responses, in seq-mean's number of sequences."""
    kl_coef: float = Field(0.0, ge=0.0)
    """Weight of KL(policy || reference)."""
    kl_estimator: Literal[KL_ESTIMATORS] = "k3"
    """KL estimator."""
    kl_clamp: float = Field(0.0, ge=0.0)
    """Cap on each token's k3 estimate, with zero gradient beyond it (verl caps at 10); 0: no cap
    (TRL's). Its log-ratio is clamped to [-20, 20] either way."""
    loss_agg: Literal[LOSS_AGGREGATIONS] = "token-mean"
    """Loss aggregation over the global batch (online_dpo: the mean over pairs); seq-sum-norm
    divides by the number of sequences times the episode's cap on policy tokens (see
    reward.overlong_buffer)."""
    rollout_correction: Literal[CORRECTION_MODES] = "none"
    """Correct for the gap between the engine that sampled (its behaviour log-probs) and the
    learner: each token's policy-gradient term is multiplied by a weight of rho = pi_old /
    pi_behaviour (see correction_proximal), band [lo, hi] = [correction_clip_min,
    correction_clip_max]. token_truncate: clip(rho_t, lo, hi); token_mask: rho_t inside the band,
    else 0; icepop: the same as token_mask (IcePop's name, from the Ring-1T report);
    sequence_truncate / sequence_mask: the same with the sequence's product of token ratios;
    geometric_mask: 1 if the geometric mean of the sequence's token ratios is inside the band,
    else 0 (verl's Geo-RS). TRL's default is sequence_mask with hi = 3. Formulas, defaults and
    verl/TRL names: docs/corrections.md."""
    correction_clip_min: float = Field(0.0, ge=0.0)
    """rollout_correction: the band's lower end (0: no lower bound, TRL's default); the band must
    hold 1."""
    correction_clip_max: float = Field(3.0, gt=0.0)
    """rollout_correction: the band's upper end (TRL's default, 3); the band must hold 1."""
    correction_proximal: Literal[PROXIMAL_POLICIES] = "decoupled"
    """The proximal policy. decoupled: old log-probs are the learner's policy at the iteration's
    start and the correction weighs by pi_old / pi_behaviour on top of the loss's pi / pi_old.
    bypass: old log-probs are the engine's behaviour log-probs (no old pass, no frozen old copy,
    for every row), the correction acts on pi / pi_behaviour, and a loss with a ratio (ppo_clip,
    gspo, cispo) takes only its mask (verl's bypass_mode)."""
    tis_cap: float = Field(0.0, ge=0.0)
    """The older name of rollout_correction = 'token_truncate' with correction_clip_max = tis_cap
    (min(pi_old / pi_behaviour, tis_cap) per token; the same numbers); 0 leaves it unset, else >= 1.
    Not together with the rollout_correction and correction_* keys."""
    dpo_beta: float = Field(0.1, gt=0.0)
    """online_dpo: beta of DPO (tau of IPO), the pull to the reference."""
    dpo_loss: Literal[DPO_LOSSES] = "sigmoid"
    """online_dpo: sigmoid (DPO), ipo (IPO on summed sequence log-ratios: the paper's, TRL's
    OnlineDPOTrainer's) or ipo_token_mean (IPO on per-token mean log-ratios: TRL's DPOTrainer's)."""

    @model_validator(mode="before")
    @classmethod
    def _gspo_aggregation(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("loss") in LOSSES:
            own = loss_kind(data["loss"]).aggregation  # GSPO's objective: the mean over sequences
            if own:
                data.setdefault("loss_agg", own)
        return data

    @model_validator(mode="before")
    @classmethod
    def _rloo_advantage(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("loss") not in LOSSES:
            return data
        own = loss_kind(data["loss"]).advantage
        if not own:
            return data
        advantage = data.setdefault("advantage", own)
        if advantage != own:
            raise ValueError(
                f"algo.loss = '{data['loss']}' computes its advantages itself ('{own}'); "
                f"algo.advantage = {advantage!r} would be ignored: set it to '{own}' or leave it "
                "out"
            )
        return data

    @model_validator(mode="after")
    def _consistent(self) -> AlgoConfig:
        if self.tis_cap != 0 and self.tis_cap < 1:
            raise ValueError(
                f"algo.tis_cap must be 0 (off) or >= 1 (a cap below 1 shrinks the weight of "
                f"on-policy tokens); got {self.tis_cap}"
            )
        corrects = self.tis_cap > 0 or self.rollout_correction != "none"
        pairs = loss_kind(self.loss).pairs
        if pairs and (self.kl_coef > 0 or corrects or self.correction_proximal != "decoupled"):
            raise ValueError(
                f"algo.loss = '{self.loss}' takes no algo.kl_coef or algo.tis_cap, nor a rollout "
                "correction (dpo_beta pulls towards the reference; there is no importance ratio): "
                "set both to 0, algo.rollout_correction = 'none' and algo.correction_proximal = "
                "'decoupled'"
            )
        self._check_correction()
        if self.clip_ratio_c != 0 and self.clip_ratio_c <= 1:
            raise ValueError(
                f"algo.clip_ratio_c must be 0 (off) or > 1 (the dual clip bounds the loss of a "
                f"negative advantage at -A * clip_ratio_c); got {self.clip_ratio_c}"
            )
        if self.clip_ratio_c > 0 and not loss_kind(self.loss).dual_clip:
            raise ValueError(
                f"algo.clip_ratio_c is dual-clip PPO: it applies to algo.loss = 'ppo_clip' only, "
                f"not '{self.loss}'; set algo.clip_ratio_c = 0"
            )
        if self.mask_truncated and pairs:
            raise ValueError(
                f"algo.mask_truncated would leave {self.loss} pairs with an empty response: "
                "set algo.mask_truncated = false (or reward.overlong_buffer to penalise length)"
            )
        return self

    def _check_correction(self) -> None:
        newer = changed(self, ("rollout_correction", "correction_clip_min", "correction_clip_max"))
        if self.tis_cap > 0 and newer:
            raise ValueError(
                f"algo.tis_cap = {self.tis_cap} is the older name of algo.rollout_correction = "
                f"'token_truncate' with algo.correction_clip_max = {self.tis_cap}: set "
                f"{', '.join('algo.' + k for k in newer)} or algo.tis_cap, not both"
            )
        low, high = self.correction_clip_min, self.correction_clip_max
        if low > high:
            raise ValueError(
                f"algo.correction_clip_min = {low} is above algo.correction_clip_max = {high}: "
                "the band [correction_clip_min, correction_clip_max] would be empty"
            )
        if not low <= 1.0 <= high:
            raise ValueError(
                f"the band [algo.correction_clip_min, algo.correction_clip_max] = [{low}, {high}] "
                "must hold 1: a token the learner's own policy sampled has ratio 1, and a band "
                "without it would cut or shrink every on-policy token"
            )
        truncate = self.rollout_correction in ("token_truncate", "sequence_truncate")
        ratio_loss = loss_kind(self.loss).ratio
        if self.correction_proximal == "bypass" and truncate and ratio_loss:
            raise ValueError(
                f"algo.rollout_correction = '{self.rollout_correction}' with "
                f"algo.correction_proximal = 'bypass' and algo.loss = '{self.loss}' would change "
                "nothing: the loss's own ratio pi / pi_behaviour is the importance weight "
                "(clipped by clip_low / clip_high). Use a *_mask mode, correction_proximal = "
                "'decoupled', or algo.loss = 'pg' or 'rloo'"
            )
