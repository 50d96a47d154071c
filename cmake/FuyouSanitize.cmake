# FUYOU_SANITIZE: a comma-separated list of sanitizers (e.g. "address,undefined")
# that every C and C++ target of the project is compiled and linked with. Empty
# (the default) builds without sanitizers. deploy/test.sh builds a second tree,
# build-asan, with "address,undefined" and runs the C++ tests and the RPC fuzzer
# in it.
#
# UBSan stops at the first report (-fno-sanitize-recover), as ASan does, so a
# report always fails the test that caused it: a process that exits non-zero.
# Every executable also gets the default options of cmake/sanitizer_options.cc
# (fuyou_sanitize_executables, called at the end of the top-level CMakeLists).
# CUDA is left out of such a build, and so is the Python module (it would need
# libasan preloaded into the interpreter).
set(FUYOU_SANITIZE "" CACHE STRING
  "Sanitizers for every target, comma-separated (e.g. address,undefined); empty for none")

if(FUYOU_SANITIZE)
  if(NOT CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    message(FATAL_ERROR "FUYOU_SANITIZE needs GCC or Clang, not ${CMAKE_CXX_COMPILER_ID}")
  endif()
  set(FUYOU_SANITIZE_FLAGS -fsanitize=${FUYOU_SANITIZE} -fno-omit-frame-pointer)
  if(FUYOU_SANITIZE MATCHES "undefined")
    # No vptr check: it reads the object's memory through a pipe, so in a process
    # that has run out of file descriptors (a case the integration tests create
    # on purpose) every virtual call is reported as a call on an "invalid vptr".
    list(APPEND FUYOU_SANITIZE_FLAGS -fno-sanitize-recover=undefined -fno-sanitize=vptr)
  endif()
  add_compile_options("$<$<COMPILE_LANGUAGE:C,CXX>:${FUYOU_SANITIZE_FLAGS}>")
  add_link_options(${FUYOU_SANITIZE_FLAGS})
  if(FUYOU_BUILD_PYTHON)
    message(STATUS "fuyou: FUYOU_SANITIZE set; the Python module is not built (FUYOU_BUILD_PYTHON=OFF)")
    set(FUYOU_BUILD_PYTHON OFF CACHE BOOL "Build the pybind11 module of python_client" FORCE)
  endif()
  message(STATUS "fuyou: sanitizers ${FUYOU_SANITIZE} on every C/C++ target")
endif()

# Adds cmake/sanitizer_options.cc to every executable defined in `dir` and below.
function(fuyou_sanitize_executables dir)
  if(NOT FUYOU_SANITIZE)
    return()
  endif()
  get_property(targets DIRECTORY ${dir} PROPERTY BUILDSYSTEM_TARGETS)
  foreach(target ${targets})
    get_target_property(type ${target} TYPE)
    if(type STREQUAL "EXECUTABLE")
      target_sources(${target} PRIVATE ${PROJECT_SOURCE_DIR}/cmake/sanitizer_options.cc)
    endif()
  endforeach()
  get_property(subdirs DIRECTORY ${dir} PROPERTY SUBDIRECTORIES)
  foreach(subdir ${subdirs})
    fuyou_sanitize_executables(${subdir})
  endforeach()
endfunction()
