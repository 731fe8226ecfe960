"""What the benchmark commands share: bad-input errors, number settings checked where they are parsed, the
conversation options, JSON output."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..engine.runner import MEMORY_MODES, PREFILL_CHUNK
from ..models.loading import DEVICES, DTYPES
from ..plain.errors import UserError
from ..plain.schema import stamp


class CliError(UserError):
    """Bad input to a command; printed as one line, exit status 2."""


def whole(low: int | None = None, high: int | None = None, what: str = ""):
    """An argparse type: a whole number within low..high (either end open), else one line saying what is allowed
    (argparse prefixes it with the option's name); nothing is ever replaced by a default."""
    span = (
        f"{low}..{high}"
        if low is not None and high is not None
        else f">= {low}"
        if low is not None
        else f"<= {high}"
        if high is not None
        else "any"
    )
    allowed = f"allowed: whole numbers {span}" + (f" ({what})" if what else "")

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; {allowed}") from None
        if (low is not None and value < low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{value} is not allowed; {allowed}")
        return value

    parse.__name__ = "whole number"
    return parse


THREADS = whole(1, None, "torch threads")
WORKERS = whole(1, None, "processes")
TOKENS = whole(1, None, "tokens")


def add_conversation_options(p: argparse.ArgumentParser):
    """The options `run` and `sweep` share: the model, the conversation, the device, timing and memory."""
    p.add_argument("--model", default="smollm2-135m", help="preset name, Hub id or local path")
    p.add_argument("--prompt", help="one user message (a chat model's template is applied)")
    p.add_argument("--prompt-file", help="a file holding one user message")
    p.add_argument("--scenario", help="a scripted conversation from presets/scenarios.toml")
    p.add_argument(
        "--context",
        type=TOKENS,
        help="one turn of exactly this many tokens of the long-document preset, fed raw (a context of a known length)",
    )
    p.add_argument("--raw", action="store_true", help="feed the text as is, without the chat template")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=64,
        help="new tokens per turn, at most (checked against this run's cap with every other setting)",
    )
    p.add_argument("--dtype", default="float32", help=f"one of {', '.join(DTYPES)}")
    p.add_argument("--device", default="auto", help=f"one of {', '.join(DEVICES)}")
    p.add_argument(
        "--threads", type=THREADS, default=None, help="torch threads, pinned for every forward (default: torch's)"
    )
    p.add_argument(
        "--memory",
        default="auto",
        help=f"one of {', '.join(MEMORY_MODES)}: auto (the default) is "
        "allocator where it can be read, else storage, and says why; allocator: each lane's held bytes and "
        "peak measured by the allocator its tensors live in (the CPU allocator's ledger, CUDA's caching "
        "allocator); trace: every allocation traced (slow; it audits the allocator's figures); storage: "
        "the tensors each strategy lists (declared, not measured); none: the formula only",
    )
    p.add_argument(
        "--no-instruments",
        action="store_true",
        help="every instrument off (memory, K/V comparison, twins, agreement, snapshots, digests, RSS): "
        "the lanes alone, for timing what the strategies cost",
    )
    p.add_argument(
        "--sequential",
        action="store_true",
        help="run the lanes of a step one after another instead of in one batched pass (same bits)",
    )
    p.add_argument(
        "--no-twins",
        action="store_true",
        help="no teacher-forced twins: agreement and KL stop at a strategy's first divergence",
    )
    p.add_argument(
        "--prefill-chunk",
        type=TOKENS,
        default=PREFILL_CHUNK,
        help="a prompt longer than this is fed in pieces of this many tokens",
    )
    p.add_argument(
        "--kernels",
        default="invariant",
        help="invariant (the default where the probe passes: every "
        "linear one GEMM of a proven row count, block attention; a rebuild or replay is one GEMM per layer) "
        "or native (the model's own kernels; exact replay repeats the original shapes)",
    )


def write_json(path: str | None, data: dict, kind: str):
    """Write a results file of `kind`, stamped with its schema id and version (kvdirect_app/plain/schema.py)."""
    if path:
        Path(path).write_text(json.dumps(stamp(kind, data), indent=1))
        print(f"\nwrote {path}")
