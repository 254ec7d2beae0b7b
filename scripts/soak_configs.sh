#!/usr/bin/env bash
# The served soak through every shipped config that `adaptivespec serve` accepts (one server at a time).
#
#   scripts/soak_configs.sh [OUT] [-- adaptivespec soak flags]     # default: runs/soak, 1000 requests, 8 at a time
#
# Configs serve refuses (sources, no drafter) are listed with serve's one-line reason and skipped.
# Writes OUT/<config>/soak.json and soak-rss.png, and OUT/summary.md (one row per config).
set -uo pipefail
out="${1:-runs/soak}"; shift || true
[ "${1:-}" = "--" ] && shift
mkdir -p "$out"
summary="$out/summary.md"
echo "| config | valid completed | bad: 4xx naming the field | 5xx | hangs | RSS growth | state bounded | seconds | verdict |" > "$summary"
echo "|---|---:|---:|---:|---:|---:|---|---:|---|" >> "$summary"
for cfg in configs/*.yaml; do
    name="$(basename "$cfg" .yaml)"
    if ! why="$(adaptivespec serve --config "$cfg" --print-command 2>&1 >/dev/null)"; then
        echo "soak_configs: $name: skipped: ${why#adaptivespec: error: }"
        echo "| $name | not served: ${why#adaptivespec: error: cannot serve } | | | | | | | |" >> "$summary"
        continue
    fi
    adaptivespec soak --config "$cfg" --out "$out/$name" --quiet "$@"
    python - "$out/$name/soak.json" "$name" >> "$summary" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
g = "n/a" if d["rss_growth"] is None else f"{d['rss_growth']:+.1%}"
print(f"| {sys.argv[2]} | {d['valid_completed']}/{d['valid']} | {d['bad_4xx_naming_field']}/{d['bad']} | {d['http_5xx']} | "
      f"{d['hangs']} | {g} | {d['state_bounded']} | {d['seconds']:.0f} | {'pass' if not d['failures'] else 'FAIL: ' + '; '.join(d['failures'])} |")
PY
done
cat "$summary"
