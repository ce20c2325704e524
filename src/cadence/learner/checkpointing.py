"""Activation checkpointing per decoder layer, and a prompt cache that survives it.

`checkpoint_layers` makes each decoder layer (the model's `_no_split_modules`) keep only its
inputs in the forward and run again in the backward (torch.utils.checkpoint, non-reentrant): a
layer's intermediates live for one layer's backward, not the whole pass. It does not use
transformers' own gradient checkpointing, which turns the key/value cache off in training and so
would silently drop the prompt cache of the shared-prompt prefix layout; instead `PrefixCache`
makes that cache safe to run again: the prompt pass stores each layer's keys and values once (a
layer run again gets back what it computed), the responses' pass reads them without storing its
own. State dict names are unchanged. docs/learner.md#activation-checkpointing.
"""

from __future__ import annotations

import copy

import torch
from torch.utils.checkpoint import checkpoint

from cadence.learner.logprobs import causal_lm

_CLASSES: dict[type, type] = {}


def _checkpointed(cls: type) -> type:
    """`cls` with its forward run under `checkpoint` while gradients are on (one subclass per
    class, so that copies and FSDP2 wrapping keep it)."""
    if cls not in _CLASSES:

        def forward(self, *args, **kwargs):
            if not torch.is_grad_enabled():
                return super(sub, self).forward(*args, **kwargs)
            parent = super(sub, self).forward
            return checkpoint(parent, *args, use_reentrant=False, **kwargs)

        sub = type(f"Checkpointed{cls.__name__}", (cls,), {"forward": forward})
        _CLASSES[cls] = sub
    return _CLASSES[cls]


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of `model`: the modules of a class its causal LM names in
    `_no_split_modules`, whatever subclass wraps it now (checkpointing makes a layer a
    `Checkpointed<Name>`, FSDP2 an `FSDP<Name>`: the name alone no longer says it). What FSDP2
    shards as a unit and what activation checkpointing recomputes: one list for both."""
    lm = causal_lm(model)
    names = set(getattr(lm, "_no_split_modules", None) or ())
    return [m for m in lm.modules() if any(c.__name__ in names for c in type(m).__mro__)]


def checkpoint_layers(model: torch.nn.Module) -> int:
    """Checkpoint every decoder layer of `model` (idempotent); how many there are."""
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(
            f"learner.activation_checkpointing: {type(causal_lm(model)).__name__} names no "
            "decoder layer class (_no_split_modules)"
        )
    for layer in layers:
        if not _is_wrapped(layer):
            layer.__class__ = _checkpointed(type(layer))
    return len(layers)


def _is_wrapped(module: torch.nn.Module) -> bool:
    """Whether `module` is checkpointed (under whatever wraps it since: FSDP2's subclass)."""
    wrapped = set(_CLASSES.values())
    return any(c in wrapped for c in type(module).__mro__)


def no_cache(model: torch.nn.Module) -> dict[str, bool]:
    """`use_cache=False` for a checkpointed model (a cache it made itself would grow when a
    layer runs again), nothing otherwise: the unpacked layout passes a plain forward only what
    every causal LM takes."""
    return {"use_cache": False} if any(map(_is_wrapped, model.modules())) else {}


def prefix_cache():
    """A new `PrefixCache`: a prompt pass's keys and values for responses that attend to them
    (see the module docstring). The prompt pass stores each layer once; its `for_responses` view
    (each prompt's rows repeated for its responses) puts a layer's prompt keys and values before
    the responses' own, which it does not keep. Two objects, so that a layer run again in the
    backward meets the cache of its own pass. Made on first use: transformers is imported then."""
    global _PREFIX_CACHE
    if _PREFIX_CACHE is None:
        from transformers import DynamicCache

        class PrefixCache(DynamicCache):
            def __init__(self) -> None:
                super().__init__()
                self.frozen = False
                self._stored: set[int] = set()

            def for_responses(self, index):
                """A reading view: each layer's keys and values at the rows `index`."""
                view = copy.copy(self)
                view.layers = [copy.copy(layer) for layer in self.layers]
                view.batch_select_indices(index)
                view.frozen = True
                return view

            def update(self, key_states, value_states, layer_idx, *args, **kwargs):
                if self.frozen:
                    layer = self.layers[layer_idx]
                    keys = torch.cat([layer.keys, key_states], dim=-2)
                    return keys, torch.cat([layer.values, value_states], dim=-2)
                if layer_idx in self._stored:  # a checkpointed layer run again: what it had
                    return key_states, value_states
                self._stored.add(layer_idx)
                return super().update(key_states, value_states, layer_idx, *args, **kwargs)

        _PREFIX_CACHE = PrefixCache
    return _PREFIX_CACHE()


_PREFIX_CACHE: type | None = None
