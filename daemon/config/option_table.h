// The option table: every setting of fuyoud spelled once, with its TOML table and
// key, its flag, its parser, its default and its help. The TOML reader
// (ApplyTomlText) and the command line (command_line.h) are both driven by it;
// a new option is one entry in option_table.cc.
#pragma once

#include <toml++/toml.h>

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "config/daemon_config.h"

namespace fuyou {

// How a setting's value is read, from a TOML node or from a flag's text.
enum class OptionParser {
  kSize,       // "4GiB", "512MiB" or (TOML) an integer of bytes: ParseByteSize
  kAutoSize,   // "auto" (kAutoBytes), "unlimited" (0) or a size: ParseAutoByteSize
  kCount,      // an integer in min..max
  kSeconds,    // a number of seconds >= 0 (TOML: an integer or a float)
  kBool,       // true or false
  kPath,       // a non-empty path
  kPathList,   // non-empty paths (TOML: an array; a flag: repeated or several values)
  kText,       // any string, "" included
  kEnum,       // one of `choices`
  kOctalMode,  // "0660": octal permission bits, at most 0777
};

// The DaemonConfig member a setting writes.
using ConfigField =
    std::variant<uint64_t DaemonConfig::*, uint32_t DaemonConfig::*, double DaemonConfig::*, bool DaemonConfig::*,
                 std::string DaemonConfig::*, std::filesystem::path DaemonConfig::*,
                 std::vector<std::filesystem::path> DaemonConfig::*, DurabilityMode DaemonConfig::*>;

struct DaemonOption {
  std::string_view table;  // TOML table, e.g. "limits"; "" when the setting has no TOML key
  std::string_view key;    // TOML key in `table`
  std::string_view flag;   // CLI11 names, e.g. "--data-dir,--storage-path"; "" when it has no flag
  OptionParser parser;
  ConfigField field;
  std::string_view default_text;  // the built-in default as --help shows it
  std::string_view help;
  std::string_view expected = {};  // what a value of the wrong type or out of range is told
  int64_t min = 0;                 // kCount
  int64_t max = 0;                 // kCount
  std::span<const std::string_view> choices = {};  // kEnum; a DurabilityMode field takes the index
};

// Every setting, in --help order.
std::span<const DaemonOption> DaemonOptions();

// "limits.max_sessions", or the first flag name of a setting with no TOML key.
std::string OptionName(const DaemonOption& option);
// "--max-sessions": the first of `option.flag`'s names.
std::string_view FlagName(const DaemonOption& option);

// Overlays the settings of a parsed TOML document onto `config`. Unknown tables
// and keys and bad values are INVALID_ARGUMENT "<origin>: key '<table.key>': <what is wrong>".
absl::Status ApplyTomlRoot(const toml::table& root, std::string_view origin, DaemonConfig* config);

// Overlays a flag's values (one, or several for kPathList) onto `config`; a bad
// value is INVALID_ARGUMENT "<flag>: <what is wrong>".
absl::Status ApplyFlag(const DaemonOption& option, const std::vector<std::string>& values, DaemonConfig* config);

}  // namespace fuyou
