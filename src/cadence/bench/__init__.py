"""`cadence bench`: measurements run side by side in one process, reported as ratios.

Each suite interleaves its variants across repeats (A, B, C, then A, B, C again) so that machine
drift hits all of them alike, and reports the median. Suites:
- `modes` (bench/modes.py): the same RL workload in several pipeline modes (TPSPD, busy times).
- `shared-prompt` (bench/shared_prompt.py): one training iteration with each micro-batch layout.
- `engine` (bench/engine.py): static batching, `model.generate` and continuous batching on a
  long-tailed and a uniform response-length workload.
- `trl` (bench/trl_peer.py, TRL set up by bench/trl_setup.py): cadence and TRL's GRPOTrainer on
  the same workload.
- `ablation` (bench/ablation.py): pipeline x shared prompt x old-logprob reuse, plus TRL.
- `ranks` (bench/ranks.py): one learner process against `learner.ranks` ranks (FSDP, DDP):
  iteration time and memory per process.
- `race` (bench/race.py): cadence and TRL for the same wall-clock minutes each; held-out
  accuracy of their snapshots against training seconds, and the time each takes to a target.
"""

from cadence.bench.ablation import bench_ablation
from cadence.bench.engine import bench_engine
from cadence.bench.modes import MODES, bench, markdown_table, parse_modes
from cadence.bench.ranks import bench_ranks
from cadence.bench.shared_prompt import bench_shared_prompt
from cadence.bench.trl_peer import bench_trl

SUITES = ("modes", "shared-prompt", "engine", "trl", "ablation", "ranks", "race")

__all__ = [
    "MODES",
    "SUITES",
    "bench",
    "bench_ablation",
    "bench_engine",
    "bench_ranks",
    "bench_shared_prompt",
    "bench_trl",
    "markdown_table",
    "parse_modes",
]
