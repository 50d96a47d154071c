# The Python suite (tests/python, pytest): fuyou.AdamW against torch.optim.AdamW,
# mixed precision, resume after SIGKILL, failures, against a real fuyoud that the
# fixtures start on a temporary socket. Included by tests/CMakeLists.txt.
if(TARGET _fuyou AND TARGET fuyoud)
  # The data-parallel tests (issue 24: real gloo ranks, many processes each) are
  # an entry of their own, run alone so that their ranks' timeouts never meet
  # another test's load; every other test file is python_tests'.
  file(GLOB FUYOU_DP_TESTS CONFIGURE_DEPENDS
       ${CMAKE_SOURCE_DIR}/tests/python/test_data_parallel.py
       ${CMAKE_SOURCE_DIR}/tests/python/test_dp_*.py
       ${CMAKE_SOURCE_DIR}/tests/python/test_ddp_*.py)
  set(FUYOU_PYTHON_ENV
      "FUYOU_DAEMON=$<TARGET_FILE:fuyoud>;PYTHONPATH=${CMAKE_SOURCE_DIR}/python_client;FUYOU_EMBEDDED=0")
  set(FUYOU_NOT_DP)
  foreach(dp_test ${FUYOU_DP_TESTS})
    list(APPEND FUYOU_NOT_DP --ignore=${dp_test})
  endforeach()
  add_test(NAME python_tests
    COMMAND ${Python3_EXECUTABLE} -m pytest -q -p no:cacheprovider ${FUYOU_NOT_DP} ${CMAKE_SOURCE_DIR}/tests/python
    WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
  set_tests_properties(python_tests PROPERTIES
    ENVIRONMENT "${FUYOU_PYTHON_ENV}"
    LABELS "python;integration"
    TIMEOUT 900)
  add_test(NAME python_data_parallel_tests
    COMMAND ${Python3_EXECUTABLE} -m pytest -q -p no:cacheprovider ${FUYOU_DP_TESTS}
    WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
  set_tests_properties(python_data_parallel_tests PROPERTIES
    ENVIRONMENT "${FUYOU_PYTHON_ENV}"
    LABELS "python;integration;slow"
    RUN_SERIAL TRUE
    TIMEOUT 1500)
  # The GPU tests of the chunk pipeline (issue 11): they skip without a CUDA device.
  add_test(NAME python_gpu_tests
    COMMAND ${Python3_EXECUTABLE} -m pytest -q -rs -p no:cacheprovider
            ${CMAKE_SOURCE_DIR}/tests/gpu/test_cuda_pipeline.py
    WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
  set_tests_properties(python_gpu_tests PROPERTIES
    ENVIRONMENT "${FUYOU_PYTHON_ENV}"
    LABELS "python;gpu"
    TIMEOUT 300)
  # The client's layout (issue 21): no import cycle, no file over 500 lines.
  add_test(NAME python_layout
    COMMAND ${Python3_EXECUTABLE} ${CMAKE_SOURCE_DIR}/python_client/tools/check_layout.py
    WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
  set_tests_properties(python_layout PROPERTIES LABELS "python;unit" TIMEOUT 60)
else()
  message(STATUS "fuyou: python_tests not registered (needs targets _fuyou and fuyoud)")
endif()
