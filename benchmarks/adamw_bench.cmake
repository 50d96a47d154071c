# adamw_bench: the CPU AdamW kernel against an Adam-shaped memory-bandwidth probe.
# benchmarks/adamw_vs_torch.py runs it beside torch.optim.AdamW.
add_executable(adamw_bench
  ${CMAKE_CURRENT_LIST_DIR}/adamw_bench.cc
  ${CMAKE_CURRENT_LIST_DIR}/adamw_bench_probe.cc)
target_link_libraries(adamw_bench PRIVATE fuyou_optimizer Threads::Threads)
target_compile_options(adamw_bench PRIVATE -O3)
if(CMAKE_SYSTEM_PROCESSOR MATCHES "^(x86_64|AMD64|amd64)$")
  set_source_files_properties(${CMAKE_CURRENT_LIST_DIR}/adamw_bench_probe.cc PROPERTIES
    COMPILE_OPTIONS "-mavx512f;-mfma")
endif()
