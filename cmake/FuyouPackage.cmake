# The Debian package (CPack, DEB generator): `cpack -G DEB` in the build tree
# (or `cmake --build build --target package`) writes fuyou_<version>_amd64.deb.
#
# It installs, under /usr: fuyoud and fuyouctl (bin/), the systemd unit
# (lib/systemd/system/fuyoud.service, ExecStart=/usr/bin/fuyoud), the README; and
# /etc/fuyou/fuyoud.toml, a conffile (dpkg keeps a changed one on upgrade and on remove). The maintainer
# scripts (deploy/debian/) create the system group and user `fuyou` and
# /var/lib/fuyou, which no upgrade, remove or purge deletes (job states).
# Runtime dependencies come from dpkg-shlibdeps on the binaries. The Python client
# is not in the package: it is the wheel (`pip install .` into the user's own venv,
# with torch 2 from PyPI), which finds this fuyoud on PATH or at its system socket.
#
# The package-only files are the install component `deb`, left out of a plain
# `cmake --install` (deploy/install.sh installs under /usr/local with its own
# unit and config handling).
set(FUYOU_DEB_STAGE ${CMAKE_BINARY_DIR}/deb)

# The unit as packaged: the binary is /usr/bin/fuyoud, the README under /usr/share/doc.
file(READ ${PROJECT_SOURCE_DIR}/deploy/fuyoud.service fuyou_unit)
string(REPLACE "/usr/local/bin/fuyoud" "/usr/bin/fuyoud" fuyou_unit "${fuyou_unit}")
string(REPLACE "/usr/local/share/doc/fuyou" "/usr/share/doc/fuyou" fuyou_unit "${fuyou_unit}")
string(REPLACE "Installed by deploy/install.sh as /etc/systemd/system/fuyoud.service"
               "Installed by the fuyou Debian package as /usr/lib/systemd/system/fuyoud.service"
               fuyou_unit "${fuyou_unit}")
file(WRITE ${FUYOU_DEB_STAGE}/fuyoud.service "${fuyou_unit}")
install(FILES ${FUYOU_DEB_STAGE}/fuyoud.service DESTINATION lib/systemd/system COMPONENT deb EXCLUDE_FROM_ALL)
install(FILES ${PROJECT_SOURCE_DIR}/deploy/fuyoud.toml DESTINATION /etc/fuyou COMPONENT deb EXCLUDE_FROM_ALL)
install(FILES ${PROJECT_SOURCE_DIR}/README.md DESTINATION share/doc/fuyou COMPONENT deb EXCLUDE_FROM_ALL)
file(GLOB fuyou_doc_pages ${PROJECT_SOURCE_DIR}/docs/*.md)
install(FILES ${fuyou_doc_pages} DESTINATION share/doc/fuyou/docs COMPONENT deb EXCLUDE_FROM_ALL)

# Maintainer scripts (executable) and the conffile list.
foreach(script postinst prerm postrm)
  file(COPY ${PROJECT_SOURCE_DIR}/deploy/debian/${script} DESTINATION ${FUYOU_DEB_STAGE}/control
       FILE_PERMISSIONS OWNER_READ OWNER_WRITE OWNER_EXECUTE GROUP_READ GROUP_EXECUTE WORLD_READ WORLD_EXECUTE)
endforeach()
file(WRITE ${FUYOU_DEB_STAGE}/control/conffiles "/etc/fuyou/fuyoud.toml\n")

set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGE_NAME fuyou)
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_CONTACT "fuyou maintainers <fuyou@localhost>")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "AdamW optimizer states on NVMe SSDs, updated on the CPU (fuyoud daemon)")
set(CPACK_PACKAGE_DESCRIPTION "fuyoud keeps a PyTorch job's AdamW optimizer states on NVMe SSDs and runs the optimizer on the CPU; jobs talk to it over a Unix socket and shared memory. Includes fuyouctl; the Python client is the wheel (pip install).")
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_DEB_COMPONENT_INSTALL ON)
set(CPACK_COMPONENTS_GROUPING ALL_COMPONENTS_IN_ONE)
set(CPACK_COMPONENTS_ALL Unspecified deb)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PACKAGE_ARCHITECTURE amd64)
set(CPACK_DEBIAN_PACKAGE_SECTION science)
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
# Stripped binaries (the build tree keeps the debug info): about 6x smaller.
set(CPACK_STRIP_FILES ON)
# adduser-like tools come from passwd.
set(CPACK_DEBIAN_PACKAGE_DEPENDS "passwd")
set(CPACK_DEBIAN_PACKAGE_CONTROL_EXTRA
    ${FUYOU_DEB_STAGE}/control/postinst ${FUYOU_DEB_STAGE}/control/prerm ${FUYOU_DEB_STAGE}/control/postrm
    ${FUYOU_DEB_STAGE}/control/conffiles)
set(CPACK_DEBIAN_PACKAGE_CONTROL_STRICT_PERMISSION ON)
set(CPACK_OUTPUT_FILE_PREFIX ${CMAKE_BINARY_DIR}/packages)
include(CPack)
