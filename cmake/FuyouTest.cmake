# fuyou_add_test(NAME <name> SOURCES <files...> LIBS <targets...> [LABELS <labels...>])
# Builds a GoogleTest binary and registers each of its tests with CTest.
#
# Labels (deploy/test.sh lists them all): LABELS names the part (storage,
# optimizer, wire, clientlib, ...) or `integration` (a real fuyoud); every test that is
# not `integration` or `gpu` is also `unit`. `slow` marks a binary too slow for
# the sanitizer pass; every other test also gets `sanitizer`, the set that
# deploy/test.sh runs in the ASan+UBSan tree (ctest -L sanitizer). A test that
# needs a temporary directory lists fuyou_test_common in LIBS: the header-only
# helpers in tests/support/ (`TempDir`, "test_support/temp_dir.h"), which the
# integration tests' fuyou_test_support (tests/integration.cmake) shares.
add_library(fuyou_test_common INTERFACE)
target_include_directories(fuyou_test_common INTERFACE ${CMAKE_CURRENT_LIST_DIR}/../tests/support)

function(fuyou_add_test)
  cmake_parse_arguments(ARG "" "NAME" "SOURCES;LIBS;LABELS" ${ARGN})
  if(NOT FUYOU_BUILD_TESTS)
    return()
  endif()
  set(labels ${ARG_LABELS})
  if(NOT "integration" IN_LIST labels AND NOT "gpu" IN_LIST labels AND NOT "unit" IN_LIST labels)
    list(APPEND labels unit)
  endif()
  if(NOT "slow" IN_LIST labels AND NOT "gpu" IN_LIST labels)
    list(APPEND labels sanitizer)
  endif()
  add_executable(${ARG_NAME} ${ARG_SOURCES})
  target_link_libraries(${ARG_NAME} PRIVATE ${ARG_LIBS} GTest::gtest GTest::gtest_main)
  include(GoogleTest)
  # A sanitized binary starts slower; its tests run several times slower.
  if(FUYOU_SANITIZE)
    set(timeout 900)
  else()
    set(timeout 300)
  endif()
  gtest_discover_tests(${ARG_NAME} DISCOVERY_TIMEOUT 120 PROPERTIES TIMEOUT ${timeout})
  # Labels are a list, which gtest_discover_tests's PROPERTIES flattens: they are
  # set by a file CTest includes after the discovered tests (${name}_TESTS).
  set(label_file ${CMAKE_CURRENT_BINARY_DIR}/${ARG_NAME}_labels.cmake)
  file(WRITE ${label_file}
    "if(${ARG_NAME}_TESTS)\n  set_tests_properties(\${${ARG_NAME}_TESTS} PROPERTIES LABELS \"${labels}\")\nendif()\n")
  set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES ${label_file})
endfunction()
