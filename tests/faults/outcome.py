"""The fault suites' one verdict after a run: every acknowledged request finished once,
with its reference tokens, none lost, none twice (bench/harness/fault_stack.check)."""

from __future__ import annotations

from bench.harness.fault_stack import Job, Outcome, check


def assert_nothing_lost(stub, jobs: list[Job]) -> Outcome:
    """Assert what `check` finds after a run of `jobs`: no problem, every job
    acknowledged, and no request lost, no token twice, none missing, no wrong output."""
    outcome = check(stub, jobs)
    assert outcome.problems == [], "\n".join(outcome.problems[:20])
    assert outcome.acknowledged == len(jobs), f"{outcome.acknowledged} of {len(jobs)} acknowledged"
    counts = (
        outcome.lost,
        outcome.duplicated_tokens,
        outcome.missing_tokens,
        outcome.wrong_outputs,
    )
    assert counts == (0, 0, 0, 0), f"lost, duplicated, missing, wrong: {counts}"
    return outcome
