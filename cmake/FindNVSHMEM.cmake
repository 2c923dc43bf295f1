# Finds NVSHMEM: from NVSHMEM_HOME (CMake variable or environment), else from the
# nvidia-nvshmem-cu13 wheel of the Python interpreter being built for.
# The wheel ships libnvshmem_host.so.3 (no unversioned .so) and libnvshmem_device.a.
# Defines NVSHMEM_INCLUDE_DIR, NVSHMEM_LIBRARY_DIR, NVSHMEM_VERSION and the imported targets
# NVSHMEM::host (shared) and NVSHMEM::device (static, device code).

if(NOT NVSHMEM_HOME AND DEFINED ENV{NVSHMEM_HOME})
  set(NVSHMEM_HOME "$ENV{NVSHMEM_HOME}")
endif()
if(NOT NVSHMEM_HOME AND Python_EXECUTABLE)
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c
            "import nvidia.nvshmem as m, os; print(os.path.dirname(m.__file__) if m.__file__ else list(m.__path__)[0])"
    OUTPUT_VARIABLE _nvshmem_wheel OUTPUT_STRIP_TRAILING_WHITESPACE
    RESULT_VARIABLE _nvshmem_rc ERROR_QUIET)
  if(_nvshmem_rc EQUAL 0 AND EXISTS "${_nvshmem_wheel}/include/nvshmem.h")
    set(NVSHMEM_HOME "${_nvshmem_wheel}")
    set(NVSHMEM_FROM_WHEEL TRUE)
  endif()
endif()

find_path(NVSHMEM_INCLUDE_DIR nvshmem.h HINTS "${NVSHMEM_HOME}/include" NO_DEFAULT_PATH)
find_file(NVSHMEM_HOST_LIBRARY NAMES libnvshmem_host.so libnvshmem_host.so.3
          HINTS "${NVSHMEM_HOME}/lib" "${NVSHMEM_HOME}/lib64" NO_DEFAULT_PATH)
find_file(NVSHMEM_DEVICE_LIBRARY NAMES libnvshmem_device.a
          HINTS "${NVSHMEM_HOME}/lib" "${NVSHMEM_HOME}/lib64" NO_DEFAULT_PATH)

if(NVSHMEM_INCLUDE_DIR)
  file(STRINGS "${NVSHMEM_INCLUDE_DIR}/non_abi/nvshmem_version.h" _nvshmem_version_lines
       REGEX "#define NVSHMEM_VENDOR_(MAJOR|MINOR|PATCH)_VERSION")
  foreach(_part MAJOR MINOR PATCH)
    string(REGEX MATCH "NVSHMEM_VENDOR_${_part}_VERSION ([0-9]+)" _m "${_nvshmem_version_lines}")
    set(_nvshmem_${_part} "${CMAKE_MATCH_1}")
  endforeach()
  set(NVSHMEM_VERSION "${_nvshmem_MAJOR}.${_nvshmem_MINOR}.${_nvshmem_PATCH}")
endif()

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(NVSHMEM
  REQUIRED_VARS NVSHMEM_INCLUDE_DIR NVSHMEM_HOST_LIBRARY NVSHMEM_DEVICE_LIBRARY
  VERSION_VAR NVSHMEM_VERSION
  REASON_FAILURE_MESSAGE
    "Set NVSHMEM_HOME, or install the wheel into the interpreter you build for: pip install nvidia-nvshmem-cu13==3.4.5")

if(NVSHMEM_FOUND AND NOT TARGET NVSHMEM::host)
  get_filename_component(NVSHMEM_LIBRARY_DIR "${NVSHMEM_HOST_LIBRARY}" DIRECTORY)
  add_library(NVSHMEM::host SHARED IMPORTED)
  set_target_properties(NVSHMEM::host PROPERTIES
    IMPORTED_LOCATION "${NVSHMEM_HOST_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${NVSHMEM_INCLUDE_DIR}")
  add_library(NVSHMEM::device STATIC IMPORTED)
  set_target_properties(NVSHMEM::device PROPERTIES
    IMPORTED_LOCATION "${NVSHMEM_DEVICE_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${NVSHMEM_INCLUDE_DIR}")
endif()
