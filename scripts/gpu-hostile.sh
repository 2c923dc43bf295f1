#!/usr/bin/env bash
# The real-conditions tests (tests/gpu/test_real_conditions.py), one group per torchrun, each
# bounded, so that a group that hangs or kills its processes does not hide the others.
#   device run (kind nvidia-h200-x2):  bash scripts/gpu-hostile.sh [--no-build]
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYDATACOPY_TIMEOUT_S=${PYDATACOPY_TIMEOUT_S:-10}
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
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
done
printf '%s\n' "${RESULTS[@]}"
! printf '%s\n' "${RESULTS[@]}" | grep -qv "rc=0 "
