"""Replaying a run of one-token decode steps as one layer call, bit for bit (native kernels only).

With `--kernels invariant` (the default where the probe passes) none of this runs: a row's bits do not depend
on the call there, so a replay is one ordinary call over all old tokens (`kernels.py`).

A decode step computes each token as a one-row forward: its projections are
one-row GEMMs and its attention is one query over the keys before it.  An
exact replay must repeat exactly those shapes (docs/measurement.md, "Kernels"), so a
naive replay of `m` decoded tokens calls the decoder layer `m` times, and on
a CPU the Python and dispatch overhead of those calls dominates.

`rows(...)` runs the `m` tokens through the layer in one call and keeps the
shapes of each row:

* every `F.linear` on the `(1, m, d)` input is computed row by row
  (`replay.linear_rows`: one `bmm` with each row as its own batch element,
  where a check on this device proved it bit-equal to one-row calls; a loop
  of one-row calls otherwise);
* the attention call is the model's own attention function called once per
  row, with that row's query, the keys up to and including it, and the mask
  a one-token step at that position gets: the same call the decode step made.
  The model's attention modules look the function up by name in
  transformers' attention registry, so the replay registers one more name
  there (`kvdirect_rows`) and points the layer's config at it for that call
  only, under the model's lock;
* everything else in a decoder layer (norms, RoPE, activations, residual
  adds) works on each row alone.

Whether the whole thing gives the same bits as separate calls is checked on
the first run of rows for each layer type (`LayerReplayer`); where it does
not, the replay keeps separate calls and says so.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..models import compat

ROWS_IMPLEMENTATION = "kvdirect_rows"
_LOCAL = threading.local()  # .context: the RowsContext of the layer call in progress on this thread


@dataclass
class RowsContext:
    """One layer call over `m` decoded tokens at positions start..start+m-1."""

    start: int
    m: int
    attention: Callable  # the model's own attention function
    mask_for: Callable[[int], torch.Tensor | None]  # position -> the mask a one-token step there gets
    linear_rows: Callable  # (linear weight, bias, rows (m, d)) -> (m, out), each row as its own GEMM


class _RowLinear(TorchFunctionMode):
    """Every `F.linear` over m > 1 rows becomes m one-row GEMMs."""

    def __init__(self, context: RowsContext):
        super().__init__()
        self.context = context

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if x.dim() == 3 and x.shape[0] == 1 and x.shape[1] == self.context.m and self.context.m > 1:
                return self.context.linear_rows(weight, bias, x[0]).unsqueeze(0)
        return func(*args, **kwargs)


def rows_attention(module, query, key, value, attention_mask, **kwargs):
    """The registered attention function: the model's own, once per row, as the decode steps called it."""
    context: RowsContext = _LOCAL.context
    first = key.shape[-2] - context.m  # keys before the first row
    outputs, weights = [], None
    for i in range(context.m):
        end = first + i + 1
        out, weights = context.attention(
            module,
            query[:, :, i : i + 1],
            key[..., :end, :],
            value[..., :end, :],
            context.mask_for(context.start + i),
            **kwargs,
        )
        outputs.append(out)
    return torch.cat(outputs, dim=1), weights


@contextlib.contextmanager
def rows(config, context: RowsContext):
    """Run the layer call inside with `context`'s rows kept apart (see the module docstring)."""
    compat.register_attention(ROWS_IMPLEMENTATION, rows_attention)
    _LOCAL.context = context
    try:
        with compat.attention_implementation(config, ROWS_IMPLEMENTATION), _RowLinear(context):
            yield
    finally:
        _LOCAL.context = None
