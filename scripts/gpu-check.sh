#!/usr/bin/env bash
# GPU checks and benchmarks in one call, for a bare CUDA machine with no network (the image's
# python3 must already hold torch, transformers, tokenizers, safetensors, matplotlib, jinja2).
# Runs the package from this checkout (no install), each step under its own time limit, and
# packs every result into one archive:
#
#   OUT=/tmp/gpu bash scripts/gpu-check.sh            # the CUDA checks and benchmarks
#   OUT=/tmp/gpu DEVICE=cpu SMALL=1 bash scripts/gpu-check.sh   # a dry run of this script on CPU
#
# Steps, in order of value: the CUDA exactness tests (tests/test_gpu.py), the step anatomy
# (`dspark bench steps`, device synchronized every step; once as is and once with
# CUDA_MODULE_LOADING=EAGER, to see what cold kernels cost), single-stream peers (transformers
# generate() and prompt lookup vs this engine's none and dspark), online mixed and online hostile (in lockstep,
# with an A/A `none#2` row). Writes $OUT/log.txt (the diagnostic's lines included) and $OUT/results.tar.gz (docs/results
# layout: peers/, online/, hostile/). The limits add up to ~570 s (one device call): `bench online` rewrites its
# report after every concurrency level, so a step stopped at its limit still leaves the levels it finished.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dspark-gpu}
DEVICE=${DEVICE:-cuda}
SMALL=${SMALL:-0}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TQDM_DISABLE=1
mkdir -p "$OUT/r"
log=$OUT/log.txt

step() {  # step LIMIT_S CMD...: run one step, log its output, never stop the script
  local limit=$1; shift
  echo "=== $(date -u +%T) [${limit}s] $*" | tee -a "$log"
  timeout "$limit" "$@" >>"$log" 2>&1
  local rc=$?
  echo "=== $(date -u +%T) rc=$rc$( [ $rc = 124 ] && echo ' (time limit)')" | tee -a "$log"
}

if [ "$SMALL" = 1 ]; then
  STEPS="--max-tokens 16 --num-prompts 1 --repeats 1"; PEERS="--num-prompts 1 --max-tokens 16"; ONLINE="--concurrency 1,4 --requests-per-client 1 --num-prompts 4"
  HOSTILE="--concurrency 1,4 --requests-per-client 1 --num-prompts 4"; LIMIT=300; HLIMIT=300
else
  STEPS="--max-tokens 96 --repeats 1"; PEERS="--num-prompts 2 --max-tokens 128 --repeats 2"
  ONLINE="--concurrency 1,4,16,64 --requests-per-client 2 --repeats 2"
  HOSTILE="--concurrency 1,4,16,64 --requests-per-client 2 --repeats 2"; LIMIT=150; HLIMIT=90
fi

{ command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
  python3 -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__)"
} >>"$log" 2>&1
[ "$DEVICE" = cuda ] && step 45 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py
for c in 1 16; do
  # shellcheck disable=SC2086
  step 35 python3 -m dspark bench steps --device "$DEVICE" --concurrency $c $STEPS --out "$OUT/r/steps-c$c"
  # shellcheck disable=SC2086
  step 35 env CUDA_MODULE_LOADING=EAGER python3 -m dspark bench steps --device "$DEVICE" --concurrency $c $STEPS \
    --out "$OUT/r/steps-c$c-eager"
done
# shellcheck disable=SC2086
step 140 python3 -m dspark bench peers --device "$DEVICE" --profile refresh $PEERS --out "$OUT/r/peers"
# shellcheck disable=SC2086
step "$LIMIT" python3 -m dspark bench online --device "$DEVICE" --profile refresh \
  --configs "none;mtp:static:1;dspark:static:7;dspark:dspark" $ONLINE --out "$OUT/r/online"
# shellcheck disable=SC2086
step "$HLIMIT" python3 -m dspark bench online --device "$DEVICE" --profile auto --workload hostile --lockstep \
  --configs "none;none;dspark:static:7;dspark:dspark" $HOSTILE --out "$OUT/r/hostile"
tar czf "$OUT/results.tar.gz" -C "$OUT" r
echo "=== $(date -u +%T) done" | tee -a "$log"
