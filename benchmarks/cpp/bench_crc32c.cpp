// CRC32C throughput: the SSE4.2 path against the portable table (the baseline, same run).
#include <benchmark/benchmark.h>

#include <vector>

#include "vitrify/crc32c.hpp"

static void BM_crc32c(benchmark::State& st, bool hardware) {
  const size_t n = static_cast<size_t>(st.range(0));
  std::vector<uint8_t> buf(n);
  for (size_t i = 0; i < n; ++i) buf[i] = static_cast<uint8_t>(i * 131);
  for (auto _ : st) {
    uint32_t c = hardware ? vitrify::crc32c(buf.data(), n) : vitrify::crc32c_software(buf.data(), n);
    benchmark::DoNotOptimize(c);
  }
  st.SetBytesProcessed(static_cast<int64_t>(st.iterations()) * static_cast<int64_t>(n));
  st.counters["hardware"] = hardware && vitrify::crc32c_hardware();
}
BENCHMARK_CAPTURE(BM_crc32c, dispatch, true)->Arg(4096)->Arg(1 << 20)->Arg(4 << 20);
BENCHMARK_CAPTURE(BM_crc32c, software, false)->Arg(4096)->Arg(1 << 20)->Arg(4 << 20);

BENCHMARK_MAIN();
