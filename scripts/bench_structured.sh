#!/usr/bin/env bash
# Structured output side by side on the `structured` set (docs/structured-output.md): constrained plain
# decoding (ar), the grammar source alone (grammar), hybrid (head + retrieval + grammar) and hybrid
# without the grammar source, one interleaved bench run, per category. Every prompt is constrained by
# its own JSON schema. Run it alone on the machine:
#   scripts/bench_structured.sh [OUT] [extra bench args, e.g. --per-category 3 --max-new-tokens 128]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/bench-structured}; shift || true
mkdir -p "$out/configs"
# the same config without the grammar source (generation.grammar_draft: false)
python - configs/hybrid.yaml "$out/configs/hybrid-no-grammar.yaml" <<'PY'
import sys, yaml
data = yaml.safe_load(open(sys.argv[1]))
data.setdefault("generation", {})["grammar_draft"] = False
open(sys.argv[2], "w").write(yaml.safe_dump(data, sort_keys=False))
PY
OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} adaptivespec bench --dataset structured --set runtime.threads=2 \
  --configs configs/ar.yaml configs/grammar.yaml configs/hybrid.yaml "$out/configs/hybrid-no-grammar.yaml" \
  --out "$out" "$@"
