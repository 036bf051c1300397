#!/usr/bin/env bash
# DGX Spark readiness without a Spark: resolve lorakit's whole install (dependencies, the quant extra, the torch
# pins CI tests) for Linux aarch64 / CPython 3.12 with binary wheels only. A dependency that would make a Spark
# user build from source fails this (and CI). Needs only the package index, no aarch64 machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-"torch==2.14.1 torchvision==0.29.1"}
mapfile -t DEPS < <("$PY" - <<'PYEOF'
import tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
for d in p["dependencies"] + p["optional-dependencies"]["quant"]:
    if not d.startswith(("torch>", "torch=", "torchvision")):
        print(d)
PYEOF
)
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
# shellcheck disable=SC2086
# DGX OS 7 (Ubuntu 24.04) has glibc 2.39: every manylinux_2_17 ... 2_39 aarch64 wheel installs there.
PLATFORMS=(--platform manylinux2014_aarch64 --platform linux_aarch64)
for v in $(seq 17 39); do PLATFORMS+=(--platform "manylinux_2_${v}_aarch64"); done
# shellcheck disable=SC2086
"$PY" -m pip install --dry-run --quiet --report "$TMP/report.json" --ignore-installed --only-binary=:all: \
    "${PLATFORMS[@]}" --python-version 3.12 --implementation cp --target "$TMP/t" $TORCH_SPEC "${DEPS[@]}" \
    2> >(grep -v "^WARNING: Location" >&2)
"$PY" - "$TMP/report.json" <<'PYEOF'
import json, sys
items = json.load(open(sys.argv[1]))["install"]
wheels = [i["download_info"]["url"].rsplit("/", 1)[-1] for i in items]
native = sorted(w for w in wheels if not w.endswith("-none-any.whl"))
print(f"aarch64 cp312: {len(wheels)} packages resolve to binary wheels ({len(native)} with native code):")
for w in native:
    print("  " + w)
PYEOF
