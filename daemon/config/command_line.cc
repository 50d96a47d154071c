#include "config/command_line.h"

#include "common/status_util.h"

namespace fuyou {

DaemonCommandLine::DaemonCommandLine(CLI::App& app) {
  app.add_option("--config", config_file_, "TOML config file (see deploy/fuyoud.toml)")->check(CLI::ExistingFile);
  for (const DaemonOption& option : DaemonOptions()) {
    if (option.flag.empty()) continue;
    Flag& flag = flags_.emplace_back(Flag{.option = &option, .cli = nullptr, .text = {}, .texts = {}});
    std::string help = std::string(option.help) + " (default " + std::string(option.default_text) + ")";
    std::string names(option.flag);
    if (option.parser == OptionParser::kPathList) {
      flag.cli = app.add_option(names, flag.texts, help)->type_name("PATH");
    } else {
      flag.cli = app.add_option(names, flag.text, help);
      switch (option.parser) {
        case OptionParser::kSize:
        case OptionParser::kAutoSize: flag.cli->type_name("SIZE"); break;
        case OptionParser::kCount: flag.cli->type_name("INT"); break;
        case OptionParser::kSeconds: flag.cli->type_name("SECONDS"); break;
        case OptionParser::kPath: flag.cli->type_name("PATH"); break;
        default: flag.cli->type_name("TEXT"); break;
      }
    }
  }
}

absl::StatusOr<DaemonConfig> DaemonCommandLine::Resolve() const {
  DaemonConfig config = DefaultDaemonConfig();
  if (!config_file_.empty()) FUYOU_RETURN_IF_ERROR(ApplyTomlFile(config_file_, &config));
  for (const Flag& flag : flags_) {
    if (flag.cli->count() == 0) continue;
    if (flag.option->parser == OptionParser::kPathList) {
      FUYOU_RETURN_IF_ERROR(ApplyFlag(*flag.option, flag.texts, &config));
    } else {
      FUYOU_RETURN_IF_ERROR(ApplyFlag(*flag.option, {flag.text}, &config));
    }
  }
  return config;
}

}  // namespace fuyou
