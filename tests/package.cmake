# The Debian package (label `package`): builds fuyou_<version>_amd64.deb from
# this build tree with cpack, installs it into an empty root with dpkg --root and
# checks the installed files (tests/package/deb_test.sh); and
# `systemd-analyze verify` of the unit as the package installs it
# (tests/package/unit_verify_test.sh); and the wheel built, installed into a clean
# venv and trained with (tests/package/wheel_test.sh). Included by tests/CMakeLists.txt.
if(TARGET fuyoud AND TARGET fuyouctl)
  add_test(NAME deb_package_test
    COMMAND ${CMAKE_SOURCE_DIR}/tests/package/deb_test.sh ${CMAKE_BINARY_DIR} ${PROJECT_VERSION})
  add_test(NAME systemd_unit_verify_test
    COMMAND ${CMAKE_SOURCE_DIR}/tests/package/unit_verify_test.sh ${CMAKE_BINARY_DIR} ${PROJECT_VERSION})
  # Both build the package in the same place: never side by side.
  set_tests_properties(deb_package_test systemd_unit_verify_test PROPERTIES
    LABELS package TIMEOUT 300 RESOURCE_LOCK fuyou_deb SKIP_RETURN_CODE 77)
  # The wheel (pyproject.toml) built, installed into a clean venv, trained with.
  add_test(NAME wheel_test
    COMMAND ${CMAKE_SOURCE_DIR}/tests/package/wheel_test.sh ${CMAKE_BINARY_DIR} ${Python3_EXECUTABLE})
  set_tests_properties(wheel_test PROPERTIES LABELS "package;python" TIMEOUT 900)
else()
  message(STATUS "fuyou: package tests not registered (need targets fuyoud, fuyouctl)")
endif()
