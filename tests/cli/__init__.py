"""Tests of `kvdirect_app.cli`: the `bench` commands' output and errors, the anchor subcommands, the docs' figures."""
