#!/usr/bin/env bash
# On an offline GPU benchmark host whose image has torch, transformers and peft but not lorakit's other dependencies:
# install the wheels downloaded beforehand into .whl (`pip download --no-deps --only-binary=:all: --python-version
# 3.12 -d .whl diffusers==0.42.1 fastsafetensors==0.5.0 optimum-quanto bitsandbytes pydantic ...`), set up the
# environment, run the command from a checkout of this tree.
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
export PYTHONPATH=/tmp/site:$PWD PYTHONPYCACHEPREFIX=/tmp/pycache
unset PYTHONDONTWRITEBYTECODE  # the image may set it: bytecode is then never kept (a user's Python keeps it)
# The image's packages come without bytecode and Python may not write it beside them (each lorakit process compiled
# ~2,400 sources at import: ~10 s). A user's pip compiles it at install; here it is compiled once per machine.
if [ ! -f /tmp/pycache/.done ]; then
  mkdir -p /tmp/pycache
  sp=$(python3 -c "import importlib.util as u, os; print(os.path.dirname(os.path.dirname(u.find_spec('torch').origin)))")
  dirs=(/tmp/site)
  for p in torch transformers peft accelerate safetensors sympy huggingface_hub tokenizers typer rich click yaml \
           numpy PIL networkx jinja2 filelock fsspec triton regex tqdm packaging psutil mpmath markupsafe; do
    [ -d "$sp/$p" ] && dirs+=("$sp/$p")
  done
  python3 -m compileall -q -j 16 "${dirs[@]}" > /dev/null 2>&1
  # and whatever else the stack imports where it is installed (sklearn, scipy, pandas through transformers on the
  # benchmark image: ~1,800 sources compiled in each process otherwise): imported once, its bytecode written
  python3 -c "import torch._dynamo, torch._inductor.compile_fx, diffusers, transformers, peft, accelerate, typer, rich
from diffusers import FluxTransformer2DModel, AutoencoderKL
import transformers.generation, transformers.models.auto.modeling_auto" > /dev/null 2>&1
  touch /tmp/pycache/.done
fi
# FlashAttention 4's CuTe DSL packages, where a --target install of its wheels puts them (their .pth files go unread)
[ -d /tmp/site/nvidia_cutlass_dsl/dsl_packages ] && export PYTHONPATH=$PYTHONPATH:/tmp/site/nvidia_cutlass_dsl/dsl_packages
export LORAKIT_CACHE=${LORAKIT_CACHE:-/tmp/lorakit-cache} HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
if [ "${1:-}" = lorakit ]; then shift; exec python3 -m lorakit "$@"; fi
exec "$@"
