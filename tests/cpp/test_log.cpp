#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "vitrify/log.hpp"

namespace {
std::vector<std::pair<int, std::string>> g_seen;
void sink(int level, const char* m) noexcept { g_seen.emplace_back(level, m); }
}  // namespace

TEST(Log, ParseLevel) {
  EXPECT_EQ(vitrify::log::parse_level("debug", 99), 10);
  EXPECT_EQ(vitrify::log::parse_level("WARN", 99), 30);
  EXPECT_EQ(vitrify::log::parse_level("25", 99), 25);
  EXPECT_EQ(vitrify::log::parse_level("", 99), 99);
  EXPECT_EQ(vitrify::log::parse_level(nullptr, 99), 99);
  EXPECT_EQ(vitrify::log::parse_level("loud", 99), 99);
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
