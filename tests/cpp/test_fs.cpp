#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdlib>
#include <string>

#include "thaw/fs.hpp"

TEST(Fs, ProbeReportsTypeAndAnAnswer) {
  char tmpl[] = "/tmp/thaw-fs-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const thaw::fs::DirectIoProbe p = thaw::fs::probe_direct_io(tmpl);
  EXPECT_FALSE(p.fs_type.empty());
  EXPECT_GT(p.block_size, 0u);
  EXPECT_TRUE(p.supported || !p.reason.empty()) << "unsupported must say why";
  ::rmdir(tmpl);  // the probe leaves nothing behind, so the directory is empty again
  EXPECT_NE(::access(tmpl, F_OK), 0);
}

TEST(Fs, MissingDirectoryIsSystemError) {
  try {
    thaw::fs::probe_direct_io("/nonexistent/thaw/dir");
    FAIL() << "no throw";
  } catch (const std::system_error& e) {
    EXPECT_EQ(e.code().value(), ENOENT);
  }
}

TEST(Fs, Names) {
  EXPECT_EQ(thaw::fs::fs_type_name(0xEF53), "ext4");
  EXPECT_EQ(thaw::fs::fs_type_name(0x01021994), "tmpfs");
  EXPECT_EQ(thaw::fs::fs_type_name(0x1234), "0x1234");
}
