// The disk tier's slot path: one O_DIRECT transfer per slot (SlabFile) and the Store's
// put/get with background I/O threads. Directory: VITRIFY_BENCH_DIR (default /tmp; use the drive
// you care about, not tmpfs). Bytes/s are reported per benchmark.
#include <benchmark/benchmark.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>

#include "vitrify/disk.hpp"

using namespace vitrify::disk;
using vitrify::file_io::DirectIo;

namespace {

std::string bench_dir() {
  const char* d = std::getenv("VITRIFY_BENCH_DIR");
  std::string tmpl = std::string(d && *d ? d : "/tmp") + "/vitrify-bench-disk-XXXXXX";
  if (::mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
  return tmpl;
}

constexpr uint64_t kSlots = 64;

Key key_of(uint64_t i) {
  Key k{};
  std::memcpy(k.data(), &i, sizeof i);
  return k;
}

void BM_SlabWrite(benchmark::State& st) {
  const size_t page = static_cast<size_t>(st.range(0));
  const std::string dir = bench_dir();
  {
    SlabFile f(dir + "/w.slab", SlabGeometry{0, slot_bytes_for(page), kSlots, 1}, ColdStart::kClear,
               DirectIo::kAuto);
    vitrify::AlignedBuffer buf(slot_bytes_for(page));
    std::memset(buf.data() + 64, 0x5A, page);
    uint64_t i = 0;
    for (auto _ : st) {
      f.write_aligned(i % kSlots, key_of(i), buf.data(), page, static_cast<uint32_t>(i));
      ++i;
    }
    f.sync();
    st.SetBytesProcessed(static_cast<int64_t>(st.iterations() * page));
    st.counters["direct"] = f.direct();
  }
  std::filesystem::remove_all(dir);
}

void BM_SlabRead(benchmark::State& st) {
  const size_t page = static_cast<size_t>(st.range(0));
  const std::string dir = bench_dir();
  {
    SlabFile f(dir + "/r.slab", SlabGeometry{0, slot_bytes_for(page), kSlots, 1}, ColdStart::kClear,
               DirectIo::kAuto);
    vitrify::AlignedBuffer buf(slot_bytes_for(page));
    std::memset(buf.data() + 64, 0x5A, page);
    for (uint64_t i = 0; i < kSlots; ++i) f.write_aligned(i, key_of(i), buf.data(), page, 0);
    f.sync();
    uint64_t i = 0, misses = 0;
    for (auto _ : st) {
      misses += !f.read_into(i % kSlots, key_of(i % kSlots), buf.data(), buf.size(), page);
      ++i;
    }
    st.SetBytesProcessed(static_cast<int64_t>(st.iterations() * page));
    st.counters["misses"] = static_cast<double>(misses);
  }
  std::filesystem::remove_all(dir);
}

// Store round trip: a batch of `depth` puts (zero-copy slot buffers) then `depth` gets.
void BM_StorePutGet(benchmark::State& st) {
  const size_t page = static_cast<size_t>(st.range(0));
  const unsigned depth = static_cast<unsigned>(st.range(1));
  const std::string dir = bench_dir();
  {
    StoreConfig c;
    c.dirs = {dir};
    c.kinds = {KindConfig{page, 1.0}};
    c.budget_bytes = 4096 + 4 * depth * slot_bytes_for(page);
    c.write_threads = depth;
    c.read_threads = depth;
    Store s(c);
    std::vector<SlotBufferPtr> bufs;
    for (unsigned j = 0; j < depth; ++j) {
      bufs.push_back(s.make_buffer(0));
      std::memset(bufs.back()->data() + 64, 0x33, page);
    }
    uint64_t next = 0;
    for (auto _ : st) {
      std::vector<PutItem> items;
      std::vector<GetItem> gets;
      for (unsigned j = 0; j < depth; ++j) {
        items.push_back(PutItem{key_of(next + j), bufs[j], page});
        gets.push_back(GetItem{key_of(next + j), bufs[j]->data(), bufs[j]->size(), true});
      }
      s.submit_put(0, std::move(items))->wait();
      s.submit_get(0, std::move(gets))->wait();
      next += depth;
    }
    st.SetBytesProcessed(static_cast<int64_t>(st.iterations() * depth * page * 2));
  }
  std::filesystem::remove_all(dir);
}

// Cold start `load`'s header scan of a slab of range(0) slots of 64 KiB, each holding a slot
// header (one 4 KiB read per slot), with range(1) threads: serial (1) vs parallel.
void BM_SlabScan(benchmark::State& st) {
  const uint64_t slots = static_cast<uint64_t>(st.range(0));
  const unsigned threads = static_cast<unsigned>(st.range(1));
  const std::string dir = bench_dir();
  {
    const SlabGeometry g{0, 64 * 1024, slots, 1};
    {
      SlabFile f(dir + "/s.slab", g, ColdStart::kClear, DirectIo::kAuto);
      vitrify::AlignedBuffer buf(kBlock);
      for (uint64_t i = 0; i < slots; ++i) f.write_aligned(i, key_of(i), buf.data(), 16, 0);
      f.sync();
    }
    SlabFile f(dir + "/s.slab", g, ColdStart::kLoad, DirectIo::kAuto);
    size_t found = 0;
    for (auto _ : st) found = f.scan(threads).size();
    st.counters["found"] = static_cast<double>(found);
    st.counters["direct"] = f.direct();
    st.SetItemsProcessed(static_cast<int64_t>(st.iterations() * slots));
  }
  std::filesystem::remove_all(dir);
}

// Reads at queue depth 1 (one read thread), 32 gets per submission into slot buffers, with the
// payload CRC on the reading thread (range(1) = 0) or on a second stage overlapping the next
// read (1). VITRIFY_BENCH_DIR=/dev/shm shows the software ceiling.
void BM_StoreReadQd1(benchmark::State& st) {
  const size_t page = static_cast<size_t>(st.range(0));
  constexpr unsigned kBatch = 32;
  const std::string dir = bench_dir();
  {
    StoreConfig c;
    c.dirs = {dir};
    c.kinds = {KindConfig{page, 1.0}};
    c.budget_bytes = 4096 + 2 * kBatch * slot_bytes_for(page);
    c.read_threads = 1;
    c.verify_stage = static_cast<int>(st.range(1));
    Store s(c);
    std::vector<SlotBufferPtr> bufs;
    std::vector<PutItem> items;
    for (unsigned j = 0; j < kBatch; ++j) {
      bufs.push_back(s.make_buffer(0));
      std::memset(bufs.back()->data() + 64, 0x33 + j, page);
      items.push_back(PutItem{key_of(j), bufs[j], page});
    }
    s.submit_put(0, std::move(items))->wait();
    int64_t misses = 0;
    for (auto _ : st) {
      std::vector<GetItem> gets;
      for (unsigned j = 0; j < kBatch; ++j)
        gets.push_back(GetItem{key_of(j), bufs[j]->data(), bufs[j]->size(), true});
      for (int64_t r : s.submit_get(0, std::move(gets))->wait()) misses += r < 0;
    }
    st.SetBytesProcessed(static_cast<int64_t>(st.iterations() * kBatch * page));
    st.counters["misses"] = static_cast<double>(misses);
  }
  std::filesystem::remove_all(dir);
}

}  // namespace

BENCHMARK(BM_StoreReadQd1)->Args({1 << 20, 0})->Args({1 << 20, 1})->Args({4 << 20, 0})
    ->Args({4 << 20, 1})->Unit(benchmark::kMillisecond)->MinTime(1.0)->UseRealTime();
BENCHMARK(BM_SlabScan)->Args({8192, 1})->Args({8192, 8})->Unit(benchmark::kMillisecond)
    ->MinTime(0.5)->UseRealTime();
BENCHMARK(BM_SlabWrite)->Arg(1 << 20)->Arg(4 << 20)->Unit(benchmark::kMillisecond)->MinTime(0.5)->UseRealTime();
BENCHMARK(BM_SlabRead)->Arg(1 << 20)->Arg(4 << 20)->Unit(benchmark::kMillisecond)->MinTime(0.5)->UseRealTime();
BENCHMARK(BM_StorePutGet)->Args({1 << 20, 1})->Args({1 << 20, 4})->Args({4 << 20, 4})
    ->Unit(benchmark::kMillisecond)->MinTime(0.5)->UseRealTime();

BENCHMARK_MAIN();
