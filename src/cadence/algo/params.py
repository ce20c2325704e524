"""Every algorithm setting in one record: what the loss, the advantage estimator and the reward
shaping are, and their hyper-parameters.

Read on: docs/algorithms.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from cadence.algo.advantages import STD_EPS, STD_MODES
from cadence.algo.aggregation import AGG_MODES
from cadence.algo.correction import TRUNCATE_MODES
from cadence.choices import (
    CORRECTION_MODES,
    DPO_LOSSES,
    KL_ESTIMATORS,
    LOSS_KINDS,
    PROXIMAL_POLICIES,
)

# Losses whose per-token term holds the ratio pi / pi_old: under the bypass (old = behaviour) that
# ratio is already the importance weight, so a rollout correction adds only its mask to them.
RATIO_LOSSES = frozenset(name for name, kind in LOSS_KINDS.items() if kind.ratio)


@dataclass(frozen=True)
class AlgoParams:
    """The algorithm: loss, advantages, shaping, and their hyper-parameters."""

    loss: str = "ppo_clip"  # registry name (`algo.LOSSES`)
    advantage: str = "grpo"  # registry name (`algo.ADVANTAGES`)
    scale_by_std: bool = True  # GRPO: divide by the group's std (False: Dr. GRPO)
    std: str = "unbiased"  # GRPO / REINFORCE++ std: one of STD_MODES
    std_eps: float = STD_EPS  # added to that std
    loss_agg: str = "token-mean"  # one of AGG_MODES
    clip_low: float = 0.2  # ratio floor is 1 - clip_low (1: no floor, CISPO's usual setting)
    clip_high: float = 0.2  # ratio ceiling is 1 + clip_high (DAPO's clip-higher raises it alone)
    clip_ratio_c: float = 0.0  # dual-clip PPO: loss of an A < 0 token at most -A * c; 0: off
    kl_coef: float = 0.0  # weight of the per-token KL(pi || ref) penalty; 0 turns it off
    kl_estimator: str = "k3"  # one of KL_ESTIMATORS
    kl_clamp: float = 0.0  # cap on each token's k3 estimate (verl's: 10); 0: no cap
    # rollout correction (algo/correction.py): a mode of CORRECTION_MODES, its band, and whether
    # the ratio's target is the learner's old policy ("decoupled") or the policy itself, the
    # behaviour log-probs then being the old ones ("bypass")
    rollout_correction: str = "none"
    correction_clip_min: float = 0.0  # lower end of the band; 0: none
    correction_clip_max: float = 3.0  # upper end of the band (TRL's default)
    correction_proximal: str = "decoupled"  # one of PROXIMAL_POLICIES
    # the older name: tis_cap = c > 0 is rollout_correction "token_truncate" with
    # correction_clip_max c, and is stored so (tis_cap then reads 0); 0: unset
    tis_cap: float = 0.0
    dpo_beta: float = 0.1  # DPO's beta (IPO's tau): strength of the pull towards the reference
    dpo_loss: str = "sigmoid"  # one of DPO_LOSSES
    # the most tokens the policy writes in one episode (a multi-turn episode's, not one turn's):
    # the overlong penalty's cap and seq-sum-norm's constant (learner/scorer.py)
    max_policy_tokens: int = 64
    overlong_buffer: int = 0  # DAPO's overlong penalty ramps over these last tokens; 0: off
    overlong_penalty: float = 1.0  # the penalty at max_policy_tokens
    mask_truncated: bool = False  # drop cut responses (finish_reason "length") from the loss

    def __post_init__(self) -> None:
        self._check_clipping()
        if self.kl_coef < 0.0:
            raise ValueError(f"kl_coef must be >= 0; got {self.kl_coef}")
        if self.kl_clamp < 0.0:
            raise ValueError(f"kl_clamp must be >= 0 (0: no cap); got {self.kl_clamp}")
        self._map_tis_cap()
        self._check_correction()
        if not self.dpo_beta > 0.0:
            raise ValueError(f"dpo_beta must be > 0; got {self.dpo_beta}")
        for name, allowed in (
            ("kl_estimator", KL_ESTIMATORS),
            ("dpo_loss", DPO_LOSSES),
            ("std", STD_MODES),
            ("loss_agg", AGG_MODES),
            ("rollout_correction", CORRECTION_MODES),
            ("correction_proximal", PROXIMAL_POLICIES),
        ):
            check_choice(name, getattr(self, name), allowed)
        self._check_shaping()

    def _check_clipping(self) -> None:
        if not 0.0 <= self.clip_low <= 1.0:
            raise ValueError(f"clip_low must be in [0, 1]; got {self.clip_low}")
        if self.clip_high < 0.0:
            raise ValueError(f"clip_high must be >= 0; got {self.clip_high}")
        if self.clip_ratio_c != 0.0 and not self.clip_ratio_c > 1.0:
            raise ValueError(
                f"clip_ratio_c must be 0 (off) or > 1 (dual-clip bounds the loss of a negative "
                f"advantage at -A * clip_ratio_c); got {self.clip_ratio_c}"
            )

    @property
    def corrects(self) -> bool:
        """Whether the loss reads behaviour log-probs: a correction mode, or the bypass."""
        return self.rollout_correction != "none" or self.correction_proximal == "bypass"

    def _map_tis_cap(self) -> None:
        if self.tis_cap == 0.0:
            return
        if not self.tis_cap >= 1.0:
            raise ValueError(
                f"tis_cap must be 0 (off) or >= 1 (a cap below 1 would shrink the weight of "
                f"on-policy tokens); got {self.tis_cap}"
            )
        if self.rollout_correction != "none":
            raise ValueError(
                f"tis_cap={self.tis_cap} is the older name of rollout_correction="
                f"'token_truncate' with correction_clip_max={self.tis_cap}; got it together with "
                f"rollout_correction={self.rollout_correction!r}: set one of them"
            )
        # frozen: the record is normalised once, here, to the name that runs
        object.__setattr__(self, "rollout_correction", "token_truncate")
        object.__setattr__(self, "correction_clip_max", self.tis_cap)
        object.__setattr__(self, "tis_cap", 0.0)

    def _check_correction(self) -> None:
        low, high = self.correction_clip_min, self.correction_clip_max
        if low > high:
            raise ValueError(f"correction_clip_min ({low}) must be <= correction_clip_max ({high})")
        if not 0.0 <= low <= 1.0 <= high:
            raise ValueError(
                f"the correction band [correction_clip_min, correction_clip_max] must hold 1 "
                f"(a token sampled by the learner's own policy has ratio 1) and start at >= 0; "
                f"got [{low}, {high}]"
            )
        bypass = self.correction_proximal == "bypass"
        if bypass and self.rollout_correction in TRUNCATE_MODES and self.loss in RATIO_LOSSES:
            raise ValueError(
                f"rollout_correction={self.rollout_correction!r} with correction_proximal="
                f"'bypass' and loss={self.loss!r} would change nothing: the loss's own ratio "
                f"pi / pi_behaviour is the importance weight (clipped by clip_low/clip_high); use "
                f"a *_mask mode, correction_proximal='decoupled', or a loss without a ratio "
                f"(pg, rloo)"
            )

    def _check_shaping(self) -> None:
        if self.max_policy_tokens < 1:
            raise ValueError(f"max_policy_tokens must be >= 1; got {self.max_policy_tokens}")
        if not 0 <= self.overlong_buffer <= self.max_policy_tokens:
            raise ValueError(
                f"overlong_buffer must be in [0, max_policy_tokens = {self.max_policy_tokens}]; "
                f"got {self.overlong_buffer}"
            )


def check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {name} {value!r}; allowed: {', '.join(allowed)}")
