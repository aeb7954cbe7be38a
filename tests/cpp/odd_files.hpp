// What a reader of an archive's files must refuse, planted in a test directory: a symbolic link
// to a good file, a dangling link, a link to a FIFO, a FIFO and a directory; and a way to call a
// reader that must not block on any of them (a reader that opens the FIFO is unblocked by
// opening its write end, so a regression fails the test instead of hanging it).
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

namespace vitrify::test {

struct OddFile {
  std::string name;  // what it is, for messages
  std::string path;
  int err;           // the errno a reader's refusal carries
  const char* kind;  // the words the refusal uses for it
};

// Plants the odd files in `dir`, the links pointing at `target` (a regular file) or at the FIFO.
inline std::vector<OddFile> plant_odd_files(const std::string& dir, const std::string& target) {
  const std::vector<OddFile> odd = {
      {"a link to a regular file", dir + "/link", ELOOP, "a symbolic link"},
      {"a dangling link", dir + "/dangling", ELOOP, "a symbolic link"},
      {"a link to a FIFO", dir + "/fifo-link", ELOOP, "a symbolic link"},
      {"a FIFO", dir + "/fifo", EINVAL, "a FIFO"},
      {"a directory", dir + "/dir", EISDIR, "a directory"},
  };
  if (::symlink(target.c_str(), odd[0].path.c_str()) != 0 ||
      ::symlink((dir + "/nowhere").c_str(), odd[1].path.c_str()) != 0 ||
      ::symlink(odd[3].path.c_str(), odd[2].path.c_str()) != 0 ||
      ::mkfifo(odd[3].path.c_str(), 0600) != 0 || ::mkdir(odd[4].path.c_str(), 0700) != 0)
    throw std::system_error(errno, std::generic_category(), "planting odd files in " + dir);
  return odd;
}

// The outcome of a reader call: its std::system_error's message and errno, or "(no exception)";
// `prompt` false when it had not returned after `limit` (it is then unblocked through `fifo`).
struct ReaderOutcome {
  std::string message = "(no exception)";
  int err = 0;
  bool prompt = true;
  std::string other;  // what another exception said
};

inline ReaderOutcome call_reader(const std::function<void()>& fn, const std::string& fifo,
                                 std::chrono::seconds limit = std::chrono::seconds(10)) {
  auto out = std::make_shared<ReaderOutcome>();
  std::promise<void> done;
  std::future<void> finished = done.get_future();
  std::thread t([fn, out, p = std::move(done)]() mutable {
    try {
      fn();
    } catch (const std::system_error& e) {
      out->message = e.what();
      out->err = e.code().value();
    } catch (const std::exception& e) {
      out->other = e.what();
    }
    p.set_value();
  });
  if (finished.wait_for(limit) != std::future_status::ready) {
    out->prompt = false;
    // A reader blocked opening the FIFO returns once a writer opens it; then it reads nothing.
    for (int i = 0; i < 100 && finished.wait_for(std::chrono::milliseconds(100)) !=
                                   std::future_status::ready; ++i) {
      const int w = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
      if (w >= 0) ::close(w);
    }
  }
  t.join();
  ReaderOutcome r = *out;
  return r;
}

}  // namespace vitrify::test
