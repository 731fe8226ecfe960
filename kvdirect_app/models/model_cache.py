"""A local copy of what loading an embedded GGUF preset produces, so that later loads are fast and flat.

Loading a GGUF file costs twice: time (transformers parses the file's
metadata for the config, for the tokenizer and for the weights, then
dequantises every tensor: 26-37 s for SmolLM2 here) and memory (the
dequantised state dict and the model's own weights are alive at once: the
process peaks ~250 MiB above what it holds afterwards, more than any run of a
small cache adds, so `/usr/bin/time` saw the load, not the run).

The first load of a preset writes, into one folder per (preset, package
version, transformers and torch versions, dtype):

* ``config.json``, ``generation_config.json`` and the tokenizer's files
  (`save_pretrained`);
* ``weights.pt``: every parameter and buffer (`torch.save`).

Later loads build the model on the meta device (no memory), then assign the
weights straight from the file mapped into memory (`torch.load(mmap=True)`,
`load_state_dict(assign=True)`): nothing is copied or dequantised, the
weights' pages are read as the first forward touches them, and the load's
peak RSS is what the process holds after it.  The tensors are the ones the
GGUF load produced, bit for bit (`tests/models/test_models.py` compares them).

`KVDIRECT_MODEL_CACHE` names the folder (default: ``$XDG_CACHE_HOME`` or
``~/.cache``, then ``kvdirect-studio/models``); ``KVDIRECT_MODEL_CACHE=off``
turns it off.  A folder that cannot be written is not an error: the model
loads from the GGUF file and the log says why nothing was kept.
`make install` prepares the cache of both embedded presets
(``python -m kvdirect_app.cli.prepare_models smollm2-135m gemma3-270m``).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from importlib import metadata
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from ..plain.paths import cache

CACHE_ENV = "KVDIRECT_MODEL_CACHE"
WEIGHTS = "weights.pt"
MANIFEST = "manifest.json"
FORMAT = 1  # bump when the folder's layout changes


def root() -> Path | None:
    """The folder, or None when it is turned off (`paths.cache`)."""
    return cache(CACHE_ENV, "models")


def _version(package: str) -> str:
    try:
        return metadata.version(package.replace("_", "-"))
    except metadata.PackageNotFoundError:
        return "unknown"


def manifest(name: str, preset: dict, dtype: torch.dtype) -> dict:
    """What a cached copy must have been made from to be used: any change makes a new folder."""
    return {
        "format": FORMAT,
        "preset": name,
        "package": preset["package"],
        "package_version": _version(preset["package"]),
        "file": preset["file"],
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "dtype": str(dtype).removeprefix("torch."),
    }


def folder(name: str, preset: dict, dtype: torch.dtype) -> Path | None:
    base = root()
    if base is None:
        return None
    m = manifest(name, preset, dtype)
    return base / f"{name}-{m['package_version']}-tf{m['transformers']}-torch{m['torch']}-{m['dtype']}"


def present(path: Path | None, want: dict) -> bool:
    try:
        return path is not None and json.loads((path / MANIFEST).read_text()) == want and (path / WEIGHTS).is_file()
    except (OSError, ValueError):
        return False


def save(model: torch.nn.Module, tokenizer, path: Path, want: dict) -> str | None:
    """Write the model's copy (atomically: a temporary folder renamed into place); None, or why nothing was kept."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=".incomplete-", dir=path.parent))
    except OSError as e:
        return f"the model cache {path.parent} cannot be written ({e.strerror})"
    try:
        model.config.save_pretrained(work)
        model.generation_config.save_pretrained(work)
        tokenizer.save_pretrained(work)
        tensors = {
            **dict(model.named_parameters(remove_duplicate=False)),
            **dict(model.named_buffers(remove_duplicate=False)),
        }
        torch.save({k: v.detach() for k, v in tensors.items()}, work / WEIGHTS)
        (work / MANIFEST).write_text(json.dumps(want, indent=1))
        if path.exists():
            shutil.rmtree(path)
        work.rename(path)
    except OSError as e:
        shutil.rmtree(work, ignore_errors=True)
        return f"the model cache {path} could not be written ({e.strerror or e})"
    return None


def load(path: Path, dtype: torch.dtype):
    """(model, tokenizer) from a cached copy: the model built on the meta device, its weights assigned from the
    file mapped into memory."""
    config = AutoConfig.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tensors = torch.load(path / WEIGHTS, mmap=True, weights_only=True)
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    model.load_state_dict({k: v for k, v in tensors.items() if k in params}, strict=False, assign=True)
    for name, _ in model.named_buffers(remove_duplicate=False):  # non-persistent ones too (RoPE frequencies)
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._buffers[leaf] = tensors[name]
    model.tie_weights()
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise ValueError(f"the cached copy in {path} lacks {', '.join(left[:3])}")
    model.generation_config = GenerationConfig.from_pretrained(path)
    return model.eval(), tokenizer
