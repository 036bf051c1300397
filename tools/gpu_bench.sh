#!/usr/bin/env bash
# On a lent GPU machine (docs/benchmarks.md): install the carried wheels, then run the named stages;
# every result goes to $OUT. Stages: tests, load, flux, flux-nocompile, flux-trace, fp8, fa4, fa4-trace, fa4-again, fa4-more, fp8-trace, fp8-graphs, fp8-gemm, fp8-ab (.bench/head: the package compared with), fp8-trace-graphs, small-again, small-5090, edit-fa4, doctor-fa4, small-compile, ckpt-auto, qwen, edit, caps, qwen-4090,
# spark, spark-qwen, edit-caps, ddp (2 GPUs), fsdp (2 GPUs; CKPT_DIR for the checkpoint, ~115 GiB).
#   bash tools/gpu_bench.sh tests flux load
# fp8-ab compares this tree with a commit's package, made here and carried (run's carry: [".bench"]):
#   mkdir -p .bench/head && git archive COMMIT lorakit | tar -x -C .bench/head && ln -sfn ../../profiles .bench/head/profiles
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
# a --target install leaves .pth files unread: CuTe DSL's (flash-attn-4's) packages are put on the path by hand
[ -d /tmp/site/nvidia_cutlass_dsl/dsl_packages ] && export PYTHONPATH=$PYTHONPATH:/tmp/site/nvidia_cutlass_dsl/dsl_packages
export LORAKIT_CACHE=/tmp/lorakit-cache COLUMNS=160 PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >> "$OUT/log.txt"
step() {  # step NAME TIMEOUT ARGS...: one bench step run, JSON kept, table-ish summary logged
  local name=$1 t=$2; shift 2
  timeout "$t" python3 -m lorakit bench step --json "$@" > "$OUT/step-$name.json" 2>> "$OUT/stderr.txt"
  echo "== $name rc=$? :: $*" >> "$OUT/log.txt"
  python3 - "$OUT/step-$name.json" >> "$OUT/log.txt" 2>&1 <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["rows"]:
    print("  ", r["way"], {k: r.get(k) for k in ("gpus", "s_per_step", "speedup_vs_plain", "throughput_vs_1gpu",
                                                 "peak_gib", "estimate_gib", "mfu", "checkpointing", "build_s", "error", "settings",
                                                 "checkpoint")})
PY
}
for stage in "$@"; do
  echo "### $stage $(date +%T)" >> "$OUT/log.txt"
  case $stage in
    tests) timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/io tests/unit/bench \
             2>&1 \
             | tail -15 >> "$OUT/log.txt" ;;
    load) df -T "$PWD" /tmp >> "$OUT/log.txt"
          timeout 330 python3 -m lorakit bench load --synthetic 8G --repeats 2 --json --dir "$PWD/.bench" --keep \
             > "$OUT/load.json" 2>> "$OUT/stderr.txt"; echo "load rc=$?" >> "$OUT/log.txt"
          d=$(python3 -c "import json,os;print(os.path.dirname(json.load(open('$OUT/load.json'))['files'][0]))")
          for tc in ${LOAD_TUNE:-}; do  # threads:chunk MiB, warm page cache to the GPU
            LORAKIT_IO_THREADS=${tc%:*} LORAKIT_IO_CHUNK_MIB=${tc#*:} timeout 60 python3 -m lorakit bench load "$d" \
              --target cuda --cache warm --repeats 3 --json 2>/dev/null | python3 -c "import json,sys
for r in json.load(sys.stdin)['rows']: print('  tune $tc', r['way'], r['seconds'], r['gbps'], r['rss_growth_gib'])" \
              >> "$OUT/log.txt"
          done ;;
    flux) step flux-1024 300 --family flux --res 1024 --profile datacenter ;;
    flux-nocompile) step flux-1024-nocompile 200 --family flux --res 1024 --profile datacenter \
             --ways lorakit --set memory.compile=false ;;
    fp8) for f in flux qwen-image; do  # bf16 and fp8 compute, one after the other in the same run
           step $f-1024-bf16 138 --family $f --res 1024 --profile datacenter --ways lorakit
           step $f-1024-fp8 138 --family $f --res 1024 --profile datacenter --ways lorakit --set memory.compute=fp8
         done ;;
    fa4) timeout 200 python3 tools/fa4_probe.py > "$OUT/fa4_probe.jsonl" 2>> "$OUT/stderr.txt"
         echo "fa4_probe rc=$?" >> "$OUT/log.txt"; cat "$OUT/fa4_probe.jsonl" >> "$OUT/log.txt"
         timeout 120 python3 -m pytest -q -p no:cacheprovider tests/unit/hardware/test_fa4.py 2>&1 | tail -4 >> "$OUT/log.txt"
         step flux-1024-fa4 200 --family flux --res 1024 --profile datacenter --attention fa4
         step flux-1024-fa4-fp8 130 --family flux --res 1024 --profile datacenter --ways lorakit --attention fa4 \
           --set memory.compute=fp8
         step qwen-1024-fa4 130 --family qwen-image --res 1024 --profile datacenter --ways lorakit \
           --attention fa4+efficient ;;
    small-compile) step flux-4090-compile 160 --family flux --res 1024 --profile rtx4090 --memory-cap 24 --ways lorakit \
                     --set memory.compile=true
                   step qwen-4090-compile 180 --family qwen-image --res 1024 --profile rtx4090 --memory-cap 24 \
                     --ways lorakit --set memory.compile=true ;;
    edit-fa4) step edit-1024-fa4 200 --family qwen-image-edit --res 1024 --profile datacenter --ways lorakit \
                --attention fa4+efficient ;;
    doctor-fa4) timeout 300 python3 -m lorakit doctor --retest --json --disk /tmp > "$OUT/doctor-fa4.json" 2>> "$OUT/stderr.txt"
                echo "doctor --retest rc=$?" >> "$OUT/log.txt"
                timeout 60 python3 -m lorakit doctor --disk /tmp > "$OUT/doctor-fa4.txt" 2>&1; echo "doctor rc=$?" >> "$OUT/log.txt" ;;
    fa4-trace) step flux-trace-fa4 170 --family flux --res 1024 --profile datacenter --ways lorakit --steps 3 \
                 --warmup 2 --attention fa4 --trace "$OUT"
               gzip -f "$OUT"/*.json.json "$OUT"/lorakit-*.json 2>/dev/null
               step flux-1024-fa4 150 --family flux --res 1024 --profile datacenter --ways lorakit --attention fa4 ;;
    fa4-again) step flux-1024-fa4 240 --family flux --res 1024 --profile datacenter --attention fa4
               step flux-1024-fa4-fp8 150 --family flux --res 1024 --profile datacenter --ways lorakit --attention fa4 \
                 --set memory.compute=fp8 ;;
    fp8-trace) step flux-trace-fa4-fp8 170 --family flux --res 1024 --profile datacenter --ways lorakit --steps 3 \
                 --warmup 2 --attention fa4 --set memory.compute=fp8 --trace "$OUT"
               gzip -f "$OUT"/lorakit-*.json 2>/dev/null ;;
    fp8-graphs) F=(--family flux --res 1024 --profile datacenter --ways lorakit --attention fa4 --set memory.compute=fp8
              --steps 15 --warmup 4)  # fp8 compute without CUDA graphs, then with memory.cuda_graphs, twice
           step fp8-nographs 150 "${F[@]}"
           for i in 1 2; do step fp8-graphs-$i 170 "${F[@]}" --set memory.cuda_graphs=true; done ;;
    fp8-gemm) timeout 240 python3 tools/fp8_gemm_probe.py > "$OUT/fp8_gemm.jsonl" 2>> "$OUT/stderr.txt"
              echo "fp8_gemm_probe rc=$?" >> "$OUT/log.txt" ;;
    fp8-ab) F=(--family flux --res 1024 --profile datacenter --ways lorakit --attention fa4 --set memory.compute=fp8
              --set memory.cuda_graphs=true --steps 15 --warmup 4)  # this tree, then the package in .bench/head
           step fp8-ab-tree 170 "${F[@]}"                             # (git archive of the commit compared with)
           [ -d .bench/head/lorakit ] && (cd .bench/head  # python -m puts the working directory first on the path
             python3 -c "import lorakit.train.quant as q; print('  compared with', q.__file__)" >> "$OUT/log.txt"
             step fp8-ab-head 170 "${F[@]}") ;;
    fp8-trace-graphs) step flux-trace-fp8-graphs 170 --family flux --res 1024 --profile datacenter --ways lorakit \
                 --steps 3 --warmup 4 --attention fa4 --set memory.compute=fp8 --set memory.cuda_graphs=true --trace "$OUT"
               gzip -f "$OUT"/lorakit-*.json 2>/dev/null ;;
    small-again) step qwen-5090 210 --family qwen-image --res 1024 --profile rtx5090 --memory-cap 32 --ways lorakit
                 step flux-4090 220 --family flux --res 1024 --profile rtx4090 --memory-cap 24 --ways lorakit
                 step flux-5090 160 --family flux --res 1024 --profile rtx5090 --memory-cap 32 --ways lorakit ;;
    small-5090) step flux-5090 170 --family flux --res 1024 --profile rtx5090 --memory-cap 32 --ways lorakit
                step qwen-5090 200 --family qwen-image --res 1024 --profile rtx5090 --memory-cap 32 --ways lorakit ;;
    fa4-more) step edit-1024-fa4 200 --family qwen-image-edit --res 1024 --profile datacenter --ways lorakit \
                --attention fa4+efficient
              step flux-trace-fa4 150 --family flux --res 1024 --profile datacenter --ways lorakit --steps 3 \
                --warmup 2 --attention fa4 --trace "$OUT"
              step flux-512-fa4 120 --family flux --res 512 --profile datacenter --ways lorakit --attention fa4
              step flux-512 120 --family flux --res 512 --profile datacenter --ways lorakit ;;
    ckpt-auto) step flux-4090-auto 130 --family flux --res 1024 --profile rtx4090 --memory-cap 24 --ways lorakit \
                 --set memory.checkpoint_blocks=auto
               step flux-4090-auto-fp8 110 --family flux --res 1024 --profile rtx4090 --memory-cap 24 --ways lorakit \
                 --set memory.checkpoint_blocks=auto --set memory.compute=fp8
               step qwen-4090-fp8 130 --family qwen-image --res 1024 --profile rtx4090 --memory-cap 24 --ways lorakit \
                 --set memory.compute=fp8
               step qwen-5090-auto 120 --family qwen-image --res 1024 --profile rtx5090 --memory-cap 32 --ways lorakit \
                 --set memory.checkpoint_blocks=auto
               step edit-auto 90 --family qwen-image-edit --res 1024 --profile datacenter --ways lorakit \
                 --set memory.checkpoint_blocks=auto ;;
    qwen) step qwen-1024 330 --family qwen-image --res 1024 --profile datacenter
          step qwen-512 240 --family qwen-image --res 512 --profile datacenter --trace "$OUT" ;;
    flux-trace) step flux-trace 200 --family flux --res 1024 --profile datacenter --ways lorakit --steps 3 \
             --warmup 2 --trace "$OUT" ;;
    edit) step edit-1024 330 --family qwen-image-edit --res 1024 --profile datacenter ;;
    qwen-4090) step qwen-4090 230 --family qwen-image --res 1024 --profile rtx4090 --memory-cap 24 --ways lorakit ;;
    caps) step flux-4090 200 --family flux --res 1024 --profile rtx4090 --memory-cap 24 --ways lorakit
          step qwen-4090 230 --family qwen-image --res 1024 --profile rtx4090 --memory-cap 24 --ways lorakit
          step qwen-5090 200 --family qwen-image --res 1024 --profile rtx5090 --memory-cap 32 --ways lorakit ;;
    spark) step flux-spark 200 --family flux --res 1024 --profile dgx-spark --ways lorakit ;;
    spark-qwen) step qwen-spark 230 --family qwen-image --res 1024 --profile dgx-spark --ways lorakit ;;
    edit-caps) step edit-4090 230 --family qwen-image-edit --res 1024 --profile rtx4090 --memory-cap 24 --ways lorakit
          step edit-5090 230 --family qwen-image-edit --res 1024 --profile rtx5090 --memory-cap 32 --ways lorakit
          step edit-spark 230 --family qwen-image-edit --res 1024 --profile dgx-spark --ways lorakit ;;
    ddp) step flux-ddp 560 --family flux --res 1024 --profile datacenter --ways lorakit --gpus 2 ;;
    fsdp) df -h "$PWD" /tmp /dev/shm >> "$OUT/log.txt"; free -g >> "$OUT/log.txt"
          step qwen-full-fsdp 580 --family qwen-image --res 1024 --profile datacenter --ways lorakit --gpus 2 \
             --set method=full --checkpoint-dir "${CKPT_DIR:-$PWD/.ckpt}"
          rm -rf "${CKPT_DIR:-$PWD/.ckpt}" ;;
  esac
done
echo "### done $(date +%T)" >> "$OUT/log.txt"
