#!/usr/bin/env bash
# On a lent GPU machine (the device tool runs a copy of this tree there): install the wheels the image lacks (made here
# by ../shared/device/fetch-wheels.sh into .whl, carried with the run), set up the environment, run the command.
#   bash scripts/device.sh lorakit bench matrix --family flux --profile datacenter --out "$OUT/matrix"
#   bash scripts/device.sh lorakit doctor --json
# "lorakit ..." runs this tree's lorakit; anything else runs as given. The wheels are installed with their bytecode
# compiled, as pip does for a user (without it every first import compiles the sources: ~12 s of a run's start).
set -uo pipefail
have=$(ls .whl | sha256sum)
if [ "$(cat /tmp/site/.lorakit-wheels 2>/dev/null)" != "$have" ]; then  # installed once per machine
  python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && echo "$have" > /tmp/site/.lorakit-wheels || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD
# FlashAttention 4's CuTe DSL packages, where tools/fa4_carry.sh put them (a --target install leaves .pth files unread)
[ -d /tmp/site/nvidia_cutlass_dsl/dsl_packages ] && export PYTHONPATH=$PYTHONPATH:/tmp/site/nvidia_cutlass_dsl/dsl_packages
export LORAKIT_CACHE=${LORAKIT_CACHE:-/tmp/lorakit-cache} HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
if [ "${1:-}" = lorakit ]; then shift; exec python3 -m lorakit "$@"; fi
exec "$@"
