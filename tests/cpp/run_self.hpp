// Re-runs the test binary itself (/proc/self/exe) in a child process with more environment
// variables: how a test puts the binary in a child mode (its GoogleTest environment reads them)
// or hides a fake-driver entry point. Shared by the *_fake tests.
#pragma once

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <string>
#include <vector>

extern char** environ;

namespace vitrify::test {

// The child's exit status, or -1 when it did not exit normally (or could not be started).
// `keep_fd` >= 0: that descriptor stays open across the exec (exported fds are close-on-exec).
inline int run_self(const char* name, const std::vector<std::string>& extra, int keep_fd = -1) {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) env.emplace_back(*e);
  for (const auto& x : extra) env.push_back(x);
  std::vector<char*> envp;
  for (auto& s : env) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::string arg0 = name;
  char* argv[] = {arg0.data(), nullptr};
  const pid_t pid = ::fork();
  if (pid == 0) {
    if (keep_fd >= 0) ::fcntl(keep_fd, F_SETFD, 0);
    ::execve("/proc/self/exe", argv, envp.data());
    ::_exit(127);
  }
  if (pid < 0) return -1;
  int status = 0;
  while (::waitpid(pid, &status, 0) == -1 && errno == EINTR) {
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

}  // namespace vitrify::test
