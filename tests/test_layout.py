"""The package's layout holds: no import circle among cadence's modules, no module importing
another's private names, and layers that point one way.

Every import in a module counts, wherever it stands (module level, inside a function, under
`TYPE_CHECKING`): a lazy import still ties the two modules together.
"""

from __future__ import annotations

import ast
import collections
from pathlib import Path

import cadence

ROOT = Path(cadence.__file__).parent

# What each top-level part may import of cadence (besides itself): down the layers only.
ALLOWED = {
    "types": set(),
    "imports": set(),  # user code by "module:attribute"
    # the algorithm's choice lists are cadence.types' names, read by both config/ and algo/
    "config": {"types"},
    "algo": {"types"},
    "data": {"types"},
    "models": {"types"},
    "metrics": {"types"},
    # the vLLM engine loads its model itself: a model it cannot run is a ModelLoadError, an
    # engine argument vLLM does not know a ConfigError
    "engine": {"types", "models", "config"},
    "rewards": {"types", "imports", "data", "models"},
    "envs": {"types", "imports", "data", "rewards"},
    # the sharded learner's driver (learner/driver.py) reaches its ranks through backend's
    # process and actor transports; backend imports nothing of the learner
    "learner": {"types", "algo", "data", "metrics", "models", "backend"},
    "dataplane": {"types", "metrics"},
    # the HTTP face of an engine (`cadence serve`): what a worker lends a verifiers environment;
    # tool calls in the model's chat format are envs' (chat_tools.py)
    "serve": {"types", "engine", "models", "envs"},
    # the policy acting (workers, episodes, evaluation): above what it acts with, below what
    # carries it to processes (backend) and what runs training (pipeline)
    "rollout": {"types", "engine", "envs", "metrics", "models", "rewards", "serve"},
    # engines only as what weights load into (EngineWeights); rewards for the reward stage
    "backend": {"types", "dataplane", "engine", "metrics", "models", "rewards", "rollout"},
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
    "builder": {
        "types",
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
    assert not {"config", "engine", "envs", "algo"} & ALLOWED["pipeline"]
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


# The environment's kind is asked of its traits (envs.kind_traits) outside the rooms that define
# the kinds: a comparison with a kind's name elsewhere is a decision taken by name.
ENV_KINDS = {"single_turn", "tool", "class", "openenv", "verifiers"}
KIND_ROOMS = ("envs", "config")


def _kind_literals(path: Path) -> list[int]:
    """Lines comparing something called `kind` (`cfg.env.kind`, `e.kind`, `kind`) with an
    environment kind's name, or a tuple of them."""

    def is_kind(node: ast.expr) -> bool:
        return getattr(node, "attr", getattr(node, "id", "")) == "kind"

    def names(node: ast.expr) -> set:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return {node.value}
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            return set().union(*(names(e) for e in node.elts))
        return set()

    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(map(is_kind, sides)) and any(names(s) & ENV_KINDS for s in sides):
                found.append(node.lineno)
    return found


def test_no_env_kind_compared_by_name_outside_envs_and_config():
    bad = [
        f"{name}:{line}"
        for name, path in _modules().items()
        if _top(name) not in KIND_ROOMS
        for line in _kind_literals(path)
    ]
    assert bad == []


def test_the_kind_check_sees_each_way_of_comparing(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "a = cfg.env.kind == 'verifiers'\n"
        "b = e.kind in ('tool', 'class')\n"
        "c = kind != 'single_turn'\n"
        "d = spec.kind == 'model'\n"  # a reward's kind: not an environment's
    )
    assert _kind_literals(probe) == [1, 2, 3]


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
