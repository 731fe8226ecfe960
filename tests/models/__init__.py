"""Tests of `kvdirect_app.models`: loading the presets, and geometry from a config alone."""
