#!/usr/bin/env bash
# The optional packages the GPU machine lacks, as wheels in .whl/ (git-ignored), for a device
# call that names .whl in `carry`; scripts/gpu-check.sh installs them there. The machine reaches
# no registry, and a call carries at most 64 MiB with the working tree, so:
#   nixl-cu13    the bench's NIXL baseline; slimmed here to what its Python API loads (its
#                nixl_ep_cu13 expert-parallel kernels, headers and example programs dropped:
#                about 56 -> 28 MiB)
#   libucx-cu13  NVSHMEM's UCX transport (tests/stress/ucx_check.py; 42 MiB): only with UCX=1,
#                since both together pass the limit
# Usage: bash scripts/device-wheels.sh            (Python 3.12, the GPU machine's)
#        PYVER=3.11 bash scripts/device-wheels.sh  (this machine's: to try the slim wheel here)
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=${PYVER:-3.12}
NIXL=${NIXL:-nixl-cu13==1.5.1}
LIBUCX=${LIBUCX:-libucx-cu13==1.22.0}
exclude=$(git rev-parse --git-path info/exclude)  # also where .git is a file (a worktree)
grep -qx '/.whl/' "$exclude" 2>/dev/null || grep -qx '/.whl/' .gitignore \
  || { mkdir -p "$(dirname "$exclude")" && echo /.whl/ >> "$exclude"; }
rm -rf .whl && mkdir -p .whl
download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$1" "$2"
}
raw=$(mktemp -d)
trap 'rm -rf "$raw"' EXIT
download "$raw" "$NIXL"
python3 - "$raw"/nixl_cu13-*.whl .whl <<'PY'
"""Copy the wheel without what the NIXL Python API never loads; RECORD lists what is left."""
import os, sys, zipfile

source, target_dir = sys.argv[1], sys.argv[2]
drop = ("nixl_ep_cu13/", ".data/headers/", ".data/scripts/", ".scripts/")
with zipfile.ZipFile(source) as wheel:
    kept = [i for i in wheel.infolist() if not any(d in i.filename or i.filename.startswith(d) for d in drop)]
    names = {i.filename for i in kept}
    target = os.path.join(target_dir, os.path.basename(source))
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as out:
        for info in kept:
            data = wheel.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines()
                data = ("\n".join(l for l in lines if l.split(",")[0] in names or l.split(",")[0] == info.filename) + "\n").encode()
            out.writestr(info, data)
print(f"{os.path.basename(source)}: {os.path.getsize(source) >> 20} MiB -> {os.path.getsize(target) >> 20} MiB")
PY
if [ "${UCX:-0}" = 1 ]; then download .whl "$LIBUCX"; fi
du -sh .whl
