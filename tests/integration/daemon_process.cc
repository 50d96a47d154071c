#include "daemon_process.h"

#include <signal.h>
#include <spawn.h>
#include <fcntl.h>
#include <grp.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string_view>
#include <thread>

#include "fuyou/admin_client.h"

extern char** environ;

namespace fuyou::testing {
namespace fs = std::filesystem;

namespace {

// argv and envp for an exec of `program`: this process's environment with `env`
// added or replacing. The pointers point into the arguments.
struct ExecArgs {
  std::vector<char*> argv;
  std::vector<char*> envp;
};

ExecArgs MakeExecArgs(const std::string& program, const std::vector<std::string>& args,
                      const std::vector<std::string>& env) {
  ExecArgs exec;
  exec.argv.push_back(const_cast<char*>(program.c_str()));
  for (const std::string& arg : args) exec.argv.push_back(const_cast<char*>(arg.c_str()));
  exec.argv.push_back(nullptr);
  std::vector<std::string> names;
  for (const std::string& entry : env) names.push_back(entry.substr(0, entry.find('=') + 1));
  for (char** inherited = environ; *inherited != nullptr; ++inherited) {
    bool replaced = false;
    for (const std::string& name : names) replaced = replaced || std::string_view(*inherited).starts_with(name);
    if (!replaced) exec.envp.push_back(*inherited);
  }
  for (const std::string& entry : env) exec.envp.push_back(const_cast<char*>(entry.c_str()));
  exec.envp.push_back(nullptr);
  return exec;
}

}  // namespace

pid_t SpawnAs(uid_t uid, const std::string& program, const std::vector<std::string>& args,
              const std::vector<std::string>& env) {
  ExecArgs exec = MakeExecArgs(program, args, env);  // before fork: no allocation in the child
  const pid_t pid = ::fork();
  if (pid != 0) return pid;
  if (::setgroups(0, nullptr) != 0 || ::setgid(uid) != 0 || ::setuid(uid) != 0) ::_exit(126);
  ::execve(program.c_str(), exec.argv.data(), exec.envp.data());
  ::_exit(127);
}

int RunAs(uid_t uid, const std::string& program, const std::vector<std::string>& args,
          const std::filesystem::path& output_file, std::string* output) {
  ExecArgs exec = MakeExecArgs(program, args, {});
  const int out = ::open(output_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
  if (out < 0) return -1;
  const pid_t pid = ::fork();
  if (pid == 0) {
    if (::dup2(out, 1) < 0 || ::dup2(out, 2) < 0) ::_exit(125);
    if (::setgroups(0, nullptr) != 0 || ::setgid(uid) != 0 || ::setuid(uid) != 0) ::_exit(126);
    ::execve(program.c_str(), exec.argv.data(), exec.envp.data());
    ::_exit(127);
  }
  ::close(out);
  int status = 0;
  if (pid < 0 || ::waitpid(pid, &status, 0) != pid) return -1;
  std::ifstream in(output_file);
  *output = std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

pid_t Spawn(const std::string& program, const std::vector<std::string>& args, const std::vector<std::string>& env) {
  ExecArgs exec = MakeExecArgs(program, args, env);
  pid_t pid = -1;
  if (::posix_spawn(&pid, program.c_str(), nullptr, nullptr, exec.argv.data(), exec.envp.data()) != 0) return -1;
  return pid;
}

absl::StatusOr<std::unique_ptr<ClientSegment>> HandOverNewSegment(const v1::OpenSessionResponse& opened) {
  auto segment = ClientSegment::Create(opened.segment_bytes());
  if (!segment.ok()) return segment.status();
  absl::Status handed = (*segment)->HandOver(opened.segment_socket(), opened.session_id(), std::chrono::seconds(20));
  if (!handed.ok()) return handed;
  return segment;
}

DaemonProcess::DaemonProcess(const fs::path& dir, std::vector<std::string> extra_args, std::vector<std::string> env)
    : socket_path_(dir / "fuyoud.sock"),
      data_dir_(dir / "data"),
      extra_args_(std::move(extra_args)),
      env_(std::move(env)) {}

DaemonProcess::~DaemonProcess() { Stop(); }

absl::Status DaemonProcess::Start() {
  std::vector<std::string> args = {"--socket", socket_path_.string(), "--data-dir", data_dir_.string()};
  args.insert(args.end(), extra_args_.begin(), extra_args_.end());
  pid_ = run_as_ == static_cast<uid_t>(-1) ? Spawn(FUYOUD_PATH, args, env_)
                                           : SpawnAs(run_as_, FUYOUD_PATH, args, env_);
  if (pid_ < 0) return absl::InternalError("cannot spawn " FUYOUD_PATH);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (std::chrono::steady_clock::now() < deadline) {
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return absl::InternalError("fuyoud exited during start-up");
    }
    if (fs::exists(socket_path_)) {
      auto admin = AdminClient::Connect(client_options());
      if (admin.ok() && (*admin)->Health().ok()) return absl::OkStatus();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return absl::DeadlineExceededError("fuyoud did not answer within 20 s");
}

int DaemonProcess::Stop() {
  if (pid_ < 0) return -1;
  ::kill(pid_, SIGTERM);
  int status = 0;
  for (int i = 0; i < 300; ++i) {
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return status;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  Kill();
  return -1;
}

void DaemonProcess::Kill() {
  if (pid_ < 0) return;
  ::kill(pid_, SIGKILL);
  ::waitpid(pid_, nullptr, 0);
  pid_ = -1;
}

int DaemonProcess::WaitForExit(std::chrono::milliseconds timeout) {
  if (pid_ < 0) return -1;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  int status = 0;
  while (true) {
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return status;
    }
    if (std::chrono::steady_clock::now() >= deadline) return -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

ClientOptions DaemonProcess::client_options() const {
  ClientOptions options;
  options.address = "unix:" + socket_path_.string();
  options.rpc_timeout = std::chrono::milliseconds(20000);
  options.connect_timeout = std::chrono::milliseconds(3000);
  return options;
}

std::map<std::string, std::string> KeyValues(const std::string& text) {
  std::map<std::string, std::string> values;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    const size_t eq = line.find('=');
    if (eq != std::string::npos) values[line.substr(0, eq)] = line.substr(eq + 1);
  }
  return values;
}

}  // namespace fuyou::testing
