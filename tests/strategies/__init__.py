"""Tests of `kvdirect_app.strategies`: each family's exactness or eviction rule, the contract the engine holds
them to, and the table of every strategy's spec that the other tests share (tests/specs.py)."""
