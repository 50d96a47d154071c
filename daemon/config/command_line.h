// fuyoud's command line: --config and a flag for every setting of the option
// table (option_table.h) that has one, and the precedence between them.
#pragma once

#include <CLI/CLI.hpp>
#include <deque>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "config/daemon_config.h"
#include "config/option_table.h"

namespace fuyou {

class DaemonCommandLine {
 public:
  // Adds --config and the table's flags to `app`, which must outlive this object
  // (CLI11 writes the flags' values into it).
  explicit DaemonCommandLine(CLI::App& app);
  DaemonCommandLine(const DaemonCommandLine&) = delete;
  DaemonCommandLine& operator=(const DaemonCommandLine&) = delete;

  // After app.parse(): the built-in defaults, overlaid by the --config file,
  // overlaid by the flags given. A bad file or value is an error naming the key
  // or the flag and what is wrong with it.
  absl::StatusOr<DaemonConfig> Resolve() const;

 private:
  struct Flag {
    const DaemonOption* option;
    CLI::Option* cli = nullptr;
    std::string text;                // a single-valued flag
    std::vector<std::string> texts;  // a kPathList flag
  };
  std::string config_file_;
  std::deque<Flag> flags_;  // CLI11 holds pointers into them
};

}  // namespace fuyou
