"""Pure RL algorithm pieces: advantage estimators, policy and preference losses, registry.

Everything here is a function of tensors; it imports only torch, the stdlib and `cadence.types`.
"""

from cadence.algo.advantages import grpo_advantages, reinforce_advantages, rloo_advantages
from cadence.algo.losses import (
    AGG_MODES,
    COUNT_METRICS,
    DPO_LOSSES,
    KL_ESTIMATORS,
    LossParams,
    PolicyBatch,
    kl_penalty,
    normaliser,
    online_dpo_loss,
    pg_loss,
    ppo_clip_loss,
    preference_pairs,
    rloo_loss,
    tis_weights,
    token_weights,
)
from cadence.algo.registry import (
    ADVANTAGES,
    LOSSES,
    PAIR_LOSSES,
    AdvantageContext,
    AdvantageFn,
    LossFn,
    get_advantage,
    get_loss,
    is_pair_loss,
    needs_reference,
)

__all__ = [
    "ADVANTAGES",
    "AGG_MODES",
    "COUNT_METRICS",
    "DPO_LOSSES",
    "KL_ESTIMATORS",
    "LOSSES",
    "PAIR_LOSSES",
    "AdvantageContext",
    "AdvantageFn",
    "LossFn",
    "LossParams",
    "PolicyBatch",
    "get_advantage",
    "get_loss",
    "grpo_advantages",
    "is_pair_loss",
    "kl_penalty",
    "needs_reference",
    "normaliser",
    "online_dpo_loss",
    "pg_loss",
    "ppo_clip_loss",
    "preference_pairs",
    "reinforce_advantages",
    "rloo_advantages",
    "rloo_loss",
    "tis_weights",
    "token_weights",
]
