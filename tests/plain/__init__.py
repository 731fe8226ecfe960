"""Tests of `kvdirect_app.plain`, the torch-free layer: the results files' schema."""
