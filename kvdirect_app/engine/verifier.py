"""`strategy_cache(..., verify=True)`'s check (`integration.py`): what a cache hands attention, bit for bit and row by
row, against what a full cache fed the same new K/V in the same run hands it (`Verifier`).  Its figures are the
report's `verified`."""

from __future__ import annotations

import time

import torch

from ..measure.memory import harness
from ..models import compat


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers of its width (so -0.0 differs from 0.0 and a NaN equals its own bits)."""
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _rows_differing(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(T,) True where token row t of a and b (1, H, T, d) differs in any bit."""
    return (_bits(a) != _bits(b)).any(dim=-1).any(dim=1)[0]


class Verifier:
    """Checks what a cache hands attention against what a full cache would hand it in the same run.

    A shadow `DynamicCache` (the model's own layer types: sliding layers keep their window) is fed the new
    K/V the model computes at each layer, the same tensors the strategy gets; what it hands attention is the
    full cache's K/V of this run, old tokens included.  Each layer's handed K/V are compared with it bit for
    bit, token row by token row.  Equal at every layer of every forward means attention read exactly what it
    would have read with the full cache, so the run is the full cache's run.

    A layer that hands attention fewer rows than the full cache (an eviction strategy once it has evicted)
    cannot be lined up row by row: its rows are counted as missing, none of them as checked (they are the
    stored K/V of the tokens it kept: nothing there was rebuilt).  Costs a full cache's K/V (dropped when the
    block ends) and one compare per layer and forward, on its own timer.
    """

    def __init__(self, model: torch.nn.Module):
        self.shadow = compat.DynamicCache(config=model.config)
        self.checked = self.rebuilt = self.mismatched = self.missing = 0
        self.first_mismatch: dict | None = None
        self.seconds = 0.0

    def expect(self, key_states: torch.Tensor, value_states: torch.Tensor, layer: int):
        """The full cache's K/V for this layer after this forward's new `key_states`/`value_states`."""
        t0 = time.perf_counter()
        with harness():
            out = self.shadow.update(key_states, value_states, layer)
        self.seconds += time.perf_counter() - t0
        return out

    def check(
        self, forward: int, layer: int, keys: torch.Tensor, values: torch.Tensor, expected, rebuilt: int, end: int
    ):
        """`keys`/`values` (1, H, T, d) handed to attention at `layer` in forward `forward`, whose first `rebuilt`
        rows were rebuilt or replayed; `end`: tokens seen after this forward (row T-1 is token end-1)."""
        t0 = time.perf_counter()
        rk, rv = expected
        with harness():
            if keys.shape != rk.shape or values.shape != rv.shape:
                heads_dims = keys.shape[:-2] == rk.shape[:-2] and keys.shape[-1] == rk.shape[-1]
                if heads_dims and values.shape[-2] == keys.shape[-2] < rk.shape[-2]:  # fewer rows: evicted
                    self.missing += rk.shape[-2] - keys.shape[-2]
                else:
                    self.mismatched += rk.shape[-2]
                    self._first(forward, layer, None, False, f"shape {tuple(keys.shape)} != {tuple(rk.shape)}")
            else:
                rows = rk.shape[-2]
                self.checked += rows
                self.rebuilt += rebuilt
                if not (torch.equal(_bits(keys), _bits(rk)) and torch.equal(_bits(values), _bits(rv))):
                    bad = _rows_differing(keys, rk) | _rows_differing(values, rv)
                    self.mismatched += int(bad.sum())
                    row = int(bad.nonzero()[0, 0])
                    dk = float((keys[..., row, :].float() - rk[..., row, :].float()).abs().max())
                    dv = float((values[..., row, :].float() - rv[..., row, :].float()).abs().max())
                    self._first(forward, layer, end - rows + row, row < rebuilt, f"max |dK| {dk:g}, max |dV| {dv:g}")
        self.seconds += time.perf_counter() - t0

    def _first(self, forward: int, layer: int, token: int | None, rebuilt: bool, what: str):
        if self.first_mismatch is None:
            self.first_mismatch = {"forward": forward, "layer": layer, "token": token, "rebuilt": rebuilt, "what": what}

    def close(self):
        """Drop the shadow (a full cache's K/V); the counts stay for `report`."""
        self.shadow = None

    def report(self) -> dict:
        return {
            "checked_token_layers": self.checked,
            "rebuilt_token_layers": self.rebuilt,
            "mismatched_token_layers": self.mismatched,
            "missing_token_layers": self.missing,
            "exact": self.checked > 0 and self.mismatched == 0 and self.missing == 0,
            "first_mismatch": self.first_mismatch,
        }
