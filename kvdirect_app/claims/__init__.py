"""Checks of the papers' claims, one module per claim, each measured on the running machine."""
