#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdlib>
#include <string>

#include "vitrify/fs.hpp"

TEST(Fs, ProbeReportsTypeAndAnAnswer) {
  char tmpl[] = "/tmp/vitrify-fs-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const vitrify::fs::DirectIoProbe p = vitrify::fs::probe_direct_io(tmpl);
  EXPECT_FALSE(p.fs_type.empty());
  EXPECT_GT(p.block_size, 0u);
  EXPECT_TRUE(p.supported || !p.reason.empty()) << "unsupported must say why";
  ::rmdir(tmpl);  // the probe leaves nothing behind, so the directory is empty again
  EXPECT_NE(::access(tmpl, F_OK), 0);
}

TEST(Fs, MissingDirectoryIsSystemError) {
  try {
    vitrify::fs::probe_direct_io("/nonexistent/vitrify/dir");
    FAIL() << "no throw";
  } catch (const std::system_error& e) {
    EXPECT_EQ(e.code().value(), ENOENT);
  }
}

TEST(Fs, Names) {
  EXPECT_EQ(vitrify::fs::fs_type_name(0xEF53), "ext4");
  EXPECT_EQ(vitrify::fs::fs_type_name(0x01021994), "tmpfs");
  EXPECT_EQ(vitrify::fs::fs_type_name(0x1234), "0x1234");
}
