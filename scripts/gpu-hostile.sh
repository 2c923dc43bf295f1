#!/usr/bin/env bash
# The real-conditions tests (tests/gpu/test_real_conditions.py), one group per torchrun, each
# bounded, so that a group that hangs or kills its processes does not hide the others.
#   device run (kind nvidia-h200-x2):  bash scripts/gpu-hostile.sh [--no-build]
#   device run (kind nvidia-h200):     the same: the two PEs share cuda:0 (PYDATACOPY_RANKS_PER_GPU=2)
#                                      under CUDA MPS, 50% of the SMs each, restarted after a failed group
# Under scripts/gpu-check.sh (GPU_CHECK_MPS=1) the caller has set all that up.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYDATACOPY_TIMEOUT_S=${PYDATACOPY_TIMEOUT_S:-10}
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
HERE=$(cd "$(dirname "$0")" && pwd)
if [ -z "${GPU_CHECK_MPS:-}" ] && [ "$(nvidia-smi -L | wc -l)" = 1 ]; then
  export PYDATACOPY_RANKS_PER_GPU=2 CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 GPU_CHECK_MPS=1
  export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/pydatacopy-mps}
  export CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY:-/tmp/pydatacopy-mps-log}
  bash "$HERE/mps.sh" start || echo "gpu-hostile: MPS did not start; the two PEs time-slice the GPU"
  trap 'bash "$HERE/mps.sh" stop' EXIT
fi
if [ "${1:-}" != --no-build ]; then
  $PY -m pip install --no-build-isolation --no-deps --no-index . > "$OUT/hostile-build.log" 2>&1 \
    || { tail -n 40 "$OUT/hostile-build.log"; exit 1; }
fi
declare -a RESULTS
for group in "graph_sendrecv" "graph_group" "graph_token" "graph_put" "refuse_capture" "temporaries" \
             "any_block_count" "all_but_a_few" "two_sizes" "two_streams" "too_large" \
             "bad_block_index" "busy_stream" "one_stream_wait"; do
  start=$SECONDS
  timeout ${GROUP_TIMEOUT:-120} torchrun --nproc_per_node=2 -m pytest tests/gpu/test_real_conditions.py \
    -q -x -rP -p no:cacheprovider -k "$group" > "$OUT/hostile-$group.log" 2>&1
  rc=$?
  RESULTS+=("$(printf '%-18s rc=%-4s %4ss  %s' "$group" "$rc" $((SECONDS - start)) \
    "$(grep -hE '^(FAILED|ERROR)|[0-9]+ (passed|failed)|Error:|AssertionError|Segmentation|exitcode|Not enough' "$OUT/hostile-$group.log" | head -n 4 | cut -c1-220 | tr '\n' ' ')")")
  # A failed client can leave MPS refusing the next ones.
  if [ "$rc" != 0 ] && [ "${GPU_CHECK_MPS:-0}" = 1 ]; then bash "$HERE/mps.sh" restart > /dev/null; fi
done
printf '%s\n' "${RESULTS[@]}"
! printf '%s\n' "${RESULTS[@]}" | grep -qv "rc=0 "
