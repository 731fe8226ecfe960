"""What each lane keeps of each token and where its last prompt query looked: the token maps and attention snapshots
the page draws (part of `Engine`: `engine.py`)."""

from __future__ import annotations


class LaneMaps:
    """Per lane and layer, the state of every token (kept, rebuilt, evicted) and the attention snapshot."""

    def token_map(self, label: str, layer: int) -> dict:
        """Per fed token of a strategy's free run at `layer`: its text and what is kept of it
        ("kv", "residual", "anchor", "replayed" (rebuilt from an anchor below), "evicted"), as plain lists."""
        lane = self.reference if label == self.reference.label else next(l for l in self.lanes if l.label == label)
        states = lane.cache.layers[layer].token_states()
        pieces = [self.loaded.tokenizer.decode([t]) for t in lane.history[:len(states)]]
        return {"tokens": pieces, "states": states}

    def token_maps(self) -> dict:
        """Every layer's token states of every shown lane: {label: {"tokens": [...], "states": [[...] per layer]}}."""
        out = {}
        for label in self.show:
            first = self.token_map(label, 0)
            layers = len(self.reference.cache.layers)
            out[label] = {"tokens": first["tokens"],
                          "states": [first["states"]] + [self.token_map(label, i)["states"] for i in range(1, layers)]}
        return out

    def attention_map(self, label: str, layer: int) -> dict | None:
        """The attention snapshot of a shown lane at `layer`: the last query of the latest turn's prompt (what reads
        the question), heads averaged (`lockstep.last_query_attention`); None before the first turn.

        {"position": p, "turn": t (1-based), "tokens": [p + 1 token texts], "weights": [p + 1 entries]}, an entry
        the weight in [0, 1] of a position the layer handed attention, None for one it did not (evicted, or
        outside a sliding window); the weights sum to 1."""
        lane = self.reference if label == self.reference.label else next(l for l in self.lanes if l.label == label)
        snap = lane.attention
        if snap is None:
            return None
        p = snap["position"]
        handed, probs = snap["layers"][layer]
        return {"position": p, "turn": snap["turn"],
                "tokens": [self.loaded.tokenizer.decode([t]) for t in lane.history[:p + 1]],
                "weights": [float(w) if h else None for h, w in zip(handed.tolist(), probs.tolist())]}

    def attention_maps(self) -> dict:
        """Every shown lane's snapshot at every layer: {label: {"position", "turn", "tokens", "layers": [weights
        per layer]}}; lanes without a snapshot are left out."""
        out = {}
        for label in self.show:
            first = self.attention_map(label, 0)
            if first is None:
                continue
            layers = [first["weights"]] + [self.attention_map(label, j)["weights"]
                                            for j in range(1, len(self.reference.cache.layers))]
            out[label] = {"position": first["position"], "turn": first["turn"], "tokens": first["tokens"],
                          "layers": layers}
        return out
