// A fresh directory for one test, under VITRIFY_TEST_DIR (else /tmp; ShmDir: /dev/shm), removed
// with its contents when the test ends.
#pragma once

#include <stdlib.h>

#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <string>

namespace vitrify::test {

struct TempDir {
  std::string path;
  TempDir() : TempDir(nullptr) {}
  // Under `parent` (e.g. "/dev/shm" for the host tier, which needs tmpfs) instead.
  explicit TempDir(const char* parent) {
    const char* base = parent ? parent : std::getenv("VITRIFY_TEST_DIR");
    std::string tmpl = std::string(base && *base ? base : "/tmp") + "/vitrify-test-XXXXXX";
    if (::mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed: " + tmpl);
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
};

// A fresh directory in /dev/shm (tmpfs), as the host tier's slabs need.
struct ShmDir : TempDir {
  ShmDir() : TempDir("/dev/shm") {}
};

}  // namespace vitrify::test
