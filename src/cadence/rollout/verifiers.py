"""verifiers episodes inside a rollout worker, against the worker's own engine.

Read on: docs/envs.md.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures as cf
import itertools
import queue
import socket
import threading
import time
from collections.abc import Callable, Hashable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path

from cadence.engine import Request, SamplingParams, StreamingEngine, derive_turn_seed
from cadence.envs import CALL_END, VerifiersEnv
from cadence.rollout.episodes import Finished
from cadence.types import Prompt

IDLE_WAIT_S = 0.05  # longest wait for a request or a finished episode while the engine idles
START_TIMEOUT_S = 60.0
CLOSE_TIMEOUT_S = 30.0
NO_KEY = "CADENCE_VERIFIERS_NO_KEY"  # the loopback endpoint takes no key: an unset variable


@dataclass(eq=False)
class _Item:
    request: Request
    params: SamplingParams
    future: cf.Future = field(default_factory=cf.Future)


class StepLoop:
    """`cadence serve`'s engine-loop contract (`submit`, `broken`, `close`) over an engine that
    its owner steps: requests wait until `step` admits them, in rounds of equal sampling params
    (an engine decodes with one at a time). `turn_seed` maps each request's seed as admitted."""

    def __init__(self, wake: threading.Event, turn_seed: Callable[[int], int]) -> None:
        self._wake, self._turn_seed = wake, turn_seed
        self._inbox: queue.Queue[_Item] = queue.Queue()
        self._waiting: collections.deque[_Item] = collections.deque()
        self._running: dict[Hashable, _Item] = {}
        self._keys = itertools.count()
        self._params: SamplingParams | None = None
        self.broken: str | None = None

    @property
    def pending(self) -> bool:
        return bool(self._waiting) or not self._inbox.empty()

    def submit(self, request: Request, params: SamplingParams) -> cf.Future:
        from cadence.serve.engine_loop import EngineBroken

        item = _Item(request, params)
        if self.broken is not None:
            item.future.set_exception(EngineBroken(self.broken))
        else:
            self._inbox.put(item)
            self._wake.set()
        return item.future

    def step(self, engine: StreamingEngine) -> None:
        while not self._inbox.empty():
            self._waiting.append(self._inbox.get_nowait())
        self._admit(engine)
        if engine.busy:
            for key, completions in engine.step():
                self._running.pop(key).future.set_result(completions)

    def _admit(self, engine: StreamingEngine) -> None:
        if not self._waiting:
            return
        if engine.busy and any(i.params != self._params for i in self._waiting):
            return  # the engine drains first; the other params start the next round
        if not engine.busy:
            self._params = self._waiting[0].params
        chosen = [i for i in self._waiting if i.params == self._params]
        self._waiting = collections.deque(i for i in self._waiting if i.params != self._params)
        for item in chosen:
            if not item.future.set_running_or_notify_cancel():
                continue  # cancelled while it waited: its caller is gone
            request = item.request
            seeds = [self._turn_seed(s) for s in request.seeds]
            key = next(self._keys)
            try:
                engine.add(key, replace(request, seeds=seeds), item.params)
            except Exception as e:  # an engine checks before it takes a request: it stays clean
                from cadence.serve.engine_loop import RequestFailed

                item.future.set_exception(RequestFailed(f"the engine refused it: {e!r}"))
                continue
            self._running[key] = item

    def close(self, why: str = "the rollout worker stopped") -> None:
        from cadence.serve.engine_loop import EngineBroken

        self.broken = why
        while not self._inbox.empty():
            self._waiting.append(self._inbox.get_nowait())
        for item in [*self._running.values(), *self._waiting]:
            if not item.future.done():
                item.future.set_exception(EngineBroken(why))
        self._running, self._waiting = {}, collections.deque()


class _Http:
    """An ASGI app served by uvicorn on a free loopback port, in a daemon thread."""

    def __init__(self, app) -> None:
        import uvicorn

        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}/v1"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [self._sock]},
            name="cadence-verifiers-http",
            daemon=True,
        )
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the verifiers endpoint (loopback cadence serve) did not start")
            time.sleep(0.01)

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=CLOSE_TIMEOUT_S)
        self._sock.close()


_LOOP: asyncio.AbstractEventLoop | None = None
_LOOP_LOCK = threading.Lock()


def _event_loop() -> asyncio.AbstractEventLoop:
    """The process's one event loop for verifiers, running in a daemon thread. One for every
    runner a process ever starts (a held-out evaluation starts one of its own): verifiers and its
    renderers keep asyncio state per process (locks bound to the loop that first waited on them,
    renderers pooled across clients), which a second loop would trip over."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="cadence-verifiers", daemon=True).start()
            _LOOP = loop
        return _LOOP


class _Contexts:
    """Async contexts held open on the shared event loop until `close`, and coroutines run
    there."""

    def __init__(self) -> None:
        self.loop = _event_loop()
        self._stack = AsyncExitStack()
        self._running: set[cf.Future] = set()

    def run(self, coro) -> cf.Future:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        self._running.add(future)
        future.add_done_callback(self._running.discard)
        return future

    def enter(self, context) -> None:
        self.run(self._stack.enter_async_context(context)).result()

    def close(self) -> None:
        """Cancel what still runs, then leave the contexts (last entered first)."""
        for future in list(self._running):
            future.cancel()
        self.run(self._stack.aclose()).result(timeout=CLOSE_TIMEOUT_S)


@dataclass(eq=False)
class _Group:
    key: Hashable
    seeds: list[int]
    episodes: dict[int, object] = field(default_factory=dict)  # sample -> its trace, or why not


class _Live:
    """What a runner holds once it has work: the environment inside its `serving()` context on
    the process's verifiers event loop, and the endpoint over the engine."""

    def __init__(self, spec: VerifiersEnv, tokenizer, sampling: SamplingParams, loop: StepLoop):
        from cadence.envs.verifiers.env import load_environment
        from cadence.serve import make_app

        self.env = load_environment(spec.factory)
        self.context = _context(spec, tokenizer, sampling)
        self.server = _server(loop, tokenizer, sampling)
        self.http: _Http | None = None
        self.events = _Contexts()
        try:
            self.http = _Http(make_app(self.server))
            self.events.enter(self.env.serving())
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self.server.loop.close()  # fails every request waiting on the engine
        try:
            self.events.close()  # cancels the episodes, leaves the environment's serving()
        finally:
            if self.http is not None:
                self.http.close()
            self.server.close()


class VerifiersRunner:
    """Runs groups of verifiers episodes on a streaming engine, as `EpisodeRunner` runs cadence's
    own: `add` a prompt's G episodes, `step` until they come back as completions. It starts the
    environment and the endpoint with its first group (a worker that never runs one, such as the
    learner's beside worker processes, starts nothing) and stops them in `close`."""

    def __init__(
        self, env: VerifiersEnv, engine: StreamingEngine, tokenizer, sampling: SamplingParams
    ) -> None:
        self.engine, self.tokenizer = engine, tokenizer
        self.spans: list[tuple[str, float, float]] = []  # verifiers keeps its own timings
        self._spec, self._sampling = env, sampling
        self._live: _Live | None = None
        self._wake = threading.Event()
        self._turns: dict[int, int] = {}  # an in-flight sample's seed -> its turns so far
        self._loop = StepLoop(self._wake, self._turn_seed)
        self._groups: dict[Hashable, _Group] = {}
        self._finished: queue.Queue[tuple[Hashable, int, cf.Future]] = queue.Queue()

    @property
    def busy(self) -> bool:
        return bool(self._groups)

    def add(
        self, key: Hashable, prompt: Prompt, prompt_ids: list[int], seeds: list[int]
    ) -> list[int]:
        """Start a prompt's episodes (its task rebuilt from the prompt); `prompt_ids` are
        returned unused: the environment renders its own prompt, which comes back with the
        group (`Finished.prompt_ids`)."""
        from cadence.envs.verifiers.env import task_of

        if self._live is None:
            self._live = _Live(self._spec, self.tokenizer, self._sampling, self._loop)
        live = self._live
        task = task_of(live.env, prompt)
        self._groups[key] = _Group(key, list(seeds))
        for j, seed in enumerate(seeds):
            self._turns[seed] = 0
            run = live.events.run(live.env.run_episode(task, live.context(live.http.url, seed)))
            run.add_done_callback(lambda f, j=j: self._done(key, j, f))
        return prompt_ids

    def step(self) -> list[Finished]:
        out = self._collect()
        if self._loop.pending or self.engine.busy:
            self._loop.step(self.engine)
        elif self._groups:
            self._wake.wait(IDLE_WAIT_S)
            self._wake.clear()
        return out + self._collect()

    def close(self) -> None:
        """Fail what is in flight, leave the environment's serving context, stop the endpoint."""
        if self._live is not None:
            live, self._live = self._live, None
            live.close()
        self._loop.close()
        self._groups.clear()

    def _turn_seed(self, seed: int) -> int:
        turn = self._turns.get(seed)
        if turn is None:
            return seed  # not one of this worker's samples: as sent
        self._turns[seed] = turn + 1
        return derive_turn_seed(seed, turn)

    def _done(self, key: Hashable, sample: int, future: cf.Future) -> None:
        self._finished.put((key, sample, future))
        self._wake.set()

    def _collect(self) -> list[Finished]:
        from cadence.envs.verifiers.env import group_completions

        out = []
        while not self._finished.empty():
            key, sample, future = self._finished.get_nowait()
            group = self._groups[key]
            group.episodes[sample] = _outcome(future)
            self._turns.pop(group.seeds[sample], None)
            if len(group.episodes) < len(group.seeds):
                continue
            del self._groups[key]
            outcomes = [group.episodes[j] for j in range(len(group.seeds))]
            prompt_ids, completions, rewards = group_completions(outcomes, self.tokenizer)
            out.append(Finished(key, completions, rewards, prompt_ids))
        return out


def _outcome(future: cf.Future):
    """A finished episode's one trace, or why it failed: the environment's failure is the
    episode's alone (scored 0 with the error); the endpoint stopping under it is not."""
    from cadence.serve.engine_loop import EngineBroken

    try:
        return _trace(future.result())
    except (cf.CancelledError, EngineBroken):
        raise
    except Exception as e:
        return f"verifiers: the episode raised {type(e).__name__}: {e}"


def _trace(episode):
    """The episode's one trace (cadence trains single-agent episodes: one sample each)."""
    if len(episode.traces) != 1:
        why = episode.errors[-1].message if episode.errors else f"{len(episode.traces)} traces"
        raise RuntimeError(f"a verifiers episode must run one agent once, for one sample: {why}")
    return episode.traces[0]


def _context(env: VerifiersEnv, tokenizer, sampling: SamplingParams):
    """`(url, seed) -> vf.ModelContext`: the run's sampling, verifiers' training client on the
    loopback endpoint, and a renderer: cadence's plain one unless the model's chat template is
    asked for (`data.chat_template = true`: verifiers picks the model's renderer)."""
    import verifiers.v1 as vf
    from renderers.configs import CustomRendererConfig

    from cadence.envs.verifiers.render import IMPORT_PATH

    stops = list(sampling.stop)
    renderer = None
    if env.renderer == "plain":
        renderer = CustomRendererConfig(import_path=IMPORT_PATH)
        stops += [CALL_END] * (CALL_END not in stops)  # a turn with a call ends with it
    model = _model_name(tokenizer)

    def context(url: str, seed: int) -> vf.ModelContext:
        client = vf.TrainClientConfig(
            base_url=url,
            api_key_var=NO_KEY,
            renderer=renderer,
            renderer_model_name=tokenizer.name_or_path,
        )
        knobs = vf.SamplingConfig(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=sampling.max_new_tokens,
            seed=seed,
            stop=stops or None,
        )  # stop ids: the renderer's, and the endpoint adds the run's
        return vf.ModelContext(model=model, client=client, sampling=knobs)

    return context


def _server(loop: StepLoop, tokenizer, sampling: SamplingParams):
    """`cadence serve`'s server over the stepped loop: the run's stop ids, turns of at most
    `rollout.max_new_tokens`, prompts checked against the model's positions."""
    from cadence.serve import Server

    return Server(
        loop,
        tokenizer,
        _model_name(tokenizer),
        _positions(tokenizer.name_or_path),
        sampling.max_new_tokens,
        vocab_size=len(tokenizer),
        stop_token_ids=sampling.stop_token_ids,
    )


def _model_name(tokenizer) -> str:
    return Path(tokenizer.name_or_path).name or "cadence-policy"


def _positions(model_path: str) -> int:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path, local_files_only=True)
    return getattr(config, "max_position_embeddings", None) or 4096
