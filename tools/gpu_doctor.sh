#!/usr/bin/env bash
# On a lent GPU machine (see docs/benchmarks.md): install the carried wheels, run `lorakit doctor`
# (table + JSON) and the GPU tests; results go to $OUT.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export LORAKIT_CACHE=/tmp/lorakit-cache COLUMNS=160 PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/nvidia-smi.txt"
python3 -m lorakit doctor --retest --json --disk /tmp > "$OUT/doctor.json"; echo "doctor --json rc=$?"
python3 -m lorakit doctor --disk /tmp 2>&1 | tee "$OUT/doctor.txt"; echo "doctor rc=${PIPESTATUS[0]}"
LORAKIT_GPU_CACHE=/tmp/lorakit-cache python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tail -15 | tee "$OUT/pytest-gpu.txt"
python3 tools/attention_in_model.py --json "$OUT/attention_in_model.json" 2>&1 | grep -v Warning | tee "$OUT/attention_in_model.txt"
