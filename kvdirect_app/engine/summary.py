"""What a run reports: each step's figures as a visitor saw it (every part as its clock read it, what no clock
covered, what no lane's work holds) and the run's summary per lane (`results`); the memory instrument a run
resolves.  `Engine` holds a `Report` and passes it what changes as the run goes (`runner.py`)."""

from __future__ import annotations

from collections import defaultdict

import torch

from ..kernels.invariant import Kernels
from ..measure import ledger, meters
from ..measure.agreement import token_match
from ..measure.instruments import Instruments
from ..measure.observe import ENGINE, Observer
from ..models.loading import LoadedModel
from ..models.prompts import InputError
from .forwards import Forwards
from .lanes import Lane
from .teacher_forcing import kv_summary


class Report:
    """A run's step figures and its summary.  It keeps what it accumulates (the steps' figures, the most bytes no
    lane held) and the facts fixed when the engine is built; what the engine changes as it runs (its lanes, thread
    count, kernels, turns) is passed in by each call, so everything it reads is named in its inputs."""

    def __init__(
        self,
        loaded: LoadedModel,
        observer: Observer,
        forwards: Forwards,
        instruments: Instruments,
        memory: str,
        instrument: str,
        determinism: dict,
        solo: bool,
        twins: bool,
        max_new_tokens: int,
    ):
        self.loaded, self.observer, self.forwards, self.instruments = loaded, observer, forwards, instruments
        self.memory, self.instrument, self.determinism = memory, instrument, determinism
        self.solo, self.twins, self.max_new_tokens = solo, twins, max_new_tokens
        self.steps: list[dict] = []  # per decode step: its wall time and each part's
        self.unattributed_peak = 0  # the most bytes no lane's work held after a step (`unattributed`)

    def step_figures(self, started: float, mark: dict, fed: set[str], lanes: list[Lane], turns: int) -> dict:
        """The step as a visitor sees it, every part as its clock read it: each fed lane's own time (its regions
        and its share of the shared pass), the instruments' (the twins' rows among them), the engine's own
        (choosing tokens, detokenising, events), and the rest no clock covered; `shared_ms` is the shared pass
        before it was charged to the rows.  `lanes`: every lane (the reference first); `turns`: the turns begun."""
        wall = 1e3 * (self.observer.now() - started)
        fed_ms, measured, engine = {label: 0.0 for label in fed}, defaultdict(float), defaultdict(float)
        for (owner, op), s in self.observer.since(mark).items():
            if owner.kind == "lane":
                fed_ms[owner.label] = fed_ms.get(owner.label, 0.0) + 1e3 * s
            elif owner.kind == "twin":
                measured["twins"] += 1e3 * s
            elif owner.kind == "instrument":
                measured[owner.label] += 1e3 * s
            elif owner.kind == "engine":
                engine[op] += 1e3 * s
            # (the shared pass's time was charged to its rows: none of it is left here)
        measured = {name: ms for name, ms in measured.items() if ms}
        engine = {op: ms for op, ms in engine.items() if ms}
        figures = {
            "step_ms": wall,
            "lanes_ms": fed_ms,
            "measurement_ms": measured,
            "engine_ms": engine,
            "shared_ms": self.forwards.step_shared_ms,
            "unattributed_ms": wall - sum(fed_ms.values()) - sum(measured.values()) - sum(engine.values()),
            "unattributed_bytes": self.unattributed(lanes, turns),
        }
        self.steps.append(figures)
        return figures

    def lane_event(self, lane: Lane, k: int) -> dict:
        """What a step event says of a lane that chose a token in turn `k`."""
        last = (lane.times.decode or lane.times.prefill)[-1]
        token = lane.tokens[k][-1]
        with self.observer.region(ENGINE, "detokenize"):
            piece = self.loaded.tokenizer.decode([token])
        return {
            "token_id": token,
            "piece": piece,
            "text": lane.texts[k],
            "active": lane.active,
            "fed": lane.active,  # the last token of a turn is not fed; its latency is the previous step's
            "prefill_ms": 1e3 * lane.times.prefill[-1]["total"],
            "seen": lane.cache.get_seq_length(),
            **lane.book.last,
            "rss_bytes": self.forwards.rss,
            "latency_ms": {op: 1e3 * s for op, s in last.items()},
            "diverged": lane.diverged,
            "kl_mean": lane.kl_sum / lane.tf_steps if lane.tf_steps else 0.0,
        }

    def unattributed(self, lanes: list[Lane], turns: int) -> dict | None:
        """No lane's bytes now (`Observer.unattributed`), and the most they reached in this run."""
        if self.memory == "none":
            return None
        # The lanes' forwards so far (their twins' too): each leaves a few records the cross-check cannot tell from
        # a strategy's (`ledger.CrossCheck.PER_FORWARD`).
        rows = sum(1 + (lane.tf_cache is not None) for lane in lanes)
        now = self.observer.unattributed(rows * (len(self.steps) + 1 + turns))
        if now is not None:
            self.unattributed_peak = max(self.unattributed_peak, now["bytes"])
        return now

    def lane_summary(self, lane: Lane, ref: Lane, kernels: Kernels) -> dict:
        """One lane's results beside the reference `ref`, computed with `kernels` (the run's now)."""
        is_ref = lane is ref and not self.solo
        match, first = token_match(ref.tokens, lane.tokens) if not self.solo else (None, None)
        if self.solo:
            kv = {
                "kv_exact": None,
                "max_abs_dk": None,
                "max_abs_dv": None,
                "layers_compared": 0,
                "rebuilt_token_layers": None,
                "shape_mismatches": 0,
            }
        elif is_ref:
            kv = {
                "kv_exact": True,
                "max_abs_dk": 0.0,
                "max_abs_dv": 0.0,
                "layers_compared": len(lane.cache.layers),
                "rebuilt_token_layers": 0,
                "shape_mismatches": 0,
            }
        else:
            kv = kv_summary(lane, self.observer)
        decode_s = sum(step["total"] for step in lane.times.decode)
        return {
            "token_ids": [t for turn in lane.tokens for t in turn],
            "turn_token_ids": lane.tokens,
            "text": "\n\n".join(lane.texts),
            "turn_texts": lane.texts,
            "token_match": match,
            "first_divergence": first,
            "teacher_forced_agreement": 1.0 if is_ref else (lane.tf_agree / lane.tf_steps if lane.tf_steps else None),
            "kl_mean": 0.0 if is_ref else (lane.kl_sum / lane.tf_steps if lane.tf_steps else None),
            "max_abs_dlogit": 0.0 if is_ref else (lane.max_dlogit if lane.tf_steps else None),
            "teacher_forced_steps": None if is_ref or self.solo else lane.tf_steps,
            # A pane that joined later (`Engine.join`): its agreement, KL and |dlogit| cover the turns from this one
            # on; its tokens (and `token_match`) every turn.
            "joined_at_turn": lane.joined,
            **kv,
            "kv_digest": lane.kv_digest,
            "canonical_spec": lane.strategy.spec(),
            "mode": getattr(lane.strategy, "mode", None),  # "exact" | "fast" for rebuilding strategies, else None
            "kernels": lane_kernels(lane, kernels),
            "notes": lane.strategy.notes,
            "claims_exact": lane.strategy.claims_exact and self.determinism["deterministic"],
            "exact_unavailable": None
            if not lane.strategy.claims_exact or self.determinism["deterministic"]
            else self.determinism["reason"],
            "state_bytes": lane.book.summary(self.forwards.held(lane), self.instrument),
            "turns": [t.summary() for t in lane.book.turns],
            "latency_ms": lane.times.summary(),
            "parks": lane.parks,
            "tokens_per_s": len(lane.times.decode) / decode_s if decode_s > 0 else None,
        }

    def results(
        self,
        reference: Lane,
        lanes: list[Lane],
        show: list[str],
        threads: int,
        kernels: Kernels,
        prompt_ids: list[int],
        turn_chunks: list[list[int]],
        turn_seconds: list[float],
    ) -> dict:
        """The run's summary: the reference and the other lanes, the labels shown (in order), the thread count and
        kernels the run has now, and its turns (the first turn's prompt, each turn's ids fed, each turn's wall
        time)."""
        by_label = {reference.label: reference, **{lane.label: lane for lane in lanes}}
        shared = self.forwards.shared_ms
        out = {
            "model": self.loaded.name,
            "model_source": self.loaded.source,
            "device": str(self.loaded.device),
            "dtype": str(self.loaded.dtype).removeprefix("torch."),
            "threads": threads,
            "compared_with_full_cache": not self.solo,
            "batched": self.forwards.batch,
            "teacher_forced_twins": self.twins,
            "shared_pass_ms_mean": sum(shared) / len(shared) if shared else None,
            "shared_rule": "the pass's shared work (linears, norms, embedding, head) charged by rows: 1/N to each "
            "of its N rows (a lane's forward or a twin's)",
            "instruments": self.instruments.describe(),
            "steps": step_summary(self.steps),
            "turn_seconds": turn_seconds,
            "prompt_ids": prompt_ids,
            "turn_chunk_ids": turn_chunks,
            "max_new_tokens": self.max_new_tokens,
            "process_rss_peak_bytes": self.forwards.rss_peak,
            "memory_instrument": self.instrument,
            # Bytes no lane's work holds, now and at most after a step (process-wide: blocks allocated outside every
            # region, the measurement's own, shared memory); None where no meter reads them.
            "unattributed_bytes": None
            if (now := self.unattributed([reference, *lanes], len(turn_chunks))) is None
            else {**now, "peak": max(self.unattributed_peak, now["bytes"])},
            "determinism": self.determinism,
            "kernels": kernels.report(),
            "strategies": {
                label: self.lane_summary(by_label[label], reference, kernels) for label in show if label in by_label
            },
        }
        if self.loaded.device.type == "cuda":
            out["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(self.loaded.device)
        return out


def lane_kernels(lane: Lane, kernels: Kernels) -> dict:
    """What computed this lane: its forwards (the run's kernels) and its rebuilt K/V (the run's in exact mode,
    the model's own in one call with `mode=fast`, nothing for a strategy that rebuilds nothing)."""
    mode = getattr(lane.strategy, "mode", None)
    return {
        "forward": kernels.mode,
        "rebuild": None if mode is None else "native, one call" if mode == "fast" else kernels.mode,
    }


def memory_instrument(requested: str, device: torch.device) -> tuple[str, str, object]:
    """The memory mode a run asked for, resolved here: (mode, the instrument's name, the meter or None).
    "auto" is the allocator where its meter can be read (`meters.for_device`), else the declared storage count,
    whose name says why; an explicit "allocator" that cannot be read is one error line."""
    if requested == "none":
        return "none", "none (formula only)", None
    if requested == "storage":
        return "storage", f"tensor storages the strategies list ({device.type}; declared, not measured)", None
    try:
        meter = meters.for_device(device)
    except ledger.Unavailable as e:
        if requested == "allocator":
            raise InputError(
                f"--memory: allocator cannot be read here ({e}); allowed: auto, trace, storage, none"
            ) from None
        if requested == "trace":
            return "trace", f"allocator trace ({device.type})", None
        return "storage", f"tensor storages the strategies list (declared, not measured: {e})", None
    if requested == "trace":
        return "trace", f"allocator trace ({device.type}), auditing the {meter.name}", meter
    return "allocator", meter.name, meter


def step_summary(steps: list[dict]) -> dict | None:
    """Means over the decode steps of the step figures (`Report.step_figures`), ms."""
    if not steps:
        return None
    n = len(steps)
    names = sorted({name for step in steps for name in step["measurement_ms"]})
    ops = sorted({op for step in steps for op in step["engine_ms"]})
    return {
        "steps": n,
        "wall_ms_mean": sum(s["step_ms"] for s in steps) / n,
        "lanes_ms_mean": sum(sum(s["lanes_ms"].values()) for s in steps) / n,
        "shared_ms_mean": sum(s["shared_ms"] for s in steps) / n,
        "measurement_ms_mean": sum(sum(s["measurement_ms"].values()) for s in steps) / n,
        "measurement_by_instrument_ms_mean": {
            name: sum(s["measurement_ms"].get(name, 0.0) for s in steps) / n for name in names
        },
        "engine_ms_mean": sum(sum(s["engine_ms"].values()) for s in steps) / n,
        "engine_by_op_ms_mean": {op: sum(s["engine_ms"].get(op, 0.0) for s in steps) / n for op in ops},
        "unattributed_ms_mean": sum(s["unattributed_ms"] for s in steps) / n,
        "measurement_ms_per_step": [round(sum(s["measurement_ms"].values()), 3) for s in steps],
    }
