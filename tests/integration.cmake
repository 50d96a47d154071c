# Integration tests: real fuyoud processes driven through clientlib.
set(FUYOU_INTEGRATION_DIR ${CMAKE_CURRENT_LIST_DIR}/integration)

add_library(fuyou_test_support STATIC ${FUYOU_INTEGRATION_DIR}/daemon_process.cc)
target_include_directories(fuyou_test_support PUBLIC ${FUYOU_INTEGRATION_DIR})
target_link_libraries(fuyou_test_support PUBLIC fuyou_client)
target_compile_definitions(fuyou_test_support PUBLIC FUYOUD_PATH="$<TARGET_FILE:fuyoud>")

add_executable(crash_client ${FUYOU_INTEGRATION_DIR}/crash_client.cc)
target_link_libraries(crash_client PRIVATE fuyou_client)

fuyou_add_test(NAME offload_integration_test
  SOURCES ${FUYOU_INTEGRATION_DIR}/offload_integration_test.cc
  LIBS fuyou_test_support fuyou_proto fmt::fmt
  LABELS integration)
target_compile_definitions(offload_integration_test PRIVATE CRASH_CLIENT_PATH="$<TARGET_FILE:crash_client>")
add_dependencies(offload_integration_test fuyoud crash_client)
