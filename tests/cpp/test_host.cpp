// The host tier on CPU: slab planning, segments, hugetlbfs capacity (fake statfs), the
// registration guard, layouts, and gather/scatter round trips. Invariant numbers: DESIGN.md.
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "vitrify/aligned.hpp"
#include "vitrify/crc32c.hpp"
#include "vitrify/driver.hpp"
#include "vitrify/error.hpp"
#include "vitrify/host.hpp"

using namespace vitrify::host;
using vitrify::round_up;

namespace {

constexpr size_t KiB = 1024, MiB = 1024 * KiB;

void expect_plan_ok(const std::vector<SlabPlan>& p, size_t total, size_t page, size_t ceiling,
                    size_t align) {
  size_t pages = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    EXPECT_EQ(p[i].index, i);
    EXPECT_EQ(p[i].first_page, pages) << "slabs are consecutive";  // H1
    EXPECT_GT(p[i].pages, 0u);
    EXPECT_EQ(p[i].bytes, p[i].pages * page);
    EXPECT_EQ(p[i].map_bytes % align, 0u);
    EXPECT_GE(p[i].map_bytes, p[i].bytes);
    EXPECT_LE(p[i].map_bytes, ceiling) << "slab " << i << " above the ceiling";  // H2
    if (i + 1 < p.size()) EXPECT_EQ(p[i].pages, p[0].pages) << "only the last slab is short";
    pages += p[i].pages;
  }
  EXPECT_EQ(pages * page, total);
}

std::string what_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no exception)";
}

}  // namespace

// ---- planning -----------------------------------------------------------------------------------

TEST(SlabPlan, ExactFit) {
  const auto p = plan_slabs(64 * MiB, 2 * MiB, 16 * MiB, 4096);
  ASSERT_EQ(p.size(), 4u);
  for (const auto& s : p) EXPECT_EQ(s.pages, 8u);
  expect_plan_ok(p, 64 * MiB, 2 * MiB, 16 * MiB, 4096);
}

TEST(SlabPlan, Remainder) {
  const auto p = plan_slabs(10 * MiB, MiB, 4 * MiB, 4096);
  ASSERT_EQ(p.size(), 3u);
  EXPECT_EQ(p[2].pages, 2u);
  EXPECT_EQ(p[2].first_page, 8u);
  expect_plan_ok(p, 10 * MiB, MiB, 4 * MiB, 4096);
}

TEST(SlabPlan, TinyPoolIsOneSlab) {
  const auto p = plan_slabs(4096, 4096, size_t(480) << 30, 4096);
  ASSERT_EQ(p.size(), 1u);
  EXPECT_EQ(p[0].pages, 1u);
  const auto q = plan_slabs(3 * 100, 100, size_t(480) << 30, 4096);  // pages smaller than a mapping page
  ASSERT_EQ(q.size(), 1u);
  EXPECT_EQ(q[0].bytes, 300u);
  EXPECT_EQ(q[0].map_bytes, 4096u);
}

TEST(SlabPlan, CeilingEdge) {
  // A ceiling of exactly one page fits one page per slab; one byte less fits none.
  const auto p = plan_slabs(5 * 8192, 8192, 8192, 4096);
  ASSERT_EQ(p.size(), 5u);
  expect_plan_ok(p, 5 * 8192, 8192, 8192, 4096);
  const std::string e = what_of([] { plan_slabs(5 * 8192, 8192, 8191, 4096); });
  EXPECT_NE(e.find("does not fit under the single-registration ceiling"), std::string::npos) << e;
  EXPECT_NE(e.find("VITRIFY_MAX_SLAB_GB"), std::string::npos) << e;
}

TEST(SlabPlan, PageNotDividingTheCeiling) {
  // 3 KiB pages under a 10 KiB ceiling with 4 KiB mapping pages: 3 pages use 9 KiB but map 12 KiB
  // (above the ceiling), so only 2 fit (6 KiB, mapped 8 KiB).
  const auto p = plan_slabs(7 * 3 * KiB, 3 * KiB, 10 * KiB, 4 * KiB);
  ASSERT_EQ(p.size(), 4u);
  EXPECT_EQ(p[0].pages, 2u);
  EXPECT_EQ(p[0].map_bytes, 8 * KiB);
  EXPECT_EQ(p[3].pages, 1u);
  expect_plan_ok(p, 7 * 3 * KiB, 3 * KiB, 10 * KiB, 4 * KiB);
  // Huge-page alignment: 3 MiB pages under a 7 MiB ceiling with 2 MiB huge pages: 2 pages map
  // 6 MiB.
  const auto h = plan_slabs(9 * 3 * MiB, 3 * MiB, 7 * MiB, 2 * MiB);
  EXPECT_EQ(h[0].pages, 2u);
  expect_plan_ok(h, 9 * 3 * MiB, 3 * MiB, 7 * MiB, 2 * MiB);
}

TEST(SlabPlan, RandomizedInvariants) {
  std::mt19937_64 rng(1234);
  for (int it = 0; it < 2000; ++it) {
    const size_t align = size_t(1) << (12 + rng() % 10);
    const size_t page = 1 + rng() % (4 * MiB);
    const size_t pages = 1 + rng() % 5000;
    const size_t ceiling = round_up(page, align) + rng() % (64 * MiB);
    const auto p = plan_slabs(pages * page, page, ceiling, align);
    expect_plan_ok(p, pages * page, page, ceiling, align);
    if (HasFailure()) FAIL() << "align=" << align << " page=" << page << " pages=" << pages
                             << " ceiling=" << ceiling;
  }
}

TEST(SlabPlan, BadSizesAreNamed) {
  EXPECT_NE(what_of([] { plan_slabs(0, 4096, MiB, 4096); }).find("total_bytes must be positive"),
            std::string::npos);
  EXPECT_NE(what_of([] { plan_slabs(4096, 0, MiB, 4096); }).find("page_bytes must be positive"),
            std::string::npos);
  const std::string e = what_of([] { plan_slabs(10000, 4096, MiB, 4096); });
  EXPECT_NE(e.find("10000 is not a multiple of page_bytes 4096"), std::string::npos) << e;
  EXPECT_THROW(plan_slabs(4096, 4096, MiB, 3000), std::invalid_argument);
  EXPECT_THROW(plan_slabs(SIZE_MAX - SIZE_MAX % 4096, SIZE_MAX - SIZE_MAX % 4096, SIZE_MAX, 4096),
               std::invalid_argument);
}

// ---- the pool (no GPU: unregistered) -----------------------------------------------------------

TEST(HostPool, MultiSlabAddressesAndSegments) {
  HostPoolOptions o;
  o.max_slab_bytes = 3 * 4096;
  o.registration = Registration::Off;
  HostPool pool(10 * 4096, 4096, o);
  EXPECT_EQ(pool.num_slabs(), 4u);
  EXPECT_EQ(pool.num_pages(), 10u);
  EXPECT_FALSE(pool.registered());
  for (size_t p = 0; p < pool.num_pages(); ++p) {
    const size_t s = p / 3;
    EXPECT_EQ(pool.slab_of(p), s);
    EXPECT_EQ(pool.page_address(p), pool.slab_base(s) + (p - 3 * s) * 4096);
    std::memset(pool.page_address(p), int(p), 4096);  // every page is writable memory
  }
  for (size_t p = 0; p < pool.num_pages(); ++p) EXPECT_EQ(pool.page_address(p)[4095], uint8_t(p));
  const auto segs = pool.segments(2, 6);  // pages 2..7: slabs 0 (2), 1 (3,4,5), 2 (6,7)
  ASSERT_EQ(segs.size(), 3u);
  EXPECT_EQ(segs[0].slab, 0u);
  EXPECT_EQ(segs[0].pages, 1u);
  EXPECT_EQ(segs[1].first_page, 3u);
  EXPECT_EQ(segs[1].pages, 3u);
  EXPECT_EQ(segs[1].ptr, pool.slab_base(1));
  EXPECT_EQ(segs[2].pages, 2u);
  EXPECT_TRUE(pool.segments(4, 0).empty());
  EXPECT_THROW(pool.segments(8, 3), std::invalid_argument);
  EXPECT_THROW(pool.page_address(10), std::invalid_argument);
  EXPECT_THROW(pool.slab_base(4), std::invalid_argument);
}

TEST(HostPool, SegmentsNeverStraddleRandomized) {  // H3
  std::mt19937_64 rng(7);
  for (int it = 0; it < 50; ++it) {
    HostPoolOptions o;
    const size_t page = 64 * (1 + rng() % 200);
    o.max_slab_bytes = round_up(page, 4096) * (1 + rng() % 6) + rng() % 4096;
    o.registration = Registration::Off;
    const size_t pages = 1 + rng() % 60;
    HostPool pool(pages * page, page, o);
    for (int q = 0; q < 50; ++q) {
      const size_t first = rng() % pages;
      const size_t count = rng() % (pages - first + 1);
      size_t next = first;
      for (const auto& s : pool.segments(first, count)) {
        ASSERT_EQ(s.first_page, next);
        ASSERT_GT(s.pages, 0u);
        const auto& sp = pool.slabs()[s.slab];
        ASSERT_GE(s.first_page, sp.first_page);
        ASSERT_LE(s.first_page + s.pages, sp.first_page + sp.pages) << "straddles";
        ASSERT_EQ(s.ptr, pool.page_address(s.first_page));
        ASSERT_EQ(s.bytes, s.pages * page);
        next += s.pages;
      }
      ASSERT_EQ(next, first + count);
    }
  }
}

TEST(HostPool, RegistrationOnWithoutDriverSaysWhy) {
  if (vitrify::driver::available()) GTEST_SKIP() << "a driver is present (covered by the GPU tests)";
  HostPoolOptions o;
  o.registration = Registration::On;
  EXPECT_THROW(HostPool(4096, 4096, o), vitrify::DriverUnavailable);
}

// ---- hugetlbfs ----------------------------------------------------------------------------------

TEST(Hugetlbfs, CapacityCheckMessage) {
  FsCapacity cap{kHugetlbfsMagic, 2 * MiB, 10};
  EXPECT_NO_THROW(check_hugetlbfs_capacity("/mnt/huge", 20 * MiB, cap));
  try {
    check_hugetlbfs_capacity("/mnt/huge", 30 * MiB, cap);
    FAIL() << "no throw";
  } catch (const vitrify::OutOfSpace& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("\"/mnt/huge\""), std::string::npos) << m;
    EXPECT_NE(m.find("20.00 MiB"), std::string::npos) << "free: " << m;
    EXPECT_NE(m.find("30.00 MiB"), std::string::npos) << "needed: " << m;
    EXPECT_NE(m.find("2.00 MiB"), std::string::npos) << "page size: " << m;
    EXPECT_NE(m.find("hugepages-2048kB/nr_hugepages"), std::string::npos) << m;
    EXPECT_NE(m.find("echo 15"), std::string::npos) << m;
  }
  const std::string e = what_of([] {
    check_hugetlbfs_capacity("/tmp", 1, FsCapacity{0xEF53, 4096, 1000});
  });
  EXPECT_NE(e.find("not a hugetlbfs mount"), std::string::npos) << e;
  EXPECT_NE(e.find("0xef53"), std::string::npos) << e;
}

TEST(Hugetlbfs, FreePagesFromSysfsWhenTheMountHasNoSizeLimit) {
  char dir[] = "/tmp/vitrify-sysfs-XXXXXX";
  ASSERT_NE(::mkdtemp(dir), nullptr);
  const std::string sub = std::string(dir) + "/hugepages-2048kB";
  ASSERT_EQ(::mkdir(sub.c_str(), 0700), 0);
  auto put = [&](const char* name, const char* v) {
    FILE* f = std::fopen((sub + "/" + name).c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fputs(v, f);
    std::fclose(f);
  };
  EXPECT_EQ(hugetlb_free_pages(2 * MiB, dir), 0u) << "unreadable -> 0";
  put("free_hugepages", "100\n");
  EXPECT_EQ(hugetlb_free_pages(2 * MiB, dir), 100u);
  put("resv_hugepages", "30\n");
  EXPECT_EQ(hugetlb_free_pages(2 * MiB, dir), 70u) << "reserved pages are not free";
  EXPECT_EQ(hugetlb_free_pages(1024 * MiB, dir), 0u) << "another page size";
  for (const char* f : {"free_hugepages", "resv_hugepages"}) ::unlink((sub + "/" + f).c_str());
  ::rmdir(sub.c_str());
  ::rmdir(dir);
}

TEST(Hugetlbfs, PoolChecksCapacityBeforeMapping) {
  HostPoolOptions o;
  o.hugetlbfs_mount = "/nonexistent-hugetlbfs";
  o.registration = Registration::Off;
  int calls = 0;
  o.statfs = [&](const std::string& path) {
    ++calls;
    EXPECT_EQ(path, "/nonexistent-hugetlbfs");
    return FsCapacity{kHugetlbfsMagic, 2 * MiB, 3};
  };
  // 7 pages of 1 MiB under a 2 MiB ceiling with 2 MiB huge pages: slabs of 2,2,2,1 pages each
  // map 2 MiB = 4 huge pages, but only 3 are free.
  EXPECT_THROW(HostPool(7 * MiB, MiB, o), vitrify::OutOfSpace);
  EXPECT_EQ(calls, 1);
  o.statfs = [](const std::string&) { return FsCapacity{0x01021994 /* tmpfs */, 4096, 1u << 30}; };
  EXPECT_THROW(HostPool(MiB, MiB, o), std::invalid_argument);
}

TEST(Hugetlbfs, FileBackedSlabsWithAFakeMount) {
  // A fake statfs that calls /tmp hugetlbfs with 4 KiB "huge" pages exercises the file-backed
  // path (create, unlink, ftruncate, MAP_SHARED) on any machine.
  char dir[] = "/tmp/vitrify-hugetlbfs-XXXXXX";
  ASSERT_NE(::mkdtemp(dir), nullptr);
  {
    HostPoolOptions o;
    o.hugetlbfs_mount = dir;
    o.max_slab_bytes = 16 * KiB;
    o.registration = Registration::Off;
    o.statfs = [](const std::string&) { return FsCapacity{kHugetlbfsMagic, 4096, 100}; };
    HostPool pool(40 * KiB, 8 * KiB, o);
    EXPECT_EQ(pool.num_slabs(), 3u);
    EXPECT_EQ(pool.map_align(), 4096u);
    for (size_t p = 0; p < pool.num_pages(); ++p) std::memset(pool.page_address(p), 0x5A, 8 * KiB);
    EXPECT_EQ(pool.page_address(4)[8191], 0x5A);
  }
  EXPECT_EQ(::rmdir(dir), 0) << "slab files must be unlinked at creation";
}

// ---- the registration guard ---------------------------------------------------------------------

TEST(Registration, RefusesAboveTheCeilingBeforeTheDriver) {  // H2
  std::vector<uint8_t> buf(8192);
  const std::string e = what_of([&] { HostRegistration r(buf.data(), 8192, 0, 4096); });
  EXPECT_NE(e.find("refusing to register"), std::string::npos) << e;
  EXPECT_NE(e.find("single-registration ceiling"), std::string::npos) << e;
  EXPECT_NE(e.find("VITRIFY_MAX_SLAB_GB"), std::string::npos) << e;
  EXPECT_THROW(HostRegistration(buf.data(), 8192, 0, 4096), std::invalid_argument);
}

// ---- thread pool --------------------------------------------------------------------------------

TEST(ThreadPool, RunsEveryTaskOnceAndPropagatesErrors) {
  ThreadPool tp(4);
  std::vector<std::atomic<int>> hits(1000);
  tp.run(hits.size(), [&](size_t i) { hits[i].fetch_add(1); });
  for (auto& h : hits) ASSERT_EQ(h.load(), 1);
  EXPECT_THROW(tp.run(50, [](size_t i) {
    if (i == 17) throw std::runtime_error("task 17");
  }),
               std::runtime_error);
  // Still usable, and concurrent callers do not mix their jobs.
  std::vector<std::thread> callers;
  std::atomic<size_t> sum{0};
  for (int c = 0; c < 4; ++c)
    callers.emplace_back([&] {
      for (int r = 0; r < 50; ++r) tp.run(37, [&](size_t i) { sum.fetch_add(i); });
    });
  for (auto& t : callers) t.join();
  EXPECT_EQ(sum.load(), size_t(4 * 50) * (36 * 37 / 2));
}

// ---- layouts and gather/scatter -----------------------------------------------------------------

namespace {

void fill_random(std::vector<uint8_t>& v, uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
}

// Checks gather against a direct reading of the layout's definition, then scatter round trip.
void round_trip(const PageLayout& l, Copier& c, std::vector<std::vector<uint8_t>>& mem) {
  const size_t blob = l.blob_bytes();
  std::vector<uint8_t> out(blob + 64 + 7);
  for (size_t page = 0; page < l.pages; ++page) {
    uint8_t* dst = out.data() + 64;  // as after a disk slot's 64-byte header
    c.gather(l, page, dst, blob);
    for (size_t comp = 0; comp < l.components.size(); ++comp)
      for (size_t layer = 0; layer < l.layers; ++layer) {
        const uint8_t* src = reinterpret_cast<const uint8_t*>(l.components[comp]) +
                             layer * l.layer_stride + page * l.page_stride;
        ASSERT_EQ(std::memcmp(dst + (comp * l.layers + layer) * l.slice_bytes, src, l.slice_bytes), 0)
            << "page " << page << " comp " << comp << " layer " << layer;
      }
  }
  // Scatter fresh blobs into every page, gather them back, and check untouched bytes stay.
  std::vector<std::vector<uint8_t>> before = mem;
  std::vector<uint8_t> blobs(blob * l.pages);
  fill_random(blobs, 99);
  for (size_t page = 0; page < l.pages; ++page) c.scatter(blobs.data() + page * blob, blob, l, page);
  std::vector<uint8_t> back(blob);
  for (size_t page = 0; page < l.pages; ++page) {
    c.gather(l, page, back.data(), blob);
    ASSERT_EQ(std::memcmp(back.data(), blobs.data() + page * blob, blob), 0) << "page " << page;
  }
  // Bytes outside every slice (padding) were not written.
  for (size_t comp = 0; comp < mem.size(); ++comp) {
    std::vector<bool> covered(mem[comp].size());
    for (size_t layer = 0; layer < l.layers; ++layer)
      for (size_t page = 0; page < l.pages; ++page)
        for (size_t b = 0; b < l.slice_bytes; ++b)
          covered[layer * l.layer_stride + page * l.page_stride + b] = true;
    for (size_t i = 0; i < mem[comp].size(); ++i)
      if (!covered[i]) ASSERT_EQ(mem[comp][i], before[comp][i]) << "padding byte " << i;
  }
}

}  // namespace

TEST(Gather, LayerFirstAndPageFirstRoundTrip) {
  Copier c(3);
  for (int kind = 0; kind < 2; ++kind)
    for (size_t comps : {1u, 2u}) {
      const size_t layers = 5, pages = 7, tokens = 4, heads = 3, dim = 16, item = 2;
      const size_t bytes = layers * pages * tokens * heads * dim * item;
      std::vector<std::vector<uint8_t>> mem(comps, std::vector<uint8_t>(bytes));
      std::vector<uintptr_t> bases;
      for (size_t i = 0; i < comps; ++i) {
        fill_random(mem[i], 10 + i);
        bases.push_back(reinterpret_cast<uintptr_t>(mem[i].data()));
      }
      const PageLayout l =
          kind == 0 ? PageLayout::layer_first(bases, layers, pages, tokens, heads, dim, item)
                    : PageLayout::page_first(bases, layers, pages, tokens, heads, dim, item);
      EXPECT_EQ(l.blob_bytes(), comps * layers * tokens * heads * dim * item);
      round_trip(l, c, mem);
    }
}

TEST(Gather, PaddedStridedLayoutAndLargeParallelPages) {
  // Padding between slices and pages, and big slices that take the multi-threaded path.
  for (size_t slice : {size_t(100), size_t(3 * MiB + 5)}) {
    Copier c(4);
    PageLayout l;
    l.layers = 3;
    l.pages = 2;
    l.slice_bytes = slice;
    l.page_stride = slice + 13;
    l.layer_stride = 2 * l.page_stride + 29;
    l.component_bytes = 3 * l.layer_stride;
    std::vector<std::vector<uint8_t>> mem(2, std::vector<uint8_t>(l.component_bytes));
    fill_random(mem[0], 1);
    fill_random(mem[1], 2);
    l.components = {reinterpret_cast<uintptr_t>(mem[0].data()),
                    reinterpret_cast<uintptr_t>(mem[1].data())};
    l.validate();
    round_trip(l, c, mem);
  }
}

// scatter_crc_each: every page lands as scatter_each would put it, and its CRC is the CRC32C
// of its source blob, whether one task or many (runs split inside a page) copy it.
TEST(Gather, ScatterCrcEachCopiesAndChecksumsEveryPage) {
  for (size_t threads : {1u, 3u, 8u})
    for (size_t tokens : {4u, 2048u}) {  // 3 KiB pages (one task) and 1.5 MiB pages (parallel)
      const size_t layers = 6, pages = 9, heads = 2, dim = 32, item = 2;
      const size_t bytes = layers * pages * tokens * heads * dim * item;
      std::vector<std::vector<uint8_t>> mem(2, std::vector<uint8_t>(bytes, 0xEE));
      const PageLayout l = PageLayout::page_first(
          {reinterpret_cast<uintptr_t>(mem[0].data()), reinterpret_cast<uintptr_t>(mem[1].data())},
          layers, pages, tokens, heads, dim, item);
      const size_t blob = l.blob_bytes();
      std::vector<uint8_t> blobs(5 * blob);
      fill_random(blobs, threads * 100 + tokens);
      std::vector<uintptr_t> srcs;
      for (size_t i = 0; i < 5; ++i) srcs.push_back(reinterpret_cast<uintptr_t>(blobs.data() + i * blob));
      const std::vector<size_t> dst_pages = {7, 0, 3, 8, 4};
      Copier c(threads);
      const std::vector<uint32_t> crcs = c.scatter_crc_each(srcs, blob, l, dst_pages);
      ASSERT_EQ(crcs.size(), 5u);
      std::vector<uint8_t> back(blob);
      for (size_t i = 0; i < 5; ++i) {
        EXPECT_EQ(crcs[i], vitrify::crc32c(blobs.data() + i * blob, blob))
            << "threads " << threads << " tokens " << tokens << " page " << i;
        c.gather(l, dst_pages[i], back.data(), blob);
        EXPECT_EQ(std::memcmp(back.data(), blobs.data() + i * blob, blob), 0) << "page " << i;
      }
      std::vector<uint8_t> untouched(blob);
      for (size_t p : {1u, 2u, 5u, 6u}) {
        c.gather(l, p, untouched.data(), blob);
        EXPECT_EQ(untouched, std::vector<uint8_t>(blob, 0xEE)) << "page " << p << " written";
      }
      EXPECT_TRUE(c.scatter_crc_each({}, blob, l, {}).empty());
      EXPECT_THROW(c.scatter_crc_each({srcs[0], srcs[1]}, blob, l, {2, 2}), std::invalid_argument);
      EXPECT_THROW(c.scatter_crc_each({srcs[0]}, blob - 1, l, {2}), std::invalid_argument);
      EXPECT_THROW(c.scatter_crc_each({srcs[0]}, blob, l, {pages}), std::invalid_argument);
    }
}

TEST(Gather, BatchedPagesIntoSlotStride) {
  const size_t layers = 4, pages = 9;
  std::vector<std::vector<uint8_t>> mem(1, std::vector<uint8_t>(layers * pages * 256));
  fill_random(mem[0], 5);
  const PageLayout l = PageLayout::layer_first({reinterpret_cast<uintptr_t>(mem[0].data())}, layers,
                                               pages, 2, 2, 32, 2);
  Copier c(2);
  const size_t slot = 4096;  // each blob lands after a 64-byte header in its own slot
  std::vector<uint8_t> slots(3 * slot, 0xEE);
  const std::vector<size_t> which = {8, 0, 3};
  c.gather_pages(l, which, slots.data() + 64, slot, slots.size() - 64);
  for (size_t i = 0; i < which.size(); ++i) {
    std::vector<uint8_t> one(l.blob_bytes());
    c.gather(l, which[i], one.data(), one.size());
    EXPECT_EQ(std::memcmp(slots.data() + i * slot + 64, one.data(), one.size()), 0);
    EXPECT_EQ(slots[i * slot + 63], 0xEE) << "header untouched";
    EXPECT_EQ(slots[i * slot + 64 + l.blob_bytes()], 0xEE) << "pad untouched";
  }
  std::vector<std::vector<uint8_t>> copy = mem;
  std::memset(mem[0].data(), 0, mem[0].size());
  c.scatter_pages(slots.data() + 64, slot, slots.size() - 64, l, which);
  std::vector<uint8_t> a(l.blob_bytes()), b(l.blob_bytes());
  for (size_t p : which) {
    c.gather(l, p, a.data(), a.size());
    const PageLayout orig = PageLayout::layer_first(
        {reinterpret_cast<uintptr_t>(copy[0].data())}, layers, pages, 2, 2, 32, 2);
    c.gather(orig, p, b.data(), b.size());
    EXPECT_EQ(a, b) << "page " << p;
  }
  EXPECT_THROW(c.scatter_pages(slots.data(), slot, slots.size(), l, {1, 1}),
               std::invalid_argument);
  EXPECT_THROW(c.gather_pages(l, {0, 1}, slots.data(), l.blob_bytes() - 1, slots.size()),
               std::invalid_argument);
}

TEST(Gather, BadLayoutsAreRejected) {
  std::vector<uint8_t> mem(1 << 16);
  const uintptr_t base = reinterpret_cast<uintptr_t>(mem.data());
  auto make = [&] {
    PageLayout l;
    l.components = {base};
    l.component_bytes = mem.size();
    l.layers = 4;
    l.pages = 8;
    l.slice_bytes = 64;
    l.page_stride = 64;
    l.layer_stride = 512;
    return l;
  };
  EXPECT_NO_THROW(make().validate());
  auto expect_bad = [&](PageLayout l, const char* needle) {
    const std::string e = what_of([&] { l.validate(); });
    EXPECT_NE(e.find(needle), std::string::npos) << "wanted '" << needle << "' in: " << e;
    EXPECT_THROW(l.validate(), std::invalid_argument);
  };
  auto l = make();
  l.layers = 0;
  expect_bad(l, "layers must be positive");
  l = make();
  l.slice_bytes = 0;
  expect_bad(l, "slice_bytes must be positive");
  l = make();
  l.components = {};
  expect_bad(l, "1 to 16 components");
  l = make();
  l.components = {0};
  expect_bad(l, "null base");
  l = make();
  l.page_stride = 32;  // slices of neighbouring pages overlap
  expect_bad(l, "slices overlap");
  l = make();
  l.layer_stride = 256;  // layer 1 lands inside page 4..7 of layer 0
  expect_bad(l, "strides must nest");
  l = make();
  l.component_bytes = 2047;
  expect_bad(l, "out of range");
  l = make();
  l.layer_stride = SIZE_MAX / 2;
  expect_bad(l, "overflows");
  l = make();
  l.components = {base, base + 1024};  // V inside K's span
  expect_bad(l, "overlap");
  EXPECT_THROW(PageLayout::layer_first({base}, 2, 2, 0, 1, 1, 1), std::invalid_argument);
  EXPECT_THROW(PageLayout::page_first({base}, 1, 2, SIZE_MAX, 2, 1, 1), std::invalid_argument);
  // Out-of-range page and short buffers.
  Copier c(1);
  const auto good = make();
  std::vector<uint8_t> dst(good.blob_bytes());
  EXPECT_THROW(c.gather(good, 8, dst.data(), dst.size()), std::invalid_argument);
  EXPECT_THROW(c.gather(good, 0, dst.data(), dst.size() - 1), std::invalid_argument);
  EXPECT_THROW(c.scatter(dst.data(), dst.size() - 1, good, 0), std::invalid_argument);
  EXPECT_THROW(c.gather(good, 0, nullptr, dst.size()), std::invalid_argument);
}
