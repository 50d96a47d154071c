# io_fair_bench: a read's latency behind another session's write flood, the I/O queue's turns against one FIFO.
add_executable(io_fair_bench ${CMAKE_CURRENT_LIST_DIR}/io_fair_bench.cc)
target_link_libraries(io_fair_bench PRIVATE fuyou_storage)
