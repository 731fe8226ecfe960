"""Tests of `kvdirect_app.engine`: lanes in lockstep, the numbers the engine reports, the strategies inside
transformers' `generate`, the attention view."""
