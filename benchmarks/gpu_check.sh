#!/usr/bin/env bash
# `make gpu-check` on a lent GPU machine: install the wheels carried in .gpu/whl (benchmarks/gpu_carry.py made them
# here) beside the image's own packages, point the embedded default at the carried GGUF, and run the check.
set -euo pipefail
cd "$(dirname "$0")/.."
SITE=${BURSTGATE_GPU_SITE:-/tmp/burstgate-site}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .gpu/whl/*.whl
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
BURSTGATE_DEFAULT_MODEL=$(ls "$PWD"/.gpu/model/*.gguf)
export BURSTGATE_DEFAULT_MODEL
exec python3 benchmarks/gpu_check.py "$@"
