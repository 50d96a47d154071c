# The RPC fuzz test (tests/fuzz): hypothesis-generated and byte-mutated messages on
# every RPC against a real fuyoud, beside a legitimate job of another user. In CI
# it runs in build-asan, against the ASan+UBSan daemon (deploy/test.sh).
# FUYOU_FUZZ_SECONDS (environment, at test time) bounds the fuzzing; default 60.
set(FUYOU_FUZZ_DIR ${CMAKE_CURRENT_LIST_DIR}/fuzz)

# The legitimate job: trains through the real clientlib, checked against a plain AdamW.
add_executable(legit_job ${FUYOU_FUZZ_DIR}/legit_job.cc)
target_include_directories(legit_job PRIVATE ${CMAKE_CURRENT_LIST_DIR}/integration)
target_link_libraries(legit_job PRIVATE fuyou_client fmt::fmt)

# Python modules of the protocol, from the protos in the tree (no gRPC plugin: the
# fuzzer calls methods by name with the message classes' serializers). Generated
# flat (offload_pb2, admin_pb2) so they do not shadow python_client's `fuyou`.
set(FUYOU_FUZZ_PB2_DIR ${CMAKE_CURRENT_BINARY_DIR}/fuzz_pb2)
set(FUYOU_FUZZ_PB2 ${FUYOU_FUZZ_PB2_DIR}/offload_pb2.py ${FUYOU_FUZZ_PB2_DIR}/admin_pb2.py)
add_custom_command(
  OUTPUT ${FUYOU_FUZZ_PB2}
  COMMAND ${CMAKE_COMMAND} -E make_directory ${FUYOU_FUZZ_PB2_DIR}
  COMMAND protobuf::protoc --proto_path=${PROJECT_SOURCE_DIR}/proto/fuyou/v1
    --python_out=${FUYOU_FUZZ_PB2_DIR} offload.proto admin.proto
  DEPENDS ${PROJECT_SOURCE_DIR}/proto/fuyou/v1/offload.proto ${PROJECT_SOURCE_DIR}/proto/fuyou/v1/admin.proto
  COMMENT "protoc --python_out (fuzz test)")
add_custom_target(fuyou_fuzz_pb2 ALL DEPENDS ${FUYOU_FUZZ_PB2})

add_test(NAME rpc_fuzz
  COMMAND ${Python3_EXECUTABLE} ${FUYOU_FUZZ_DIR}/rpc_fuzz.py
    --daemon $<TARGET_FILE:fuyoud> --legit-job $<TARGET_FILE:legit_job> --pb2-dir ${FUYOU_FUZZ_PB2_DIR})
set_tests_properties(rpc_fuzz PROPERTIES
  LABELS "fuzz;integration"
  SKIP_RETURN_CODE 77
  TIMEOUT 900)
