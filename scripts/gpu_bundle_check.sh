#!/bin/sh
# make gpu-bundle-check: the bundle's install tested here, in a clean venv that holds only
# what the GPU image holds (the project's requirements the image lists, from the local index)
# and a copy of the tree; the bundle is built for this machine's Python, stashed part by part
# as the calls would, installed with --no-index, then: imports and `agentgym check-env`.
set -eu
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mktemp -d /tmp/gpu-bundle-check.XXXXXX)
trap 'rm -rf "$WORK" /tmp/site' EXIT
PYV=$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
"$ROOT/.venv/bin/python" "$ROOT/scripts/gpu_bundle.py" --python "$PYV" --out "$WORK/bundle"
python3 -m venv "$WORK/venv"
# the image's share of the project's requirements (torch, transformers, numpy, ...)
grep -v '^#' "$ROOT/scripts/gpu_image.txt" | tr 'A-Z_.' 'a-z--' > "$WORK/image.txt"
"$WORK/venv/bin/pip" install -q --disable-pip-version-check torch==2.13.0
# the pins: core.txt (the package's own) and cpu.txt (its -r line aside)
cat "$ROOT/requirements/core.txt" "$ROOT/requirements/cpu.txt" | grep -v '^#' | grep -v '^-r ' \
  > "$WORK/pins.txt"
sed 's/[<>=;\[ ].*//' "$WORK/pins.txt" | grep . | while read -r name; do
  canon=$(echo "$name" | tr 'A-Z_.' 'a-z--')
  if grep -qx "$canon" "$WORK/image.txt" && [ "$canon" != torch ]; then
    grep -i "^$name[=<> ;]" "$WORK/pins.txt" | head -1
  fi
done > "$WORK/image-reqs.txt"
"$WORK/venv/bin/pip" install -q --disable-pip-version-check -c "$ROOT/requirements/constraints.txt" \
  -r "$WORK/image-reqs.txt"
git -C "$ROOT" archive HEAD | tar -x -C "$WORK" --one-top-level=tree
cp -r "$WORK/bundle" "$WORK/tree/gpu-bundle"
cd "$WORK/tree"
for part in gpu-bundle/part-*; do sh gpu-bundle/stash.sh "${part#gpu-bundle/part-}"; done
PATH="$WORK/venv/bin:$PATH"
. gpu-bundle/install.sh
AGENTGYM_CACHE="$WORK/cache" python3 -m agentgym.cli check-env
AGENTGYM_CACHE="$WORK/cache" python3 -c "
from agentgym.models.zoo import resolve_model, load_model
m = load_model(resolve_model('smollm2-135m'))
print('smollm2-135m from the carried GGUF:', m.num_parameters(), 'parameters')"
echo "gpu-bundle-check: ok"
