"""What each lane keeps of each token and where its last prompt query looked: the token maps and attention snapshots
the page draws.  Plain functions of a lane and the tokenizer (`Engine.token_maps` and its kin pass them in), so that
what a map reads is named where it is called."""

from __future__ import annotations

from .lanes import Lane


def token_map(lane: Lane, tokenizer, layer: int) -> dict:
    """Per fed token of the lane's free run at `layer`: its text and what is kept of it
    ("kv", "residual", "anchor", "replayed" (rebuilt from an anchor below), "evicted"), as plain lists."""
    states = lane.cache.layers[layer].token_states()
    pieces = [tokenizer.decode([t]) for t in lane.history[: len(states)]]
    return {"tokens": pieces, "states": states}


def token_maps(shown: dict[str, Lane], tokenizer, layers: int) -> dict:
    """Every layer's token states of every shown lane (label -> lane, in the order shown):
    {label: {"tokens": [...], "states": [[...] per layer]}}."""
    out = {}
    for label, lane in shown.items():
        first = token_map(lane, tokenizer, 0)
        out[label] = {
            "tokens": first["tokens"],
            "states": [first["states"]] + [token_map(lane, tokenizer, i)["states"] for i in range(1, layers)],
        }
    return out


def attention_map(lane: Lane, tokenizer, layer: int) -> dict | None:
    """The lane's attention snapshot at `layer`: the last query of the latest turn's prompt (what reads the
    question), heads averaged (`lockstep.last_query_attention`); None before the first turn.

    {"position": p, "turn": t (1-based), "tokens": [p + 1 token texts], "weights": [p + 1 entries]}, an entry
    the weight in [0, 1] of a position the layer handed attention, None for one it did not (evicted, or
    outside a sliding window); the weights sum to 1."""
    snap = lane.attention
    if snap is None:
        return None
    p = snap["position"]
    handed, probs = snap["layers"][layer]
    return {
        "position": p,
        "turn": snap["turn"],
        "tokens": [tokenizer.decode([t]) for t in lane.history[: p + 1]],
        "weights": [float(w) if h else None for h, w in zip(handed.tolist(), probs.tolist())],
    }


def attention_maps(shown: dict[str, Lane], tokenizer, layers: int) -> dict:
    """Every shown lane's snapshot at every layer (label -> lane, in the order shown): {label: {"position", "turn",
    "tokens", "layers": [weights per layer]}}; lanes without a snapshot are left out."""
    out = {}
    for label, lane in shown.items():
        first = attention_map(lane, tokenizer, 0)
        if first is None:
            continue
        out[label] = {
            "position": first["position"],
            "turn": first["turn"],
            "tokens": first["tokens"],
            "layers": [first["weights"]] + [attention_map(lane, tokenizer, j)["weights"] for j in range(1, layers)],
        }
    return out
