#!/usr/bin/env bash
# The wheels a full `bench matrix` needs on a lent GPU machine, under the carry limit (64 MiB with the tree):
# ../shared/device/fetch-wheels.sh's set plus PyAV (`av`, 35 MB: the video families read and write clips; the
# image lacks it), with bitsandbytes (43 MB: a library for every CUDA since 11.8, ROCm and XPU) cut to its CPU and
# CUDA 13 libraries (7 MB; the lent image's torch is cu130). Without av the video lanes stop at their first import
# ("a library lorakit needs is missing or broken: av", session 25). Run from the project root; carry ".whl".
set -euo pipefail
root=$(git rev-parse --show-toplevel); cd "$root"
bash ../shared/device/fetch-wheels.sh av > /dev/null
python3 - <<'PY'
import glob, os, re, zipfile
drop = re.compile(r"libbitsandbytes_(cuda1(1[0-9]|2[0-9])|rocm\d+|xpu\d+)\.so$")  # keep cpu, cuda13x
for src in glob.glob(".whl/bitsandbytes-*.whl"):
    with zipfile.ZipFile(src) as zi, zipfile.ZipFile(src + ".tmp", "w", zipfile.ZIP_DEFLATED) as zo:
        for info in zi.infolist():
            if drop.search(info.filename):
                continue
            data = zi.read(info)
            if info.filename.endswith(".dist-info/RECORD"):  # pip reads it: the dropped files leave it too
                data = b"\n".join(x for x in data.split(b"\n") if not drop.search(x.split(b",")[0].decode()))
            zo.writestr(info, data)
    os.replace(src + ".tmp", src)
PY
du -sh .whl
