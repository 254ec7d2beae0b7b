#!/usr/bin/env bash
# The README's "Results by category" table: every shipped config (configs/*.yaml, found when the
# script runs), plus transformers' greedy generate and prompt lookup, on Spec-Bench with the same
# number of prompts from each of its six categories, on this machine's CPU. Interleaved and
# resumable: rerun the same command after an interruption. Writes $OUT/results.md (overall table,
# then "By category"), $OUT/category_speedup.png, and $OUT/readme_categories.md: the per-category
# speedup table to paste into the README.
#
#   scripts/bench_categories.sh                      # PER_CATEGORY=5 MAX_NEW_TOKENS=256 OUT=runs/readme-specbench
#   PER_CATEGORY=10 scripts/bench_categories.sh --set runtime.threads=2
set -euo pipefail
cd "$(dirname "$0")/.."

configs=(configs/ar.yaml configs/eagle3.yaml)
for c in configs/*.yaml; do
    case "$c" in configs/ar.yaml|configs/eagle3.yaml) continue ;; esac
    # a config whose strategies come from a plugin that is not installed (TALON, FLy, ...) is left out, and said so
    if python -c "import sys; from adaptivespec.config import load_config; load_config(sys.argv[1])" "$c" 2>/dev/null; then
        configs+=("$c")
    else
        echo "bench_categories: leaving out $c (its strategies are not installed)" >&2
    fi
done

out="${OUT:-runs/readme-specbench}"
adaptivespec bench --configs "${configs[@]}" --peers hf-generate,hf-prompt-lookup \
    --dataset specbench --per-category "${PER_CATEGORY:-5}" --max-new-tokens "${MAX_NEW_TOKENS:-256}" \
    --out "$out" "$@"
# the overview table of "## By category" (speedup vs AR, accept length in brackets), for the README
python - "$out" <<'PY'
import sys
from pathlib import Path

out = Path(sys.argv[1])
lines = (out / "results.md").read_text().splitlines()
start = lines.index("## By category")
note = next(line for line in lines[start:] if line.startswith("Speedup"))
first = next(i for i in range(start, len(lines)) if lines[i].startswith("|"))
end = next((i for i in range(first, len(lines)) if not lines[i].startswith("|")), len(lines))
(out / "readme_categories.md").write_text("\n".join([note, "", *lines[first:end]]) + "\n")
print(f"wrote {out / 'readme_categories.md'}", file=sys.stderr)
PY
