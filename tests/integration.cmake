# Integration tests: real fuyoud processes driven through clientlib.
set(FUYOU_INTEGRATION_DIR ${CMAKE_CURRENT_LIST_DIR}/integration)

add_library(fuyou_test_support STATIC ${FUYOU_INTEGRATION_DIR}/daemon_process.cc)
target_include_directories(fuyou_test_support PUBLIC ${FUYOU_INTEGRATION_DIR})
target_link_libraries(fuyou_test_support PUBLIC fuyou_client fuyou_test_common)
target_compile_definitions(fuyou_test_support PUBLIC FUYOUD_PATH="$<TARGET_FILE:fuyoud>")

add_executable(crash_client ${FUYOU_INTEGRATION_DIR}/crash_client.cc)
target_link_libraries(crash_client PRIVATE fuyou_client)

fuyou_add_test(NAME offload_integration_test
  SOURCES ${FUYOU_INTEGRATION_DIR}/offload_integration_test.cc
  LIBS fuyou_test_support fuyou_proto fmt::fmt
  LABELS integration)
target_compile_definitions(offload_integration_test PRIVATE CRASH_CLIENT_PATH="$<TARGET_FILE:crash_client>"
  FUYOUCTL_PATH="$<TARGET_FILE:fuyouctl>")
add_dependencies(offload_integration_test fuyoud crash_client fuyouctl)

fuyou_add_test(NAME dram_tier_integration_test
  SOURCES ${FUYOU_INTEGRATION_DIR}/dram_tier_integration_test.cc
  LIBS fuyou_test_support fuyou_proto
  LABELS integration)
add_dependencies(dram_tier_integration_test fuyoud)

fuyou_add_test(NAME state_transfer_test
  SOURCES ${FUYOU_INTEGRATION_DIR}/state_transfer_test.cc
  LIBS fuyou_test_support
  LABELS integration)
add_dependencies(state_transfer_test fuyoud)

# Crash consistency: the daemon killed at its crash points (FUYOU_CRASH_AT), and
# clients killed mid-step, against one deterministic job (crash_driver.h).
add_library(fuyou_crash_driver STATIC ${FUYOU_INTEGRATION_DIR}/crash_driver.cc)
target_link_libraries(fuyou_crash_driver PUBLIC fuyou_test_support fmt::fmt)
add_executable(crash_loop_client ${FUYOU_INTEGRATION_DIR}/crash_loop_client.cc)
target_link_libraries(crash_loop_client PRIVATE fuyou_crash_driver)
fuyou_add_test(NAME crash_loop_test
  SOURCES ${FUYOU_INTEGRATION_DIR}/crash_loop_test.cc
  LIBS fuyou_crash_driver fmt::fmt
  LABELS integration)
target_compile_definitions(crash_loop_test PRIVATE CRASH_LOOP_CLIENT_PATH="$<TARGET_FILE:crash_loop_client>")
add_dependencies(crash_loop_test fuyoud crash_loop_client)

# Storage faults (FUYOU_TEST_FAULTS), corrupt extents, capacity and quota, leaks.
fuyou_add_test(NAME durability_integration_test
  SOURCES ${FUYOU_INTEGRATION_DIR}/durability_integration_test.cc
  LIBS fuyou_test_support fuyou_proto fmt::fmt
  LABELS integration)
add_dependencies(durability_integration_test fuyoud)

# Jobs belong to their owner (issue 8): namespaces per uid, no link followed,
# storage hygiene, the job limit, migration, the storage-path lock.
add_executable(job_owner_client ${FUYOU_INTEGRATION_DIR}/job_owner_client.cc)
target_link_libraries(job_owner_client PRIVATE fuyou_client)
fuyou_add_test(NAME jobs_security_test
  SOURCES ${FUYOU_INTEGRATION_DIR}/jobs_security_test.cc
  LIBS fuyou_test_support fuyou_proto fmt::fmt
  LABELS integration)
target_compile_definitions(jobs_security_test PRIVATE JOB_OWNER_CLIENT_PATH="$<TARGET_FILE:job_owner_client>"
  FUYOUCTL_PATH="$<TARGET_FILE:fuyouctl>")
add_dependencies(jobs_security_test fuyoud job_owner_client fuyouctl)
# Hostile input (issue 8): raw-gRPC requests with sizes that wrap, layouts that
# differ, update counts past the bound and unbounded names, against a real fuyoud.
fuyou_add_test(NAME hostile_input_test
  SOURCES ${FUYOU_INTEGRATION_DIR}/hostile_input_test.cc
  LIBS fuyou_test_support fuyou_proto
  LABELS integration)
add_dependencies(hostile_input_test fuyoud)
# Least privilege: fuyoud as an unprivileged uid with no capability, serving
# root and another user; the segment handover's refusals (needs root; skips
# otherwise).
add_executable(privilege_client ${FUYOU_INTEGRATION_DIR}/privilege_client.cc)
target_include_directories(privilege_client PRIVATE ${FUYOU_INTEGRATION_DIR})
target_link_libraries(privilege_client PRIVATE fuyou_client)
fuyou_add_test(NAME privilege_test
  SOURCES ${FUYOU_INTEGRATION_DIR}/privilege_test.cc
  LIBS fuyou_test_support fuyou_proto fmt::fmt
  LABELS integration)
target_compile_definitions(privilege_test PRIVATE PRIVILEGE_CLIENT_PATH="$<TARGET_FILE:privilege_client>")
add_dependencies(privilege_test fuyoud privilege_client)
# Per-user and daemon-wide limits, idle sessions, client_info, GetStats scope,
# the socket's permission message; a second user is limits_client run as nobody.
add_executable(limits_client ${FUYOU_INTEGRATION_DIR}/limits_client.cc)
target_link_libraries(limits_client PRIVATE fuyou_client fuyou_proto)
fuyou_add_test(NAME limits_test
  SOURCES ${FUYOU_INTEGRATION_DIR}/limits_test.cc
  LIBS fuyou_test_support fuyou_proto fmt::fmt
  LABELS integration)
target_compile_definitions(limits_test PRIVATE LIMITS_CLIENT_PATH="$<TARGET_FILE:limits_client>"
  FUYOUCTL_PATH="$<TARGET_FILE:fuyouctl>")
add_dependencies(limits_test fuyoud limits_client fuyouctl)

# Both ends of the segment handover (fuyou/segment_handover.h) in one process: the
# daemon's SegmentListener on a real socket, clientlib's ClientSegment and
# SendSegmentHandover. Here and not in daemon/server/ because the daemon's code
# does not include clientlib; not `integration` (no fuyoud process).
fuyou_add_test(NAME segment_listener_test
  SOURCES ${FUYOU_INTEGRATION_DIR}/segment_listener_test.cc
  LIBS fuyou_daemon_core fuyou_client fuyou_test_common)

# Speculate, validate, redo (issue 10), daemon side: redo, segments without
# gradient, skipped steps, their stats and crash points, over the raw protocol.
add_library(fuyou_raw_session STATIC ${FUYOU_INTEGRATION_DIR}/raw_session.cc)
target_link_libraries(fuyou_raw_session PUBLIC fuyou_test_support fuyou_proto fmt::fmt)
add_executable(redo_client ${FUYOU_INTEGRATION_DIR}/redo_client.cc)
target_link_libraries(redo_client PRIVATE fuyou_raw_session)
fuyou_add_test(NAME redo_integration_test
  SOURCES ${FUYOU_INTEGRATION_DIR}/redo_integration_test.cc
  LIBS fuyou_raw_session fuyou_optimizer
  LABELS integration)
target_compile_definitions(redo_integration_test PRIVATE FUYOUCTL_PATH="$<TARGET_FILE:fuyouctl>"
  REDO_CLIENT_PATH="$<TARGET_FILE:redo_client>")
add_dependencies(redo_integration_test fuyoud fuyouctl redo_client)

# Gradient journals (issue 19, streamed mode) over the raw protocol: KEEP then
# REPLAY/ADD exactly, the journal's stats, its lifetime, hostile fields, the
# spill to <data>/journal with its checksum, and the GetStats counters.
fuyou_add_test(NAME journal_integration_test
  SOURCES ${FUYOU_INTEGRATION_DIR}/journal_integration_test.cc
  LIBS fuyou_raw_session fuyou_optimizer fuyou_client
  LABELS integration)
add_dependencies(journal_integration_test fuyoud)

# Working weights kept by the daemon and fetched by chunk id (issue 12), over
# the raw protocol: committed weights between and during steps, hostile
# fetches, restarts, the SSD bytes a step reads beyond the DRAM budget, GetStats
# in both scopes (weights_client run as nobody) and fuyouctl stats.
add_executable(weights_client ${FUYOU_INTEGRATION_DIR}/weights_client.cc)
target_link_libraries(weights_client PRIVATE fuyou_raw_session)
fuyou_add_test(NAME weights_integration_test
  SOURCES ${FUYOU_INTEGRATION_DIR}/weights_integration_test.cc
  LIBS fuyou_raw_session
  LABELS integration)
target_compile_definitions(weights_integration_test PRIVATE FUYOUCTL_PATH="$<TARGET_FILE:fuyouctl>"
  WEIGHTS_CLIENT_PATH="$<TARGET_FILE:weights_client>")
add_dependencies(weights_integration_test fuyoud fuyouctl weights_client)

# Request ids (issue 21): fuyoud echoes every stream message's request_id on its
# reply (0, the largest id and repeated ids alike), over the raw protocol; a
# clientlib session, which routes replies by id, trains against it.
fuyou_add_test(NAME request_id_integration_test
  SOURCES ${FUYOU_INTEGRATION_DIR}/request_id_integration_test.cc
  LIBS fuyou_raw_session fuyou_client
  LABELS integration)
add_dependencies(request_id_integration_test fuyoud)

# Spilled activations (issue 23, activation offload's SSD tier) over the raw
# protocol: the same bytes back from <data>/activations, hostile fields, the
# step's end and DropActivations, the per-user limit and the storage budget, no
# file left by a closed session, the GetStats counters; another user
# (activation_peer_client run as uid 65533) reaches none of them.
add_executable(activation_peer_client ${FUYOU_INTEGRATION_DIR}/activation_peer_client.cc)
target_link_libraries(activation_peer_client PRIVATE fuyou_raw_session)
fuyou_add_test(NAME activation_integration_test
  SOURCES ${FUYOU_INTEGRATION_DIR}/activation_integration_test.cc
  LIBS fuyou_raw_session fuyou_client
  LABELS integration)
target_compile_definitions(activation_integration_test PRIVATE
  ACTIVATION_PEER_CLIENT_PATH="$<TARGET_FILE:activation_peer_client>")
add_dependencies(activation_integration_test fuyoud activation_peer_client)
