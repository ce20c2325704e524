"""A model's base pass rate on reasoning-gym datasets at easy settings, in two answer formats:
the answer in <answer></answer> tags (reasoning-gym's own rule, graded by each dataset's
score_answer) and, for datasets whose answer is a number, one line ending in it (the last number
graded). Greedy, `cadence eval`'s evaluator on each dataset's own held-out rows; accuracy (score
>= 1) with its standard error and the mean score (reasoning-gym's partial credit). Writes
base_rates.json after every dataset (a second run with the same --out measures only what is
missing) and prints the Markdown table of docs/smollm2.md.

    python benchmarks/reasoning_gym_base_rates.py --model runs/smollm2 --heldout 64 \\
        --out runs/rg-base-rates
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from cadence.builder import evaluate_model, set_threads
from cadence.config import load_config
from cadence.metrics import binomial_stderr

# name -> (reasoning-gym config at easy settings, whether the answer is one number)
DATASETS: dict[str, tuple[str, bool]] = {
    "basic_arithmetic": (
        '{ min_terms = 2, max_terms = 2, max_digits = 1, operators = ["+", "-"], '
        "allow_parentheses = false, allow_negation = false }",
        True,
    ),
    "chain_sum": ("{ min_terms = 2, max_terms = 2, max_digits = 1 }", True),
    "products": ("{ min_terms = 2, max_terms = 2, max_digits = 1 }", True),
    "leg_counting": ("{ min_animals = 1, max_animals = 2, max_instances = 3 }", True),
    "letter_counting": ("{ min_words = 3, max_words = 5 }", True),
    "count_bits": ("{ min_n = 1, max_n = 16 }", True),
    "gcd": ("{ max_value = 20 }", True),
    "lcm": ("{ max_value = 10 }", True),
    "simple_equations": (
        '{ min_terms = 2, max_terms = 2, max_value = 10, operators = ["+", "-"], '
        "operators_weights = [0.5, 0.5] }",
        True,
    ),
    "spell_backward": ("{ min_word_len = 3, max_word_len = 4 }", False),
    "word_sequence_reversal": ("{ min_words = 3, max_words = 3 }", False),
    "number_sorting": (
        "{ min_numbers = 3, max_numbers = 3, max_decimals = 0, min_value = 0.0, max_value = 20.0 }",
        False,
    ),
    "syllogism": ("{}", False),
    "isomorphic_strings": ("{ min_string_length = 2, max_string_length = 4 }", False),
}
FORMATS = {
    # reasoning-gym's rule: the last <answer>...</answer>
    "tags": (
        "auto",
        "Think briefly, then give the final answer inside <answer></answer> tags, "
        "like <answer>7</answer>.",
    ),
    # the SmolLM2 arithmetic recipe's: one line, the last number graded
    "one line": ("last_number", "Reply with one line that ends with the answer, like: 3 + 4 = 7."),
}


def overrides(model: str, name: str, config: str, fmt: str, heldout: int, tokens: int):
    answer_format, prompt = FORMATS[fmt]
    return [
        f"model.path='{model}'",
        "data.task='reasoning_gym'",
        f"data.reasoning_gym.datasets.{name}.config={config}",
        "data.reasoning_gym.size=200",
        f"data.num_heldout={heldout}",
        "data.chat_template=true",
        f"data.system_prompt={json.dumps(prompt)}",
        f"reward.answer_format='{answer_format}'",
        f"rollout.max_new_tokens={tokens}",
        "train.threads=1",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="runs/smollm2")
    parser.add_argument("--heldout", type=int, default=64, help="held-out rows per dataset")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--datasets", default=",".join(DATASETS))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    set_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "base_rates.json"
    rows = json.loads(path.read_text()) if path.exists() else []  # a run cut short goes on
    done = {(r["dataset"], r["format"]) for r in rows}
    for name in args.datasets.split(","):
        config, numeric = DATASETS[name]
        for fmt in FORMATS if numeric else ("tags",):
            if (name, fmt) in done:
                continue
            sets = overrides(args.model, name, config, fmt, args.heldout, args.max_new_tokens)
            start = time.perf_counter()
            result = evaluate_model(load_config(None, sets), args.model)
            n = int(result["num_prompts"])
            rows.append(
                {
                    "dataset": name,
                    "config": config,
                    "format": fmt,
                    "num_prompts": n,
                    "accuracy": result["accuracy"],
                    "stderr": binomial_stderr(result["accuracy"], n),
                    "score_mean": result["score_mean"],
                    "response_tokens_mean": result["response_tokens_mean"],
                    "seconds": time.perf_counter() - start,
                }
            )
            r = rows[-1]
            print(
                f"{name:24s} {fmt:9s} accuracy {r['accuracy']:.3f} ± {r['stderr']:.3f}, "
                f"score {r['score_mean']:.3f}, {r['response_tokens_mean']:.1f} tokens, "
                f"{r['seconds']:.0f} s",
                flush=True,
            )
            path.write_text(json.dumps(rows, indent=2) + "\n")
    print("\n| dataset (easy settings) | format | accuracy ± s.e. | mean score | tokens |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| `{r['dataset']}` `{r['config']}` | {r['format']} | {r['accuracy']:.3f} ± "
            f"{r['stderr']:.3f} | {r['score_mean']:.3f} | {r['response_tokens_mean']:.1f} |"
        )


if __name__ == "__main__":
    main()
