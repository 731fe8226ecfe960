"""The tokenizer of a model preset, without loading the model (for generating task samples and for tests)."""

from __future__ import annotations

from functools import lru_cache

from transformers import AutoTokenizer

from ...models import model_cache
from ...models.loading import DTYPES, ModelError, byte_tokenizer, gguf_location
from ...plain.catalog import presets
from .haystack import SampleError


@lru_cache(maxsize=None)
def tokenizer_for(preset: str):
    """A preset's tokenizer: the model cache's copy where `make install` left one (under a second), else read
    from the preset's GGUF file (seconds); a tiny preset's byte-level tokenizer.  Shared: do not modify it."""
    table = presets()
    if preset not in table:
        raise SampleError(f"preset: {preset!r} is not allowed; allowed: {', '.join(table)}")
    p = table[preset]
    if p["kind"] == "tiny":
        return byte_tokenizer()
    for dtype in DTYPES.values():  # every dtype's copy holds the same tokenizer files
        folder = model_cache.folder(preset, p, dtype)
        if folder is not None and (folder / "tokenizer.json").is_file():
            return AutoTokenizer.from_pretrained(folder)
    location = gguf_location(p)
    if location is None:
        raise ModelError(
            f"model: {preset}'s tokenizer ships in the package {p['package']}, which is not "
            f"installed; install it: {p['install']}"
        )
    path, file = location
    return AutoTokenizer.from_pretrained(str(path), gguf_file=file)
