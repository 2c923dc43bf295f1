#!/usr/bin/env bash
# Build from the working tree and run the GPU tests, the checks and the benchmark, in one call:
#   device run (kind nvidia-h200-x2):  bash scripts/gpu-check.sh          (one PE per GPU, as before)
#   device run (kind nvidia-h200):     bash scripts/gpu-check.sh          (one GPU: PEs share cuda:0)
# One GPU: every two-PE step runs 2 PEs on cuda:0 (PYDATACOPY_RANKS_PER_GPU=2, torch.distributed on
# gloo) under CUDA MPS, started here (scripts/mps.sh, as root), 50% of the SMs per client; MPS is
# restarted before every GPU step (a failed client leaves it refusing new ones) and stopped at the end.
# The N-PE steps run 4 PEs: on one GPU at 25% each; on 2+ GPUs PYDATACOPY_RANKS_PER_GPU=ceil(4/NGPU)
# (under MPS where that is more than one).
# A device call runs at most 10 minutes: PART=a (suites on the direct and forced-RMA paths, the
# N-PE tests, note test, stress) and PART=b (kill ring, torch order, UCX, kill and network checks,
# sanitizers, bench, the real-conditions groups one by one on 2+ GPUs) each fit one call; each
# builds first and stops starting steps at DEADLINE_S, so that its summary always comes back.
# QUICK=1: build, the suite on the direct and the forced-RMA path (2 PEs) and the N-PE step, in at
# most 4 minutes, for iterating. ONLY="step ..." runs just those steps (and the build);
# SKIP="step ..." leaves steps out; SANITIZE=0 leaves out the compute-sanitizer runs; SWEEP=1 adds
# the send/recv sweep; HOSTILE=1 runs the real-conditions groups one by one on one GPU too (by
# default there only after a failed suite: the same tests run inside the suites). MPS=0: no MPS
# (time-sliced, slow). BEFORE=DIR: an earlier revision's tree, benched in the same call (below).
# Logs are packed into $OUT/logs.tgz; the summary table is printed last.
set -uo pipefail
QUICK=${QUICK:-0}
PART=${PART:-all}
[ "$QUICK" = 1 ] && PART=quick
case "$PART" in
  a|b|all|quick) ;;
  *) echo "gpu-check: PART=${PART} is not a, b or all"; exit 2 ;;
esac
NGPU=$(nvidia-smi -L | wc -l)
# A part stops starting steps (and cuts the one running) at DEADLINE_S, so that its summary
# table still comes back within the device call.
case "$PART" in
  quick) DEADLINE_S=${DEADLINE_S:-225} ;;
  all) DEADLINE_S=${DEADLINE_S:-86400} ;;
  *) DEADLINE_S=${DEADLINE_S:-510} ;;
esac
# NVLink multicast can take the shared GPUs down: keep it off everywhere.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYDATACOPY_TIMEOUT_S=${PYDATACOPY_TIMEOUT_S:-30}
# The benchmark puts up to 1 GiB into symmetric memory, beside the send/recv staging.
export NVSHMEM_SYMMETRIC_SIZE=${NVSHMEM_SYMMETRIC_SIZE:-4G}
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
HERE=$(cd "$(dirname "$0")" && pwd)
# Optional packages the machine lacks (nixl-cu13 for the bench's NIXL baseline, libucx-cu13 for
# the UCX check) travel as wheels in .whl/, made by scripts/device-wheels.sh and named in the
# call's carry; the steps that need them skip without.
if compgen -G ".whl/*.whl" > /dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

# ---- PEs, GPUs and MPS ---------------------------------------------------------------------
N_PES=${N_PES:-4}                          # the N-PE steps
NPES_PER_GPU=$(( (N_PES + NGPU - 1) / NGPU ))
export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/pydatacopy-mps}
export CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY:-/tmp/pydatacopy-mps-log}
MPS_ON=0
declare -a SUMMARY NOTES
mps() {  # mps start|stop|restart, logged; MPS_ON follows
  [ "${MPS:-1}" = 0 ] && return 0
  [ "$1" = stop ] && [ "$MPS_ON" = 0 ] && return 0  # only the daemon this script started
  bash "$HERE/mps.sh" "$1" >> "$OUT/mps.log" 2>&1
  local rc=$?
  case "$1" in stop) MPS_ON=0 ;; *) [ $rc = 0 ] && MPS_ON=1 || MPS_ON=0 ;; esac
  [ $rc = 0 ] || echo "gpu-check: mps $1 failed: $(tail -n 2 "$OUT/mps.log" | tr '\n' ' ')"
  return $rc
}
trap 'mps stop' EXIT
ONE_GPU=0
if [ "$NGPU" = 1 ]; then
  ONE_GPU=1
  export PYDATACOPY_RANKS_PER_GPU=2 CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50
  GPU_CHECK_MPS=1; [ "${MPS:-1}" = 0 ] && GPU_CHECK_MPS=0
  export GPU_CHECK_MPS  # scripts/gpu-hostile.sh: MPS is managed here
  mps start || NOTES+=("MPS did not start (mps.log in logs.tgz): the PEs time-slice the GPU, slowly")
fi
# The environment of a step of `pes` PEs: ranks per GPU and each client's share of the SMs.
pes() {
  local per_gpu=$(( ($1 + NGPU - 1) / NGPU ))
  if [ "$per_gpu" -gt 1 ]; then
    echo "PYDATACOPY_RANKS_PER_GPU=$per_gpu CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / per_gpu))"
  else
    echo "PYDATACOPY_RANKS_PER_GPU=1"
  fi
}

# ---- steps ---------------------------------------------------------------------------------
declare -A RESULT
GPU_STEPS_RUN=0
step() {  # step NAME COMMAND...: run, log to $OUT/NAME.log, record pass/fail and seconds
  local name=$1; shift
  local start=$SECONDS
  local group=$name; [[ "$name" == sanitizer-* ]] && group=sanitizers  # ONLY=sanitizers: all of them
  [[ "$name" == *-before ]] && group=${name%-before}  # ONLY=bench: bench-before too (BEFORE=...)
  if [[ " ${SKIP:-} " == *" $name "* ]] || { [ -n "${ONLY:-}" ] && [[ "$name" != build && "$name" != build-torch-backend ]] && \
       [[ " $ONLY " != *" $name "* ]] && [[ " $ONLY " != *" $group "* ]]; }; then
    SUMMARY+=("$(printf '%-28s %-8s' "$name" SKIPPED)"); RESULT[$name]=SKIPPED; : > "$OUT/$name.log"; return 0
  fi
  local left=$((DEADLINE_S - SECONDS))
  if [ "$left" -lt 20 ]; then  # no time left in this part
    SUMMARY+=("$(printf '%-28s %-8s' "$name" NO-TIME)"); RESULT[$name]=NO-TIME; : > "$OUT/$name.log"; return 1
  fi
  # A fresh MPS for every GPU step: a client that failed or was killed in the last one can
  # leave it refusing new clients.
  if [ "$name" != build ] && [ "$name" != cpu-tests ]; then
    if [ "$MPS_ON" = 1 ] && [ "$GPU_STEPS_RUN" -gt 0 ]; then mps restart; fi
    GPU_STEPS_RUN=$((GPU_STEPS_RUN + 1))
  fi
  echo "=== $name: $*"
  timeout -k 5 "$left" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/$name.log"
  local verdict; verdict=$([ $rc = 0 ] && echo PASS || echo "FAIL:$rc")
  # A step that ran nothing says SKIPPED, not PASS: a check that skipped itself (ucx-check without
  # libucx prints "ucx-check: SKIPPED: ..." and exits 0), or pytest with every test skipped.
  if [ $rc = 0 ] && ran_nothing "$OUT/$name.log"; then verdict=SKIPPED; fi
  RESULT[$name]=$verdict
  SUMMARY+=("$(printf '%-28s %-8s %5ss  %s' "$name" "$verdict" $((SECONDS - start)) "$(counts "$name")")")
  return $rc
}
ran_nothing() {  # ran_nothing LOG: the step only skipped
  local log=$1
  if grep -qE "^[a-z_-]+: SKIPPED" "$log" && ! grep -qE "^[a-z_-]+:? .*\bPASS\b" "$log"; then return 0; fi
  grep -qE "^=* ?[0-9]+ skipped" "$log" && ! grep -qE "[0-9]+ (passed|failed|errors?)" "$log"
}
counts() {  # what a step's log counts: pytest's last line, the stress rounds, or PASS/FAIL lines
  local log="$OUT/$1.log" line
  if grep -qE "^[a-z_]+ +rc=" "$log" 2>/dev/null; then  # scripts/gpu-hostile.sh: one line per group
    echo "$(grep -cE "^[a-z_]+ +rc=0 " "$log") of $(grep -cE "^[a-z_]+ +rc=" "$log") groups passed"; return
  fi
  line=$(grep -hE "[0-9]+ (passed|failed|errors?|skipped|deselected)" "$log" 2>/dev/null | tail -n 1 | sed 's/=//g; s/^ *//')
  [ -z "$line" ] && line=$(grep -hoE "^stress: [0-9]+ rounds( \(of [0-9]+)?" "$log" 2>/dev/null | tail -n 1)
  if [ -z "$line" ]; then
    local pass fail
    pass=$(grep -cE "^[a-z_-]+[: ].*\bPASS\b" "$log" 2>/dev/null); fail=$(grep -cE "^[a-z_-]+[: ].*\bFAIL\b" "$log" 2>/dev/null)
    [ "$((pass + fail))" -gt 0 ] && line="$pass PASS, $fail FAIL lines"
  fi
  echo "$line" | cut -c1-100
}
has() { [[ " $1 " == *" $2 "* ]]; }

case "$PART" in
  quick) STEPS="gpu2-tests gpu2-tests-rma n-pes distributed" ;;
  a) STEPS="cpu-tests doctor gpu2-tests gpu2-tests-rma n-pes distributed note-test stress stress-rma stress-rma-async" ;;
  b) STEPS="hostile kill-ring kill-moe kill-distributed torch-order ucx-check kill-check netns-check sanitizers bench bench-moe" ;;
  all) STEPS="cpu-tests doctor gpu2-tests gpu2-tests-rma gpu2-tests-expandable n-pes distributed note-test stress stress-rma stress-rma-async hostile kill-ring kill-moe kill-distributed torch-order ucx-check kill-check netns-check sanitizers bench bench-moe" ;;
esac
# On one GPU the stress runs are cut by time (fewer rounds), so that a part fits one call.
if [ "$ONE_GPU" = 1 ]; then
  STRESS_CAP="--max-seconds ${STRESS_SECONDS:-50}"; STRESS_RMA_CAP="--max-seconds ${STRESS_RMA_SECONDS:-35}"
  STRESS_ASYNC_CAP="--max-seconds ${STRESS_ASYNC_SECONDS:-25}"
  NOTES+=("one GPU: 2 PEs on cuda:0 under MPS at 50% each (PYDATACOPY_RANKS_PER_GPU=2, gloo), N-PE steps 4 PEs at 25%; stress runs cut at ${STRESS_SECONDS:-50}/${STRESS_RMA_SECONDS:-35}/${STRESS_ASYNC_SECONDS:-25} s (rounds done: below)")
else
  STRESS_CAP=""; STRESS_RMA_CAP=""; STRESS_ASYNC_CAP=""
fi
SUITE="-m pytest tests/gpu -q -p no:cacheprovider -rs"
# A GPU test still running after TEST_HANG_S seconds (default 180) ends its rank with every thread's
# traceback in $OUT/hang-rank<R>.log (tests/gpu/conftest.py; packed into logs.tgz): a hang costs
# that, not the rest of its step's limit.
export PYDATACOPY_TEST_HANG_S=${TEST_HANG_S:-180} PYDATACOPY_TEST_HANG_DIR=$OUT

nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
step build $PY -m pip install --no-build-isolation --no-deps --no-index -v . || { printf '%s\n' "${SUMMARY[@]}"; exit 1; }
# The torch.distributed backend's native part, built against this torch once, here, rather than
# inside the first test that makes a group (python/pydatacopy/distributed/native.py).
step build-torch-backend env PYDATACOPY_DISTRIBUTED_NATIVE=1 $PY -c "from pydatacopy.distributed import native; assert native.load() is not None, native.failure(); print(native.cache_dir())"
# BEFORE=DIR (a source tree of an earlier revision: `git archive REV | tar x -C DIR`): built into
# a directory of its own while the tests run, then its bench and bench-moe run right after this
# tree's, same call, same GPU (steps bench-before, bench-moe-before; BENCH_BEFORE_ARGS when its
# bench knows other ops; BEFORE_MOE=DIR: another tree for bench-moe-before), and
# scripts/bench_compare.py prints the two side by side.
BEFORE_MOE=${BEFORE_MOE:-${BEFORE:-}}
declare -A BEFORE_PID
build_before() {  # build_before NAME DIR: DIR built into /tmp/pydatacopy-NAME in the background
  rm -rf "/tmp/pydatacopy-$1"
  # A bare directory name is a requirement to pip (BEFORE=before-REV built nothing, 2026-12-07).
  local dir=$2
  case "$dir" in /*|./*|../*) ;; *) dir=./$dir ;; esac
  ( nice -n 19 $PY -m pip install --no-build-isolation --no-deps --no-index --target "/tmp/pydatacopy-$1" "$dir" \
      > "$OUT/build-$1.log" 2>&1 &&
    # Its module finds NVSHMEM at $ORIGIN/../nvidia/nvshmem/lib (the installed layout): the same
    # nvidia packages as this tree's, beside it.
    ln -sfn "$($PY -c 'import os, nvidia.nvshmem as n; print(os.path.dirname(list(n.__path__)[0]))')" \
      "/tmp/pydatacopy-$1/nvidia" >> "$OUT/build-$1.log" 2>&1; echo $? > "$OUT/build-$1.rc" ) &
  BEFORE_PID[$1]=$!
}
[ -n "${BEFORE:-}" ] && build_before before "$BEFORE"
[ -n "$BEFORE_MOE" ] && [ "$BEFORE_MOE" != "${BEFORE:-}" ] && build_before before-moe "$BEFORE_MOE"
before_site() {  # before_site NAME: SITE= the built tree's directory, or fails (and says so)
  SITE=
  [ -n "${BEFORE_PID[$1]:-}" ] || return 1
  wait "${BEFORE_PID[$1]}" 2>/dev/null  # (this shell's child: not from a $(...) subshell)
  if [ "$(cat "$OUT/build-$1.rc" 2>/dev/null)" != 0 ]; then
    NOTES+=("the earlier tree for $1 did not build (build-$1.log in logs.tgz)"); return 1
  fi
  SITE=/tmp/pydatacopy-$1
}
# The CPU tests set their own environment: not the one-GPU settings of this script.
has "$STEPS" cpu-tests && step cpu-tests env -u PYDATACOPY_RANKS_PER_GPU -u CUDA_MPS_ACTIVE_THREAD_PERCENTAGE \
  $PY -m pytest tests/test_runtime.py tests/test_network.py tests/test_doctor.py tests/test_double_buffer_cpu.py \
    tests/test_host_path.py tests/test_bad_inputs.py -q
has "$STEPS" doctor && step doctor $PY -m pydatacopy.doctor
# GPU_TEST_K: a pytest -k expression for the 2-PE suites, spaces allowed ("compat or moe");
# GPU_TEST_TIMEOUT: the gpu2-tests step's limit in seconds (420).
K_ARGS=()
[ -n "${GPU_TEST_K:-}" ] && K_ARGS=(-k "$GPU_TEST_K")
if has "$STEPS" gpu2-tests; then
  step gpu2-tests timeout ${GPU_TEST_TIMEOUT:-420} torchrun --nproc_per_node=2 $SUITE ${K_ARGS[@]+"${K_ARGS[@]}"} ${GPU_TEST_ARGS:-}
  # The same suite as if no peer were directly reachable: the NVSHMEM RMA path of a remote peer,
  # with every local address handed to NVSHMEM checked to be symmetric or registered.
  step gpu2-tests-rma env PYDATACOPY_FORCE_RMA=1 PYDATACOPY_CHECK_RMA=1 timeout 420 torchrun --nproc_per_node=2 $SUITE ${K_ARGS[@]+"${K_ARGS[@]}"} ${GPU_TEST_ARGS:-}
fi
# The same suite under torch's expandable segments (issue 36: zero-copy into VMM memory, chunks
# that come and go): asked for by name (ONLY="gpu2-tests-expandable") or with PART=all.
if has "$STEPS" gpu2-tests-expandable; then
  # EXPANDABLE_TEST_ARGS (unquoted words, e.g. --deselect=tests/gpu/test_moe.py): this step's own, else GPU_TEST_ARGS.
  # SEGV_BACKTRACE=1: a native backtrace on a crash (scripts/segv_backtrace.c, preloaded): the
  # SIGSEGV inside torch.cuda.empty_cache() seen here (2026-12-06) showed only a Python frame.
  # pytest's faulthandler plugin is turned off then: its handler, installed after the preloaded
  # one, printed only Python frames (call 1 of 2026-12-06f).
  PRELOAD=()
  NO_FAULTHANDLER=""
  if [ "${SEGV_BACKTRACE:-0}" = 1 ] && gcc -shared -fPIC -O1 -o /tmp/segv_backtrace.so "$HERE/segv_backtrace.c" >> "$OUT/build.log" 2>&1; then
    PRELOAD=(LD_PRELOAD=/tmp/segv_backtrace.so PYDATACOPY_SEGV_BACKTRACE_SO=/tmp/segv_backtrace.so)
    NO_FAULTHANDLER="-p no:faulthandler -vv"
  fi
  step gpu2-tests-expandable env ${PRELOAD[@]+"${PRELOAD[@]}"} PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 420 torchrun --nproc_per_node=2 $SUITE $NO_FAULTHANDLER ${EXPANDABLE_TEST_ARGS:-${GPU_TEST_ARGS:-}}
  # Symbolized only after a crash (a "signal" record; the refused-sigaction records alone took
  # 8 minutes of addr2line, 2026-12-06 call 1 of the eighth session), and at most 60 s.
  if [ -n "$NO_FAULTHANDLER" ] && grep -aEq "=== segv_backtrace: pid [0-9]+ signal" "$OUT/gpu2-tests-expandable.log"; then
    timeout 60 $PY "$HERE/symbolize_backtrace.py" "$OUT/gpu2-tests-expandable.log" > "$OUT/gpu2-tests-expandable.symbols" 2>&1 || true
    head -n 80 "$OUT/gpu2-tests-expandable.symbols"
  fi
fi
# 2+ GPUs with more PEs than GPUs (the N-PE steps): MPS for as long as those run.
SHARED_MPS=0
shared_mps() {  # shared_mps start|stop
  if [ "$1" = start ] && [ "$ONE_GPU" = 0 ] && [ "$NPES_PER_GPU" -gt 1 ] && [ "$MPS_ON" = 0 ]; then
    mps start && SHARED_MPS=1
  elif [ "$1" = stop ] && [ "$SHARED_MPS" = 1 ]; then
    mps stop; SHARED_MPS=0
  fi
  return 0
}
# The tests for any number of PEs, with 4.
if has "$STEPS" n-pes; then
  shared_mps start
  # shellcheck disable=SC2046  # pes prints NAME=VALUE words for env
  # NPES_K: a -k expression for this step (e.g. N_PES=8 NPES_K="compat").
  NPES_K_ARGS=()
  [ -n "${NPES_K:-}" ] && NPES_K_ARGS=(-k "$NPES_K")
  step n-pes env $(pes "$N_PES") timeout 300 torchrun --nproc_per_node="$N_PES" $SUITE -m any_pes ${NPES_K_ARGS[@]+"${NPES_K_ARGS[@]}"}
  shared_mps stop
fi
# The torch.distributed backend as its users start it: the default group on
# "cpu:gloo,cuda:pydatacopy" (NVSHMEM started through the group's store), with 2 and N PEs, then
# as users get it (the native backend; the variable unset) with 2 and N PEs.
if has "$STEPS" distributed; then
  shared_mps start
  # shellcheck disable=SC2046
  step distributed bash -c "env $(pes 2) PYDATACOPY_DISTRIBUTED_NATIVE=0 timeout 200 torchrun --nproc_per_node=2 tests/gpu/distributed_default_group.py && \
    env $(pes "$N_PES") PYDATACOPY_DISTRIBUTED_NATIVE=0 timeout 200 torchrun --nproc_per_node=$N_PES tests/gpu/distributed_default_group.py && \
    env -u PYDATACOPY_DISTRIBUTED_NATIVE $(pes 2) timeout 200 torchrun --nproc_per_node=2 tests/gpu/distributed_default_group.py && \
    env -u PYDATACOPY_DISTRIBUTED_NATIVE $(pes "$N_PES") timeout 200 torchrun --nproc_per_node=$N_PES tests/gpu/distributed_default_group.py"
  shared_mps stop
fi
# The MoE tests with 8 PEs (12% of the SMs each on one GPU): asked for by name (ONLY="moe-8",
# or MOE8=1 with a part), as they take a few minutes beside the 4-PE step's run of them.
if [[ " ${ONLY:-} " == *" moe-8 "* ]] || [ "${MOE8:-0}" = 1 ]; then
  shared_mps start
  # shellcheck disable=SC2046  # pes prints NAME=VALUE words for env
  step moe-8 env $(pes 8) timeout 400 torchrun --nproc_per_node=8 -m pytest tests/gpu/test_moe.py -q -p no:cacheprovider -rs
  shared_mps stop
fi
# The real-conditions tests one group per process (a group that hangs or kills its processes
# cannot hide the others). On one GPU only to find the culprit after a failed suite (the same
# tests ran inside it), or with HOSTILE=1.
hostile_wanted() {
  [ "$ONE_GPU" = 0 ] && has "$STEPS" hostile && return 0
  [ "${HOSTILE:-auto}" = 1 ] && has "$STEPS" hostile && return 0
  [ "${HOSTILE:-auto}" = auto ] && [ "$PART" != quick ] && \
    [[ "${RESULT[gpu2-tests]:-}${RESULT[gpu2-tests-rma]:-}" == *FAIL* ]]
}
if [ "$ONE_GPU" = 1 ] && hostile_wanted; then step hostile bash scripts/gpu-hostile.sh --no-build; fi
# The design note's test, then the README's example (examples/quickstart.py) as a user runs it.
has "$STEPS" note-test && step note-test bash -c "timeout 300 torchrun --nproc_per_node=2 examples/note_test.py && timeout 200 torchrun --nproc_per_node=2 examples/quickstart.py"
if has "$STEPS" stress; then
  step stress timeout 400 torchrun --nproc_per_node=2 tests/stress/stress.py --rounds ${STRESS_ROUNDS:-10000} $STRESS_CAP
  step stress-rma env PYDATACOPY_FORCE_RMA=1 PYDATACOPY_CHECK_RMA=1 timeout 400 torchrun --nproc_per_node=2 tests/stress/stress.py --rounds ${STRESS_RMA_ROUNDS:-3000} --empty-cache-every 25 $STRESS_RMA_CAP
  # torch's cudaMallocAsync allocator: every tensor its own allocation, addresses reused at once.
  step stress-rma-async env PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync PYDATACOPY_FORCE_RMA=1 PYDATACOPY_CHECK_RMA=1 timeout 300 torchrun --nproc_per_node=2 tests/stress/stress.py --rounds ${STRESS_RMA_ROUNDS:-1000} --empty-cache-every 25 $STRESS_ASYNC_CAP
fi
if [ "$ONE_GPU" = 0 ] && hostile_wanted; then step hostile bash scripts/gpu-hostile.sh --no-build; fi
if has "$STEPS" kill-ring; then  # 4 processes of its own, one killed (tests/stress/kill_ring.py)
  shared_mps start
  # shellcheck disable=SC2046  # pes prints NAME=VALUE words for env
  step kill-ring env $(pes "$N_PES") timeout 300 $PY tests/stress/kill_ring.py
  shared_mps stop
fi
if has "$STEPS" kill-moe; then  # 4 processes of its own, one killed during MoE dispatch/combine
  shared_mps start
  # shellcheck disable=SC2046  # pes prints NAME=VALUE words for env
  step kill-moe env $(pes 4) timeout 240 $PY tests/stress/kill_moe.py
  shared_mps stop
fi
if has "$STEPS" kill-distributed; then  # the same through torch.distributed's all_to_all_single (issue 38)
  shared_mps start
  # shellcheck disable=SC2046  # pes prints NAME=VALUE words for env
  step kill-distributed bash -c "env $(pes 4) timeout 200 $PY tests/stress/kill_moe.py --workload distributed --timeout 15 && \
    env $(pes 4) timeout 200 $PY tests/stress/kill_moe.py --workload distributed-native --timeout 15"
  shared_mps stop
fi
has "$STEPS" torch-order && step torch-order timeout 400 $PY tests/stress/torch_order_check.py
has "$STEPS" ucx-check && step ucx-check timeout 200 $PY tests/stress/ucx_check.py
if has "$STEPS" kill-check; then
  if [ "$MPS_ON" = 1 ]; then  # a killed client can leave MPS refusing the next: one MPS per scenario
    # KILL_SCENARIOS="kill kill-small": only those (each takes about 10 s with its MPS restart).
    step kill-check bash -c 'rc=0; for s in '"${KILL_SCENARIOS:-kill kill-small no-finalize late-exit late-finalize absent-barrier absent-alloc absent-init init-after-finalize}"'; do
        timeout 150 '"$PY"' tests/stress/kill_check.py --timeout 5 --only $s || rc=1
        bash '"$HERE"'/mps.sh restart > /dev/null; done; exit $rc'
  else
    step kill-check timeout 400 $PY tests/stress/kill_check.py --timeout 5
  fi
fi
has "$STEPS" netns-check && step netns-check timeout 400 $PY tests/stress/netns_check.py --timeout 30
if has "$STEPS" sanitizers && [ "${SANITIZE:-1}" = 1 ]; then
  # A representative subset under compute-sanitizer (slow: device puts drop to a few GB/s).
  # --report-api-errors no: NCCL's and NVSHMEM's init probe kernel images and get
  # cudaErrorNoKernelImageForDevice back by design; those return codes are not our errors.
  SUBSET="byte_exact_both_ways and 3-7 or sendrecv_both_ways_byte_exact and 4096 or put_blocks_kv_cache_style and 300-auto or barrier_with_deadline or graph_sendrecv and 4K or any_block_count and 7 or bad_block_index or one_stream_wait or two_sizes or more_messages_in_a_row or mixes_the_protocol or inside_a_long_group and 16-low-latency or only_low_latency_messages_beyond_the_ring or moves_once_chunk_by_chunk or torch_expandable_segments_move_once or expand_false_too_many_tokens and bf16x65-in-region and direct or dispatch_and_combine_are_byte_exact and random and bf16-pre_reduce and direct"
  for tool in memcheck racecheck; do
    step sanitizer-$tool timeout 300 torchrun --nproc_per_node=2 --no-python compute-sanitizer \
      --tool $tool --report-api-errors no --error-exitcode 9 --print-limit 40 $PY $SUITE -k "$SUBSET"
    # Should the sanitizer refuse MPS clients, the same subset time-sliced, without MPS.
    if [ "$MPS_ON" = 1 ] && [[ "${RESULT[sanitizer-$tool]}" == FAIL* ]] && \
       grep -qiE "MPS|busy or unavailable|not supported" "$OUT/sanitizer-$tool.log"; then
      RESULT[sanitizer-$tool]=MPS-REFUSED  # judged by the run without MPS
      SUMMARY[${#SUMMARY[@]}-1]=${SUMMARY[-1]/FAIL:/MPS-REFUSED:}
      mps stop
      step sanitizer-$tool-no-mps env -u CUDA_MPS_ACTIVE_THREAD_PERCENTAGE timeout 300 torchrun --nproc_per_node=2 --no-python \
        compute-sanitizer --tool $tool --report-api-errors no --error-exitcode 9 --print-limit 40 $PY $SUITE -k "$SUBSET"
      NOTES+=("sanitizer-$tool refused under MPS: sanitizer-$tool-no-mps ran it time-sliced")
      mps start
    fi
  done
fi
if has "$STEPS" bench; then
  # Every send/recv path (default: what a user gets; zero-copy, staged, low-latency forced) and
  # NIXL (skipped, with a line that says so, where it does not import), 4 KiB to 1 GiB both ways.
  # Fits the step's 300 s: the same sizes with fewer rows took 18 s (2026-12-02b, call 5); rows
  # above 64 MiB time fewer calls (5 of 20 from 256 MiB: bench/_harness.py counts_for_size).
  BENCH_SIZES="-b 4K -e 1G -f 4 -d all"
  if [ "$ONE_GPU" = 1 ]; then
    # One GPU: no NCCL (it refuses two ranks on one GPU) and no torch symmetric memory (it does not
    # share a GPU) rows; the memory is local, so the figures are costs beside a bare copy, not links.
    BENCH_OPS=memcpy,kernel_copy,ce_handoff,kernel_handoff,put_ce,put_sm,put_rma,sendrecv_default,sendrecv_distributed,sendrecv_distributed_python,sendrecv,sendrecv_ce,sendrecv_staged,sendrecv_ll,nixl,tokens,latency,host,put_many,graph,engagement,group
    DEFAULT_BENCH="$BENCH_SIZES --ops $BENCH_OPS"
  else
    BENCH_OPS=; DEFAULT_BENCH=$BENCH_SIZES  # every op but compile, NCCL and torch symm_mem too
  fi
  # The earlier tree's build (BEFORE=) done first: not compiling beside this tree's bench.
  before_site before; have_before=$?
  step bench timeout 300 torchrun --nproc_per_node=2 -m pydatacopy.bench --json "$OUT/bench.json" --csv "$OUT/bench.csv" --plot "$OUT/bench.png" ${BENCH_ARGS:-$DEFAULT_BENCH}
  if [ "$have_before" = 0 ]; then
    # The earlier tree's bench refuses ops it does not know: by default it gets those it knows.
    BEFORE_BENCH=$DEFAULT_BENCH
    if [ -n "$BENCH_OPS" ] && before_ops=$(PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" $PY -c 'import sys
from pydatacopy.bench import OPS
print(",".join(op for op in sys.argv[1].split(",") if op in OPS))' "$BENCH_OPS" 2>> "$OUT/build-before.log"); then
      BEFORE_BENCH="$BENCH_SIZES --ops $before_ops"
    fi
    step bench-before env PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" timeout 300 torchrun --nproc_per_node=2 \
      -m pydatacopy.bench --json "$OUT/bench-before.json" ${BENCH_BEFORE_ARGS:-${BENCH_ARGS:-$BEFORE_BENCH}}
    $PY scripts/bench_compare.py "$OUT/bench-before.json" "$OUT/bench.json" > "$OUT/bench-compare.md" 2>&1
  fi
  # The send/recv rows under torch's other allocator settings (issue 36: `alloc` in each row),
  # from 64 MiB, and the engagement runs; one JSON ($OUT/bench-alloc.json) for both settings.
  # The default allocator's rows are the bench's above.
  step bench-alloc bash scripts/bench-alloc.sh "$OUT/bench-alloc.json"
fi
# Kernel timelines of send/recv messages queued back to back (issue 35), asked for by name
# (ONLY="timeline ..."): 2 PEs, TIMELINE_SIZES (default 4K,1M,4M,16M).
if [[ " ${ONLY:-} " == *" timeline "* ]]; then
  step timeline timeout 240 torchrun --nproc_per_node=2 -m pydatacopy.bench.timeline \
    --sizes "${TIMELINE_SIZES:-4K,1M,4M,16M}" --json "$OUT/timeline.json"
  # BEFORE=DIR: the earlier tree's timeline right after, same sizes (its own stamps and columns).
  if before_site before; then
    step timeline-before env PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" timeout 240 torchrun --nproc_per_node=2 \
      -m pydatacopy.bench.timeline --sizes "${TIMELINE_SIZES:-4K,1M,4M,16M}" --json "$OUT/timeline-before.json"
  fi
fi
# MoE dispatch/combine with N_PES PEs (4: the issue's target shape; N_PES=8 for eight).
if has "$STEPS" bench-moe; then
  shared_mps start
  moe_before=before; [ "$BEFORE_MOE" != "${BEFORE:-}" ] && moe_before=before-moe
  before_site $moe_before; have_before=$?  # (its build done before this tree's bench-moe)
  moe_site=$SITE
  # shellcheck disable=SC2046  # pes prints NAME=VALUE words for env
  step bench-moe env $(pes "$N_PES") NVSHMEM_SYMMETRIC_SIZE=${MOE_SYMMETRIC_SIZE:-6G} timeout 300 \
    torchrun --nproc_per_node="$N_PES" -m pydatacopy.bench.moe --json "$OUT/bench-moe.json" ${BENCH_MOE_ARGS:-}
  if [ "$have_before" = 0 ]; then
    step bench-moe-before env $(pes "$N_PES") NVSHMEM_SYMMETRIC_SIZE=${MOE_SYMMETRIC_SIZE:-6G} \
      PYTHONPATH="$moe_site${PYTHONPATH:+:$PYTHONPATH}" timeout 300 \
      torchrun --nproc_per_node="$N_PES" -m pydatacopy.bench.moe --json "$OUT/bench-moe-before.json" ${BENCH_MOE_ARGS:-}
    $PY scripts/bench_compare.py "$OUT/bench-moe-before.json" "$OUT/bench-moe.json" > "$OUT/bench-moe-compare.md" 2>&1
  fi
  shared_mps stop
fi
if [ "${SWEEP:-0}" = 1 ]; then step sweep bash scripts/sweep-send-recv.sh; fi
# BEFORE_TESTS="pytest arguments" (with BEFORE=DIR; ONLY must name tests-before where ONLY is set):
# this tree's tests run against the earlier tree's build, 2 PEs, in the same call: a hostile test
# written for a fix must FAIL here (the step's FAIL is that evidence), and pass in gpu2-tests.
if [ -n "${BEFORE_TESTS:-}" ]; then
  if before_site before; then
    # shellcheck disable=SC2086  # BEFORE_TESTS: pytest's words
    step tests-before env PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" timeout 300 \
      torchrun --nproc_per_node=2 -m pytest -q -p no:cacheprovider $BEFORE_TESTS
  else
    NOTES+=("BEFORE_TESTS: no earlier tree was built (BEFORE=DIR)")
  fi
fi
mps stop

echo
echo "=== gpu-check PART=$PART $(date -u +%Y-%m-%dT%H:%MZ) on $NGPU x $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), ${SECONDS}s of ${DEADLINE_S}s"
printf '%s\n' "${NOTES[@]}"
printf '%s\n' "${SUMMARY[@]}"
grep -h " rc=" "$OUT/hostile.log" 2>/dev/null
for log in cpu-tests gpu2-tests gpu2-tests-rma n-pes moe-8; do
  [ -s "$OUT/$log.log" ] && echo "$log: $(grep -h "passed\|failed" "$OUT/$log.log" | tail -n 2 | tr '\n' ' ')"
done
grep -h "^SKIPPED" "$OUT"/gpu2-tests*.log "$OUT/n-pes.log" 2>/dev/null | sort | uniq -c | head -n 20
grep -h "test_bandwidth" "$OUT/note-test.log" 2>/dev/null | tail -n 2
grep -h "^stress:\|MISMATCH\|Error" "$OUT"/stress*.log 2>/dev/null | tail -n 6
grep -h "^kill-ring\|^kill_ring" "$OUT/kill-ring.log" 2>/dev/null | tail -n 8
grep -h "^torch-order-check" "$OUT/torch-order.log" 2>/dev/null
grep -h "^ucx-check" "$OUT/ucx-check.log" 2>/dev/null
grep -h "^kill-check" "$OUT/kill-check.log" 2>/dev/null
grep -h "^netns-check" "$OUT/netns-check.log" 2>/dev/null
[ -s "$OUT/doctor.log" ] && cat "$OUT/doctor.log"
grep -h "^===\|^send/recv" "$OUT/sweep.log" 2>/dev/null
grep -h "ERROR SUMMARY\|RACECHECK SUMMARY" "$OUT"/sanitizer-*.log 2>/dev/null | sort | uniq -c
[ -s "$OUT/bench.log" ] && sed -n '/^op /,$p' "$OUT/bench.log"
[ -s "$OUT/bench-moe.log" ] && sed -n '/^op /,$p' "$OUT/bench-moe.log"
[ -s "$OUT/timeline.log" ] && sed -n '/^path /,$p' "$OUT/timeline.log"
[ -s "$OUT/timeline-before.log" ] && { echo "--- timeline-before (BEFORE=${BEFORE:-})"; sed -n '/^path /,$p' "$OUT/timeline-before.log"; }
for compare in bench-compare bench-moe-compare; do
  [ -s "$OUT/$compare.md" ] && { echo "--- $compare (BEFORE=${BEFORE:-} BEFORE_MOE=$BEFORE_MOE)"; cat "$OUT/$compare.md"; }
done
grep -h "^kill-moe" "$OUT/kill-moe.log" 2>/dev/null | tail -n 4
grep -h "^kill-distributed" "$OUT/kill-distributed.log" 2>/dev/null | tail -n 4
for f in "$OUT"/hang-rank*.log; do  # a GPU test that outran TEST_HANG_S (its traceback: logs.tgz)
  # A traceback only from the timer; a process that crashed leaves the header alone.
  if grep -q "^Timeout (" "$f"; then
    echo "hang: $(head -n 1 "$f")"; grep -m 3 "tests/gpu/" "$f" | sed 's/^/  /'
  fi
done
for f in control server; do  # MPS's own logs, for a client it refused
  [ -f "$CUDA_MPS_LOG_DIRECTORY/$f.log" ] && cp "$CUDA_MPS_LOG_DIRECTORY/$f.log" "$OUT/mps-$f.log"
done
# At most 8 files come back from the device tool: keep the summary, pack the logs.
(cd "$OUT" && tar czf logs.tgz -- *.log && find . -name '*.log' ! -name gpu-check.log -delete) 2>/dev/null
# Passed: every step that ran passed and none was left without time.
! printf '%s\n' "${RESULT[@]}" | grep -q "^FAIL\|^NO-TIME"
