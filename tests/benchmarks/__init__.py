"""Tests of `kvdirect_app.benchmarks`: the task suite, the executors, the conformance kit."""
