#!/usr/bin/env bash
# The user-path matrix on a GPU machine with several GPUs: one `lorakit bench matrix` per GPU at once (a lane: its
# own GPU, lorakit cache, compile cache and model folders), each lane's results under OUT/laneN (matrix.json,
# matrix.md, the stages' logs). Every lane's model folders are written first, all lanes together, so no lane's timed
# stages share the disk with another lane's writing (a lane's `--cold` stage still reads from the disk alone only if
# the other lanes read their folders from the page cache: leave --cold off there). Needs the disk for every lane's
# folders at once.
#   bash scripts/matrix_lanes.sh OUT "--family flux --profile datacenter --stages train,train-warm --cold" \
#                                    "--family kandinsky5-t2i --profile datacenter"
# SHARED=1: one folder per family for all lanes (/tmp/models, written once on GPU 0, kept): a family too large to
# write twice (FLUX.2 [dev], 112 GB, on the 128 GiB disk), each lane another profile of it:
#   SHARED=1 bash scripts/matrix_lanes.sh OUT "--family flux2-dev --profile rtx5090" "--family flux2-dev --profile rtx4090"
# ONE_GPU=1 (with SHARED=1): every lane on GPU 0 at once — cells under the small cards' caps (24, 32 GiB) fit a 141 GB
# card three or four times; the stock pipeline (uncapped) then runs one component at a time. The lanes share the
# GPU's time: their s/step is not a lone run's (say so).
set -uo pipefail
out=$1; shift
mkdir -p "$out"
bash scripts/device.sh true || exit 1  # the wheels, once
write() {  # family, folder[, like]: the full-size random-weight folder in the hub layout, once; `like`: a folder
           # written before whose equal components are linked (the Qwen-Image Edit models share their weights)
  [ -f "$2/lorakit_synthetic.json" ] && return 0
  bash scripts/device.sh python3 -c "import sys, time, torch; from pathlib import Path
from lorakit.bench.hub import write_model
t = time.perf_counter(); r = write_model(sys.argv[1], Path(sys.argv[2]), device='cuda', dtype=torch.bfloat16,
                                         like=sys.argv[3] if len(sys.argv) > 3 else None)
print(f'{sys.argv[1]}: {r[\"bytes\"] / 2**30:.1f} GiB written in {time.perf_counter() - t:.1f} s')" "$@"
}
if [ "${SHARED:-}" = 1 ]; then
  prev=(${LIKE:+"$LIKE"})  # LIKE=FOLDER: a folder written before (in an earlier call) to link equal weights from
  for f in $(echo "$@" | grep -o -- '--family [^ ]*' | cut -d' ' -f2 | sort -u); do
    CUDA_VISIBLE_DEVICES=0 write "$f" "/tmp/models/$f" "${prev[@]}" >> "$out/write.log" 2>&1
    prev=("/tmp/models/$f")
  done
  i=0
  for spec in "$@"; do
    # shellcheck disable=SC2086  # a lane's arguments are words
    gpu=$i; [ "${ONE_GPU:-}" = 1 ] && gpu=0
    (CUDA_VISIBLE_DEVICES=$gpu LORAKIT_BENCH_SHARED_GPU=${ONE_GPU:-} LORAKIT_CACHE=/tmp/lorakit-cache-$i bash scripts/device.sh lorakit bench matrix $spec \
       --models /tmp/models --keep-models --out "$out/lane$i") > "$out/lane$i.log" 2>&1 &
    i=$((i + 1))
  done
  wait
  for f in "$out"/lane*/matrix.md; do echo "== $f"; cat "$f"; done
  exit 0
fi
i=0
for spec in "$@"; do
  fams=$(echo "$spec" | grep -o -- '--family [^ ]*' | cut -d' ' -f2)
  (export CUDA_VISIBLE_DEVICES=$i
   for f in $fams; do write "$f" "/tmp/models-$i/$f"; done) > "$out/lane$i-write.log" 2>&1 &
  i=$((i + 1))
done
wait
i=0
for spec in "$@"; do
  # shellcheck disable=SC2086  # a lane's arguments are words
  (CUDA_VISIBLE_DEVICES=$i LORAKIT_CACHE=/tmp/lorakit-cache-$i bash scripts/device.sh lorakit bench matrix $spec \
     --models "/tmp/models-$i" --out "$out/lane$i") > "$out/lane$i.log" 2>&1 &
  i=$((i + 1))
done
wait
for f in "$out"/lane*/matrix.md; do echo "== $f"; cat "$f"; done
