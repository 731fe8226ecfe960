"""Residual patching: is the residual stream entering a layer the only state the rest of the model reads?

KV-Direct's claim: "cross-task residual patching at every layer produces D_KL = 0 between patched and original
output distributions, confirming that the residual stream satisfies a Markov property and is the sole
information-carrying state".

`measure(loaded)` takes two prompts of different tasks (a donor and a recipient, cut to the same number of
tokens so that positions line up) and, for every layer l:

* **patched**: the recipient's forward with the donor's residual stream entering layer l put in place of its own
  at every position; its next-token distributions (every position) against the donor's own forward.  If
  everything from layer l on reads only that stream (and the positions), the two are the same computation on
  the same numbers: KL 0 (in float64) and max |Δlogit| 0 at every layer.
* **control**: the same patch at the last position only, read at that position.  The earlier positions keep the
  recipient's stream, so attention at layer l and above reads other keys and values: the KL must be above 0, at
  every layer.  It shows
  that the measurement can fail; where it does not (KL 0 with a one-position patch), the patched figure proves
  nothing and the claim is not measured.

Plain forwards without a cache, the model's own kernels, on the device the model is on.
"""

from __future__ import annotations

import time

import plotly.graph_objects as go
import torch

from ..models import compat
from ..models.threads import pin

DONOR = (
    "Translate into French, word by word, and keep the punctuation: the old lighthouse keeper climbs the "
    "stairs every evening to light the lamp, and the ships pass safely through the narrow strait."
)
RECIPIENT = (
    "Write a Python function that returns the sum of the squares of the even numbers in a list, "
    "with a docstring, two examples and a test that checks an empty list gives zero."
)


def _kl(reference: torch.Tensor, other: torch.Tensor) -> float:
    """max over the given positions of KL(reference || other), in float64, from logits (positions, vocab)."""
    p = torch.log_softmax(reference.double(), dim=-1)
    q = torch.log_softmax(other.double(), dim=-1)
    return float((p.exp() * (p - q)).sum(-1).max())


def _ids(loaded) -> tuple[torch.Tensor, torch.Tensor]:
    tok = loaded.tokenizer
    a, b = tok.encode(DONOR), tok.encode(RECIPIENT)
    n = min(len(a), len(b))
    device = loaded.device
    return torch.tensor([a[:n]], device=device), torch.tensor([b[:n]], device=device)


def measure(loaded, threads: int | None = None) -> dict:
    """KL and max |Δlogit| per layer, patched at every position and (the control) at the last only.

    Returns a JSON-ready dict: model, dtype, device, tokens, per-layer rows {layer, kl, max_abs_dlogit,
    control_kl, control_max_abs_dlogit}, and the worst of each.
    """
    previous = torch.get_num_threads()
    if threads:
        pin(threads)
    try:
        return _measure(loaded, threads or previous)
    finally:
        pin(previous)


def _measure(loaded, threads: int) -> dict:
    model = loaded.model
    layers = compat.decoder_layers(model)
    donor, recipient = _ids(loaded)
    inputs: list[torch.Tensor] = []

    def capture(module, args, kwargs):
        inputs.append((args[0] if args else kwargs["hidden_states"]).clone())

    def forward(ids):
        with torch.inference_mode():
            return model(input_ids=ids, use_cache=False).logits[0]

    t0 = time.perf_counter()
    handles = [layer.register_forward_pre_hook(capture, with_kwargs=True) for layer in layers]
    try:
        reference = forward(donor)
    finally:
        for h in handles:
            h.remove()
    rows = []
    for index, layer in enumerate(layers):
        row = {"layer": index}
        for name, last_only in (("", False), ("control_", True)):

            def patch(module, args, kwargs, given=inputs[index], last_only=last_only):
                hidden = args[0] if args else kwargs["hidden_states"]
                if last_only:
                    hidden = hidden.clone()
                    hidden[:, -1] = given[:, -1]
                else:
                    hidden = given.clone()
                if args:
                    return (hidden, *args[1:]), kwargs
                return args, {**kwargs, "hidden_states": hidden}

            handle = layer.register_forward_pre_hook(patch, with_kwargs=True)
            try:
                logits = forward(recipient)
            finally:
                handle.remove()
            # The control is read where it patched (the last position): the earlier positions keep the recipient's
            # own stream and differ trivially.
            ours, theirs = (reference[-1:], logits[-1:]) if last_only else (reference, logits)
            row[f"{name}kl"] = _kl(ours, theirs)
            row[f"{name}max_abs_dlogit"] = float((ours.float() - theirs.float()).abs().max())
        rows.append(row)
    return {
        "model": loaded.name,
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "device": str(loaded.device),
        "threads": threads,
        "tokens": donor.shape[1],
        "layers": len(layers),
        "kernels": "the model's own (plain forwards, no cache)",
        "seconds": time.perf_counter() - t0,
        "rows": rows,
        "max_kl": max(r["kl"] for r in rows),
        "max_abs_dlogit": max(r["max_abs_dlogit"] for r in rows),
        "min_control_kl": min(r["control_kl"] for r in rows),
    }


def figure(results: list[dict], model: str):
    """KL per layer for the report's model and the real (not tiny) models: every position patched (0 at every
    layer where the claim holds) and the control (the last position only); the tiny families are in the table."""
    fig = go.Figure()
    for r in [r for r in results if r["model"] == model or not r["model"].startswith("tiny-")]:
        layers = [row["layer"] for row in r["rows"]]
        fig.add_trace(
            go.Scatter(
                x=layers,
                y=[row["control_kl"] for row in r["rows"]],
                mode="lines+markers",
                name=f"{r['model']}: last position only (control)",
                line=dict(dash="dot"),
            )
        )
        fig.add_trace(
            go.Scatter(
                x=layers,
                y=[row["kl"] for row in r["rows"]],
                mode="lines+markers",
                name=f"{r['model']}: every position patched",
            )
        )
    fig.update_layout(
        title="Residual patching: KL(donor || patched) per layer, float64",
        xaxis=dict(title="layer whose input is patched"),
        yaxis=dict(title="KL (patched: max over positions; control: last position)"),
        font=dict(size=16),
        template="plotly_white",
    )
    return fig
