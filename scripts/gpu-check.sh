#!/usr/bin/env bash
# Build from the working tree and run the multi-GPU tests and the benchmark, in one call:
#   device run (kind nvidia-h200-x2):  bash scripts/gpu-check.sh
# Logs go to $OUT (or ./gpu-check-out); the summary table is printed last. SANITIZE=0 leaves out
# the compute-sanitizer runs, SWEEP=1 adds the send/recv sweep, SKIP="name ..." skips steps.
# A device call runs at most 10 minutes, and everything together can take longer: PART=a (the
# suites, stress, torch order, UCX; about 4 minutes) and PART=b (real-conditions groups, kill and
# network checks, the bench, the sanitizers) split it in two calls; each builds first.
set -uo pipefail
case "${PART:-all}" in
  a) SKIP="${SKIP:-} hostile kill-check netns-check bench"; SANITIZE=0 ;;
  b) SKIP="${SKIP:-} cpu-tests doctor gpu2-tests gpu2-tests-rma note-test stress stress-rma stress-rma-async torch-order ucx-check" ;;
  all) ;;
  *) echo "gpu-check: PART=${PART} is not a, b or all"; exit 2 ;;
esac
# A part stops starting steps (and cuts the one running) at DEADLINE_S, so that its summary
# table still comes back within the device call's 10 minutes.
DEADLINE_S=${DEADLINE_S:-$([ "${PART:-all}" = all ] && echo 86400 || echo 560)}
# NVLink multicast can take the shared GPUs down: keep it off everywhere.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYDATACOPY_TIMEOUT_S=${PYDATACOPY_TIMEOUT_S:-30}
# The benchmark puts up to 1 GiB into symmetric memory, beside the send/recv staging.
export NVSHMEM_SYMMETRIC_SIZE=${NVSHMEM_SYMMETRIC_SIZE:-4G}
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
# Optional packages the machine lacks (nixl-cu13 for the bench's NIXL baseline, libucx-cu13 for
# the UCX check) travel as wheels in .whl/, made by scripts/device-wheels.sh and named in the
# call's carry; the steps that need them skip without.
if compgen -G ".whl/*.whl" > /dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
NGPU=$(nvidia-smi -L | wc -l)
declare -a SUMMARY

step() {  # step NAME COMMAND...: run, log to $OUT/NAME.log, record pass/fail and seconds
  local name=$1; shift
  local start=$SECONDS
  if [[ " ${SKIP:-} " == *" $name "* ]]; then  # SKIP="bench netns-check": a shorter check
    SUMMARY+=("$(printf '%-28s %-6s' "$name" SKIPPED)"); : > "$OUT/$name.log"; return 0
  fi
  local left=$((DEADLINE_S - SECONDS))
  if [ "$left" -lt 20 ]; then  # no time left in this part
    SUMMARY+=("$(printf '%-28s %-6s' "$name" NO-TIME)"); : > "$OUT/$name.log"; return 1
  fi
  echo "=== $name: $*"
  timeout -k 5 "$left" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/$name.log"
  SUMMARY+=("$(printf '%-28s %-6s %5ss' "$name" "$([ $rc = 0 ] && echo PASS || echo FAIL:$rc)" $((SECONDS - start)))")
  return $rc
}

nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
step build $PY -m pip install --no-build-isolation --no-deps --no-index -v . || { printf '%s\n' "${SUMMARY[@]}"; exit 1; }
# The real-conditions tests one group per process first (a group that hangs or kills its
# processes cannot hide the others), then with the rest of the suite.
step hostile bash scripts/gpu-hostile.sh --no-build
step cpu-tests $PY -m pytest tests/test_cpu.py tests/test_bad_inputs.py -q
step doctor $PY -m pydatacopy.doctor
step gpu2-tests timeout 420 torchrun --nproc_per_node=2 -m pytest tests/gpu -q -p no:cacheprovider ${GPU_TEST_ARGS:-}
# The same suite as if no peer were directly reachable: the NVSHMEM RMA path of a remote peer,
# with every local address handed to NVSHMEM checked to be symmetric or registered.
step gpu2-tests-rma env PYDATACOPY_FORCE_RMA=1 PYDATACOPY_CHECK_RMA=1 timeout 420 torchrun --nproc_per_node=2 -m pytest tests/gpu -q -p no:cacheprovider ${GPU_TEST_ARGS:-}
step note-test timeout 300 torchrun --nproc_per_node=2 examples/note_test.py
step stress timeout 400 torchrun --nproc_per_node=2 tests/stress/stress.py --rounds ${STRESS_ROUNDS:-10000}
step stress-rma env PYDATACOPY_FORCE_RMA=1 PYDATACOPY_CHECK_RMA=1 timeout 400 torchrun --nproc_per_node=2 tests/stress/stress.py --rounds ${STRESS_RMA_ROUNDS:-3000} --empty-cache-every 25
# torch's cudaMallocAsync allocator: every tensor its own allocation, addresses reused at once.
step stress-rma-async env PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync PYDATACOPY_FORCE_RMA=1 PYDATACOPY_CHECK_RMA=1 timeout 300 torchrun --nproc_per_node=2 tests/stress/stress.py --rounds ${STRESS_RMA_ROUNDS:-1000} --empty-cache-every 25
step torch-order timeout 400 $PY tests/stress/torch_order_check.py
step ucx-check timeout 200 $PY tests/stress/ucx_check.py
step kill-check timeout 400 $PY tests/stress/kill_check.py --timeout 5
step netns-check timeout 400 $PY tests/stress/netns_check.py --timeout 30
step bench timeout 300 torchrun --nproc_per_node=2 -m pydatacopy.bench --json "$OUT/bench.json" --csv "$OUT/bench.csv" --plot "$OUT/bench.png" ${BENCH_ARGS:--b 4K -e 1G -f 4 -d all}
if [ "${SANITIZE:-1}" = 1 ]; then
  # A representative subset under compute-sanitizer (slow: device puts drop to a few GB/s).
  for tool in memcheck racecheck; do
    # --report-api-errors no: NCCL's and NVSHMEM's init probe kernel images and get
    # cudaErrorNoKernelImageForDevice back by design; those return codes are not our errors.
    step sanitizer-$tool timeout 300 torchrun --nproc_per_node=2 --no-python compute-sanitizer \
      --tool $tool --report-api-errors no --error-exitcode 9 --print-limit 40 $PY -m pytest tests/gpu -q -p no:cacheprovider \
      -k "byte_exact_both_ways and 3-7 or sendrecv_both_ways_byte_exact and 4096 or put_blocks_kv_cache_style and 300-auto or barrier_with_deadline or graph_sendrecv and 4K or any_block_count and 7 or bad_block_index or one_stream_wait or two_sizes"
  done
fi
if [ "${SWEEP:-0}" = 1 ]; then step sweep bash scripts/sweep-send-recv.sh; fi

echo
echo "=== gpu-check $(date -u +%Y-%m-%dT%H:%MZ) on $NGPU x $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
printf '%s\n' "${SUMMARY[@]}"
grep -h " rc=" "$OUT/hostile.log" 2>/dev/null
for log in cpu-tests gpu2-tests gpu2-tests-rma; do echo "$log: $(grep -h "passed\|failed" "$OUT/$log.log" | tail -n 2 | tr '\n' ' ')"; done
grep -h "test_bandwidth" "$OUT/note-test.log" | tail -n 2
grep -h "^stress:\|MISMATCH\|Error" "$OUT/stress.log" "$OUT/stress-rma.log" "$OUT/stress-rma-async.log" | tail -n 6
grep -h "^torch-order-check" "$OUT/torch-order.log"
grep -h "^ucx-check" "$OUT/ucx-check.log"
grep -h "^kill-check" "$OUT/kill-check.log"
grep -h "^netns-check" "$OUT/netns-check.log"
cat "$OUT/doctor.log"
grep -h "^===\|^send/recv" "$OUT/sweep.log" 2>/dev/null
grep -h "ERROR SUMMARY\|RACECHECK SUMMARY" "$OUT"/sanitizer-*.log 2>/dev/null | sort | uniq -c
sed -n '/^op /,$p' "$OUT/bench.log"
# At most 8 files come back from the device tool: keep the summary, pack the logs.
(cd "$OUT" && tar czf logs.tgz *.log && find . -name '*.log' ! -name gpu-check.log -delete) 2>/dev/null
! printf '%s\n' "${SUMMARY[@]}" | grep -q FAIL
