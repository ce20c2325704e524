import re
import tomllib
from pathlib import Path

import pytest

from cadence.config import Config, ConfigError, load_config, to_toml


def test_defaults_validate_and_round_trip_through_toml():
    cfg = load_config(None, ["train.iterations=3", 'rollout.stop=["\\n\\n"]'])
    assert cfg.train.iterations == 3 and cfg.rollout.stop == ["\n\n"]
    assert Config.model_validate(tomllib.loads(to_toml(cfg))) == cfg


def test_required_keys_exist():
    cfg = Config()
    for key in [
        "model.path",
        "data.task",
        "data.path",
        "train.iterations",
        "train.seed",
        "train.prompts_per_iteration",
        "rollout.group_size",
        "rollout.max_new_tokens",
        "rollout.temperature",
        "algo.loss",
        "algo.kl_coef",
        "pipeline.mode",
        "pipeline.placement",
        "learner.shared_prompt",
        "learner.shared_prompt_impl",
        "learner.reuse_old_logprobs",
        "learner.ranks",
        "learner.strategy",
    ]:
        section, field = key.split(".")
        assert field in type(getattr(cfg, section)).model_fields, key


@pytest.mark.parametrize(
    "override, key, hint",
    [
        (["train.iterationz=3"], "train.iterationz", "unknown key"),
        (
            ['algo.loss="dpo"'],
            "algo.loss",
            "'ppo_clip', 'pg', 'rloo', 'online_dpo', 'gspo' or 'cispo'",
        ),
        (["rollout.group_size=0"], "rollout.group_size", "greater than or equal to 1"),
        (["bogus.key=1"], "bogus", "unknown key"),
        (
            ['learner.shared_prompt_impl="flash"'],
            "learner.shared_prompt_impl",
            "'dense' or 'packed'",
        ),
        (["learner.ranks=0"], "learner.ranks", "greater than or equal to 1"),
        (['learner.strategy="zero3"'], "learner.strategy", "'fsdp' or 'ddp'"),
    ],
)
def test_bad_keys_and_values_name_the_key(override, key, hint):
    with pytest.raises(ConfigError) as info:
        load_config(None, override)
    assert f"'{key}'" in str(info.value) and hint in str(info.value)


def test_missing_file_and_bad_override_form(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match=r"section\.key=value"):
        load_config(None, ["train.iterations"])


def test_shared_prompt_is_on_by_default():
    cfg = Config()
    assert cfg.learner.shared_prompt and cfg.learner.shared_prompt_impl == "prefix"


def test_loss_keys_have_defaults_and_round_trip():
    algo = Config().algo
    assert (algo.tis_cap, algo.dpo_beta, algo.dpo_loss) == (0.0, 0.1, "sigmoid")
    for fields in (
        ["algo.loss='online_dpo'", "algo.dpo_beta=0.3", "algo.dpo_loss='ipo'"],
        ["algo.loss='ppo_clip'", "algo.tis_cap=2.0"],
        ["algo.loss='rloo'"],
    ):
        cfg = load_config(None, fields)
        assert Config.model_validate(tomllib.loads(to_toml(cfg))) == cfg


def test_rloo_loss_brings_its_advantage_and_refuses_another():
    assert load_config(None, ["algo.loss='rloo'"]).algo.advantage == "rloo"  # left out: filled
    assert load_config(None, ["algo.loss='rloo'", "algo.advantage='rloo'"]).algo.loss == "rloo"
    with pytest.raises(ConfigError, match=r"algo\.advantage = 'grpo' would be ignored"):
        load_config(None, ["algo.loss='rloo'", "algo.advantage='grpo'"])


@pytest.mark.parametrize(
    "override, hint",
    [
        (["algo.tis_cap=0.5"], "algo.tis_cap must be 0 (off) or >= 1"),
        (["algo.tis_cap=-1"], "greater than or equal to 0"),
        (["algo.dpo_beta=0"], "greater than 0"),
        (["algo.dpo_loss='hinge'"], "'sigmoid', 'ipo' or 'ipo_token_mean'"),
        (["algo.loss='online_dpo'", "algo.kl_coef=0.1"], "takes no algo.kl_coef or algo.tis_cap"),
        (["algo.loss='online_dpo'", "algo.tis_cap=2"], "takes no algo.kl_coef or algo.tis_cap"),
        (["algo.clip_ratio_c=1.0"], "algo.clip_ratio_c must be 0 (off) or > 1"),
        (["algo.loss='gspo'", "algo.clip_ratio_c=3"], "applies to algo.loss = 'ppo_clip' only"),
        (["algo.std='sample'"], "'unbiased' or 'population'"),
        (["algo.clip_low=1.5"], "less than or equal to 1"),
        (["algo.loss='online_dpo'", "algo.mask_truncated=true"], "set algo.mask_truncated"),
        (["algo.advantage='reinforce_plus_plus'"], "'reinforce_pp' or 'reinforce_pp_baseline'"),
    ],
)
def test_bad_loss_keys_are_refused_with_the_reason(override, hint):
    with pytest.raises(ConfigError, match="config key 'algo") as info:
        load_config(None, override)
    assert hint in str(info.value)


def test_parity_keys_have_defaults_and_round_trip():
    cfg = Config()
    assert (cfg.algo.std, cfg.algo.std_eps, cfg.algo.clip_ratio_c) == ("unbiased", 1e-4, 0.0)
    assert not cfg.algo.mask_truncated
    assert (cfg.reward.overlong_buffer, cfg.reward.overlong_penalty) == (0, 1.0)
    for fields in (
        ["algo.std='population'", "algo.std_eps=1e-6", "algo.clip_ratio_c=3.0", "algo.kl_clamp=10"],
        ["algo.loss='cispo'", "algo.clip_low=1.0", "algo.clip_high=4.0"],
        ["algo.advantage='reinforce_pp_baseline'", "algo.mask_truncated=true"],
        ["reward.overlong_buffer=16", "reward.overlong_penalty=0.5", "rollout.max_new_tokens=64"],
        ["algo.loss='online_dpo'", "algo.dpo_loss='ipo_token_mean'"],
    ):
        cfg = load_config(None, fields)
        assert Config.model_validate(tomllib.loads(to_toml(cfg))) == cfg


def test_gspo_defaults_to_seq_mean_but_keeps_an_explicit_aggregation():
    assert load_config(None, ["algo.loss='gspo'"]).algo.loss_agg == "seq-mean"
    explicit = load_config(None, ["algo.loss='gspo'", "algo.loss_agg='token-mean'"])
    assert explicit.algo.loss_agg == "token-mean"
    assert load_config(None, ["algo.loss='cispo'"]).algo.loss_agg == "token-mean"


def test_overlong_buffer_longer_than_the_response_is_refused():
    with pytest.raises(ConfigError, match=r"set reward.overlong_buffer <= 48"):
        load_config(None, ["reward.overlong_buffer=49"])
    assert load_config(None, ["reward.overlong_buffer=48"]).reward.overlong_buffer == 48


RAY = ["pipeline.backend='ray'", "pipeline.placement='separate'"]


@pytest.mark.parametrize(
    ("override", "hint"),
    [
        (["pipeline.backend='ray'"], "set pipeline.placement = 'separate'"),
        (["pipeline.backend='cluster'"], "'local' or 'ray'"),
        (["pipeline.weight_sync='broadcast'"], "pipeline.weight_sync applies to"),
        (["pipeline.ray_address='auto'"], "pipeline.ray_address applies to"),
        (["pipeline.num_gpus_per_worker=1"], "GPU shares place processes on GPUs"),
        ([*RAY, "pipeline.ray_address='auto'", "pipeline.ray_num_cpus=2"], "leave pipeline.ray"),
        ([*RAY, "pipeline.weight_sync='nccl'"], "'object_store' or 'broadcast'"),
        (
            [*RAY, "pipeline.weight_sync='broadcast'", "model.device='cuda'"],
            "set pipeline.num_gpus_per_worker > 0",
        ),
        (["learner.num_gpus_per_rank=1"], "learner.num_gpus_per_rank = 1 with model.device"),
        (
            [
                "model.device='cuda'",
                "rollout.engine='vllm'",
                "rollout.vllm.tensor_parallel_size=2",
                "pipeline.placement='separate'",
                "pipeline.num_gpus_per_worker=1",
            ],
            "set pipeline.num_gpus_per_worker = 2",
        ),
        (
            ["model.device='cuda'", "rollout.engine='vllm'", "rollout.vllm.tensor_parallel_size=2"],
            "the colocated engine shares the learner's one GPU",
        ),
        (
            ["model.device='cuda'", "learner.ranks=2"],
            "one GPU would generate for all of them",
        ),
        (
            ["model.device='cuda'", "learner.num_gpus_per_rank=2"],
            "a rank trains on one GPU",
        ),
        (  # NCCL refuses two ranks of one group on one device
            [
                "model.device='cuda'",
                "pipeline.placement='separate'",
                "pipeline.num_gpus_per_worker=1",
                "learner.ranks=2",
                "learner.num_gpus_per_rank=0.5",
            ],
            "ranks would share a GPU",
        ),
        (
            [*RAY, "model.device='cuda'", "learner.ranks=2", "learner.num_gpus_per_rank=0.5"],
            "ranks would share a GPU",
        ),
        (
            ["model.device='cuda'", "pipeline.placement='separate'", "pipeline.num_workers=2"],
            "needs pipeline.num_gpus_per_worker",
        ),
        (
            [
                "model.device='cuda'",
                "pipeline.placement='separate'",
                "pipeline.num_gpus_per_worker=1.5",
            ],
            "above 1 a worker takes whole GPUs",
        ),
        (
            [*RAY, "learner.ranks=2", "model.device='cuda'"],
            "set learner.num_gpus_per_rank > 0",
        ),
        (["pipeline.ray_worker_resources={ rollout = 1 }"], "ray_worker_resources applies to"),
        (["learner.ray_rank_resources={ trainer = 1 }"], "ray_rank_resources applies to"),
        ([*RAY, "pipeline.ray_worker_resources={ GPU = 1 }"], "keys of their own"),
        ([*RAY, "learner.ray_rank_resources={ CPU = 2 }"], "keys of their own"),
        ([*RAY, "pipeline.ray_worker_resources={ rollout = 0 }"], "must be above 0"),
    ],
)
def test_bad_backend_keys_are_refused_with_the_reason(override, hint):
    with pytest.raises(ConfigError, match=r"config key '(pipeline|\(root\))") as info:
        load_config(None, override)
    assert hint in str(info.value)


def test_ray_backend_keys_round_trip():
    cfg = load_config(None, [*RAY, "pipeline.weight_sync='broadcast'", "pipeline.ray_num_cpus=2"])
    assert cfg.pipeline.backend == "ray" and load_config(None).pipeline.backend == "local"
    again = tomllib.loads(to_toml(cfg))
    assert again["pipeline"]["weight_sync"] == "broadcast"
    assert "ray_address" not in again["pipeline"]  # unset: start a Ray for the run


def test_custom_ray_resources_round_trip_whatever_their_names():
    resources = '{ rollout = 1, "accelerator_type:A100" = 0.5 }'  # Ray's own name has a colon
    cfg = load_config(
        None,
        [
            *RAY,
            f"pipeline.ray_worker_resources={resources}",
            f"learner.ray_rank_resources={resources}",
        ],
    )
    want = {"rollout": 1.0, "accelerator_type:A100": 0.5}
    assert cfg.pipeline.ray_worker_resources == want == cfg.learner.ray_rank_resources
    assert Config.model_validate(tomllib.loads(to_toml(cfg))) == cfg


VLLM = ["rollout.engine='vllm'"]


@pytest.mark.parametrize(
    ("override", "hint"),
    [
        (["rollout.engine='paged'"], "'continuous', 'static' or 'vllm'"),
        (["rollout.vllm.enforce_eager=true"], "rollout.vllm applies to rollout.engine = 'vllm'"),
        ([*VLLM, "rollout.vllm.engine_args.seed=1"], "engine_args.seed is set by cadence"),
        ([*VLLM, "rollout.vllm.engine_args.max_num_seqs=8"], "rollout.max_num_seqs"),
        ([*VLLM, "rollout.vllm.engine_args.dtype='half'"], "set rollout.vllm.dtype"),
        ([*VLLM, "rollout.vllm.gpu_memory_utilization=1.5"], "less than or equal to 1"),
        ([*VLLM, "rollout.vllm.dtype='int8'"], "'auto', 'float32', 'bfloat16' or 'float16'"),
        ([*VLLM, "rollout.vllm.cache=1"], "unknown key"),
    ],
)
def test_bad_vllm_keys_are_refused_with_the_reason(override, hint):
    with pytest.raises(ConfigError, match=r"config key 'rollout") as info:
        load_config(None, override)
    assert hint in str(info.value)


def test_vllm_keys_round_trip_with_their_engine_arguments():
    extra = ["rollout.vllm.engine_args.block_size=32", "rollout.vllm.engine_args.swap_space=2.5"]
    cfg = load_config(None, [*VLLM, "rollout.vllm.tensor_parallel_size=2", *extra])
    text = to_toml(cfg)
    assert "[rollout.vllm]\n" in text and "[rollout.vllm.engine_args]\nblock_size = 32\n" in text
    assert Config.model_validate(tomllib.loads(text)) == cfg
    assert cfg.rollout.vllm.engine_args == {"block_size": 32, "swap_space": 2.5}


@pytest.mark.parametrize("path", sorted(Path("configs").glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_config_validates_and_round_trips(path):
    cfg = load_config(path)
    assert Config.model_validate(tomllib.loads(to_toml(cfg))) == cfg


VERIFIERS = ["env.kind='verifiers'", "env.factory='my_envs.arith:load_environment'"]


def test_a_verifiers_env_is_named_by_its_factory():
    cfg = load_config(None, VERIFIERS)
    assert (cfg.env.kind, cfg.env.factory) == ("verifiers", "my_envs.arith:load_environment")
    assert Config.model_validate(tomllib.loads(to_toml(cfg))) == cfg


def test_a_verifiers_episode_cap_is_the_one_stated():
    """The overlong penalty ramps up to the cap the user states for the environment: a correct
    120-token episode of a 160-token environment is not shaped to 0."""
    import torch

    from cadence.algo.shaping import overlong_penalty

    stated = ["env.max_total_tokens=160", "reward.overlong_buffer=32", "rollout.max_new_tokens=64"]
    cfg = load_config(None, [*VERIFIERS, *stated])
    assert cfg.max_policy_tokens == 160
    assert overlong_penalty(torch.tensor([120]), cfg.max_policy_tokens, 32, 1.0).item() == 0.0
    assert overlong_penalty(torch.tensor([120]), 128, 32, 1.0).item() < 0  # the old default cap
    turns = load_config(None, [*VERIFIERS, "env.max_turns=2", "rollout.max_new_tokens=64"])
    assert turns.max_policy_tokens == 128


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        (["env.kind='verifiers'"], "needs env.factory = 'module:function'"),
        ([*VERIFIERS[:1], "env.factory='my-envs'"], "is not 'module:name'"),
        (
            ["env.factory='my_envs:load'"],
            "env.factory applies to env.kind = 'class', 'openenv' or 'verifiers' only",
        ),
        (
            [*VERIFIERS, "reward.overlong_buffer=16"],
            "state it with env.max_turns and/or env.max_total_tokens",
        ),
        ([*VERIFIERS, "data.task='gsm8k'", "data.path='x'"], "leave data.task out"),
        ([*VERIFIERS, "data.chat_template='t.jinja'"], "a template file is not supported"),
        (
            [*VERIFIERS, "reward.stage='separate'", "pipeline.placement='separate'"],
            "set reward.stage = 'worker'",
        ),
    ],
)
def test_a_verifiers_env_refuses_keys_it_would_ignore(overrides, reason):
    with pytest.raises(ConfigError, match=re.escape(reason)):
        load_config(None, overrides)


OFFPOLICY = ["pipeline.mode='offpolicy'", "pipeline.placement='separate'"]
PARTIAL = [*OFFPOLICY, "pipeline.partial_rollout=true"]


@pytest.mark.parametrize(
    ("override", "hint"),
    [
        (["pipeline.partial_rollout=true"], "needs pipeline.mode = 'offpolicy' (got 'sync')"),
        ([*PARTIAL, "pipeline.max_staleness=0"], "needs pipeline.max_staleness >= 1"),
        (["pipeline.partial_rollout_kv='recompute'"], "applies to pipeline.partial_rollout"),
        ([*OFFPOLICY, "pipeline.staleness_strategy='wait'"], "applies to pipeline.partial_rollout"),
        ([*PARTIAL, "pipeline.partial_rollout_kv='drop'"], "'keep' or 'recompute'"),
        (
            [*PARTIAL, "rollout.engine='vllm'", "pipeline.partial_rollout_kv='recompute'"],
            "use partial_rollout_kv = 'keep'",
        ),
        ([*PARTIAL, "rollout.engine='static'"], "use rollout.engine = 'continuous'"),
        ([*PARTIAL, "env.kind='tool'"], "with env.kind = 'tool'"),
    ],
)
def test_bad_partial_rollout_keys_are_refused_naming_both_keys(override, hint):
    with pytest.raises(ConfigError, match=r"config key '(pipeline|\(root\))") as info:
        load_config(None, override)
    assert hint in str(info.value)


def test_partial_rollout_keys_reach_the_workers_and_round_trip():
    from cadence.builder import partial_rollouts
    from cadence.rollout import PartialRollouts

    assert partial_rollouts(load_config(None, OFFPOLICY)) is None  # off by default
    assert load_config(None, [*PARTIAL, "rollout.engine='vllm'"]).pipeline.partial_rollout
    cfg = load_config(None, [*PARTIAL, "pipeline.max_staleness=2"])
    assert partial_rollouts(cfg) == PartialRollouts(recompute=False, max_lag=None)
    sets = ["pipeline.partial_rollout_kv='recompute'", "pipeline.staleness_strategy='wait'"]
    cfg = load_config(None, [*PARTIAL, *sets, "pipeline.max_staleness=2"])
    assert partial_rollouts(cfg) == PartialRollouts(recompute=True, max_lag=2)
    again = tomllib.loads(to_toml(cfg))["pipeline"]
    assert (again["partial_rollout"], again["partial_rollout_kv"]) == (True, "recompute")
    assert again["staleness_strategy"] == "wait"


def test_partial_rollouts_on_vllm_refuse_asynchronous_scheduling():
    sets = [
        "rollout.engine='vllm'",
        "pipeline.mode='offpolicy'",
        "pipeline.placement='separate'",
        "pipeline.partial_rollout=true",
    ]
    with pytest.raises(ConfigError, match="leave async_scheduling out"):
        load_config(None, [*sets, "rollout.vllm.engine_args={ async_scheduling = true }"])
    assert load_config(None, sets).pipeline.partial_rollout


def test_vllm_runs_on_a_gpu_score_rewards_in_reward_processes_by_default():
    # an in-process vLLM engine shares one GIL with a reward scored beside it: the GPU waited
    vllm = ["rollout.engine='vllm'", "model.device='cuda'"]
    assert load_config(None, vllm).reward.stage == "separate"  # colocated: beside the worker
    separate = ["pipeline.placement='separate'", "pipeline.num_gpus_per_worker=1"]
    assert load_config(None, [*vllm, *separate]).reward.stage == "separate"
    assert load_config(None, [*vllm, "reward.stage='worker'"]).reward.stage == "worker"
    assert load_config(None, []).reward.stage == "worker"  # cadence's own engine
    assert load_config(None, vllm[:1]).reward.stage == "worker"  # vLLM on a CPU: no faster
    tools = [*vllm, "env.kind='tool'", "env.tools=['calculator']", "data.chat_template=true"]
    assert load_config(None, tools).reward.stage == "worker"  # episodes score themselves
    colocated = load_config(None, ["reward.stage='separate'"])  # a rule reward, any engine
    assert tomllib.loads(to_toml(colocated))["reward"]["stage"] == "separate"


@pytest.mark.parametrize("kind", ["class", "openenv"])
def test_a_reward_stage_that_would_drop_an_environments_own_rewards_is_refused(kind):
    sets = [
        f"env.kind='{kind}'",
        "env.factory='my_envs:Env'",
        "reward.stage='separate'",
        "pipeline.placement='separate'",
        "data.chat_template=true",
    ]
    with pytest.raises(ConfigError, match=f"env.kind = '{kind}' gives rewards of its own"):
        load_config(None, sets)


def test_periodic_with_dynamic_sampling_and_several_steps_is_refused_not_run_unlike_sync():
    # which groups fill a step would follow the order they finish in: periodic would not make
    # sync's update, so the pair is refused; one step, or sync, is accepted
    sampling = ["pipeline.filter_groups='zero_variance'", "train.mini_batches=2"]
    periodic = ["pipeline.placement='separate'", "pipeline.mode='periodic'"]
    with pytest.raises(ConfigError, match=r"train\.mini_batches = 2: dynamic sampling"):
        load_config(None, [*sampling, *periodic])
    load_config(None, sampling)  # sync
    load_config(None, [*periodic, "pipeline.filter_groups='zero_variance'"])  # one step


def test_a_teacher_per_task_round_trips_and_a_task_taught_twice_is_refused():
    teachers = (
        "distill.teachers=[{ path = 'a', tasks = ['chain_sum'] }, { path = 'b', tasks = ['x'] }]"
    )
    cfg = load_config(None, [teachers])
    assert [t.tasks for t in cfg.distill.teachers] == [["chain_sum"], ["x"]]
    assert cfg.distill.on and Config.model_validate(tomllib.loads(to_toml(cfg))) == cfg
    twice = "distill.teachers=[{ path = 'a', tasks = ['x'] }, { path = 'b', tasks = ['x'] }]"
    with pytest.raises(ConfigError, match=r"\['x'\] have more than one teacher"):
        load_config(None, [twice])
    with pytest.raises(ConfigError, match="not both"):
        load_config(None, ["distill.teacher='c'", teachers])


def test_a_teacher_stage_needs_the_rollout_workers_that_fill_the_store():
    worker = ["distill.teacher='t'", "distill.placement='worker'"]
    with pytest.raises(ConfigError, match=r"set pipeline\.placement = 'separate'"):
        load_config(None, worker)
    cfg = load_config(None, [*worker, "pipeline.placement='separate'", "distill.num_workers=2"])
    assert cfg.distill.placement == "worker" and cfg.distill.num_workers == 2
