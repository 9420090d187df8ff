"""The released checkpoint-selection rule of pivot GRPO (docs/ALGORITHMS.md, pipeline 2, "Checkpoint selection").

The run is meant to go past its useful region, so the sweep keeps

    the LATEST step s > 0 with   p_accuracy(s) >= alpha                      (accuracy indistinguishable from
                                                                              the start: two-sided McNemar)
                           and   p_over_search(s) < alpha  and
                                 over_search_rate(s) < over_search_rate(0)   (over-search significantly lower:
                                                                              one-sided McNemar)

and, when no step qualifies, the starting policy (step 0) with the reason. "Indistinguishable" is taken
literally: a step whose accuracy is significantly HIGHER than the start's also fails it (its verdict says so);
the rule selects for less over-search at unchanged accuracy, not for accuracy gains.

The rule reads only a table of records (`step`, `accuracy`, `over_search_rate`, `p_accuracy`, `p_over_search`,
as `table.checkpoint_record` writes them), so it can be checked on synthetic tables.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

START_STEP = 0
REQUIRED_FIELDS = ("step", "accuracy", "over_search_rate", "p_accuracy", "p_over_search")


@dataclasses.dataclass(frozen=True)
class Selection:
    step: int                   # the selected checkpoint (START_STEP when none qualifies)
    reason: str                 # one sentence: why this step
    verdicts: dict[int, str]    # step -> verdict on the rule
    qualifying: tuple[int, ...]  # every step that passes the rule, ascending


def select_checkpoint(records: Sequence[Mapping], alpha: float = 0.05) -> Selection:
    """Apply the released rule (module doc) to per-checkpoint records; one record must be step 0, the start."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha {alpha} must lie in (0, 1)")
    for record in records:
        missing = [name for name in REQUIRED_FIELDS if name not in record]
        if missing:
            raise ValueError(f"sweep record {dict(record)} lacks {missing}")
    by_step = {int(r["step"]): r for r in records}
    if len(by_step) != len(records):
        raise ValueError(f"sweep records repeat a step: {sorted(int(r['step']) for r in records)}")
    if START_STEP not in by_step:
        raise ValueError(f"sweep records have no step {START_STEP} (the starting policy every step is compared "
                         f"with); steps present: {sorted(by_step)}")
    start = by_step[START_STEP]
    verdicts, qualifying = {START_STEP: "starting policy (reference)"}, []
    for step in sorted(s for s in by_step if s != START_STEP):
        verdict, ok = _verdict(by_step[step], start, alpha)
        verdicts[step] = verdict
        if ok:
            qualifying.append(step)
    if qualifying:
        chosen = by_step[qualifying[-1]]
        verdicts[qualifying[-1]] += "; SELECTED (latest qualifying)"
        reason = (f"step {qualifying[-1]} is the latest of the qualifying steps {qualifying}: accuracy "
                  f"{chosen['accuracy']:.3f} vs {start['accuracy']:.3f} at the start (two-sided p = "
                  f"{chosen['p_accuracy']:.3g} >= {alpha}), over-search {chosen['over_search_rate']:.3f} vs "
                  f"{start['over_search_rate']:.3f} (one-sided p = {chosen['p_over_search']:.3g} < {alpha})")
        return Selection(qualifying[-1], reason, verdicts, tuple(qualifying))
    verdicts[START_STEP] += "; SELECTED (no checkpoint qualifies)"
    if len(by_step) == 1:
        reason = "only the starting policy (step 0) was evaluated; keeping it"
    else:
        reason = (f"no checkpoint after the start has accuracy indistinguishable from the starting policy "
                  f"(two-sided p >= {alpha}) together with significantly lower over-search (one-sided p < "
                  f"{alpha}); keeping the starting policy (step {START_STEP})")
    return Selection(START_STEP, reason, verdicts, ())


def _verdict(record: Mapping, start: Mapping, alpha: float) -> tuple[str, bool]:
    """(verdict text, passes the rule) of one step against the start."""
    accuracy_same = record["p_accuracy"] >= alpha
    over_search_lower = record["p_over_search"] < alpha and record["over_search_rate"] < start["over_search_rate"]
    if accuracy_same and over_search_lower:
        return "qualifies", True
    reasons = []
    if not accuracy_same:
        direction = "lower" if record["accuracy"] < start["accuracy"] else "higher"
        reasons.append(f"accuracy significantly {direction} than the start (p {record['p_accuracy']:.3g} < {alpha})")
    if not over_search_lower:
        reasons.append(f"over-search not significantly lower (p {record['p_over_search']:.3g}"
                       + (f" >= {alpha})" if record["p_over_search"] >= alpha else ", rate not below the start)"))
    return "; ".join(reasons), False
