#!/usr/bin/env bash
# On a lent GPU machine: the user's whole path at real size (tools/e2e.py), one plan per call; the stage
# JSONs, metrics and sample grids come back in $OUT/e2e-PLAN.tgz, the log in $OUT/log-PLAN.txt.
#   bash tools/gpu_e2e.sh PLAN   (flux, flux-infer, qwen-small, qwen-pair, ...: each plan synthesizes its own model folder:
#   a lent machine goes back 30 s after a call, so nothing carries over between calls)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
# FlashAttention 4 where tools/fa4_carry.sh put it (a --target install leaves its .pth unread)
[ -d /tmp/site/nvidia_cutlass_dsl/dsl_packages ] && export PYTHONPATH=$PYTHONPATH:/tmp/site/nvidia_cutlass_dsl/dsl_packages
export COLUMNS=160 PYTHONUNBUFFERED=1 LORAKIT_PROGRESS=1 LORAKIT_CACHE=/tmp/lorakit-cache HF_HUB_OFFLINE=1
OUT=${OUT:-out}; mkdir -p "$OUT"; W=/tmp/e2e; M=/tmp/models; LOG="$OUT/log-$1.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >> "$LOG"
df -h /tmp | tail -1 >> "$LOG"; free -g | head -2 >> "$LOG"
PARITY=(--set validation.items=4 --set validation.every=50 --set sampling.enabled=false)
e2e() { local t=$1; shift; timeout "$((t + 15))" python3 tools/e2e.py "$@" --models $M --work $W --limit "$t" 2>&1 \
          | grep -v -e "Writing model shards" -e "it/s]" >> "$LOG"; echo "rc=${PIPESTATUS[0]} :: $*" >> "$LOG"; }
# lorakit beside musubi-tuner (tools/peer_musubi.py): its src/ unpacked at /tmp/peer/musubi/src and its runtime
# packages installed under /tmp/peer beforehand (docs/benchmarks.md "Peer trainer" says which versions)
peer() { local setting=$1 left=$2; shift 2
         PYTHONPATH=$PYTHONPATH:/tmp/peer timeout $((left + 10)) python3 tools/peer_musubi.py compare \
           --musubi /tmp/peer/musubi/src --models $M --work $W --setting "$setting" --steps 25 --limit "$left" "$@" \
           >> "$LOG" 2>&1; echo "rc=$? :: peer $setting $*" >> "$LOG"
         cp "$W/peer-$setting/report.json" "$OUT/peer-$setting-$(date +%H%M%S).json" 2>> "$LOG"; }
case $1 in
  flux) e2e 530 synth doctor data cache train infer reproduce warm --family flux --profile datacenter
        python3 tools/probe_times.py >> "$LOG" 2>&1 ;;
  flux-4090) e2e 560 synth data cache train infer --family flux --profile rtx4090 --cap 24 ;;
  flux-4090-short) e2e 235 synth data cache train --family flux --profile rtx4090 --cap 24 --steps 20 ;;
  qwen-edit) e2e 560 synth data cache train infer reproduce --family qwen-image-edit-plus --profile datacenter ;;
  qwen-edit-short) e2e 420 synth data cache train reproduce --family qwen-image-edit-plus --profile datacenter \
                   --steps 30 ;;
  qwen-4090) e2e 560 synth data cache train infer --family qwen-image --profile rtx4090 --cap 24 ;;
  flux-pair) rm -rf $M/qwen*  # a warm machine keeps /tmp: the disk is for this plan's folder
        e2e 290 synth data cache train --family flux --profile rtx4090 --cap 24 --steps 30
        e2e 150 infer --family flux --profile rtx4090 --cap 24 --no-stock
        e2e 125 infer --family flux --profile datacenter --lora $W/flux-rtx4090-cap24/run/lora.safetensors ;;
  flux-small) rm -rf $M/qwen*  # FLUX under the rtx4090 profile and a 24 GiB cap, then the fair infer row
        e2e 345 synth data cache train --family flux --profile rtx4090 --cap 24 --steps 10
        e2e 160 infer --family flux --profile rtx4090 --cap 24 --no-stock
        left=$((575 - SECONDS)); [ $left -gt 90 ] && e2e $left infer --family flux --profile datacenter \
          --lora $W/flux-rtx4090-cap24/run/lora.safetensors ;;
  flux-infer) rm -rf $M/qwen*  # infer under a 24 GiB cap (auto: fp8 blocks), the fair rows beside stock
        e2e 150 synth data lora --family flux --profile rtx4090 --cap 24
        e2e 170 infer --family flux --profile rtx4090 --cap 24 --no-stock
        e2e 150 infer --family flux --profile datacenter --lora $W/flux-rtx4090-cap24/run/lora.safetensors
        e2e 100 cache --family flux --profile datacenter
        left=$((560 - SECONDS)); [ $left -gt 150 ] && e2e $left train --family flux --profile datacenter --steps 10 ;;
  fp8) rm -rf $M/qwen*  # where --offload fp8 spends its time (tools/fp8_probe.py), then FLUX infer under the cap
        timeout 200 python3 tools/fp8_probe.py > "$OUT/fp8_probe.jsonl" 2>> "$LOG"; cat "$OUT/fp8_probe.jsonl" >> "$LOG"
        e2e 110 synth data lora --family flux --profile rtx4090 --cap 24
        left=$((545 - SECONDS)); [ $left -gt 60 ] && e2e $left infer --family flux --profile rtx4090 --cap 24 --no-stock ;;
  flux-swap) rm -rf $M/qwen*  # FLUX infer under the cap with the Swap placement (fp8 blocks); the fair cache row again
        e2e 95 synth data lora --family flux --profile rtx4090 --cap 24
        e2e 140 infer --family flux --profile rtx4090 --cap 24 --no-stock
        e2e $((400 - SECONDS)) cache --family flux --profile datacenter ;;
  qwen-small) rm -rf $M/flux*  # Qwen-Image, rtx4090 profile, 24 GiB cap: cache, train to its LoRA file, infer with it
        e2e 150 synth data lora --family qwen-image --profile rtx4090 --cap 24
        e2e 50 cache --family qwen-image --profile rtx4090 --cap 24 --no-stock
        e2e $((465 - SECONDS)) train --family qwen-image --profile rtx4090 --cap 24 --steps 10 --warm-page-cache
        e2e $((585 - SECONDS)) infer --family qwen-image --profile rtx4090 --cap 24 --no-stock --prompts 2 ;;
  qwen-pair) rm -rf $M/flux*  # Qwen-Image-Edit-2509, datacenter; on a warm machine after qwen-small its weights are linked
        like=(); [ -f $M/qwen-image/lorakit_synthetic.json ] && like=(--like qwen-image)
        e2e 130 synth data cache --family qwen-image-edit-plus "${like[@]}" --profile datacenter
        e2e $((395 - SECONDS)) train --family qwen-image-edit-plus --profile datacenter --steps 8 --warm-page-cache
        e2e $((475 - SECONDS)) reproduce --family qwen-image-edit-plus --profile datacenter
        e2e $((585 - SECONDS)) infer --family qwen-image-edit-plus --profile datacenter --no-stock --prompts 2 ;;
  fp8-parity) rm -rf $M/qwen*  # memory.compute fp8 against bf16: FLUX, datacenter, 300 steps, 4 items held out,
        # both runs in this call (one run: ~40 s to its first step, ~145 s of steps, six validations)
        e2e 200 synth data cache --family flux --profile datacenter --no-stock "${PARITY[@]}"
        e2e $((350 - SECONDS)) train --family flux --profile datacenter --steps 300 --warm-page-cache --tag bf16 \
          "${PARITY[@]}"
        e2e $((585 - SECONDS)) train --family flux --profile datacenter --steps 300 --warm-page-cache --tag fp8 \
          "${PARITY[@]}" --set memory.compute=fp8 ;;
  fp8-parity-a) rm -rf $M/qwen*  # fp8-parity with memory.cuda_graphs in both runs, over two calls on one machine:
        e2e 200 synth data cache --family flux --profile datacenter --no-stock "${PARITY[@]}"  # the folder, cache
        e2e $((585 - SECONDS)) train --family flux --profile datacenter --steps 300 --warm-page-cache --tag bf16 \
          "${PARITY[@]}" --set memory.cuda_graphs=true ;;                                    # and bf16, then
  fp8-parity-b) e2e 585 train --family flux --profile datacenter --steps 300 --warm-page-cache --tag fp8 \
          "${PARITY[@]}" --set memory.compute=fp8 --set memory.cuda_graphs=true ;;           # fp8 compute
  fp8-parity-2) e2e 560 train --family flux --profile datacenter --steps 300 --warm-page-cache --tag fp8 \
          "${PARITY[@]}" --set memory.compute=fp8 ;;
  qwen-4090-after) rm -rf $M/flux*  # right after qwen-pair on a warm machine: its weights linked, not rewritten
        like=(); [ -f $M/qwen-image-edit-plus/lorakit_synthetic.json ] && like=(--like qwen-image-edit-plus)
        e2e 400 synth data cache train --family qwen-image "${like[@]}" --profile rtx4090 --cap 24 --steps 20
        e2e 150 infer --family qwen-image --profile rtx4090 --cap 24 --no-stock ;;
  peer-a) rm -rf $M/flux*  # Qwen-Image full size: the folder, data and lorakit's cache, then both trainers unconstrained
        e2e 220 synth data cache --family qwen-image --profile datacenter --no-stock
        peer unconstrained $((585 - SECONDS)) --only musubi-documented lorakit musubi-no-checkpointing ;;
  peer-a2) peer unconstrained $((585 - SECONDS)) --only musubi-no-checkpointing ;;  # what peer-a had no time for
  peer-b) peer 24gb $((585 - SECONDS)) --only musubi-24gb lorakit ;;  # musubi's documented 24 GB options beside
        # lorakit's rtx4090 profile, 24 GiB cap (the rtx4090 profile needs bitsandbytes: carry .whl whole)
  peer-c) peer 24gb $((330 - SECONDS)) --only lorakit musubi-24gb-compiled  # after peer-a on a warm machine: both
        peer unconstrained $((585 - SECONDS)) --only musubi-compiled ;;   # trainers with compiled blocks
  tiny) e2e 500 synth doctor data cache train warm infer reproduce --family flux --profile datacenter --tiny \
          --images 4 --steps 12 ;;
  *) echo "unknown plan $1" >> "$LOG" ;;
esac
tar czf "$OUT/e2e-$1.tgz" -C $W --exclude='cache' --exclude='*.safetensors' --exclude='checkpoints' \
    --exclude='data-*' --exclude='infer/0*.png' --exclude='*.pt' . 2>> "$LOG"
ls -la "$OUT" >> "$LOG"
