"""A deterministic engine for tests: scripted completions, no model.

`ScriptedEngine(script)` calls `script(prompt_ids, seed)` for each sample and returns its token ids
with fixed log-probs; an optional `delay_s(prompt_ids, seed)` simulates uneven generation time.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from cadence.engine.base import Request, SamplingParams
from cadence.types import Completion

Script = Callable[[list[int], int], list[int]]


class ScriptedEngine:
    owns_weights = False  # it has no weights: a model beside it is loaded by whoever holds it

    def __init__(
        self,
        script: Script,
        logprob: float = -1.0,
        decode: Callable[[list[int]], str] | None = None,
        delay_s: Callable[[list[int], int], float] | None = None,
    ) -> None:
        self.script = script
        self.logprob = logprob
        self.decode = decode or (lambda ids: " ".join(map(str, ids)))
        self.delay_s = delay_s
        self.num_calls = 0

    def generate(self, requests: list[Request], params: SamplingParams) -> list[list[Completion]]:
        self.num_calls += 1
        out = []
        for req in requests:
            group = []
            for seed in req.seeds:
                if self.delay_s is not None:
                    time.sleep(self.delay_s(req.prompt_ids, seed))
                ids = self.script(req.prompt_ids, seed)[: req.limit(params)]
                reason = "eos" if ids and ids[-1] in params.stop_token_ids else "length"
                group.append(Completion(ids, [self.logprob] * len(ids), self.decode(ids), reason))
            out.append(group)
        return out
