# The Python suite (tests/python, pytest): fuyou.AdamW against torch.optim.AdamW,
# mixed precision, resume after SIGKILL, failures, against a real fuyoud that the
# fixtures start on a temporary socket. Included by tests/CMakeLists.txt.
if(TARGET _fuyou AND TARGET fuyoud)
  add_test(NAME python_tests
    COMMAND /usr/bin/python3 -m pytest -q -p no:cacheprovider ${CMAKE_SOURCE_DIR}/tests/python
    WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
  set_tests_properties(python_tests PROPERTIES
    ENVIRONMENT "FUYOU_DAEMON=$<TARGET_FILE:fuyoud>;PYTHONPATH=${CMAKE_SOURCE_DIR}/python_client;FUYOU_EMBEDDED=0"
    LABELS "python;integration"
    TIMEOUT 600)
  # The GPU tests of the chunk pipeline (issue 11): they skip without a CUDA device.
  add_test(NAME python_gpu_tests
    COMMAND /usr/bin/python3 -m pytest -q -rs -p no:cacheprovider
            ${CMAKE_SOURCE_DIR}/tests/gpu/test_cuda_pipeline.py
    WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
  set_tests_properties(python_gpu_tests PROPERTIES
    ENVIRONMENT "FUYOU_DAEMON=$<TARGET_FILE:fuyoud>;PYTHONPATH=${CMAKE_SOURCE_DIR}/python_client;FUYOU_EMBEDDED=0"
    LABELS "python;gpu"
    TIMEOUT 300)
  # The client's layout (issue 21): no import cycle, no file over 500 lines.
  add_test(NAME python_layout
    COMMAND /usr/bin/python3 ${CMAKE_SOURCE_DIR}/python_client/tools/check_layout.py
    WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
  set_tests_properties(python_layout PROPERTIES LABELS "python;unit" TIMEOUT 60)
else()
  message(STATUS "fuyou: python_tests not registered (needs targets _fuyou and fuyoud)")
endif()
