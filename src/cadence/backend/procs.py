"""Worker processes in fixed slots: the machinery rollout workers and reward workers share.

Each slot holds one spawned process with its own inbox (a queue the owner writes) and its own
result pipe (the process writes, the owner reads). Its own pipe, not one shared by all: a process
killed while writing would leave a shared queue locked, or half a message in it, for every other
process. The owner keeps only the read end, so a dead process's pipe ends in end-of-file, never
in a read that waits forever.

Read on: docs/pipeline.md#how-it-is-built.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing import connection as mp_connection
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any, cast

import torch.multiprocessing as mp

Message = tuple[str, int, Any]  # (kind, worker id, payload)
# what a rollout worker, a reward worker and a learner rank import first (torch, transformers,
# cadence): the fork server imports them once. transformers imports its Auto classes lazily, and
# with them torch._dynamo (1-2 s in each process's first load_tokenizer or load_model on a busy
# 2-core machine); a model class imports modeling_utils and its integrations (about 1 s more in
# each process's first load_model: Llama's and Qwen2's are the ones most runs load), peft another
# 0.8 s in a LoRA run; math-verify (sympy, ~0.6 s) is imported where an answer is graded. A name
# that does not import is passed over by the server.
PRELOAD = [
    "cadence.backend.worker_loop",
    "cadence.backend.ranks",
    "cadence.learner.rank",
    "transformers.models.auto.tokenization_auto",
    "transformers.models.auto.modeling_auto",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen2.modeling_qwen2",
    "peft",
    "math_verify",
]
START_ARGS_S = 60.0  # longest a started process waits for its arguments (sent as it starts)
TOOK_ARGS = "took_args"  # a started process's first message: it holds its arguments


def fork_server():
    """The multiprocessing context whose processes fork from a server that imported PRELOAD
    (read when the server starts, once per owner process)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


class WorkerError(RuntimeError):
    """A worker raised; the message holds the worker's own traceback."""


class WorkerDied(RuntimeError):
    """A worker exited without being asked to; `wid` is its slot."""

    def __init__(self, message: str, wid: int = -1) -> None:
        super().__init__(message)
        self.wid = wid


class Sender:
    """A worker's end of its result pipe, as the outbox its loop puts into."""

    def __init__(self, conn) -> None:
        self.conn = conn

    def put(self, item: Message) -> None:
        self.conn.send(item)

    def report_error(self, wid: int) -> None:
        """From an `except` block: send the exception's traceback to the owner. An owner that is
        gone (its end of the pipe closed: it stopped, or died) has no one to tell it to, and the
        process ends quietly instead of printing a second traceback about the pipe."""
        with contextlib.suppress(BrokenPipeError, EOFError, OSError):
            self.put(("error", wid, traceback.format_exc()))


_owner: int | None = None  # in a started process: the pid of the process that started it


def _in_environment(
    environ: dict[str, str], owner: int, target: Callable[..., None], wid: int, inbox, results
) -> None:
    """Run `target(wid, *args, inbox, results)` with the owner's environment of the moment it
    started this process, `args` being the first message of the inbox (see `Processes._spawn`)."""
    global _owner
    _owner = owner
    os.environ.clear()
    os.environ.update(environ)
    try:
        args = pickle.loads(inbox.get(timeout=START_ARGS_S))
    except queue.Empty as e:
        if owner_gone():  # killed while starting us: nobody to report to
            os._exit(1)
        raise RuntimeError(f"no start arguments from pid {owner} within {START_ARGS_S:.0f}s") from e
    results.send((TOOK_ARGS, wid, None))  # the owner may let go of their descriptors now
    target(wid, *args, inbox, results)


def owner_gone() -> bool:
    """Whether the process that started this one has ended (False in any other process)."""
    if _owner is None:
        return False
    try:
        os.kill(_owner, 0)
        stat = Path(f"/proc/{_owner}/stat").read_text()
    except ProcessLookupError:
        return True
    except OSError:  # no /proc: the signal found it
        return False
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")  # ended, not yet reaped


@dataclass
class Proc:
    process: Any
    inbox: Any
    results: Any  # the read end of this process's own result pipe
    closed: bool = False  # its pipe reached end of file: the process is gone


class Processes:
    """The slots of one kind of worker process: `name` in messages ("worker 0 failed"), `tag`
    in process names (cadence-TAG-0, which a process can read to know what it is); slot `wid`'s
    process starts with this process's environment updated by `env(wid)` (its GPUs, say), and so
    does a process that replaces it."""

    def __init__(
        self,
        name: str,
        target: Callable[..., None],
        args: Callable[[int], tuple],
        timeout_s: float = 300.0,
        tag: str = "worker",
        env: Callable[[int], dict[str, str]] | None = None,
    ) -> None:
        self.name, self.target, self.args, self.timeout_s = name, target, args, timeout_s
        self.tag, self.env = tag, env
        self._ctx = fork_server()
        self.procs: list[Proc] = []
        self._took_args: set[int] = set()  # slots whose process has its arguments

    def __len__(self) -> int:
        return len(self.procs)

    def start(self, num_workers: int) -> list[Message]:
        """Spawn `num_workers` processes and wait until each is ready (closing them all if one
        fails); return the other messages that arrived meanwhile."""
        try:
            early: list[Message] = []
            for wid in range(num_workers):
                self.procs.append(self._spawn(wid))
                # one process's shared-tensor descriptors in flight at a time: each is a file
                # descriptor until the process takes it (3 workers of a 273-tensor model held
                # 819 at once, past the usual limit of 1,024)
                early += self._await_args(wid)
            return self.await_ready(set(range(num_workers)), early)
        except BaseException:
            self.close()
            raise

    def _await_args(self, wid: int) -> list[Message]:
        """Wait until slot `wid`'s process holds its arguments; the messages that came meanwhile."""
        kept, deadline = [], time.monotonic() + self.timeout_s
        while wid not in self._took_args:
            kept += self.receive(0.1)
            if wid in self._took_args:
                break
            if self.dead({wid}) is not None:
                raise WorkerDied(self.exited(wid), wid)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} {wid} did not start within {self.timeout_s:.0f}s")
        return kept

    def _spawn(self, wid: int) -> Proc:
        self._took_args.discard(wid)
        inbox = self._ctx.Queue()
        reader, writer = self._ctx.Pipe(duplex=False)
        # The arguments (a model's shared-memory tensors among them) travel as the inbox's first
        # message, not with the start: the fork server takes at most 252 file descriptors a
        # start (SmolLM2 shares 273 tensors), a queue any number. Pickled here, not in the
        # queue's thread, so that an argument that cannot travel fails this call.
        inbox.put(bytes(ForkingPickler.dumps(self.args(wid))))
        environ = dict(os.environ) | (self.env(wid) if self.env is not None else {})
        args = (environ, os.getpid(), self.target, wid, inbox, writer)
        with _ignoring_ctrl_c():
            p = self._ctx.Process(
                target=_in_environment, name=f"cadence-{self.tag}-{wid}", daemon=True, args=args
            )
            p.start()
        writer.close()
        return Proc(p, inbox, reader)

    def send(self, wid: int, message: tuple[str, Any]) -> None:
        self.procs[wid].inbox.put(message)

    def receive(self, timeout_s: float) -> list[Message]:
        """Every message that arrives within `timeout_s` (none: an empty list). A pipe at end of
        file marks its process closed; `dead` reports it."""
        by_conn = {p.results: wid for wid, p in enumerate(self.procs) if not p.closed}
        messages = []
        for conn in mp_connection.wait(list(by_conn), timeout_s):
            wid = by_conn[conn]
            try:
                message = cast(mp_connection.Connection, conn).recv()
            except (EOFError, OSError):
                self.procs[wid].closed = True
                continue
            if message[0] == TOOK_ARGS:
                self._took_args.add(wid)
            else:
                messages.append(message)
        return messages

    def dead(self, wids: set[int] | None = None) -> int | None:
        """The first slot (of `wids`, or any) whose process is gone, or None."""
        for wid, p in enumerate(self.procs):
            if (wids is None or wid in wids) and (p.closed or not p.process.is_alive()):
                return wid
        return None

    def exited(self, wid: int) -> str:
        """'<name> <wid> (pid P) exited with code C', once its exit code is known."""
        process = self.procs[wid].process
        process.join(timeout=5)  # its pipe closed as it exited: wait for its code
        return f"{self.name} {wid} (pid {process.pid}) exited with code {process.exitcode}"

    def failed(self, wid: int, traceback: str) -> WorkerError:
        return WorkerError(f"{self.name} {wid} failed:\n{traceback}")

    def await_ready(self, pending: set[int], early: list[Message] | None = None) -> list[Message]:
        """Wait for "ready" from the slots in `pending` (`early`: messages received already);
        raise on their "error", death or the timeout. Other messages (from other slots) are
        returned, in order, for the owner."""
        pending, kept = set(pending), []
        deadline = time.monotonic() + self.timeout_s
        while pending:
            messages, early = (early or []) + self.receive(0.5 if not early else 0.0), None
            for message in messages:
                kind, wid, payload = message
                if wid not in pending:
                    kept.append(message)
                elif kind == "error":
                    raise self.failed(wid, payload)
                elif kind == "refused":  # the worker could not load the model: bad input
                    from cadence.models import ModelLoadError

                    raise ModelLoadError(f"{self.name} {wid}: {payload}")
                else:
                    pending.discard(wid)
            if not messages:
                if (gone := self.dead(pending)) is not None:
                    raise WorkerDied(self.exited(gone), gone)
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{self.name}s {sorted(pending)} did not start within {self.timeout_s:.0f}s"
                    )
        return kept

    def stop(self, wid: int) -> None:
        """Make sure slot `wid`'s process has exited (terminate, then kill); its pipe stays open
        so that what it sent before it went can still be received."""
        stop_process(self.procs[wid].process)

    def respawn(self, wid: int) -> None:
        """Close a stopped slot's channels and start a fresh process in it (`await_ready` it)."""
        _close_channels(self.procs[wid])
        self.procs[wid] = self._spawn(wid)

    def close(self) -> None:
        """Stop every process; terminate, then kill, any that does not exit in time."""
        for p in self.procs:
            if p.process.is_alive():
                with contextlib.suppress(OSError, ValueError):  # its queue may be broken
                    p.inbox.put(("stop", None))
        for p in self.procs:
            stop_process(p.process)
        for p in self.procs:
            _close_channels(p)
        self.procs = []


@contextlib.contextmanager
def _ignoring_ctrl_c() -> Iterator[None]:
    """Ignore SIGINT while a process is started, so that it starts ignoring it too (an ignored
    signal stays ignored through exec, and Python leaves it so). Ctrl-C reaches every process of
    the terminal's group; the learner stops its workers itself, and workers that caught it would
    each print a traceback. Only the main thread can change it; a process started from another
    thread (a replacement) ignores SIGINT from its first import of cadence on (cadence/__init__)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def stop_process(process, grace_s: float = 5.0) -> None:
    """Join a process that was asked to stop; terminate, then kill, one that does not exit."""
    process.join(timeout=grace_s)
    if process.is_alive():
        process.terminate()
        process.join(timeout=grace_s)
    if process.is_alive():
        process.kill()
        process.join()


def _close_channels(p: Proc) -> None:
    """Close a slot's queue without waiting for its feeder thread to flush, and its pipe."""
    p.inbox.close()
    p.inbox.cancel_join_thread()
    p.results.close()
