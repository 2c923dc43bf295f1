# Before project(): point CMake at the nvcc of the nvidia-cuda-nvcc wheel (and its companions:
# runtime, cccl, crt, nvvm) of the Python being built for, when no other nvcc is set or found.
# Runs with the interpreter scikit-build-core passes (Python_EXECUTABLE), inside pip's build
# environment, where build-system.requires installed the wheels. The same steps as
# scripts/ensure-nvcc.sh, which does this for builds outside pip.

set(_pdc_force_wheels FALSE)
if(DEFINED ENV{PYDATACOPY_PIP_CUDA} AND "$ENV{PYDATACOPY_PIP_CUDA}" STREQUAL "1")
  set(_pdc_force_wheels TRUE)
endif()
set(_pdc_have_nvcc FALSE)
if(DEFINED CMAKE_CUDA_COMPILER OR DEFINED ENV{CUDACXX})
  set(_pdc_have_nvcc TRUE)
else()
  find_program(_pdc_nvcc_on_path nvcc)
  if(_pdc_nvcc_on_path OR (DEFINED ENV{CUDA_PATH} AND EXISTS "$ENV{CUDA_PATH}/bin/nvcc"))
    set(_pdc_have_nvcc TRUE)
  endif()
endif()

if((_pdc_force_wheels OR NOT _pdc_have_nvcc) AND Python_EXECUTABLE)
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c
            "import os, nvidia\nfor base in nvidia.__path__:\n    for sub in ('cu13', 'cuda_nvcc'):\n        if os.path.exists(os.path.join(base, sub, 'bin', 'nvcc')):\n            print(os.path.join(base, sub)); raise SystemExit\n"
    OUTPUT_VARIABLE _pdc_cuda_root OUTPUT_STRIP_TRAILING_WHITESPACE
    RESULT_VARIABLE _pdc_rc ERROR_QUIET)
  if(_pdc_rc EQUAL 0 AND EXISTS "${_pdc_cuda_root}/bin/nvcc")
    # CMake's CUDA support wants lib64 and an unversioned cudart beside nvcc, as in a toolkit.
    if(NOT EXISTS "${_pdc_cuda_root}/lib64")
      file(CREATE_LINK lib "${_pdc_cuda_root}/lib64" SYMBOLIC)
    endif()
    if(NOT EXISTS "${_pdc_cuda_root}/lib/libcudart.so" AND EXISTS "${_pdc_cuda_root}/lib/libcudart.so.13")
      file(CREATE_LINK libcudart.so.13 "${_pdc_cuda_root}/lib/libcudart.so" SYMBOLIC)
    endif()
    set(CMAKE_CUDA_COMPILER "${_pdc_cuda_root}/bin/nvcc" CACHE FILEPATH "nvcc from the CUDA wheels" FORCE)
    set(CUDAToolkit_ROOT "${_pdc_cuda_root}")
    message(STATUS "pydatacopy: nvcc from the CUDA 13.0 wheels at ${_pdc_cuda_root}")
  elseif(NOT _pdc_have_nvcc)
    message(FATAL_ERROR "pydatacopy needs nvcc (CUDA 13): none is set (CUDACXX), on PATH or in "
                        "$CUDA_PATH/bin, and the nvidia-cuda-nvcc wheel is not installed for "
                        "${Python_EXECUTABLE}. pip install . brings it into its build environment; "
                        "with --no-build-isolation run `bash scripts/ensure-nvcc.sh && . ./.cuda-env` "
                        "first, or set CUDACXX to your nvcc.")
  endif()
endif()
