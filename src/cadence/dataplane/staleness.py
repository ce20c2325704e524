"""The staleness rule, one for the sample store and the run loop alike.

A sample whose oldest token was made by policy version v may be trained by a consumer at version
c when c - v is within `max_staleness`; staler is dropped (and counted by the caller). Without
partial rollouts every token of a sample has its group's version; with them a sequence that took
new weights mid-way is bounded by its first, oldest, tokens. A version the consumer has not
reached, or any other version on-policy (`max_staleness = 0`), means weights reached the
generator out of order: that raises, since dropping would hide a bug.
"""

from __future__ import annotations

from cadence.dataplane.samplers import Unit


class StaleRowError(RuntimeError):
    """A row's policy version breaks the consumer's staleness rule in a way dropping cannot fix."""


def check_staleness(policy_version: int, version: int, max_staleness: int, what: str) -> bool:
    """The staleness rule, for the store and the run loop alike: True to keep a sample made by
    `policy_version` for a consumer at `version`, False to drop it (staler than `max_staleness`);
    raise `StaleRowError` where dropping would hide a bug: a version the consumer has not reached,
    or, on-policy, any other version. `what` names the sample and its consumer in the message."""
    staleness = version - policy_version
    if staleness < 0 or (max_staleness == 0 and staleness != 0):
        raise StaleRowError(
            f"{what} is at {version} (max_staleness {max_staleness}): weights reached the "
            "generator out of order"
        )
    return staleness <= max_staleness


def unit_within_staleness(unit: Unit, version: int, max_staleness: int, task: str) -> bool:
    """The rule over every row of a unit, each by its oldest token: keep or drop the unit."""
    keep = True
    for e in unit:
        row = e.row
        what = f"row {row.index} (group {row.group}) has policy_version {row.policy_version}"
        if row.bounded_version != row.policy_version:
            what += f", oldest token of version {row.oldest_version}"
        keep = (
            check_staleness(row.bounded_version, version, max_staleness, f"{what}, {task}") and keep
        )
    return keep
