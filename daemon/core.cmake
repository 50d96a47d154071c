# The parts of fuyoud beyond optimizer/ and storage/, one library each, then the
# executable. Included from daemon/CMakeLists.txt.
set(FUYOU_DAEMON_DIR ${CMAKE_CURRENT_LIST_DIR})

add_library(fuyou_daemon_core STATIC
  ${FUYOU_DAEMON_DIR}/common/log.cc
  ${FUYOU_DAEMON_DIR}/common/crash_point.cc
  ${FUYOU_DAEMON_DIR}/common/trace.cc
  ${FUYOU_DAEMON_DIR}/config/daemon_config.cc
  ${FUYOU_DAEMON_DIR}/stats/daemon_stats.cc
  ${FUYOU_DAEMON_DIR}/jobs/job.cc
  ${FUYOU_DAEMON_DIR}/jobs/job_registry.cc
  ${FUYOU_DAEMON_DIR}/scheduler/state_cache.cc
  ${FUYOU_DAEMON_DIR}/session/session_segment.cc
  ${FUYOU_DAEMON_DIR}/session/session.cc
  ${FUYOU_DAEMON_DIR}/session/session_import.cc
  ${FUYOU_DAEMON_DIR}/session/session_quota.cc
  ${FUYOU_DAEMON_DIR}/session/session_registry.cc
  ${FUYOU_DAEMON_DIR}/server/socket_path.cc
  ${FUYOU_DAEMON_DIR}/server/peer_listener.cc
  ${FUYOU_DAEMON_DIR}/server/segment_listener.cc
  ${FUYOU_DAEMON_DIR}/server/offload_service.cc
  ${FUYOU_DAEMON_DIR}/server/admin_service.cc
  ${FUYOU_DAEMON_DIR}/server/daemon_server.cc)
target_include_directories(fuyou_daemon_core PUBLIC ${FUYOU_DAEMON_DIR})
target_compile_definitions(fuyou_daemon_core PUBLIC FUYOU_VERSION="${PROJECT_VERSION}")
target_compile_options(fuyou_daemon_core PRIVATE -Wall -Wextra)
target_link_libraries(fuyou_daemon_core PUBLIC
  fuyou_optimizer fuyou_storage fuyou_wire fuyou_proto gRPC::grpc++ absl::status absl::statusor fmt::fmt
  tomlplusplus::tomlplusplus Boost::headers PkgConfig::XXHASH rt Threads::Threads)

add_executable(fuyoud ${FUYOU_DAEMON_DIR}/main.cc)
target_link_libraries(fuyoud PRIVATE fuyou_daemon_core CLI11::CLI11 PkgConfig::SYSTEMD)
install(TARGETS fuyoud RUNTIME DESTINATION bin)

fuyou_add_test(NAME daemon_config_test
  SOURCES ${FUYOU_DAEMON_DIR}/config/daemon_config_test.cc LIBS fuyou_daemon_core)
fuyou_add_test(NAME state_cache_test
  SOURCES ${FUYOU_DAEMON_DIR}/scheduler/state_cache_test.cc LIBS fuyou_daemon_core)
fuyou_add_test(NAME daemon_stats_test
  SOURCES ${FUYOU_DAEMON_DIR}/stats/daemon_stats_test.cc LIBS fuyou_daemon_core)
fuyou_add_test(NAME session_quota_test
  SOURCES ${FUYOU_DAEMON_DIR}/session/session_quota_test.cc LIBS fuyou_daemon_core)
fuyou_add_test(NAME crash_point_test
  SOURCES ${FUYOU_DAEMON_DIR}/common/crash_point_test.cc LIBS fuyou_daemon_core)
fuyou_add_test(NAME status_util_test
  SOURCES ${FUYOU_DAEMON_DIR}/common/status_util_test.cc LIBS fuyou_daemon_core)
fuyou_add_test(NAME job_test
  SOURCES ${FUYOU_DAEMON_DIR}/jobs/job_test.cc LIBS fuyou_daemon_core)
fuyou_add_test(NAME session_segment_test
  SOURCES ${FUYOU_DAEMON_DIR}/session/session_segment_test.cc LIBS fuyou_daemon_core)
