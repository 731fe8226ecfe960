"""The memory guard: before a run, its peak bytes from the geometry; a run that would not fit is refused.

The estimate, per lane (the full-cache reference and every strategy, with a
teacher-forced twin for each lossy one): the strategy's own formulas for
the state at the run's last token plus the largest transient of a step (the
prompt's pieces and the last decode step), plus the activations of one
forward of that lane (hidden states, MLP, attention scores over the whole
context, one row of logits).  Weights count only if the model is not loaded
yet.  Available memory is the least of what the OS says is available
(psutil), the container's cgroup headroom, CUDA's free memory on a GPU, and
`KVDIRECT_MEMORY_LIMIT` (an operator's cap, e.g. "2GiB").  A run fits when
its estimate times `HEADROOM` is at most that.  The estimate is a bound the
tests hold against the allocator's measurement of the same run.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch

from ..kernels.invariant import ATTENTION_ROWS_BYTES, BLOCK
from ..models import compat
from ..models.geometry import ModelGeometry
from ..plain.errors import UserError
from ..plain.units import fmt_bytes
from ..strategies import Strategy
from ..strategies.base import Forward
from ..strategies.full import Full

LIMIT_ENV = "KVDIRECT_MEMORY_LIMIT"
HEADROOM = 1.25  # what the estimate leaves out: allocator slack, Python objects, the page's own figures
LANE_SLACK = 256 * 2**10  # per lane: small tensors no formula lists (positions, masks, kept indices)
UNITS = {
    "": 1,
    "b": 1,
    "k": 1e3,
    "kb": 1e3,
    "kib": 2**10,
    "m": 1e6,
    "mb": 1e6,
    "mib": 2**20,
    "g": 1e9,
    "gb": 1e9,
    "gib": 2**30,
    "t": 1e12,
    "tb": 1e12,
    "tib": 2**40,
}


class MemoryRefused(UserError):
    """A run the guard refuses; the message holds the estimate and what is available."""


@dataclass
class Estimate:
    weights: int  # 0 when the model is already loaded (its bytes are already taken)
    lanes: dict[str, int] = field(default_factory=dict)  # label -> state + transient + activations of its forward
    tokens: int = 0

    @property
    def total(self) -> int:
        return self.weights + sum(self.lanes.values())

    def describe(self) -> str:
        top = sorted(self.lanes.items(), key=lambda kv: -kv[1])[:4]
        parts = ", ".join(f"{label} {fmt_bytes(b)}" for label, b in top)
        more = f" and {len(self.lanes) - len(top)} more" if len(self.lanes) > len(top) else ""
        weights = f"weights {fmt_bytes(self.weights)}; " if self.weights else ""
        return f"{fmt_bytes(self.total)} at {self.tokens:,} tokens ({weights}{parts}{more})"


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text or "")
    if not m or m.group(2).lower() not in UNITS:
        raise UserError(
            f"{LIMIT_ENV}: {text!r} is not a size; allowed: a number with an optional unit "
            "(B, KB, MB, GB, KiB, MiB, GiB), e.g. 2GiB"
        )
    return int(float(m.group(1)) * UNITS[m.group(2).lower()])


def _cgroup_headroom() -> int | None:
    """Bytes the container may still take (cgroup v2, then v1); None where there is no limit."""
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            limit = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 2**60:
            return max(0, int(limit) - usage)
    return None


def available(device: torch.device) -> tuple[int, str]:
    """Bytes a run may take now, and where that figure comes from."""
    options = []
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        options.append((free, "CUDA free memory"))
    else:
        options.append((psutil.virtual_memory().available, "available RAM"))
        headroom = _cgroup_headroom()
        if headroom is not None:
            options.append((headroom, "the container's memory limit"))
    if os.environ.get(LIMIT_ENV, "").strip():
        options.append((parse_size(os.environ[LIMIT_ENV]), f"{LIMIT_ENV}={os.environ[LIMIT_ENV].strip()}"))
    return min(options)


def activation_bytes(
    config, geom: ModelGeometry, q: int, context: int, scores: int = 0, replayed: int = 0, block: bool = False
) -> int:
    """One forward of `q` new tokens over `context` tokens: residual stream and norms, MLP, q/k/v/o, one row of
    logits (float32); with eager attention (every query) or a strategy that scores by attention (`scores`
    queries: all of a piece for H2O, SnapKV's window, TOVA's last), the fp32 scores, their masked copy and
    their softmax (SDPA's kernels work in blocks and never hold them: measured, a 1,024-token piece over
    2,000 tokens of SmolLM2 stays below this bound); `replayed` old tokens run through a layer (AnchorKV's
    replay).  `block`: the invariant kernels' block attention replaces the model's (eager) one."""
    cfg = compat.text_config(config)
    b = geom.bytes_per_element
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    inter = getattr(cfg, "intermediate_size", 4 * cfg.hidden_size)
    per_token = (8 * cfg.hidden_size + 4 * inter + 2 * heads * head_dim) * b
    scores = q if getattr(config, "_attn_implementation", None) == "eager" and not block else scores
    # Replay runs old rows through one layer at a time: measured, about two MLP-wide and two hidden rows per old token
    # stay live.
    return (
        q * per_token
        + replayed * 2 * (inter + cfg.hidden_size) * b
        + 3 * heads * scores * context * 4
        + 2 * cfg.vocab_size * 4
    )


def block_attention_bytes(config, geom: ModelGeometry, queries: int, context: int) -> int:
    """The invariant kernels' attention beyond what the model's own attention holds, bounded by the block attention's
    (off the CPU): over `queries` (a chunk of them at a time, `kernels` bounds it) and `context` keys, two copies of
    its scores (masked, then exponentiated), and the blocks' P@V and their running sum (float32).  The CPU's
    fixed-order attention holds less (one row of scores per thread and its output), so the guard stays above it."""
    cfg = compat.text_config(config)
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    keys = -(-context // BLOCK) * BLOCK + BLOCK
    scores = min(heads * queries * keys * 4, ATTENTION_ROWS_BYTES + heads * keys * 4 * 4)  # the last chunk's
    return 2 * scores + 2 * scores * head_dim // BLOCK


def lane_bytes(
    strategy: Strategy,
    config,
    geom: ModelGeometry,
    prompt: int,
    tokens: int,
    chunk: int,
    kernels: str = "invariant",
    shares_prompt: bool = False,
    turns: int = 1,
) -> int:
    """State + transient + activations at the run's two worst moments: the last prompt piece, the last step.
    `shares_prompt`: lanes whose first prompt is the reference's get its attention computed once, by the
    reference (lockstep); only their own replays count then."""
    pieces = [
        Forward(min(chunk, prompt - start), prompt=True, open=start + chunk < prompt)
        for start in range(0, prompt, chunk)
    ]
    forwards = pieces + [Forward(1)] * max(0, tokens - prompt)
    # The last piece sees the most tokens; a full-sized piece has the most rows (bounded together, conservatively).
    q = pieces[-1].q
    worst = 0
    for before, size, last, n in (
        (prompt - q, pieces[0].q, prompt, len(pieces)),
        (tokens - 1, 1, tokens, len(forwards)),
    ):
        state = strategy.formula_persistent(geom, last, forwards[:n])
        transient = strategy.formula_transient(geom, before, size, turn_start=before == 0, forwards=forwards[:n])
        # AnchorKV with rebuild=step replays the old tokens at every forward; rebuild=turn at the start of a later
        # turn, bounded here by its last moment
        rebuild = getattr(strategy, "rebuild", None) if hasattr(strategy, "anchor_layers") else None
        replayed = before if rebuild == "step" or (rebuild == "turn" and turns > 1 and n > len(pieces)) else 0
        scored = strategy.scored_queries(size) if getattr(strategy, "needs_attention", False) else 0
        act = activation_bytes(config, geom, size, last, scored, replayed, block=kernels == "invariant")
        if kernels == "invariant":
            own = replayed if shares_prompt and n == len(pieces) else max(size, replayed)
            act += block_attention_bytes(config, geom, own, last) if own else 0
        worst = max(worst, state + transient + act)
    return worst + LANE_SLACK


def estimate(
    config,
    dtype: torch.dtype,
    strategies: list[Strategy],
    prompt: int,
    tokens: int,
    chunk: int,
    twins: bool = True,
    compare: bool = True,
    weights: int = 0,
    kernels: str = "invariant",
    turns: int = 1,
    saved_context: bool = False,
) -> Estimate:
    """The run's peak: `prompt` tokens read in pieces of `chunk`, then up to `tokens` in all, over `turns` turns;
    `saved_context`: the engine keeps a copy of every lane's state after the prompt (`Engine.turn(save_context=)`)."""
    geom = ModelGeometry.from_config(config, dtype)
    lanes = list(strategies)
    if compare and not any(s.spec() == Full().spec() for s in lanes):
        lanes.insert(0, Full())
    out = Estimate(weights, tokens=tokens)
    for i, s in enumerate(lanes):
        out.lanes[s.label] = lane_bytes(
            s, config, geom, prompt, tokens, chunk, kernels, shares_prompt=compare and i > 0, turns=turns
        )
        if compare and twins and not s.claims_exact and s.spec() != Full().spec():
            out.lanes[f"{s.label} (twin)"] = out.lanes[s.label]
        if saved_context:
            pieces = [
                Forward(min(chunk, prompt - start), prompt=True, open=start + chunk < prompt)
                for start in range(0, prompt, chunk)
            ]
            out.lanes[f"{s.label} (saved context)"] = s.formula_persistent(geom, prompt, pieces)
    return out


def check(est: Estimate, device: torch.device) -> Estimate:
    """Refuse, with the numbers, a run whose estimate (with headroom) exceeds the memory available now."""
    free, source = available(device)
    if est.total * HEADROOM > free:
        raise MemoryRefused(
            f"memory: this run would need about {est.describe()}, x{HEADROOM} headroom = "
            f"{fmt_bytes(int(est.total * HEADROOM))}, but {fmt_bytes(free)} is free ({source}); allowed: a run "
            "that fits: fewer tokens, fewer strategies, or a strategy that holds less during a turn "
            "(AnchorKV at a deep spacing with rebuild=step)"
        )
    return est


def model_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())
