// SessionName: who a session is, in every message that names it: its job and,
// once OpenSession has answered, its id. Private to clientlib.
#pragma once

#include <string>

#include "fmt/format.h"

namespace fuyou::internal {

struct SessionName {
  std::string job;
  std::string id;  // empty until the session is open

  // "job 'x' (session y)".
  std::string Who() const { return fmt::format("job '{}' (session {})", job, id); }
};

}  // namespace fuyou::internal
