import pytest
import torch

import cadence.algo as algo
from cadence.algo.registry import LOSSES, get_advantage, get_loss


def test_advantage_names_resolve_to_the_estimators_with_context_options():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    ctx = algo.AdvantageContext(scale_by_std=False, baseline=0.25)
    # grpo without std: r - 0.5 -> [0.5, -0.5, -0.5, 0.5]
    torch.testing.assert_close(
        get_advantage("grpo")(rewards, ctx), algo.grpo_advantages(rewards, False)
    )
    torch.testing.assert_close(get_advantage("rloo")(rewards, ctx), algo.rloo_advantages(rewards))
    # reinforce: r - 0.25 -> [0.75, -0.25, -0.25, 0.75]
    torch.testing.assert_close(
        get_advantage("reinforce")(rewards, ctx), torch.tensor([[0.75, -0.25, -0.25, 0.75]])
    )


def test_loss_names_resolve_to_registered_functions():
    assert get_loss("ppo_clip") is algo.ppo_clip_loss
    assert get_loss("pg") is algo.pg_loss


def test_rloo_and_online_dpo_are_registered_and_only_dpo_is_per_pair():
    assert get_loss("rloo") is algo.rloo_loss
    assert get_loss("online_dpo") is algo.online_dpo_loss
    assert [name for name in LOSSES if algo.is_pair_loss(name)] == ["online_dpo"]


@pytest.mark.parametrize(
    ("loss", "kl_coef", "needed"),
    [
        ("ppo_clip", 0.0, False),
        ("ppo_clip", 0.1, True),
        ("rloo", 0.0, False),
        ("online_dpo", 0.0, True),
    ],
)
def test_reference_is_needed_for_kl_or_a_pair_loss(loss: str, kl_coef: float, needed: bool):
    assert algo.needs_reference(loss, kl_coef) is needed


def test_unknown_advantage_error_names_allowed_values():
    with pytest.raises(ValueError) as info:
        get_advantage("gae")
    assert str(info.value) == "unknown algo.advantage 'gae'; allowed: grpo, rloo, reinforce"


def test_unknown_loss_error_names_allowed_values():
    with pytest.raises(ValueError) as info:
        get_loss("dpo")
    assert str(info.value) == "unknown algo.loss 'dpo'; allowed: ppo_clip, pg, rloo, online_dpo"


def test_inserting_into_losses_registers_a_new_loss(monkeypatch: pytest.MonkeyPatch):
    def online_dpo(batch, params):
        raise NotImplementedError

    monkeypatch.setitem(LOSSES, "online_dpo", online_dpo)
    assert get_loss("online_dpo") is online_dpo


def test_public_surface_is_exactly_all():
    public = {name for name in vars(algo) if not name.startswith("_")}
    modules = {"advantages", "losses", "registry"}
    assert public - modules == set(algo.__all__)
