"""Teacher forcing: agreement, KL and K/V error measured on the reference's history.

Each strategy decodes greedily on its own history (its *free* run, the text
a person sees).  Until its token first differs from the reference's, the
free run *is* the reference's history.  At the first divergence its cache is
forked into a teacher-forced twin that is fed the reference's tokens from
then on, so teacher-forced agreement, KL, max |Δlogit| and max |ΔK|, |ΔV|
stay measured on identical histories.  Without twins (`twins=False`) those
figures stop at the first divergence, and the summary says how many steps
they cover.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..measure.observe import Observer
from .lanes import Lane


def observe(
    lane: Lane,
    ref_token: int | None,
    ref_logits: torch.Tensor | None,
    observer: Observer,
    fork: Callable[[Lane], None] | None,
    agreement: bool = True,
) -> torch.Tensor | None:
    """Fork the twin at the first divergence (`fork(lane)`; None: no twins); returns the logits this step's
    agreement compares with the reference's (the free run's before the divergence, the twin's after it), or
    None when there is nothing to compare.  Without `agreement` (the instruments off) only the divergence is
    noted: no twin, no K/V report."""
    if not lane.diverged:
        lane_done, ref_done = not lane.active, ref_token is None
        if lane_done and ref_done:
            return None
        if lane_done != ref_done or int(torch.argmax(lane.logits)) != ref_token:
            lane.diverged = True
            lane.kv = observer.kv_report(lane.owner)
            observer.compare_with(lane.owner, None)
            if fork is not None and agreement:
                # The free run leaves the reference's history here: keep measuring on a twin fed its tokens.
                fork(lane)
                lane.tf_logits = lane.logits
    if not agreement or ref_token is None or (lane.diverged and lane.tf_cache is None):
        return None
    return lane.tf_logits if lane.diverged else lane.logits


def agree(lanes: list[Lane], logits: list[torch.Tensor], ref_token: int, ref_logits: torch.Tensor):
    """Teacher-forced agreement, KL(p_ref || p) and max |dlogit| of every lane at this step, in one pass over the
    stacked logits (the reference's first row: identical logits give identical rows, KL and |dlogit| exactly 0)."""
    if not lanes:
        return
    rows = torch.stack([ref_logits, *logits]).float()
    logp = torch.log_softmax(rows, dim=-1)
    kl = (logp[0].exp() * (logp[0] - logp[1:])).sum(dim=-1).clamp_min(0.0)
    figures = torch.stack(
        [kl, (rows[1:].argmax(dim=-1) == ref_token).float(), (rows[1:] - rows[0]).abs().amax(dim=-1)], dim=1
    ).tolist()
    for lane, (k, same, dlogit) in zip(lanes, figures):
        lane.tf_steps += 1
        lane.tf_agree += int(same)
        lane.kl_sum += k
        lane.max_dlogit = max(lane.max_dlogit, dlogit)


def kv_summary(lane: Lane, observer: Observer) -> dict:
    """K/V against the full cache over the identical-history path: the free run before the divergence, the
    twin after it."""
    live = observer.kv_report(lane.twin if lane.tf_cache is not None else lane.owner)
    if not lane.diverged:
        return live
    before = lane.kv
    if lane.tf_cache is None or live.get("kv_exact") is None:
        return before
    if before.get("kv_exact") is None:
        return live
    return {
        "layers_compared": max(before["layers_compared"], live["layers_compared"]),
        "kv_exact": before["kv_exact"] and live["kv_exact"],
        "max_abs_dk": max(before["max_abs_dk"], live["max_abs_dk"]),
        "max_abs_dv": max(before["max_abs_dv"], live["max_abs_dv"]),
        "rebuilt_token_layers": before["rebuilt_token_layers"] + live["rebuilt_token_layers"],
        "shape_mismatches": before["shape_mismatches"] + live["shape_mismatches"],
    }
