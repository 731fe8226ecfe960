"""What the benchmark commands share: bad-input errors, the conversation options, JSON output."""

from __future__ import annotations

from ..errors import UserError
from ..schema import stamp
import argparse
import json
from pathlib import Path

from ..engine import MEMORY_MODES, PREFILL_CHUNK
from ..kernels import MODES as KERNEL_MODES
from ..models import DEVICES, DTYPES
from ..scenarios import scenarios

DEFAULT_PROMPT = "Explain in a few sentences why the sky is blue."


class CliError(UserError):
    """Bad input to a command; printed as one line, exit status 2."""


def add_conversation_options(p: argparse.ArgumentParser):
    """The options `run` and `sweep` share: the model, the conversation, the device, timing and memory."""
    p.add_argument("--model", default="smollm2-135m", help="preset name, Hub id or local path")
    p.add_argument("--prompt", help="one user message (a chat model's template is applied)")
    p.add_argument("--prompt-file", help="a file holding one user message")
    p.add_argument("--scenario", help="a scripted conversation from presets/scenarios.toml")
    p.add_argument("--context", type=int, help="one turn of exactly this many tokens of the long-document preset, "
                                                "fed raw (a context of a known length)")
    p.add_argument("--raw", action="store_true", help="feed the text as is, without the chat template")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--dtype", default="float32", help=f"one of {', '.join(DTYPES)}")
    p.add_argument("--device", default="auto", help=f"one of {', '.join(DEVICES)}")
    p.add_argument("--threads", type=int, default=None, help="torch threads, pinned for every forward (default: torch's)")
    p.add_argument("--memory", default="storage", help=f"one of {', '.join(MEMORY_MODES)}: bytes counted from the "
                   "storages of each cache's tensors (the default, cheap), measured by the allocator (every forward "
                   "traced; it audits the storage count), or the formula only")
    p.add_argument("--no-instruments", action="store_true",
                   help="every instrument off (memory, K/V comparison, twins, agreement, snapshots, digests, RSS): "
                        "the lanes alone, for timing what the strategies cost")
    p.add_argument("--sequential", action="store_true",
                   help="run the lanes of a step one after another instead of in one batched pass (same bits)")
    p.add_argument("--no-twins", action="store_true",
                   help="no teacher-forced twins: agreement and KL stop at a strategy's first divergence")
    p.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK,
                   help="a prompt longer than this is fed in pieces of this many tokens")
    p.add_argument("--kernels", default="invariant", help="invariant (the default where the probe passes: every "
                   "linear one GEMM of a proven row count, block attention; a rebuild or replay is one GEMM per layer) "
                   "or native (the model's own kernels; exact replay repeats the original shapes)")


def turns_from_args(args) -> tuple[list[str], bool]:
    """User turns and whether to feed them raw."""
    given = [x for x in (args.prompt is not None, args.prompt_file is not None, args.scenario is not None,
                         getattr(args, "context", None) is not None) if x]
    if len(given) > 1:
        raise CliError("give only one of --prompt, --prompt-file, --scenario, --context")
    if getattr(args, "context", None) is not None:
        return [f"({args.context} tokens of the long-document preset)"], True
    if args.prompt_file is not None:
        path = Path(args.prompt_file)
        if not path.is_file():
            raise CliError(f"--prompt-file: no such file {args.prompt_file!r}")
        return [path.read_text(encoding="utf-8")], args.raw
    if args.scenario is not None:
        table = scenarios()
        if args.scenario not in table:
            raise CliError(f"--scenario: unknown scenario {args.scenario!r}; allowed: {', '.join(table)}")
        scenario = table[args.scenario]
        return list(scenario["turns"]), args.raw or scenario.get("raw", False)
    return [DEFAULT_PROMPT if args.prompt is None else args.prompt], args.raw


def checked_run(args, specs: str, turns: list[str], raw: bool, compare: bool = True):
    """Every setting through `validate` (the same checks as the app and the API), the model loaded, then the
    memory guard.  Returns (request, loaded model, memory estimate, first turn's ids or None)."""
    from .. import guard, validate
    from ..models import load_model
    from ..prompts import Prompter, filler_ids

    validate.integer("threads", 1 if args.threads is None else args.threads, 1, 4096)
    validate.integer("prefill_chunk", args.prefill_chunk, 1, 1 << 20)
    if args.memory not in MEMORY_MODES:
        raise CliError(f"memory: {args.memory!r} is not allowed; allowed: {', '.join(MEMORY_MODES)}")
    if args.kernels not in KERNEL_MODES:
        raise CliError(f"kernels: {args.kernels!r} is not allowed; allowed: {', '.join(KERNEL_MODES)}")
    req = validate.request(args.model, args.device, args.dtype, specs, args.max_new_tokens, turns, raw)
    loaded = load_model(req.model, dtype=req.dtype, device=req.device)
    ids = None
    if getattr(args, "context", None) is not None:
        validate.integer("context", args.context, 2, loaded.max_context - 1 - req.max_new_tokens,
                         "the model's context less max_new_tokens")
        ids = filler_ids(loaded.tokenizer, args.context)
    total = validate.against_model(req, loaded, prompt_tokens=None if ids is None else len(ids))
    prompt = len(ids) if ids is not None else len(Prompter(loaded, raw).first(turns[0]))
    est = guard.estimate(loaded.config, loaded.dtype, list(req.strategies), prompt, total, args.prefill_chunk,
                         twins=not args.no_twins, compare=compare, turns=len(turns), kernels=args.kernels)
    if getattr(args, "dry_run", False):
        free, source = guard.available(loaded.device)
        verdict = "fits" if est.total * guard.HEADROOM <= free else "does NOT fit"
        print(f"memory estimate: {est.describe()}; free {guard.fmt_bytes(free)} ({source}): {verdict}")
    guard.check(est, loaded.device)
    return req, loaded, est, ids


def write_json(path: str | None, data: dict, kind: str):
    """Write a results file of `kind`, stamped with its schema id and version (kvdirect_app/schema.py)."""
    if path:
        Path(path).write_text(json.dumps(stamp(kind, data), indent=1))
        print(f"\nwrote {path}")


def engine_options(args) -> dict:
    """The Engine keywords the conversation options set."""
    return dict(max_new_tokens=args.max_new_tokens, threads=args.threads, memory=args.memory,
                batch=not args.sequential, twins=not args.no_twins, prefill_chunk=args.prefill_chunk,
                kernels=args.kernels, instruments=not args.no_instruments)
