# overlap_bench: a GPU-like job (timed waits for backward) against a real fuyoud
# whose states exceed its DRAM budget; overlapped vs serial steps, timeline, RSS.
if(TARGET fuyou_test_support)
  add_executable(overlap_bench ${CMAKE_CURRENT_LIST_DIR}/overlap_bench.cc)
  target_link_libraries(overlap_bench PRIVATE fuyou_test_support fuyou_proto fmt::fmt PkgConfig::URING)
  # The timeline picture is drawn by plot_timeline.py with the project's Python
  # (matplotlib is in its venv).
  target_compile_definitions(overlap_bench PRIVATE FUYOU_BENCH_SOURCE_DIR="${CMAKE_CURRENT_LIST_DIR}"
                             FUYOU_BENCH_PYTHON="${Python3_EXECUTABLE}")
  add_dependencies(overlap_bench fuyoud)
endif()
