#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "vitrify/log.hpp"

namespace {
std::vector<std::pair<int, std::string>> g_seen;
void sink(int level, const char* m) noexcept { g_seen.emplace_back(level, m); }
}  // namespace

TEST(Log, StderrLevelAppliesWithoutASink) {
  EXPECT_FALSE(vitrify::log::enabled(vitrify::log::kInfo)) << "default: WARNING";
  EXPECT_TRUE(vitrify::log::enabled(vitrify::log::kWarning));
  vitrify::log::set_stderr_level(vitrify::log::kDebug);
  EXPECT_TRUE(vitrify::log::enabled(vitrify::log::kDebug));
  vitrify::log::set_sink(&sink, vitrify::log::kError);  // a sink's level wins while installed
  EXPECT_FALSE(vitrify::log::enabled(vitrify::log::kWarning));
  vitrify::log::set_sink(nullptr, 0);  // back to the stderr level
  EXPECT_TRUE(vitrify::log::enabled(vitrify::log::kDebug));
  vitrify::log::set_stderr_level(vitrify::log::kWarning);
  EXPECT_FALSE(vitrify::log::enabled(vitrify::log::kInfo));
}

TEST(Log, SinkReceivesMessagesAtOrAboveItsLevel) {
  g_seen.clear();
  vitrify::log::set_sink(&sink, vitrify::log::kInfo);
  vitrify::log::debug("hidden");
  vitrify::log::info("shown");
  vitrify::log::error("also shown");
  vitrify::log::set_sink(nullptr, 0);
  ASSERT_EQ(g_seen.size(), 2u);
  EXPECT_EQ(g_seen[0].first, 20);
  EXPECT_EQ(g_seen[0].second, "shown");
  EXPECT_EQ(g_seen[1].first, 40);
}
