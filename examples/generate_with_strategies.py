"""The strategies inside transformers' own `generate`: the full cache, KV-Direct, AnchorKV and H2O on one prompt.

    python examples/generate_with_strategies.py [--model tiny-llama] [--tokens 24]

Loads a model preset (the embedded SmolLM2 or Gemma 3, or a tiny random model built from its config: no
download), generates greedily with transformers' DynamicCache, then with each strategy's cache, and prints
whether the tokens are the same and what each cache held.
"""

import argparse

import torch

from kvdirect_app import strategy_cache
from kvdirect_app.models import load_model
from kvdirect_app.models.compat import DynamicCache
from kvdirect_app.plain.units import fmt_bytes

SPECS = ["full", "kvdirect:budget=8", "anchorkv:spacing=2:budget=8", "h2o:budget=8"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-llama", help="a preset: tiny-llama, smollm2-135m, gemma3-270m, ...")
    parser.add_argument("--tokens", type=int, default=24)
    args = parser.parse_args()
    loaded = load_model(args.model, dtype="float32", device="cpu")
    model, tokenizer = loaded.model, loaded.tokenizer
    ids = torch.tensor([tokenizer.encode("The locker code is 4127. Please remember it.")])
    greedy = dict(max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False, pad_token_id=0)

    reference = model.generate(ids, cache=DynamicCache(config=model.config), **greedy)[0, ids.shape[1] :].tolist()
    print(f"{args.model}: {len(reference)} tokens with transformers' DynamicCache")
    for spec in SPECS:
        with strategy_cache(model, spec, verify=True) as cache:  # the taps are on the model inside the block only
            out = model.generate(ids, cache=cache, **greedy)[0, ids.shape[1] :].tolist()
        r = cache.report()
        same = sum(a == b for a, b in zip(out, reference))
        print(
            f"  {spec:<28} same tokens {same:>2}/{len(reference)}  held {fmt_bytes(r['bytes']['held_last']):>9} "
            f"(formula {fmt_bytes(r['bytes']['formula_last'])}), between turns "
            f"{fmt_bytes(r['bytes']['formula_between_turns']):>9}  rebuilt {r['rebuilt_token_layers']:>5}, "
            f"evicted {r['evicted_token_layers']:>4} token-layers  verified exact: {r['verified']['exact']}"
        )
        if r["claims_exact"] and (out != reference or not r["verified"]["exact"]):
            raise SystemExit(f"{spec}: an exact strategy handed attention other K/V or generated other tokens")


if __name__ == "__main__":
    main()
