# shm_stream_bench: gradients in and weights out through a real fuyoud's shared
# memory, against single-thread memcpy of the same bytes.
if(TARGET fuyou_test_support)
  add_executable(shm_stream_bench ${CMAKE_CURRENT_LIST_DIR}/shm_stream_bench.cc)
  target_link_libraries(shm_stream_bench PRIVATE fuyou_test_support fmt::fmt)
  add_dependencies(shm_stream_bench fuyoud)
endif()
