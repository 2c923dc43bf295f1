#!/usr/bin/env bash
# Make sure a CUDA 13.0 nvcc exists for the build. If none is on PATH or in /usr/local/cuda,
# install the toolkit's compiler pieces from PyPI wheels into the active Python environment.
# Always writes .cuda-env for the caller to source (CUDACXX, PATH; only a comment when nvcc is
# already on PATH): bash scripts/ensure-nvcc.sh && . ./.cuda-env
# PYDATACOPY_PIP_CUDA=1 forces the wheel route (to test it on a machine that has nvcc).
set -euo pipefail
rm -f .cuda-env
if [ "${PYDATACOPY_PIP_CUDA:-0}" != 1 ]; then
  if command -v nvcc > /dev/null; then
    printf '# nvcc is on PATH: %s\n' "$(command -v nvcc)" > .cuda-env
    exit 0
  fi
  if [ -x /usr/local/cuda/bin/nvcc ]; then
    printf 'export CUDACXX=/usr/local/cuda/bin/nvcc\nexport PATH=/usr/local/cuda/bin:$PATH\n' > .cuda-env
    exit 0
  fi
fi
echo "== no nvcc found: installing the CUDA 13.0 compiler from PyPI wheels"
python -m pip install -q "nvidia-cuda-nvcc==13.0.*" "nvidia-cuda-runtime==13.0.*" \
  "nvidia-cuda-cccl==13.0.*" "nvidia-cuda-crt==13.0.*" "nvidia-nvvm==13.0.*"
root=$(python - <<'PY'
import os, nvidia
for base in nvidia.__path__:
    for sub in ("cu13", "cuda_nvcc"):
        if os.path.exists(os.path.join(base, sub, "bin", "nvcc")):
            print(os.path.join(base, sub)); raise SystemExit
raise SystemExit("nvcc not found in the nvidia wheels")
PY
)
# CMake's CUDA support wants lib64 and the static runtime beside nvcc, as in a toolkit install.
[ -e "$root/lib64" ] || ln -s lib "$root/lib64"
[ -e "$root/lib/libcudart.so" ] || ln -s libcudart.so.13 "$root/lib/libcudart.so"
printf 'export CUDACXX=%s/bin/nvcc\nexport CUDAToolkit_ROOT=%s\nexport PATH=%s/bin:$PATH\n' \
  "$root" "$root" "$root" > .cuda-env
echo "== nvcc from wheels at $root"
