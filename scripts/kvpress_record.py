"""Record what NVIDIA kvpress's presses keep, for the suite to compare ours with (tests/strategies/test_kvpress.py).

Runs in an environment of its own with kvpress installed from the package registry (kvpress pins an older
transformers than the studio; the studio never imports it):

    python3.11 -m venv /some/where/kvpress-venv
    /some/where/kvpress-venv/bin/pip install kvpress==0.5.5 torch==2.13.0
    .venv/bin/python -m kvdirect_app.cli.prepare_models smollm2-135m     # prints the cached copy's folder
    /some/where/kvpress-venv/bin/python scripts/kvpress_record.py --model FOLDER \
        --out tests/strategies/kvpress-0.5.5.json

The model is the studio's cached copy of the embedded SmolLM2 (config, tokenizer and `weights.pt`, the tensors the
GGUF load made), built here by transformers from the same files.  Three contexts are cut from Python's own
documentation (`pydoc_data.topics`: text none of us wrote) to about 500, 750 and 1,000 tokens, each with a question.
For each press (SnapKV, TOVA, KNorm, StreamingLLM, PyramidKV, at kvpress's defaults) at each ratio (0.25, 0.5,
0.75), kvpress's own pipeline runs as its users run it (`pipe(context, question=..., press=...)`: the chat template
split, the context compressed alone, the question and a greedy answer read after); the pipeline leaves the
compressed context in the cache it is handed, and each kept key is found, bit for bit, among the keys of an
uncompressed forward of the same context ids: the positions each layer and KV head kept.  They are written as one
bit per context token (base64), with the ids, the answers and the versions they came from.
"""

from __future__ import annotations

import argparse
import base64
import json
import platform
import sys
from importlib import metadata
from pathlib import Path
from pydoc_data.topics import topics

import kvpress
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache, GenerationConfig, pipeline

# (pydoc topic, words of it, question): about 500, 750 and 1,000 context tokens with SmolLM2's tokenizer.
PROMPTS = [
    ("exceptions", 330, "What happens when an exception is not handled?"),
    ("assignment", 520, "What does an augmented assignment evaluate first?"),
    ("class", 700, "What is executed when a class definition is executed?"),
]
PRESSES = ["snapkv", "tova", "knorm", "streaming_llm", "pyramidkv"]
RATIOS = [0.25, 0.5, 0.75]
MAX_NEW_TOKENS = 24


def press(name: str, ratio: float):
    return {
        "snapkv": kvpress.SnapKVPress,
        "tova": kvpress.TOVAPress,
        "knorm": kvpress.KnormPress,
        "streaming_llm": kvpress.StreamingLLMPress,
        "pyramidkv": kvpress.PyramidKVPress,
    }[name](compression_ratio=ratio)


def load(folder: Path):
    config = AutoConfig.from_pretrained(folder)
    # Eager attention: with SDPA, kvpress's PyramidKVPress fails on the question (its layers hold different numbers of
    # tokens and SDPA's mask is sized by layer 0's); eager slices the mask to each layer.
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    saved = torch.load(folder / "weights.pt", map_location="cpu")
    model.load_state_dict(saved, strict=False)  # the parameters, and the persistent buffers
    for name, buffer in model.named_buffers():  # RoPE's frequencies too, as the GGUF load made them
        if not torch.equal(buffer, saved[name]):
            raise SystemExit(f"{name}: transformers here builds another buffer than the cached copy holds")
    missing = set(dict(model.named_parameters())) - set(saved)
    if missing:
        raise SystemExit(f"the cached copy lacks {sorted(missing)[:3]}")
    model.generation_config = GenerationConfig.from_pretrained(folder)
    model.eval()
    return model, AutoTokenizer.from_pretrained(folder)


def positions(full: DynamicCache, kept: DynamicCache) -> list[list[str]]:
    """Per layer and KV head, the context positions whose keys the compressed cache holds (base64 bits)."""
    out = []
    for layer_full, layer_kept in zip(full.layers, kept.layers):
        heads = []
        for h in range(layer_full.keys.shape[1]):
            where = {row.numpy().tobytes(): i for i, row in enumerate(layer_full.keys[0, h])}
            if len(where) != layer_full.keys.shape[2]:
                raise SystemExit("two context positions have bit-equal keys: positions cannot be told apart")
            bits = bytearray((layer_full.keys.shape[2] + 7) // 8)
            for row in layer_kept.keys[0, h]:
                i = where.get(row.numpy().tobytes())
                if i is None:
                    raise SystemExit("a kept key is none of the context's: the context ids differ from the pipeline's")
                bits[i // 8] |= 1 << (i % 8)
            heads.append(base64.b64encode(bytes(bits)).decode())
        out.append(heads)
    return out


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    args.add_argument("--model", type=Path, required=True, help="the studio's cached copy of smollm2-135m")
    args.add_argument("--out", type=Path, required=True)
    a = args.parse_args()
    torch.manual_seed(0)
    model, tokenizer = load(a.model)
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    prompts = []
    for topic, words, question in PROMPTS:
        context = " ".join(topics[topic].split()[:words])
        ids = pipe.preprocess(context, [question], answer_prefix="", max_context_length=1 << 20)
        context_ids, (question_ids,) = ids["context_ids"], ids["questions_ids"]
        full = DynamicCache()
        with torch.no_grad():
            model.model(input_ids=context_ids, past_key_values=full)
        runs = {}
        for name in PRESSES:
            for ratio in RATIOS:
                cache, failed = DynamicCache(), None
                try:
                    with torch.no_grad():
                        answer = pipe(
                            context,
                            question=question,
                            press=press(name, ratio),
                            cache=cache,
                            max_new_tokens=MAX_NEW_TOKENS,
                        )["answer"]
                except RuntimeError as e:  # PyramidKVPress: its layers' lengths differ, the question's mask fails
                    answer, failed = None, f"{type(e).__name__}: {e}"
                    cache = DynamicCache()  # the context alone, compressed as the pipeline compresses it
                    with torch.no_grad(), press(name, ratio)(model):
                        model.model(input_ids=context_ids, past_key_values=cache)
                runs[f"{name}:{ratio:g}"] = {
                    "answer": answer,
                    **({"answer_failed": failed} if failed else {}),
                    "kept": positions(full, cache),
                }
                print(
                    f"{topic} {name} {ratio:g}: {cache.get_seq_length()} of {context_ids.shape[1]} kept; {answer!r}",
                    file=sys.stderr,
                )
        with torch.no_grad():
            reference = pipe(context, question=question, max_new_tokens=MAX_NEW_TOKENS)["answer"]
        prompts.append(
            {
                "topic": topic,
                "question": question,
                "context_ids": context_ids[0].tolist(),
                "question_ids": question_ids[0].tolist(),
                "answer_full": reference,
                "runs": runs,
            }
        )
    manifest = json.loads((a.model / "manifest.json").read_text())
    a.out.write_text(
        json.dumps(
            {
                "made_by": "scripts/kvpress_record.py",
                "versions": {p: metadata.version(p) for p in ("kvpress", "transformers", "torch")},
                "python": platform.python_version(),
                "model": {k: manifest[k] for k in ("preset", "package", "package_version", "file", "dtype")},
                "max_new_tokens": MAX_NEW_TOKENS,
                "presses": "kvpress's defaults: SnapKVPress and PyramidKVPress window_size=64 kernel_size=5, "
                "StreamingLLMPress n_sink=4",
                "prompts": prompts,
            },
            indent=1,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
