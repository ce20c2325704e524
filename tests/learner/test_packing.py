"""Shared-prompt layouts: the mask itself, and equal log-probs, gradients and updates."""

import copy
import warnings

import pytest
import torch
from rollouts import train

from cadence.algo import AlgoParams
from cadence.learner import Learner, LearnerParams
from cadence.learner.packing import (
    LAYOUTS,
    Dense,
    Prefix,
    Unpacked,
    packed,
    positions,
    row_mask,
    shared_prompt_mask,
    shared_prompt_positions,
)
from cadence.types import Completion, Group, Prompt
from tiny_models import tiny_causal_lm
from updates import assert_same_update, capture_grads, max_relative_diff

VOCAB = 101


def test_mask_of_a_hand_written_example():
    # P = 3 prompt tokens (p0 p1 p2), G = 2 responses of R = 2 (a0 a1, b0 b1), one padding slot.
    #          p0 p1 p2 a0 a1 b0 b1 pad
    expected = [
        [1, 0, 0, 0, 0, 0, 0, 0],  # p0: causal within the prompt
        [1, 1, 0, 0, 0, 0, 0, 0],  # p1
        [1, 1, 1, 0, 0, 0, 0, 0],  # p2
        [1, 1, 1, 1, 0, 0, 0, 0],  # a0: all of P, then itself
        [1, 1, 1, 1, 1, 0, 0, 0],  # a1: all of P, causally within a
        [1, 1, 1, 0, 0, 1, 0, 0],  # b0: all of P, never a
        [1, 1, 1, 0, 0, 1, 1, 0],  # b1
        [0, 0, 0, 0, 0, 0, 0, 1],  # padding sees only itself (no empty softmax row)
    ]
    mask = shared_prompt_mask(3, [2, 2], width=8)
    assert mask.tolist() == [[bool(x) for x in row] for row in expected]
    # responses continue from len(P) = 3: a0 a1 and b0 b1 both sit at positions 3, 4
    assert shared_prompt_positions(3, [2, 2]) == [0, 1, 2, 3, 4, 3, 4]


def test_a_packed_row_lets_each_group_see_only_itself_with_positions_restarting():
    # two groups end to end: [p0 p1 | a0 | b0] and [q0 | c0 c1], then padding
    mask = row_mask([(2, [1, 1]), (1, [2])], width=8)
    expected = [
        [1, 0, 0, 0, 0, 0, 0, 0],  # p0
        [1, 1, 0, 0, 0, 0, 0, 0],  # p1
        [1, 1, 1, 0, 0, 0, 0, 0],  # a0: its prompt, itself
        [1, 1, 0, 1, 0, 0, 0, 0],  # b0: its prompt, never a
        [0, 0, 0, 0, 1, 0, 0, 0],  # q0: the second group starts afresh
        [0, 0, 0, 0, 1, 1, 0, 0],  # c0
        [0, 0, 0, 0, 1, 1, 1, 0],  # c1
        [0, 0, 0, 0, 0, 0, 0, 1],  # padding
    ]
    assert mask.tolist() == [[bool(x) for x in row] for row in expected]
    layout = packed([([5, 6], [[7], [8]]), ([9], [[10, 11]])], pad_id=0)
    assert layout.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 11]]
    assert layout.position_ids.tolist() == [[0, 1, 2, 2, 0, 1, 2]]
    assert layout.positions_computed == layout.tokens_computed == 7  # no padding at all


@pytest.mark.parametrize("layout", ["unpacked", "dense", "prefix", "packed"])
def test_the_positions_a_layout_computes_are_known_from_the_lengths_alone(layout):
    groups = _ragged_groups()
    built = LAYOUTS[layout](groups, 0)
    assert positions(layout, groups) == built.positions_computed >= built.tokens_computed


def test_tokens_computed_fall_by_the_expected_ratio():
    groups = [([1] * 256, [[2] * 64] * 8)]
    unpacked = Unpacked.build(groups, pad_id=0).tokens_computed
    assert unpacked == 8 * (256 + 64)
    for build in (Dense.build, Prefix.build, packed):
        assert build(groups, 0).tokens_computed == 256 + 8 * 64


def _tiny(arch: str, attn: str = "sdpa") -> torch.nn.Module:
    return tiny_causal_lm(arch, VOCAB, attn=attn, max_positions=128).train()


def _ragged_groups(seed: int = 1):
    """Three groups with different prompt lengths and ragged response lengths (1 to 6)."""
    gen = torch.Generator().manual_seed(seed)

    def ids(n):
        return torch.randint(2, VOCAB, (n,), generator=gen).tolist()

    return [
        (ids(5), [ids(3), ids(1), ids(4)]),
        (ids(2), [ids(2), ids(6), ids(2)]),
        (ids(7), [ids(5), ids(5), ids(1)]),
    ]


def _valid(groups):
    lens = torch.tensor([len(r) for _, rs in groups for r in rs])  # (B,)
    return torch.arange(int(lens.max()))[None, :] < lens[:, None]  # (B, T)


def _token_logprobs(model, layout_name, groups):
    """Valid per-token log-probs of every response via `layout_name`, and grads of their sum."""
    model.zero_grad()
    device = next(model.parameters()).device
    pred = LAYOUTS[layout_name](groups, 0).to(device).logits(model).log_softmax(-1).cpu()
    valid = _valid(groups)
    tokens = torch.zeros(valid.shape, dtype=torch.long)
    for b, r in enumerate(r for _, rs in groups for r in rs):
        tokens[b, : len(r)] = torch.tensor(r)
    logprobs = torch.zeros(valid.shape)  # (B, T): the (M, V) rows are the valid tokens'
    logprobs[valid] = pred.gather(-1, tokens[valid][:, None]).squeeze(-1)
    weights = torch.arange(1, logprobs.numel() + 1, dtype=torch.float32).view_as(logprobs)
    torch.where(valid, logprobs * weights / weights.numel(), 0.0).sum().backward()
    grads = {n: p.grad.cpu() for n, p in model.named_parameters()}
    return logprobs.detach()[valid], grads


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("layout", ["dense", "prefix", "packed"])
def test_shared_prompt_logprobs_and_grads_equal_unpacked(arch, layout):
    model = _tiny(arch).train()
    groups = _ragged_groups()
    want, want_grads = _token_logprobs(model, "unpacked", groups)
    got, got_grads = _token_logprobs(model, layout, groups)
    assert got.shape == want.shape == (int(_valid(groups).sum()),)
    assert (got - want).abs().max().item() <= 1e-5
    assert max_relative_diff(got_grads, want_grads) <= 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("layout", ["dense", "prefix", "packed"])
def test_shared_prompt_logprobs_and_grads_equal_unpacked_on_cuda(layout):
    model = _tiny("qwen2").cuda().train()
    groups = _ragged_groups()
    want, want_grads = _token_logprobs(model, "unpacked", groups)
    got, got_grads = _token_logprobs(model, layout, groups)
    assert (got - want).abs().max().item() <= 1e-4  # GPU kernels sum in other orders
    assert max_relative_diff(got_grads, want_grads) <= 1e-4


def test_dense_layout_is_right_under_eager_attention():
    # eager attention adds the mask to the scores: a bool mask would be read as 0/1 offsets
    model = _tiny("llama", attn="eager").eval()
    groups = _ragged_groups(seed=2)
    want, _ = _token_logprobs(model, "unpacked", groups)
    got, _ = _token_logprobs(model, "dense", groups)
    assert (got - want).abs().max().item() <= 1e-5


def _groups_of(raw):
    out = []
    for i, (prompt, responses) in enumerate(raw):
        completions = [
            Completion(r, [-1.0] * len(r), reward=float(j % 2)) for j, r in enumerate(responses)
        ]
        out.append(Group(Prompt(f"p{i}", "", "", i), prompt, completions, 0, 0))
    return out


@pytest.mark.parametrize("layout", ["dense", "prefix", "packed"])
def test_training_update_equals_unpacked(layout):
    base = _tiny("qwen2")
    groups = _groups_of(_ragged_groups(seed=3))
    models, grads = [], []
    for shared in (False, True):
        model, ref = copy.deepcopy(base), copy.deepcopy(base).requires_grad_(False)
        params = LearnerParams(
            lr=1e-3, micro_batch_groups=2, shared_prompt=shared, shared_prompt_impl=layout
        )
        learner = Learner(model, params, AlgoParams(kl_coef=0.1), 0, ref_model=ref)
        assert learner.layout == (layout if shared else "unpacked")
        seen = capture_grads(learner)
        stats = train(learner, groups)
        models.append(model)
        grads.append(seen[0])
        tokens = stats["tokens_computed"]
        expected = sum(
            (1 if shared else len(rs)) * len(p) + sum(len(r) for r in rs)
            for p, rs in _ragged_groups(seed=3)
        )
        assert tokens == expected
    assert_same_update(models[1], models[0], grads[1], grads[0])
    moved = max(
        (a - b).abs().max().item()
        for a, b in zip(models[1].parameters(), base.parameters(), strict=True)
    )
    assert moved > 1e-4


class _NoPositions(torch.nn.Module):
    """A causal LM whose forward takes only input_ids and a 2-D mask (no position ids, no cache)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def get_input_embeddings(self):
        return self.inner.get_input_embeddings()

    def forward(self, input_ids, attention_mask):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask)


class _IgnoresMask(_NoPositions):
    """Accepts every argument but silently drops the mask and position ids: wrong, not failing."""

    def forward(self, input_ids, attention_mask=None, position_ids=None, **kw):
        return self.inner(input_ids=input_ids, **kw)


@pytest.mark.parametrize("wrapper", [_NoPositions, _IgnoresMask])
@pytest.mark.parametrize("layout", ["dense", "prefix", "packed"])
def test_model_that_cannot_take_the_layout_falls_back_with_one_warning(wrapper, layout):
    model = wrapper(_tiny("llama"))
    params = LearnerParams(micro_batch_groups=3, shared_prompt_impl=layout)
    with pytest.warns(UserWarning, match="shared-prompt packing") as caught:
        learner = Learner(model, params, AlgoParams(), 0)
    assert len([w for w in caught if "shared-prompt" in str(w.message)]) == 1
    assert learner.layout == "unpacked"
    groups = _groups_of(_ragged_groups())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # training itself warns no more
        stats = train(learner, groups)
    assert torch.isfinite(torch.tensor(stats["loss"]))


def test_supported_model_gives_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        learner = Learner(_tiny("qwen2"), LearnerParams(), AlgoParams(), 0)
    assert learner.layout == "prefix"


def test_attention_by_segments_equals_the_mask_over_rows_with_padding():
    # two rows, the second padded: each group attends only to itself, padding reads zeros
    model = _tiny("qwen2").eval()
    groups = _ragged_groups(seed=4)
    want = Dense.build(groups, 0, rows=[[0, 1], [2]]).logits(model).log_softmax(-1)
    segmented = Dense.build(groups, 0, rows=[[0, 1], [2]], segmented=True)
    assert segmented.attention_mask.shape == (2, 1, 2, segmented.input_ids.shape[1])
    got = segmented.logits(model).log_softmax(-1)
    assert got.shape == (int(_valid(groups).sum()), VOCAB)  # (M, V): no row for padding
    assert (got - want).abs().max().item() <= 1e-5


def test_long_responses_attend_one_at_a_time_to_the_same_result():
    # a group of 3 responses of 200 tokens: its one mask would be mostly blocked, so each
    # response attends to [prompt | itself] in a call of its own (segments._group)
    model = tiny_causal_lm("llama", VOCAB, max_positions=512).eval()
    gen = torch.Generator().manual_seed(5)
    groups = [
        (torch.randint(2, VOCAB, (n,), generator=gen).tolist(), [
            torch.randint(2, VOCAB, (r,), generator=gen).tolist() for r in lens
        ])
        for n, lens in ((10, (200, 150, 260)), (4, (3, 5)))
    ]  # fmt: skip
    want = Dense.build(groups, 0).logits(model).log_softmax(-1)
    got = packed(groups, 0).logits(model).log_softmax(-1)
    assert (got - want).abs().max().item() <= 1e-5
