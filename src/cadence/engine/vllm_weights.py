"""What an in-process vLLM engine holds of the policy: its weights, reloaded in place (or through
files across tensor-parallel workers), a LoRA adapter beside them, and whether they are asleep.

The engine's requests (engine/vllm.py) ask this for the prefix cache's salt (a block computed
under other weights never matches) and the adapter to decode with; everything that changes the
weights goes through here, and each change counts as a load. It never labels a version (the
engine stamps tokens with labels) and never loads while requests decode unless the engine allowed
it (partial rollouts). docs/engines.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file

from cadence.engine.base import release_cached_memory
from cadence.engine.vllm_files import reload_from_files
from cadence.models.fingerprint import Fingerprints, fingerprint, held
from cadence.models.lora import ADAPTER_WEIGHTS


class VLLMWeights:
    """The weights of `llm`, vLLM's `LLM` started with `options` (engine/vllm_start.py)."""

    def __init__(self, llm, *, tensor_parallel: int, lora_rank: int, can_sleep: bool) -> None:
        self.llm = llm
        self.tensor_parallel = tensor_parallel
        self.takes_adapters = bool(lora_rank)
        self.can_sleep = can_sleep
        self.asleep = False
        self.lost = False  # asleep at level 2: its weights are gone until the next load
        self.adapter = None  # the LoRA request later requests decode with (load_adapter)
        self.loads = 0  # weight (or adapter) loads so far: the prefix cache's salt
        self.version_bytes = 0  # tensor parallel: the bytes of the last version's files
        self.adapter_fingerprint: Fingerprints = {}  # of the adapter requests carry, as read

    @property
    def cache_salt(self) -> str:
        """The prefix-cache salt of requests added now: blocks of other weights never match."""
        return f"weights-{self.loads}"

    def load(self, items: Iterable[tuple[str, torch.Tensor]], busy: bool) -> None:
        """New weights (Hugging Face names) into the running model, in place. `busy`: requests
        decode meanwhile (their blocks are kept, as partial rollouts keep their keys and values;
        later requests' salt never matches them)."""
        self.wake(loading=True)
        self.loads += 1
        if self.tensor_parallel > 1:  # its workers are processes: they read one copy in files
            self.version_bytes = reload_from_files(self.llm, items)
        else:  # consumed as it comes, in this process: a stream of buckets needs no whole copy
            self.llm.collective_rpc(
                "reload_weights", kwargs={"weights_iterator": items, "is_checkpoint_format": True}
            )
        self.llm.apply_model(_repack_output_layers)
        if not self.llm.reset_prefix_cache() and not busy:
            raise RuntimeError("vLLM kept its prefix cache: keys and values of the old weights")
        self.lost = False

    def load_adapter(self, path: str) -> None:
        """Later requests decode with the LoRA adapter saved in `path` (peft's layout) on the
        base weights: vLLM reads it before this returns, and the older adapter is dropped."""
        if not self.takes_adapters:
            raise RuntimeError("a LoRA adapter for a vLLM engine started without lora_rank")
        from vllm.lora.request import LoRARequest

        self.wake()
        self.loads += 1
        adapter = LoRARequest(f"policy-{self.loads}", self.loads, path)
        if not self.llm.llm_engine.add_lora(adapter):
            raise RuntimeError(f"vLLM did not take the LoRA adapter in {path}")
        for old in self.llm.llm_engine.list_loras() - {adapter.lora_int_id}:
            self.llm.llm_engine.remove_lora(old)
        self.adapter = adapter
        self.adapter_fingerprint = fingerprint(load_file(Path(path) / ADAPTER_WEIGHTS))
        self.llm.reset_prefix_cache()  # idle: its blocks are the old adapter's

    def held_fingerprint(self, expected: Fingerprints) -> Fingerprints:
        """The fingerprints of the weights vLLM holds now, of the tensors `expected` names that
        it holds under that name and shape (a packed one split back: `unpacked`), on every
        worker (tensor parallel: only what each holds whole); a tensor the workers hold
        differently from one another counts as held by none of them."""
        per_worker = self.llm.apply_model(lambda model: held(unpacked(model, expected), expected))
        first, *others = per_worker
        return {k: v for k, v in first.items() if all(o.get(k) == v for o in others)}

    def sleep(self) -> None:
        """Where vLLM can (a GPU, `sleep_mode`): its KV cache freed and, at level 2, its weights
        dropped, since the next sync brings every weight (level 1 would copy them to host memory
        and back only to overwrite them); level 1 where versions arrive as adapters on the base
        weights it must keep. Until the next load or request wakes it."""
        if self.can_sleep and not self.asleep:
            level = 1 if self.takes_adapters else 2
            self.llm.sleep(level=level)
            self.asleep, self.lost = True, level == 2

    def wake(self, loading: bool = False) -> None:
        """Take back what `sleep` freed, if asleep. PyTorch's cached blocks go back to the GPU
        first: the learner's freed memory stays in this process's caching allocator, where vLLM
        cannot map it. After a level-2 sleep only a load (`loading`) may wake it: a request would
        decode with whatever the weights' memory holds."""
        if not self.asleep:
            return
        if self.lost and not loading:
            raise RuntimeError(
                "vLLM woke with its weights gone (asleep at level 2): load a version before "
                "generating"
            )
        release_cached_memory()
        self.llm.wake_up()
        self.asleep = False


def _repack_output_layers(model: torch.nn.Module) -> None:
    """Run the output layer's post-load step again. Tied to the input embedding, it loads no
    weight of its own in a reload, so vLLM skips it, and on CPU it multiplies by a copy packed
    at start-up; re-packing reads the reloaded embedding (elsewhere the step does nothing)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    for module in model.modules():
        if isinstance(module, ParallelLMHead):
            module.quant_method.process_weights_after_loading(module)


def unpacked(model: torch.nn.Module, expected: Fingerprints) -> Iterator[tuple[str, torch.Tensor]]:
    """vLLM's parameters under the learner's names: each as vLLM names it; one it packs (q, k
    and v in qkv_proj, gate and up in gate_up_proj: the model's `packed_modules_mapping`) also
    as its parts, rows in that order, where their published shapes add up to it (a
    tensor-parallel shard does not: not compared); a vocabulary it pads to a multiple of 64 rows
    as its first rows. vLLM on a CPU hands its linear layers' weights to oneDNN and keeps empty
    parameters: there only the norms and embeddings are compared."""
    packed = getattr(model, "packed_modules_mapping", None) or {}
    for name, p in model.named_parameters():
        want = expected.get(name)
        if want is not None and p.ndim and p.shape[0] > want[1][0] and p.shape[1:] == want[1][1:]:
            yield name, p[: want[1][0]]  # a padded vocabulary
            continue
        yield name, p
        module, _, kind = name.rpartition(".")
        owner, _, short = module.rpartition(".")
        names = [f"{owner}.{part}.{kind}" for part in packed.get(short, ())]
        shapes = [expected[n][1] for n in names if n in expected]
        if not names or len(shapes) != len(names) or any(s[1:] != p.shape[1:] for s in shapes):
            continue
        if sum(s[0] for s in shapes) != p.shape[0]:
            continue
        at = 0
        for part, shape in zip(names, shapes, strict=True):
            yield part, p[at : at + shape[0]]
            at += shape[0]
