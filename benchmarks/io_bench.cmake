# io_bench: fuyou_storage's StateFile against a plain io_uring loop and fio, on one file.
add_executable(io_bench ${CMAKE_CURRENT_LIST_DIR}/io_bench.cc)
target_link_libraries(io_bench PRIVATE fuyou_storage)
