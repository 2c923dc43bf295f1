#!/usr/bin/env bash
# send/recv tuning sweep on the GPU machine (after gpu-check.sh has installed the build):
#   bash scripts/sweep-send-recv.sh            # configurations "blocks:chunk_MiB:slots[:narrow_blocks]"
# For each configuration, the pipeline against NCCL and the copy engine in the same run, one way.
# SWEEP_OPS and SWEEP_SIZES replace the rows and sizes (e.g. SWEEP_OPS=kernel_handoff,sendrecv
# SWEEP_SIZES="-b 1M -e 16M -f 4": the zero-copy row by blocks, beside its floor); SWEEP_DIRECTIONS
# (one, both or all) the directions, SWEEP_REPEATS the bench's -n and -r.
# One GPU (SWEEP=1 under scripts/gpu-check.sh, which runs MPS): two PEs share it, without the NCCL
# baseline (NCCL refuses two ranks on one GPU).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export NVSHMEM_SYMMETRIC_SIZE=${NVSHMEM_SYMMETRIC_SIZE:-4G}
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
CONFIGS=${CONFIGS:-"32:8:4 16:8:4 64:8:4 32:16:4 64:16:4 32:4:8"}
OPS=${SWEEP_OPS:-memcpy,sendrecv_staged,nccl}  # by default the staged row: what the staging's shape changes
SIZES=${SWEEP_SIZES:-"-b 256K -e 1G -f 4"}
DIRECTIONS=${SWEEP_DIRECTIONS:-one}  # one, both or all
REPEATS=${SWEEP_REPEATS:-"-n 10 -r 3"}  # calls per repeat and repeats (the bench's -n and -r)
if [ "$(nvidia-smi -L | wc -l)" = 1 ]; then
  OPS=${OPS//,nccl/}
  export PYDATACOPY_RANKS_PER_GPU=2 CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=${CUDA_MPS_ACTIVE_THREAD_PERCENTAGE:-50}
fi
pass=0  # a configuration may come back (alternating passes): each pass its own files
for config in $CONFIGS; do
  IFS=: read -r blocks chunk_mib slots narrow <<< "$config"
  narrow=${narrow:-${PYDATACOPY_NARROW_SEND_BLOCKS:-32}}
  pass=$((pass + 1))
  name="sweep-$pass-$blocks-$chunk_mib-$slots-$narrow"
  echo "=== sweep pass $pass blocks=$blocks chunk=${chunk_mib}MiB slots=$slots narrow=$narrow"
  PYDATACOPY_SEND_BLOCKS=$blocks PYDATACOPY_CHUNK_BYTES=$((chunk_mib << 20)) PYDATACOPY_NUM_CHUNKS=$slots \
    PYDATACOPY_NARROW_SEND_BLOCKS=$narrow \
    timeout 200 torchrun --nproc_per_node=2 -m pydatacopy.bench --ops "$OPS" \
    $SIZES -d "$DIRECTIONS" $REPEATS --json "$OUT/$name.json" \
    > "$OUT/$name.log" 2>&1 || { echo "FAILED"; tail -n 20 "$OUT/$name.log"; continue; }
  grep -E "^(send/recv|baseline) " "$OUT/$name.log"
done
