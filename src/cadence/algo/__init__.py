"""Pure RL algorithm pieces: advantage estimators, policy losses, aggregation, registry.

Everything here is a function of tensors; it imports only torch, the stdlib and `cadence.types`.
"""

from cadence.algo.advantages import grpo_advantages, reinforce_advantages, rloo_advantages
from cadence.algo.losses import (
    AGG_MODES,
    KL_ESTIMATORS,
    LossParams,
    PolicyBatch,
    kl_penalty,
    normaliser,
    pg_loss,
    ppo_clip_loss,
    token_weights,
)
from cadence.algo.registry import (
    ADVANTAGES,
    LOSSES,
    AdvantageContext,
    AdvantageFn,
    LossFn,
    get_advantage,
    get_loss,
)

__all__ = [
    "ADVANTAGES",
    "AGG_MODES",
    "KL_ESTIMATORS",
    "LOSSES",
    "AdvantageContext",
    "AdvantageFn",
    "LossFn",
    "LossParams",
    "PolicyBatch",
    "get_advantage",
    "get_loss",
    "grpo_advantages",
    "kl_penalty",
    "normaliser",
    "pg_loss",
    "ppo_clip_loss",
    "reinforce_advantages",
    "rloo_advantages",
    "token_weights",
]
