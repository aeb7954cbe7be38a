# Why ctest skipped tests, one line per reason: reads the Testing/Temporary/LastTest.log that a
# ctest run leaves in its build directory.
#   awk -f tests/cpp/skip_reasons.awk BUILD/Testing/Temporary/LastTest.log
# A GoogleTest case that calls GTEST_SKIP prints "<file>:<line>: Skipped", then its message;
# ctest marks it skipped through SKIP_REGULAR_EXPRESSION (set by gtest_discover_tests).
/^[0-9]+\/[0-9]+ Test: / { name = $3; reason = ""; grab = 0; next }
grab {
  grab = 0
  if ($0 !~ /^\[  SKIPPED \]/) reason = $0
  next
}
/: Skipped$/ { grab = 1; next }
/^Skip regular expression found in output/ {
  if (reason == "") reason = "(GTEST_SKIP without a message)"
  suite = name
  sub(/\..*/, "", suite)
  if (!(reason in count)) order[++reasons] = reason
  count[reason]++
  if (!((reason, suite) in seen)) {
    seen[reason, suite] = 1
    suites[reason] = suites[reason] (suites[reason] == "" ? "" : ", ") suite
  }
  total++
}
END {
  if (total == 0) exit 0
  printf "ctest: %d test%s skipped (counted as \"Not Run\" above), by reason:\n", total, total == 1 ? "" : "s"
  for (i = 1; i <= reasons; i++) {
    r = order[i]
    printf "  %d in %s: %s\n", count[r], suites[r], r
  }
}
