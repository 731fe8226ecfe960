"""Checks of the papers' claims, each measured on the running machine: the claims as data (`papers`), the one
verdict rule (`verdicts`), one builder per claim (`sections/`), the measurements only the claims need (`recompute`
with `recompute_report`, `patching`, `realsize`), `bench reproduce`'s plan and results (`reproduce`, torch-free)
and its cells run (`cells`), and the report (`render`)."""
