#!/usr/bin/env bash
# FlashAttention 4 on a lent GPU machine, whose carry limit (64 MiB with the tree) is smaller than the
# CuTe-DSL compiler library it needs (nvidia-cutlass-dsl-libs-cu13: a 92 MB wheel, 63.5 MB as .tar.xz).
# Makes two git-ignored folders that go in two calls back to back on one warm machine (it keeps /tmp):
#   .gpu1: the usual .whl (less bitsandbytes), flash-attn-4 and its small dependencies, part 1 of the library
#   .gpu2: the rest of the library
# then, on the lent machine (commands as used on 2026-11-23, docs/benchmarks.md "Performance II"):
#   run carry=[".gpu1"]: mkdir -p /tmp/parts .whl && cp .gpu1/cu13xz.part00 /tmp/parts/ && cp .gpu1/*.whl .whl/ \
#        && rm -f .whl/nvidia_cutlass_dsl* && python3 -m pip install -q --no-index --no-deps --no-compile \
#           --target /tmp/site .gpu1/nvidia_cutlass_dsl*.whl
#   run carry=[".gpu2"]: cat /tmp/parts/cu13xz.part00 .gpu2/cu13xz.part0[12] | python3 -c "import lzma,sys,tarfile; \
#        tarfile.open(fileobj=lzma.open(sys.stdin.buffer), mode='r|').extractall('/tmp/site')" \
#        && bash tools/gpu_bench.sh fa4
# (.whl must then no longer hold the cutlass wheels: `pip install --target --upgrade` would replace the folder
# the library was unpacked into.) The image already has cuda-bindings, cuda-pathfinder, protobuf and einops.
set -euo pipefail
root=$(git rev-parse --show-toplevel); cd "$root"
mkdir -p .git/info; touch .git/info/exclude
for d in /.gpu1/ /.gpu2/; do grep -qx "$d" .git/info/exclude || echo "$d" >> .git/info/exclude; done
[ -d .whl ] || bash ../shared/device/fetch-wheels.sh
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
dl() { python3 -m pip download -q --no-deps --pre --only-binary=:all: --python-version 3.12 --implementation cp \
         --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 -d "$tmp" "$@"; }
dl "flash-attn-4==4.0.0b36" "nvidia-cutlass-dsl==4.8.1" "nvidia-cutlass-dsl-libs-base==4.8.1" \
   "nvidia-cutlass-dsl-libs-core==4.8.1" "nvidia-cutlass-dsl-libs-cu13==4.8.1" "apache-tvm-ffi>=0.1.11,<0.2" \
   "torch-c-dlpack-ext" "quack-kernels>=0.5.3"
rm -rf .gpu1 .gpu2; mkdir -p .gpu1 .gpu2 "$tmp/cu13"
ls .whl/*.whl | grep -v bitsandbytes | xargs -I{} cp {} .gpu1/
find "$tmp" -maxdepth 1 -name '*.whl' ! -name '*libs_cu13*' -exec cp {} .gpu1/ \;
(cd "$tmp/cu13" && python3 -m zipfile -e "$tmp"/nvidia_cutlass_dsl_libs_cu13-*.whl . && tar cf - . | xz -9e -T2 > "$tmp/cu13.tar.xz")
split -b 29000000 -d "$tmp/cu13.tar.xz" "$tmp/cu13xz.part"
cp "$tmp/cu13xz.part00" .gpu1/; cp "$tmp"/cu13xz.part0[12] .gpu2/
du -b -s .gpu1 .gpu2
echo "each must stay under ~65 MB (64 MiB less the tree)"
