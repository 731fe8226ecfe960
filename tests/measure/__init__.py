"""Tests of `kvdirect_app.measure`: the meters, the bytes measured, the instruments that watch the lanes."""
