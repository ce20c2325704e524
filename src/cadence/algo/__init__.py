"""Pure RL algorithm pieces: advantage estimators, policy and preference losses, registry.

Everything here is a function of tensors; it imports only torch, the stdlib, `cadence.types` and
`cadence.choices`.
"""

from cadence.algo.advantages import (
    STD_EPS,
    STD_MODES,
    grpo_advantages,
    reinforce_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from cadence.algo.aggregation import AGG_MODES, normaliser, token_weights
from cadence.algo.correction import (
    CORRECTION_FIGURES,
    CORRECTION_MAXIMA,
    CORRECTION_SUMS,
    LARGEST_FIGURES,
    SMALLEST_FIGURES,
    correction_figures,
    correction_sums,
    correction_weights,
    tis_weights,
)
from cadence.algo.dpo import online_dpo_loss, preference_pairs
from cadence.algo.losses import (
    COUNT_METRICS,
    LOG_RATIO_CLAMP,
    TOKEN_METRICS,
    PolicyBatch,
    cispo_loss,
    gspo_loss,
    kl_penalty,
    pg_loss,
    ppo_clip_loss,
    rloo_loss,
)
from cadence.algo.params import RATIO_LOSSES, AlgoParams
from cadence.algo.registry import (
    ADVANTAGES,
    BATCH_ADVANTAGES,
    LOSSES,
    PAIR_LOSSES,
    AdvantageContext,
    AdvantageFn,
    LossFn,
    get_advantage,
    get_loss,
    is_batch_advantage,
    is_pair_loss,
    needs_reference,
)
from cadence.algo.shaping import overlong_penalty
from cadence.choices import CORRECTION_MODES, DPO_LOSSES, KL_ESTIMATORS, PROXIMAL_POLICIES

__all__ = [
    "ADVANTAGES",
    "AGG_MODES",
    "BATCH_ADVANTAGES",
    "CORRECTION_FIGURES",
    "CORRECTION_MAXIMA",
    "CORRECTION_MODES",
    "CORRECTION_SUMS",
    "COUNT_METRICS",
    "DPO_LOSSES",
    "KL_ESTIMATORS",
    "LARGEST_FIGURES",
    "LOG_RATIO_CLAMP",
    "LOSSES",
    "PAIR_LOSSES",
    "PROXIMAL_POLICIES",
    "RATIO_LOSSES",
    "SMALLEST_FIGURES",
    "STD_EPS",
    "STD_MODES",
    "TOKEN_METRICS",
    "AdvantageContext",
    "AdvantageFn",
    "AlgoParams",
    "LossFn",
    "PolicyBatch",
    "cispo_loss",
    "correction_figures",
    "correction_sums",
    "correction_weights",
    "get_advantage",
    "get_loss",
    "grpo_advantages",
    "gspo_loss",
    "is_batch_advantage",
    "is_pair_loss",
    "kl_penalty",
    "needs_reference",
    "normaliser",
    "online_dpo_loss",
    "overlong_penalty",
    "pg_loss",
    "ppo_clip_loss",
    "preference_pairs",
    "reinforce_advantages",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "rloo_loss",
    "tis_weights",
    "token_weights",
]
