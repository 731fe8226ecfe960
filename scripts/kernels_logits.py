"""How far the invariant kernels move the reference: max |Δlogit| between `native` and `invariant` full-cache runs.

    python scripts/kernels_logits.py [--model smollm2-135m] [--tokens 48] [--prompt TEXT]

Runs the full cache alone in each mode on the same prompt, keeps the logits of every step (prompt's last
position and each decoded token) and, where the two runs chose the same tokens (they must, for the numbers
to compare like for like), prints the largest absolute difference and the mean over steps.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import kvdirect_app  # noqa: E402,F401
from kvdirect_app.engine import (  # noqa: E402
    Engine,
    lockstep,  # noqa: E402
    run_to_end,
)
from kvdirect_app.models import load_model  # noqa: E402
from kvdirect_app.strategies import parse_specs  # noqa: E402


def logits_of(loaded, kernels: str, prompt: str, tokens: int):
    seen = []
    original = lockstep.run_batch

    def recording(model, rows, *args, **kwargs):
        wall = original(model, rows, *args, **kwargs)
        seen.extend(row.logits.clone() for row in rows)
        return wall

    lockstep.run_batch = recording
    try:
        import kvdirect_app.engine.forwards as forwards

        forwards.run_batch = recording
        result = run_to_end(
            Engine(loaded, parse_specs("full"), max_new_tokens=tokens, kernels=kernels, memory="none"), [prompt]
        )
    finally:
        lockstep.run_batch = original
        forwards.run_batch = original
    return result, torch.stack(seen)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--prompt", default="Why is the sky blue?")
    args = ap.parse_args()
    loaded = load_model(args.model, dtype="float32", device="cpu")
    a, la = logits_of(loaded, "native", args.prompt, args.tokens)
    b, lb = logits_of(loaded, "invariant", args.prompt, args.tokens)
    ta, tb = a["strategies"]["full"]["token_ids"], b["strategies"]["full"]["token_ids"]
    same = ta == tb
    n = min(len(la), len(lb))
    diff = (la[:n] - lb[:n]).abs()
    print(
        f"{args.model}: {n} steps, tokens identical: {same}; kernels ran: {a['kernels']['mode']} / "
        f"{b['kernels']['mode']}"
    )
    print(
        f"max |Δlogit| {diff.max().item():.3e}, mean over steps of the per-step max {diff.amax(-1).mean().item():.3e}, "
        f"logit scale (max |logit|) {la.abs().max().item():.1f}"
    )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
