"""`cadence study`: experiments over many runs, each resumable, each writing a table and a plot.

- `offpolicy` (offpolicy.py): each loss at each staleness bound, from the same model and seed.
- `seeds` (seeds.py): the main job's config over several seeds, on one held-out set.
"""

from cadence.study.offpolicy import LOSSES, study_offpolicy
from cadence.study.runs import parse_list, parse_seeds, train_or_resume
from cadence.study.seeds import study_seeds

STUDIES = ("offpolicy", "seeds")

__all__ = [
    "LOSSES",
    "STUDIES",
    "parse_list",
    "parse_seeds",
    "study_offpolicy",
    "study_seeds",
    "train_or_resume",
]
