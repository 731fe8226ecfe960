"""Tests of `kvdirect_app.strategies`: each family's exactness or eviction rule, and the contract the engine
holds them to."""
