#!/usr/bin/env bash
# The README's results table: every shipped config, plus transformers' greedy generate and prompt
# lookup, on the first GSM8K problems, on this machine's CPU. Interleaved and resumable: rerun the
# same command after an interruption. The table lands in $OUT/results.md (and on stdout).
#
#   scripts/bench_readme.sh                          # LIMIT=30 MAX_NEW_TOKENS=256 OUT=runs/readme-gsm8k
#   LIMIT=5 scripts/bench_readme.sh --set runtime.threads=2
set -euo pipefail
cd "$(dirname "$0")/.."

configs=(configs/ar.yaml configs/eagle3.yaml configs/adaptivespec-dynamic.yaml
         configs/adaptivespec-lossy.yaml configs/adaptivespec.yaml)
# TALON and FLy are plugins (plugins/adaptivespec-talon, plugins/adaptivespec-fly): included when installed.
python -c "import adaptivespec_talon" 2>/dev/null && configs+=(configs/talon.yaml)
python -c "import adaptivespec_fly" 2>/dev/null && configs+=(configs/fly.yaml)

exec adaptivespec bench --configs "${configs[@]}" --peers hf-generate,hf-prompt-lookup \
    --dataset gsm8k --limit "${LIMIT:-30}" --max-new-tokens "${MAX_NEW_TOKENS:-256}" \
    --out "${OUT:-runs/readme-gsm8k}" "$@"
