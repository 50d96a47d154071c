# kernel_fair_bench: a small job's step beside another user's hog on the AdamW kernel, its fair turns (slices by uid,
# then session) against the one FIFO of whole chunk updates it had before (issue 32 item 2).
add_executable(kernel_fair_bench ${CMAKE_CURRENT_LIST_DIR}/kernel_fair_bench.cc)
target_link_libraries(kernel_fair_bench PRIVATE fuyou_optimizer fmt::fmt Threads::Threads)
