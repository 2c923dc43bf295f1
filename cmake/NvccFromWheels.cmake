# After project(... CXX), before enable_language(CUDA): when CMake finds no CUDA compiler by its
# own search, point it at the nvcc of the nvidia-cuda-nvcc wheel (and companions: runtime, cccl,
# crt, nvvm) of the Python being built for. Inside pip's build environment build-system.requires
# installed them. The same steps as scripts/ensure-nvcc.sh, which does this for builds outside pip.
include(CheckLanguage)

set(_pdc_force_wheels FALSE)
if(DEFINED ENV{PYDATACOPY_PIP_CUDA} AND "$ENV{PYDATACOPY_PIP_CUDA}" STREQUAL "1")
  set(_pdc_force_wheels TRUE)
endif()
if(NOT _pdc_force_wheels)
  check_language(CUDA)  # CMake's own search; sets CMAKE_CUDA_COMPILER, or leaves it NOTFOUND
endif()

if(_pdc_force_wheels OR NOT CMAKE_CUDA_COMPILER)
  if(NOT Python_EXECUTABLE)  # scikit-build-core passes it; a plain cmake run finds one
    find_package(Python COMPONENTS Interpreter)
  endif()
  set(_pdc_cuda_root "")
  if(Python_EXECUTABLE)
    execute_process(
      COMMAND "${Python_EXECUTABLE}" -c
              "import os, nvidia\nfor base in nvidia.__path__:\n    for sub in ('cu13', 'cuda_nvcc'):\n        if os.path.exists(os.path.join(base, sub, 'bin', 'nvcc')):\n            print(os.path.join(base, sub)); raise SystemExit\n"
      OUTPUT_VARIABLE _pdc_cuda_root OUTPUT_STRIP_TRAILING_WHITESPACE
      RESULT_VARIABLE _pdc_rc ERROR_QUIET)
  endif()
  if(_pdc_cuda_root AND EXISTS "${_pdc_cuda_root}/bin/nvcc")
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
  else()
    message(FATAL_ERROR "pydatacopy needs nvcc (CUDA 13): CMake found none (CUDACXX, PATH, "
                        "CUDA_PATH) and the nvidia-cuda-nvcc wheel is not installed for "
                        "${Python_EXECUTABLE}. pip install . brings it into its build "
                        "environment; with --no-build-isolation run `bash scripts/ensure-nvcc.sh "
                        "&& . ./.cuda-env` first, or set CUDACXX to your nvcc.")
  endif()
endif()
