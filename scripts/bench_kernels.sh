#!/usr/bin/env bash
# Issue 17's benchmark figures, one after another on a quiet machine (docs/perf.md, "Kernels").
# Usage: scripts/bench_kernels.sh OUTDIR [TOKENS]
set -euo pipefail
OUT=${1:?output folder}; N=${2:-64}
mkdir -p "$OUT"
PY=${PY:-.venv/bin/python}
P="Why is the sky blue?"
SEVEN=full,kvdirect:budget=64,anchorkv:spacing=30:budget=64:rebuild=step,h2o:budget=64,streaming_llm:budget=64,snapkv:budget=64,tova:budget=64
run() { local name=$1; shift; "$PY" -m kvdirect_app.bench run --model smollm2-135m "$@" --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1; }
run full_native_none --prompt "$P" --strategies full --max-new-tokens "$N" --kernels native --memory none
run full_invariant_none --prompt "$P" --strategies full --max-new-tokens "$N" --kernels invariant --memory none
for k in native invariant; do
  run seven_${k}_trace --prompt "$P" --strategies "$SEVEN" --max-new-tokens "$N" --kernels $k
  run seven_${k}_none --prompt "$P" --strategies "$SEVEN" --max-new-tokens "$N" --kernels $k --memory none
done
for k in native invariant; do
  run capitals_${k} --scenario capitals --strategies full,anchorkv:anchors=0:budget=16:rebuild=step --kernels $k --memory none
done
# The compute floor of a replay: one prefill over as many tokens (ttft of a one-token run on a prompt that long).
for n in 64 128 256; do
  run prefill_${n}_invariant --context $n --strategies full --max-new-tokens 1 --kernels invariant --memory none
done
