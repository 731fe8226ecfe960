"""Tests of `kvdirect_app.claims`: the verdicts of `bench reproduce`, their rendering, and the claims' own
benchmarks (recompute against read, the real-size run)."""
