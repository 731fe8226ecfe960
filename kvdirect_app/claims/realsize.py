"""Exactness at real sizes: random weights at a public config, every exact lane against the full cache.

The papers verify bit-exact K/V on their real models; the project's tests verify two small real models and tiny
random families.  Whether a rebuild gives the full cache's bits depends on shapes and kernels (the GEMMs' row
counts, the attention's reductions, the norms), not on trained values, so a model built at a public config
(`presets/configs/*.json`: Qwen2.5-0.5B, Llama 3.2-1B, Qwen3-4B, Gemma 3-4B) with seeded random weights runs
the very kernels the real one would, at its real widths, depths, head counts and vocabulary.  What it cannot
show is anything about the text: the tokens are noise, and their agreement says the rebuilt state gave the same
logits, nothing more.  Every result says so in its `label`.

`measure` builds the model (`random_model`), feeds a seeded prompt of random token ids and decodes greedily
through the studio's own engine (`engine.Engine`, one turn given its ids, as `bench run --context N` does),
with the lanes

* ``full`` (the reference),
* ``kvdirect:budget=B``,
* ``anchorkv:spacing=s*:budget=B:rebuild=step`` (s*: the break-even spacing with a token-id anchor, as
  `reproduce.plan` computes it),
* ``anchorkv:spacing=L:budget=B:rebuild=step`` (one anchor: the deepest replay),

under the allocator trace (``memory="trace"``), and returns per lane whether its K/V were bit-equal to the full
cache's where the lane handed them to attention (`kv_exact`), how many token-layers it rebuilt (an exactness
check counts only where this is above 0), whether its tokens equal the full cache's, and whether the
allocator's held bytes equal the strategy's formula at every step and after the turn.

The weights (`random_model`): the family's module tree built by transformers without its initialisation (a
4B model's per-module init takes minutes on two cores), then every parameter filled in a fixed order from one
seeded generator: a normal of the config's `initializer_range` (0.02) for every matrix, embedding and bias,
and each norm's weight set to its identity (ones for a plain RMSNorm, zeros for Gemma's ``(1 + w)`` form,
found by what the norm does rather than by family name); the input embedding is then divided by the scale the
family applies to it (Gemma's sqrt(d); `fill_random` says why).  With that spread each layer's output is of the
order of the residual it is added to, so the layers matter to the logits and greedy tokens vary with the
context (`distinct_new_tokens` in the result says how much).  A multimodal config (Gemma 3's ``gemma3``) is built from
its text part.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from ..engine.runner import Engine
from ..models import compat
from ..models.geometry import ModelGeometry, load_config
from ..models.loading import LoadedModel, resolve_device, resolve_dtype
from ..plain import rss
from ..plain.catalog import PRESETS_DIR
from ..plain.errors import UserError
from ..strategies import parse_specs

LABEL = "random weights at the real config"
SEED = 1234
BUDGET = 32  # the hot K/V window of every rebuilding lane (reproduce.plan's budget for real models)
CONFIGS_DIR = PRESETS_DIR / "configs"


class RealSizeError(UserError):
    """A config that cannot be built, or a setting out of range; the message names the allowed values."""


def config_path(config: str) -> Path:
    """A config.json path, or the name of one in `presets/configs/` (``qwen3-4b``)."""
    path = Path(config)
    if path.is_file():
        return path
    bundled = CONFIGS_DIR / f"{config}.json"
    if bundled.is_file():
        return bundled
    names = ", ".join(sorted(p.stem for p in CONFIGS_DIR.glob("*.json")))
    raise RealSizeError(f"config: no file {config!r} and no bundled config of that name; bundled: {names}")


def text_config(path: Path):
    """The decoder's config from a config.json (a multimodal config's text part), with no special token ids:
    the prompt is random ids and decoding stops at the token limit alone."""
    cfg = compat.text_config(load_config(json.loads(path.read_text())))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(cfg, key, None)
    return cfg


def id_tokenizer(vocab_size: int):
    """A word-level tokenizer over the whole vocabulary, id i written ``<i>``, built in memory: lets the engine
    show (and a test read) any id the model can emit; it has no special tokens."""
    tok = Tokenizer(WordLevel(vocab={f"<{i}>": i for i in range(vocab_size)}, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def _norm_identity(module: torch.nn.Module) -> float:
    """The weight at which a norm leaves its normalised input unscaled: 1 for ``x * w``, 0 for Gemma's
    ``x * (1 + w)``, told apart by running the norm once with a zero weight (and a zero shift, if it has one)."""
    weight = module.weight
    with torch.no_grad():
        weight.zero_()
        if isinstance(getattr(module, "bias", None), torch.Tensor):
            module.bias.zero_()
        x = torch.linspace(-1.0, 1.0, weight.shape[-1], dtype=weight.dtype, device=weight.device)[None]
        return 0.0 if bool(module(x).abs().sum() > 0) else 1.0


def embedding_scale(model: torch.nn.Module) -> float:
    """What the family multiplies a token's embedding by before layer 0 (Gemma: sqrt(d); most families: 1), read
    off the embedding module's output for one id."""
    emb = model.get_input_embeddings()
    with torch.no_grad():
        row = emb.weight[0].float()
        out = emb(torch.zeros(1, 1, dtype=torch.long, device=emb.weight.device))[0, 0].float()
        return float(out.norm() / row.norm()) if float(row.norm()) > 0 else 1.0


def fill_random(model: torch.nn.Module, seed: int, std: float) -> dict:
    """Every parameter from one seeded generator, in `named_parameters` order (tied weights once): norms at their
    identity (a shift at zero), everything else normal(0, std); then the input embedding divided by the family's
    embedding scale.  Returns how many elements were filled how, and the scale.

    Why the division: layer 0 then sees embeddings of the same size in every family.  Gemma multiplies its
    embedding by sqrt(d) (50.6 at d 2560): at std 0.02 the token's own embedding is a large part of the last
    residual, and with the head tied to the embedding its own logit stands about 6 standard deviations above
    the others, past the largest of 262k random logits: measured at Gemma 3 4B's config, 35 of 40 prompt
    positions predicted their own token and greedy decoding repeated one id.  Divided, none did and the 8 greedy
    tokens were all different.  Families with a scale of 1 are untouched."""
    counts = {"normal": 0, "norm_ones": 0, "norm_zeros": 0}
    at_identity = set()
    with torch.no_grad():
        for module in model.modules():
            if "Norm" in type(module).__name__ and isinstance(getattr(module, "weight", None), torch.nn.Parameter):
                value = _norm_identity(module)
                module.weight.fill_(value)
                counts["norm_ones" if value else "norm_zeros"] += module.weight.numel()
                at_identity.update(id(p) for p in module.parameters(recurse=False))
        gen = torch.Generator(device="cpu").manual_seed(seed)
        for p in model.parameters():
            if id(p) not in at_identity:
                p.normal_(0.0, std, generator=gen)
                counts["normal"] += p.numel()
        scale = embedding_scale(model)
        if abs(scale - 1.0) > 1e-3:
            model.get_input_embeddings().weight.div_(scale)
    counts["embedding_scale"] = scale
    return counts


def random_model(config: str, dtype: str = "bfloat16", device: str = "cpu", seed: int = SEED) -> LoadedModel:
    """The model of a public config with seeded random weights (the module docstring says how), wrapped as the
    engine takes it, with a tokenizer over its whole vocabulary."""
    path = config_path(config)
    torch_dtype, dev = resolve_dtype(dtype), resolve_device(device)
    cfg = text_config(path)
    with compat.no_init_weights():  # the module tree only: every parameter is filled below, once
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch_dtype)
    model.tie_weights()  # skipped with the init: the head is the embedding again where the config ties them
    std = float(getattr(cfg, "initializer_range", 0.02) or 0.02)
    filled = fill_random(model, seed, std)
    model = model.to(dev).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    scaled = filled["embedding_scale"]
    source = (
        f"{LABEL}: {path.name}, seed {seed}, normal(0, {std:g}) weights"
        + (f" (the embedding's divided by its scale {scaled:.4g})" if abs(scaled - 1.0) > 1e-3 else "")
        + f", norms at identity ({filled['norm_ones']:,} ones, {filled['norm_zeros']:,} zeros)"
    )
    name = f"{path.stem} (random weights)"
    return LoadedModel(name, model, id_tokenizer(cfg.vocab_size), False, source, dev, torch_dtype)


def lanes(num_layers: int, spacing: int, budget: int) -> list[str]:
    """The four lanes' specs (three when the break-even spacing is the number of layers)."""
    return list(
        dict.fromkeys(
            [
                "full",
                f"kvdirect:budget={budget}",
                f"anchorkv:spacing={spacing}:budget={budget}:rebuild=step",
                f"anchorkv:spacing={num_layers}:budget={budget}:rebuild=step",
            ]
        )
    )


def prompt_ids(vocab_size: int, tokens: int, seed: int = SEED) -> list[int]:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, vocab_size, (tokens,), generator=gen).tolist()


def lane_verdict(r: dict, reference: dict, is_reference: bool) -> dict:
    """One lane of the engine's results, reduced to the four checks and their figures."""
    sb = r["state_bytes"]
    last = r["turns"][-1]
    audit = sb.get("meter_audit") or {}
    bytes_match = (
        sb["formula_matches_measurement"] is True
        and last["between_turns"] is not None
        and last["between_turns"] == last["formula_between_turns"]
    )
    out = {
        "reference": is_reference,
        "kv_exact": r["kv_exact"],
        "max_abs_dk": r["max_abs_dk"],
        "max_abs_dv": r["max_abs_dv"],
        "layers_compared": r["layers_compared"],
        "rebuilt_token_layers": r["rebuilt_token_layers"],
        "tokens_equal": r["token_ids"] == reference["token_ids"],
        "token_ids": r["token_ids"],
        "first_divergence": r["first_divergence"],
        "held_bytes": last["between_turns"],  # the allocator's, after the turn
        "formula_bytes": last["formula_between_turns"],
        "bytes_match": bytes_match,  # at every step and after the turn
        "byte_mismatches": sb["mismatch_count"],
        "peak_bytes": sb["peak"],
        "formula_peak_bytes": sb["formula_peak"],
        "meter_audit_mismatches": audit.get("held_mismatches"),
        "claims_exact": r["claims_exact"],
        "exact_unavailable": r["exact_unavailable"],
        "mode": r["mode"],
        "kernels": r["kernels"],
        "latency_ms": r["latency_ms"],
    }
    out["exact"] = bool(
        out["kv_exact"]
        and out["tokens_equal"]
        and bytes_match
        and (is_reference or (out["rebuilt_token_layers"] or 0) > 0)
    )
    return out


def _check(prompt_tokens: int, new_tokens: int, threads: int | None, budget: int):
    if prompt_tokens < 2:
        raise RealSizeError(f"prompt_tokens: {prompt_tokens} must be >= 2")
    if new_tokens < 1:
        raise RealSizeError(f"new_tokens: {new_tokens} must be >= 1")
    if threads is not None and threads < 1:
        raise RealSizeError(f"threads: {threads} must be >= 1")
    if not 1 <= budget < prompt_tokens:
        raise RealSizeError(
            f"budget: {budget} must be >= 1 and below prompt_tokens ({prompt_tokens}), so that old K/V are rebuilt"
        )


def measure(
    config: str,
    dtype: str,
    prompt_tokens: int = 300,
    new_tokens: int = 8,
    threads: int | None = None,
    budget: int = BUDGET,
    seed: int = SEED,
    device: str = "cpu",
) -> dict:
    """Build `config` with random weights, run the four lanes on one random prompt, free the model; the verdict.

    Returns plain data: the model (name, config file, type, dtype, parameters, layers, s*), the run (device,
    threads, kernels mode and report, determinism, prompt and new tokens, budget, seed), the time (build, engine
    turn, total, s), the process's peak RSS (VmHWM, and the engine's own reading), whether the reference's last
    logits were finite and how many distinct ids it generated, `lanes` (spec -> `lane_verdict`) and `exact` (every
    lane's checks held).
    """
    _check(prompt_tokens, new_tokens, threads, budget)
    started = time.perf_counter()
    loaded = random_model(config, dtype, device, seed)
    try:
        built = time.perf_counter()
        cfg = loaded.config
        geom = ModelGeometry.from_config(cfg, loaded.dtype)
        spacing = geom.break_even_spacing(token_id_anchor=True) or geom.num_layers
        specs = lanes(geom.num_layers, spacing, budget)
        if prompt_tokens + new_tokens >= loaded.max_context:
            raise RealSizeError(
                f"prompt_tokens: {prompt_tokens} + {new_tokens} new tokens pass the model's context "
                f"of {loaded.max_context}"
            )
        ids = prompt_ids(cfg.vocab_size, prompt_tokens, seed)
        engine = Engine(
            loaded, parse_specs(",".join(specs)), max_new_tokens=new_tokens, threads=threads, memory="trace"
        )
        turn_started = time.perf_counter()
        for _ in engine.turn(f"{prompt_tokens} random token ids", ids=ids):
            pass
        ran = time.perf_counter()
        result = engine.results()
        logits = engine.reference.logits
        finite = bool(torch.isfinite(logits).all()) if logits is not None else None
        reference = result["strategies"]["full"]
        verdicts = {spec: lane_verdict(r, reference, spec == "full") for spec, r in result["strategies"].items()}
        out = {
            "label": LABEL,
            "model": config_path(config).stem,
            "config": config_path(config).name,  # the file's name, never this machine's path
            "model_type": cfg.model_type,
            "dtype": result["dtype"],
            "parameters": sum(p.numel() for p in loaded.model.parameters()),
            "layers": geom.num_layers,
            "layer_types": sorted({layer.layer_type for layer in geom.layers}),
            "break_even_spacing": spacing,
            "budget": budget,
            "seed": seed,
            "prompt_tokens": prompt_tokens,
            "new_tokens": new_tokens,
            "device": result["device"],
            "threads": result["threads"],
            "kernels_mode": result["kernels"]["mode"],
            "kernels": result["kernels"],
            "determinism": result["determinism"],
            "memory_instrument": result["memory_instrument"],
            "model_source": loaded.source,
            "logits_finite": finite,
            "distinct_new_tokens": len(set(reference["token_ids"])),
            "lanes": verdicts,
            "exact": all(v["exact"] for v in verdicts.values()),
            "seconds": {"build": built - started, "engine_setup": turn_started - built, "turn": ran - turn_started},
            "decode_step_ms_mean": (result["steps"] or {}).get("wall_ms_mean"),
            "engine_rss_peak_bytes": result["process_rss_peak_bytes"],
        }
    finally:
        del loaded
        engine = None
        gc.collect()
        rss.trim()
    out["seconds"]["total"] = time.perf_counter() - started
    out["process_rss_peak_bytes"] = rss.peak()  # VmHWM: the build included
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m kvdirect_app.claims.realsize CONFIG DTYPE [--prompt-tokens N] [--new-tokens N] [--threads N]
    [--json PATH]``: one measurement, printed as a table and written as JSON."""
    p = argparse.ArgumentParser(prog="python -m kvdirect_app.claims.realsize", description=__doc__.splitlines()[0])
    p.add_argument(
        "config",
        help="a config.json, or a bundled config's name: "
        + ", ".join(sorted(x.stem for x in CONFIGS_DIR.glob("*.json"))),
    )
    p.add_argument("dtype", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--prompt-tokens", type=int, default=300)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--threads", type=int)
    p.add_argument("--budget", type=int, default=BUDGET)
    p.add_argument("--json")
    args = p.parse_args(argv)
    try:
        out = measure(args.config, args.dtype, args.prompt_tokens, args.new_tokens, args.threads, args.budget)
    except UserError as e:
        print(f"error: {e}")
        return 2
    print(
        f"{out['model']} ({out['label']}), {out['parameters']:,} parameters, {out['dtype']}, {out['device']}, "
        f"{out['threads']} thread(s), kernels {out['kernels_mode']}, prompt {out['prompt_tokens']} ids, "
        f"{out['new_tokens']} new; s* = {out['break_even_spacing']}, L = {out['layers']}"
    )
    print(
        "seconds: "
        + ", ".join(f"{k} {v:.1f}" for k, v in out["seconds"].items())
        + f"; peak RSS {out['process_rss_peak_bytes'] / 2**30:.2f} GiB"
    )
    for spec, v in out["lanes"].items():
        print(
            f"  {spec:45s} kv_exact={v['kv_exact']} rebuilt={v['rebuilt_token_layers']} "
            f"tokens_equal={v['tokens_equal']} held={v['held_bytes']} formula={v['formula_bytes']} "
            f"bytes_match={v['bytes_match']} -> {'EXACT' if v['exact'] else 'NOT EXACT'}"
        )
    print(
        f"all exact: {out['exact']}; logits finite: {out['logits_finite']}; distinct new ids: "
        f"{out['distinct_new_tokens']}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0 if out["exact"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
