// TempDir: a fresh directory under /tmp for one test, made at construction and
// removed with everything in it at destruction.
//
// Declare it before the members that use the directory, so that it is removed
// after they are gone:
//
//   class JobTest : public ::testing::Test {
//    protected:
//     const TempDir temp_dir_{"fuyou-job-test"};
//     const std::filesystem::path root_ = temp_dir_.path();
//     std::unique_ptr<storage::IoEngine> io_;  // closed before the directory goes
//   };
//
// When the directory cannot be made (no /tmp, or it is full), the process
// stops with the reason on stderr: no test can run without it. No GoogleTest
// here: the integration tests' clients and the benchmarks use it too.
#pragma once

#include <stdlib.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <string_view>
#include <system_error>

namespace fuyou {

class TempDir {
 public:
  // `prefix`: the directory's name before a random suffix, e.g. "fuyou-job-test".
  explicit TempDir(std::string_view prefix = "fuyou-test") {
    std::string pattern = "/tmp/" + std::string(prefix) + "-XXXXXX";
    if (::mkdtemp(pattern.data()) == nullptr) {
      std::fprintf(stderr, "FATAL: mkdtemp %s: %s\n", pattern.c_str(), std::strerror(errno));
      std::abort();
    }
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ignored;  // a test that left something unremovable still passes or fails on its own
    std::filesystem::remove_all(path_, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

}  // namespace fuyou
