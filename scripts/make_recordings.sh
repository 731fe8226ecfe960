#!/usr/bin/env bash
# The recordings shipped in presets/recordings/, each made by one `bench record` command (the page's default
# panes).  The recall and long-document ones with AnchorKV and KV-Direct at rebuild=step (every old token rebuilt at
# every step: the least memory); the twenty turns at 24 new tokens each (as the claims report's full run) with
# rebuild=turn (the papers' mode and the page's live default: old K/V rebuilt once per turn, anchors between turns),
# since at rebuild=step AnchorKV replays the whole conversation, past 1,000 tokens, at every step (over an hour here).
# Run from the repository root:  bash scripts/make_recordings.sh [NAME...]
set -euo pipefail
PY=${PYTHON:-.venv/bin/python}
OUT=presets/recordings
declare -A CMD=(
  [recall-smollm2-135m]="--model smollm2-135m --scenario recall"
  [long-document-gemma3-270m]="--model gemma3-270m --scenario long-document"
  [twenty-turns-smollm2-135m]="--model smollm2-135m --scenario twenty-turns --max-new-tokens 24 --rebuild turn"
)
names=("$@")
[ ${#names[@]} -eq 0 ] && names=(recall-smollm2-135m long-document-gemma3-270m twenty-turns-smollm2-135m)
for name in "${names[@]}"; do
  echo "== $name" >&2
  $PY -m kvdirect_app.bench record ${CMD[$name]} --out "$OUT/$name.json.gz"
done
