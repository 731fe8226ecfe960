"""`python -m kvdirect_app.cli.prepare_models NAME...` (`make install` runs it): load each preset once (float32),
so its kept copy (`models.model_cache`) is there before the first run.  It lives here, above `models`, because it
drives `load_model`, which itself reads the kept copies: in `model_cache` it made an import circle."""

from __future__ import annotations

import sys

from ..models.loading import ModelError, load_model


def prepare(names: list[str]) -> int:
    code = 0
    for name in names:
        try:
            loaded = load_model(name, dtype="float32", device="cpu", progress=lambda m: print(m, file=sys.stderr))
            print(f"{name}: {loaded.source}")
        except ModelError as e:
            print(f"{name}: {e}", file=sys.stderr)
            code = 2
    return code


if __name__ == "__main__":
    raise SystemExit(prepare(sys.argv[1:]))
