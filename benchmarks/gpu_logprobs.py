"""The engine/learner log-prob probe of `make gpu-check`: how far the rollout engine's behaviour
log-probs are from the learner's recomputation of the same tokens, on fresh rows.

One engine is opened as `cadence train` opens it (`rollout.engine`, `[rollout.vllm]`,
`model.dtype`), over `model.path`. Then, model after model, the model's weights are loaded into
that engine as a run loads a new policy version (vLLM's in-place reload), `--prompts` held-out
prompts are sampled `rollout.group_size` times each, and the same model, loaded as the learner
loads it (`model.dtype` on `model.device`), recomputes every sampled token's log-prob under
softmax(logits / T) through the learner's own shared-prompt layout. The models: 'start'
(`model.path`), 'perturbed' (it with every weight moved by about 5%: an engine that kept its old
weights, a reload that missed some, would show here far above the 'start' figure, whatever the
runs' updates did) and each model directory named (the runs' `final/`). Reported per model: the
max and mean |behaviour - learner| over the trained tokens, and how far its weights are from the
starting model's.

It measures; it asserts nothing: bf16 on a GPU sits far above the fp32 tolerances of the CPU
tests, and the figure is for the reader. One vLLM engine per process, so it runs in its own.

    python benchmarks/gpu_logprobs.py CONFIG [--set K=V] [--prompts 8] [--out FILE] [DIR ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def logprob_abs_diff(
    behaviour: torch.Tensor, learner: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """Max and mean of |behaviour - learner| over the tokens where `mask` is 1, and their count."""
    if behaviour.shape != learner.shape or learner.shape != mask.shape:
        raise ValueError(
            f"shapes differ: behaviour {tuple(behaviour.shape)}, learner {tuple(learner.shape)}, "
            f"mask {tuple(mask.shape)}"
        )
    diff = (behaviour.double() - learner.double()).abs()[mask.bool()]  # (N,)
    if diff.numel() == 0:
        raise ValueError("no token to compare: every mask entry is 0")
    return {"max": diff.max().item(), "mean": diff.mean().item(), "num_tokens": diff.numel()}


def group_logprobs(model, group, layout: str, pad_id: int, temperature: float):
    """(learner, behaviour, mask) of one group's responses, each (G, T): the learner's log-probs
    of the sampled tokens as it computes them in training, the engine's, and the trained tokens."""
    from cadence.learner.packing import LAYOUTS

    completions = group.completions
    width = max([len(c.token_ids) for c in completions] + [1])
    tokens = torch.full((len(completions), width), pad_id, dtype=torch.long)  # (G, T)
    behaviour = torch.zeros((len(completions), width))  # (G, T)
    mask = torch.zeros((len(completions), width))  # (G, T)
    for b, c in enumerate(completions):
        n = len(c.token_ids)
        tokens[b, :n] = torch.tensor(c.token_ids, dtype=torch.long)
        behaviour[b, :n] = torch.tensor(c.logprobs)
        mask[b, :n] = 1.0 if c.loss_mask is None else torch.tensor(c.loss_mask).float()
    device = next(model.parameters()).device
    packed = LAYOUTS[layout]([(group.prompt_ids, [c.token_ids for c in completions])], pad_id)
    with torch.no_grad():
        layout = packed.to(device)
        pred = layout.logits(model).float() / temperature  # (M, V): the tokens that exist
        picked = pred.gather(-1, tokens.to(device)[layout.valid][:, None]).squeeze(-1)  # (M,)
        learner = torch.zeros(tokens.shape)  # (G, T), 0 on padding
        learner[layout.valid.cpu()] = (picked - pred.logsumexp(-1)).cpu()
    return learner, behaviour, mask


def learner_layout(model, params, pad_id: int) -> str:
    """The layout the learner trains `model` with: its shared-prompt layout, or 'unpacked' where
    that layout does not reproduce the model (the learner's own fallback)."""
    from cadence.learner.packing import check_layout

    if not params.shared_prompt:
        return "unpacked"
    if check_layout(model, params.shared_prompt_impl, pad_id) is not None:
        return "unpacked"
    return params.shared_prompt_impl


def weight_change(model, start: dict[str, torch.Tensor]) -> float:
    """Largest |w - w_start| over every parameter."""
    with torch.no_grad():
        return max(
            (p.float() - start[n].to(p.device).float()).abs().max().item()
            for n, p in model.named_parameters()
        )


def perturbed(model, scale: float, seed: int = 0):
    """`model` with every weight multiplied by (1 + scale * N(0, 1)), seeded: weights no update
    could leave as they were (bf16 rounds a small learning rate's steps away)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=gen).to(p.device)  # same draw on any device
            p.mul_(1 + scale * noise)
    return model


def probe(cfg, model_dirs: list[str], num_prompts: int, scale: float = 0.05) -> dict[str, dict]:
    """Figures per model, through one engine started on `model.path`: 'start' (that model),
    'perturbed' (it, perturbed by `scale`), then each of `model_dirs` (by its path)."""
    from cadence.builder import heldout_set, learner_params, open_rollout_engine, rollout_worker
    from cadence.models import DTYPES, load_model, load_tokenizer, max_positions

    tokenizer = load_tokenizer(cfg.model.path)
    engine, weights = open_rollout_engine(cfg, tokenizer)
    prompts = heldout_set(cfg, tokenizer, max_positions(weights.model))[:num_prompts]
    if not prompts:
        raise ValueError("the task gave no held-out prompt that fits the model")
    worker = rollout_worker(cfg, engine, tokenizer, score=False)
    params = learner_params(cfg)
    dtype, device, pad = DTYPES[cfg.model.dtype], cfg.model.device, tokenizer.pad_token_id
    start = {n: p.detach().cpu() for n, p in load_model(cfg.model.path, dtype).named_parameters()}
    models = [
        ("start", lambda: load_model(cfg.model.path, dtype, device)),
        ("perturbed", lambda: perturbed(load_model(cfg.model.path, dtype, device), scale)),
        *((d, lambda d=d: load_model(d, dtype, device)) for d in model_dirs),
    ]
    out = {}
    for version, (label, load) in enumerate(models, start=1):
        model = load()
        weights.load({n: p.detach() for n, p in model.named_parameters()}, version)
        groups = worker.rollout(prompts, 0, version)
        layout = learner_layout(model, params, pad)
        learner, behaviour = [], []
        for group in groups:
            lp, bp, mask = group_logprobs(model, group, layout, pad, params.temperature)
            learner.append(lp[mask.bool()])  # (N_g,)
            behaviour.append(bp[mask.bool()])  # (N_g,)
        lp, bp = torch.cat(learner), torch.cat(behaviour)  # (N,)
        out[label] = logprob_abs_diff(bp, lp, torch.ones_like(lp)) | {
            "layout": layout,
            "num_samples": sum(len(g.completions) for g in groups),
            "max_weight_change": weight_change(model, start),
        }
        del model
    return out


def main(argv: list[str] | None = None) -> int:
    from cadence.config import load_config

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config", help="the runs' TOML config")
    p.add_argument("dirs", nargs="*", help="model directories after the starting model")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--prompts", type=int, default=8, help="held-out prompts sampled per model")
    p.add_argument("--out", default=None, help="write the figures here as JSON (else stdout)")
    args = p.parse_intermixed_args(argv)
    figures = probe(load_config(args.config, args.set), args.dirs, args.prompts)
    text = json.dumps(figures, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
