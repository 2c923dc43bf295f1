#!/usr/bin/env bash
# The send/recv rows of the bench under torch's other allocator settings (issue 36: each row says
# its `alloc`), from 64 MiB both ways and one way, and the engagement runs (10 x 200 sendrecvs of
# 256 MiB into fresh buffers), beside a bare copy in the same run: one torchrun per setting, the
# rows of both in one JSON (the first argument). The default allocator's rows are the main bench's.
# Run where 2 PEs can start (scripts/gpu-check.sh's step bench-alloc sets MPS and the PE placement).
set -uo pipefail
out=${1:?usage: bench-alloc.sh OUT.json}
parts=()
rc=0
for conf in expandable_segments:True backend:cudaMallocAsync; do
  part="${out%.json}-${conf#*:}.json"
  PYTORCH_CUDA_ALLOC_CONF=$conf timeout 140 torchrun --nproc_per_node=2 -m pydatacopy.bench -b 64M -e 1G -f 4 -d all \
    --ops memcpy,kernel_copy,sendrecv_default,engagement --json "$part" || rc=1
  [ -f "$part" ] && parts+=("$part")
done
${PYTHON:-python3} - "$out" "${parts[@]}" <<'PY' || rc=1
import json, sys
rows = [row for path in sys.argv[2:] for row in json.load(open(path))]
json.dump(rows, open(sys.argv[1], "w"), indent=1)
PY
rm -f "${parts[@]}"
exit $rc
