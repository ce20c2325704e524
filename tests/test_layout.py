"""The package's layout holds: no import circle among cadence's modules, no module importing
another's private names, and layers that point one way.

Every import in a module counts, wherever it stands (module level, inside a function, under
`TYPE_CHECKING`): a lazy import still ties the two modules together.
"""

from __future__ import annotations

import ast
import collections
import subprocess
import sys
from pathlib import Path

import cadence
from cadence.choices import ENGINE_NAMES, ENV_KIND_NAMES, LOSSES

ROOT = Path(cadence.__file__).parent

# What each top-level part may import of cadence (besides itself): down the layers only. The
# base modules import nothing of cadence: the records that cross boundaries (types), the choices
# and their traits that both sides of the config wall read (choices), the error a bad setting
# raises wherever it is found (errors).
BASE = {"types", "choices", "errors"}
ALLOWED = {
    "types": set(),
    "choices": set(),
    "errors": set(),
    "imports": set(),  # user code by "module:attribute"
    "config": BASE,
    "algo": BASE,
    "data": BASE,
    "models": BASE,
    "metrics": BASE,
    # the vLLM engine loads its model itself: a model it cannot run is a ModelLoadError
    "engine": BASE | {"models"},
    "rewards": BASE | {"imports", "data", "models"},
    "envs": BASE | {"imports", "data", "rewards"},
    # the sharded learner's driver (learner/driver.py) reaches its ranks through backend's
    # process and actor transports; backend imports nothing of the learner
    "learner": BASE | {"algo", "data", "metrics", "models", "backend"},
    "dataplane": BASE | {"metrics"},
    # the HTTP face of an engine (`cadence serve`): what a worker lends a verifiers environment;
    # tool calls in the model's chat format are envs' (chat_tools.py)
    "serve": BASE | {"engine", "models", "envs"},
    # the policy acting (workers, episodes, evaluation): above what it acts with, below what
    # carries it to processes (backend) and what runs training (pipeline)
    "rollout": BASE | {"engine", "envs", "metrics", "models", "rewards", "serve"},
    # engines only as what weights load into (EngineWeights); rewards for the reward stage
    "backend": BASE | {"dataplane", "engine", "metrics", "models", "rewards", "rollout"},
    # the runtime is config-blind: what it runs is wired by the builder from plain values, and it
    # meets engines, environments and the algorithm only through what the builder hands it
    "pipeline": {
        "types",
        "data",
        "models",
        "metrics",
        "rewards",
        "learner",
        "dataplane",
        "rollout",
        "backend",
    },
    # the one place that reads the whole config and wires a run from it
    "builder": BASE
    | {
        "config",
        "algo",
        "data",
        "models",
        "metrics",
        "engine",
        "envs",
        "rewards",
        "learner",
        "dataplane",
        "rollout",
        "backend",
        "pipeline",
    },
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in ROOT.rglob("*.py")}


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, list[str]]]:
    """(target module, names imported from it) for every cadence import in the module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name.split(".")[0] == "cadence"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            if base.split(".")[0] != "cadence":
                continue
            names = [a.name for a in node.names]
            subs = [n for n in names if f"{base}.{n}" in modules]  # submodules, imported as such
            found += [(f"{base}.{n}", []) for n in subs]
            found.append((base, [n for n in names if n not in subs]))
    return [(t, n) for t, n in found if t in modules and t != name]


def _graph() -> dict[str, dict[str, list[str]]]:
    modules = _modules()
    graph: dict[str, dict[str, list[str]]] = {}
    for name, path in modules.items():
        edges: dict[str, list[str]] = {}
        for target, names in _imports(name, path, modules):
            edges.setdefault(target, []).extend(names)
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_no_import_circle_among_cadence_modules():
    assert _cycles(_graph()) == []


def test_no_module_imports_another_modules_private_names():
    bad = [
        f"{name} imports {n} from {target}"
        for name, edges in _graph().items()
        for target, names in edges.items()
        for n in names
        if n.startswith("_")
    ]
    assert bad == []


def test_layers_point_one_way():
    bad = [
        f"{name} ({_top(name)}) imports {target}"
        for name, edges in _graph().items()
        for target in edges
        if _top(name) in ALLOWED and _top(target) not in ALLOWED[_top(name)] | {_top(name), ""}
    ]
    assert bad == []


def test_the_runtime_reads_no_config_nor_what_the_builder_chooses():
    assert not {"config", "choices", "engine", "envs", "algo"} & ALLOWED["pipeline"]
    assert "builder" not in ALLOWED["pipeline"]


def test_the_checks_see_a_circle_a_private_import_and_a_layer_breach():
    # the checks themselves can fail: a graph with each fault is caught
    graph = {
        "cadence.backend.a": {"cadence.pipeline.b": ["_hidden"]},
        "cadence.pipeline.b": {"cadence.backend.a": []},
    }
    assert _cycles(graph) == [["cadence.backend.a", "cadence.pipeline.b"]]
    assert _top("cadence.backend.a") == "backend" and "pipeline" not in ALLOWED["backend"]


# What an engine, a transport, a pool, a source, a store or an environment is, is asked of it
# (its Protocol); its class only the factory that builds it knows.
ENGINE_CLASSES = {"BatchStepper", "ContinuousEngine", "HFEngine", "ScriptedEngine", "VLLMEngine"}
IMPLEMENTATIONS = ENGINE_CLASSES | {
    # weight transports, each with its receiving half
    "SharedWeights",
    "InMemoryWeights",
    "LearnerWeights",
    "ObjectStoreWeights",
    "ObjectStoreReceiver",
    "BroadcastWeights",
    "BroadcastReceiver",
    # pools, sources and stores
    "LocalPool",
    "RayPool",
    "ThreadPool",
    "ColocatedSource",
    "WorkerSource",
    "SampleStore",
    "ActorStore",
    # environments and what runs their episodes
    "ToolEnv",
    "ClassEnv",
    "OpenEnvEnv",
    "ScriptedEnv",
    "SingleTurnEnv",
    "VerifiersEnv",
    "EpisodeRunner",
    "VerifiersRunner",
}
FACTORIES = {
    "cadence.engine.factory",  # engines
    "cadence.backend",  # pools and their transports (make_pool)
    "cadence.envs.spec",  # environments (make_env)
    "cadence.rollout.runners",  # what runs an environment's episodes (make_episodes)
}
# trainers are built by the run builder and met only through the Trainer Protocol
TRAINER_CLASSES = {"Learner", "RankedLearner", "RankLearner", "FakeTrainer"}


def _class_tests(path: Path) -> set[str]:
    """Names whose class `isinstance`/`issubclass` (or `type(x) is`) asks about in the module."""
    asked: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") in (
            "isinstance",
            "issubclass",
        ):
            target = node.args[1] if len(node.args) > 1 else None
            elts = target.elts if isinstance(target, ast.Tuple) else [target]
            asked |= {e.id if isinstance(e, ast.Name) else getattr(e, "attr", "") for e in elts}
        elif isinstance(node, ast.Compare) and any(
            isinstance(o, ast.Is | ast.IsNot) for o in node.ops
        ):
            asked |= {getattr(c, "id", "") for c in node.comparators}
    return asked


def test_no_isinstance_on_implementations_outside_their_factories():
    bad = sorted(
        f"{name} asks for {cls}"
        for name, path in _modules().items()
        if name not in FACTORIES
        for cls in _class_tests(path) & IMPLEMENTATIONS
    )
    assert bad == []


def test_no_isinstance_on_trainer_classes_anywhere():
    bad = sorted(
        f"{name} asks for {cls}"
        for name, path in _modules().items()
        for cls in _class_tests(path) & TRAINER_CLASSES
    )
    assert bad == []


def test_the_class_check_sees_each_way_of_asking(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import cadence.engine as e\n"
        "a = isinstance(x, VLLMEngine)\n"
        "b = isinstance(x, (int, e.HFEngine))\n"
        "c = type(x) is ContinuousEngine\n"
    )
    assert _class_tests(probe) & ENGINE_CLASSES == {"VLLMEngine", "HFEngine", "ContinuousEngine"}


# A choice (an environment kind, an engine, a loss) is asked of its traits (cadence.choices)
# outside the rooms that describe or implement it: a comparison with its name anywhere else, on
# either side and whatever the other operand, is a decision taken by name.
CHOICE_ROOMS = {
    "environment kind": (set(ENV_KIND_NAMES), ("envs", "config")),
    "engine": (set(ENGINE_NAMES), ("engine", "config")),
    "loss": (set(LOSSES), ("algo", "config")),
}


def _choice_literals(path: Path, names: set[str]) -> list[int]:
    """Lines of comparisons (==, !=, in, not in, is) with one of `names` as a literal, alone or
    in a tuple, list or set, on either side."""

    def literals(node: ast.expr) -> set:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return {node.value}
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            return set().union(*(literals(e) for e in node.elts))
        return set()

    return [
        node.lineno
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Compare)
        and any(literals(side) & names for side in [node.left, *node.comparators])
    ]


def test_no_choice_compared_by_name_outside_its_rooms():
    bad = [
        f"{name}:{line} ({what})"
        for what, (names, rooms) in CHOICE_ROOMS.items()
        for name, path in _modules().items()
        if _top(name) not in rooms and name != "cadence.choices"
        for line in _choice_literals(path, names)
    ]
    assert bad == []


def test_the_choice_check_sees_each_way_of_comparing(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "a = cfg.env.kind == 'verifiers'\n"
        "b = env in ('tool', 'class')\n"
        "c = 'single_turn' != e\n"
        "d = spec.kind == 'model'\n"  # a reward's kind: no environment's
        "e = cfg.rollout.engine != 'vllm'\n"
        "f = 'vllm' in engines\n"
        "g = data.get('loss') == 'gspo'\n"
    )
    envs, engines, losses = (names for names, _ in CHOICE_ROOMS.values())
    assert _choice_literals(probe, envs) == [1, 2, 3]
    assert _choice_literals(probe, engines) == [5, 6]
    assert _choice_literals(probe, losses) == [7]


MAX_MODULE_LINES = 450
MAX_CLASS_LINES = 250


def test_no_module_over_450_lines_and_no_class_over_250():
    long_modules = [
        f"{name}: {n}"
        for name, path in _modules().items()
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    long_classes = [
        f"{name}.{node.name}: {node.end_lineno - node.lineno + 1}"
        for name, path in _modules().items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES
    ]
    assert long_modules == [] and long_classes == []


def test_test_modules_have_unique_names():
    # pytest imports test modules by their base name (rootdir, no packages): two files of one
    # name in two folders stop the collection of a suite that holds both
    names = collections.Counter(p.name for p in Path(__file__).parent.rglob("test_*.py"))
    assert [n for n, count in names.items() if count > 1] == []


# The libraries of cadence's extras (pyproject.toml) and what they pull: each loads where its
# feature is used, never when cadence is imported (seconds each; a user without the extra
# imports cadence all the same).
EXTRA_LIBRARIES = {
    "ray", "vllm", "trl", "datasets", "peft", "wandb", "mlflow", "fastapi", "uvicorn",
    "tensorboard", "reasoning_gym", "openenv", "fastmcp", "verifiers",
}  # fmt: skip


def test_importing_cadence_loads_no_extras_library():
    # one interpreter for every module the extras are used behind (a subprocess start costs
    # about 5 s of the suite)
    modules = (
        "cadence, cadence.cli, cadence.config, cadence.builder, cadence.pipeline, cadence.data, "
        "cadence.models, cadence.metrics, cadence.envs, cadence.serve, cadence.engine, "
        "cadence.engine.vllm, cadence.backend, cadence.backend.local, "
        "cadence.backend.worker_loop, cadence.backend.ray.pool, cadence.backend.ray.store, "
        "cadence.backend.ray.weights, cadence.backend.ray.ranks, cadence.backend.ray.cluster, "
        "cadence.learner.driver, cadence.rewards, cadence.rewards.reasoning_gym, cadence.bench, "
        "cadence.bench.ablation"
    )
    code = f"import sys, {modules}; print(' '.join({{m.split('.')[0] for m in sys.modules}}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert sorted(EXTRA_LIBRARIES & set(out.stdout.split())) == []
