"""Tests of `kvdirect_app.kernels`: the batch-invariant and fixed-order kernels, the probe, the row kernels."""
