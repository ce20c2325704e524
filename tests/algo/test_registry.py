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
    assert str(info.value) == (
        "unknown algo.advantage 'gae'; allowed: grpo, rloo, reinforce, reinforce_pp, "
        "reinforce_pp_baseline"
    )


def test_unknown_loss_error_names_allowed_values():
    with pytest.raises(ValueError) as info:
        get_loss("dpo")
    assert str(info.value) == (
        "unknown algo.loss 'dpo'; allowed: ppo_clip, pg, rloo, online_dpo, gspo, cispo"
    )


def test_inserting_into_losses_registers_a_new_loss(monkeypatch: pytest.MonkeyPatch):
    def online_dpo(batch, params):
        raise NotImplementedError

    monkeypatch.setitem(LOSSES, "online_dpo", online_dpo)
    assert get_loss("online_dpo") is online_dpo


def test_public_surface_is_exactly_all():
    public = {name for name in vars(algo) if not name.startswith("_")}
    modules = {
        "advantages",
        "aggregation",
        "correction",
        "dpo",
        "losses",
        "params",
        "registry",
        "shaping",
    }
    assert public - modules == set(algo.__all__)


def test_gspo_and_cispo_are_registered_as_token_losses():
    assert get_loss("gspo") is algo.gspo_loss and get_loss("cispo") is algo.cispo_loss
    assert not algo.is_pair_loss("gspo") and not algo.is_pair_loss("cispo")


def test_reinforce_pp_estimators_take_lengths_and_need_the_whole_batch():
    rewards = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    lengths = torch.tensor([[1, 1], [1, 1]])
    ctx = algo.AdvantageContext(std="population", std_eps=0.0, lengths=lengths)
    # reinforce_pp: 4 tokens, mean 0.75, population std sqrt(0.1875) = 0.433013:
    #   1 -> 0.25 / 0.433013 = 0.577350; 0 -> -0.75 / 0.433013 = -1.732051
    a, b = 0.577350, -1.732051
    expected = torch.tensor([[a, b], [a, a]])
    torch.testing.assert_close(get_advantage("reinforce_pp")(rewards, ctx), expected)
    # the baseline variant: group means 0.5 and 1 -> [0.5, -0.5], [0, 0]; mean 0, population
    # std sqrt(0.5 / 4) = 0.353553 -> [1.414214, -1.414214], [0, 0]
    s2 = 2.0**0.5
    baseline = get_advantage("reinforce_pp_baseline")(rewards, ctx)
    torch.testing.assert_close(baseline, torch.tensor([[s2, -s2], [0.0, 0.0]]))
    assert [n for n in algo.ADVANTAGES if algo.is_batch_advantage(n)] == [
        "reinforce_pp",
        "reinforce_pp_baseline",
    ]
    with pytest.raises(ValueError, match="needs each response's token count"):
        get_advantage("reinforce_pp")(rewards, algo.AdvantageContext())


def test_grpo_reads_std_and_eps_from_the_context():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    ctx = algo.AdvantageContext(std="population", std_eps=0.0)
    # population std 0.5 -> +-1 (the default unbiased std + 1e-4 gives +-0.865875)
    torch.testing.assert_close(
        get_advantage("grpo")(rewards, ctx), torch.tensor([[1.0, -1.0, -1.0, 1.0]])
    )
