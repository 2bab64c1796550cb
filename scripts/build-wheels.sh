#!/usr/bin/env bash
# `make wheels`: the project's wheel (and its dependencies' wheels) in build/wheels, for the image.
# The wheel carries gpu_agent/_build_info.json (commit and build date), so `/version` tells the
# truth wherever the wheel is installed.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
info=$repo/agent/gpu_agent/_build_info.json
commit=$(git -C "$repo" rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
[[ $commit != unknown && -n $(git -C "$repo" status --porcelain --untracked-files=no 2>/dev/null) ]] && commit+=-dirty
printf '{"commit": "%s", "buildDate": "%s"}\n' "$commit" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" > "$info"
trap 'rm -f "$info"' EXIT
rm -rf "$repo/build/wheels"
"$python" -m pip wheel --quiet --wheel-dir "$repo/build/wheels" "$repo"
echo "wheels: $(ls "$repo/build/wheels" | wc -l) in build/wheels (gpu-agent at commit $commit)"
