// Read-only stores (csrc/src/disk/DESIGN.md D14): a reader opens the slab files another open
// Store writes, O_RDONLY and without the owner lock (D13); it serves the writer's pages, sees
// the ones committed later after refresh(), writes nothing, and a slot the writer evicts,
// reuses or clears while the reader reads it is a miss, never wrong bytes (D1).
#include <sys/stat.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "temp_dir.hpp"
#include "vitrify/disk.hpp"

namespace fs = std::filesystem;
using namespace vitrify::disk;
using vitrify::test::TempDir;

namespace {

constexpr size_t kPage = 6000;

Key key_of(uint32_t i) {
  Key k{};
  std::memcpy(k.data(), &i, sizeof i);
  k[31] = 0x5A;
  return k;
}

// The bytes of key i's page: a pattern no other key shares at any offset.
uint8_t byte_of(uint32_t i, size_t off) {
  return static_cast<uint8_t>((i * 2654435761u) >> 13 ^ (off * 131u) ^ (off >> 8));
}
size_t len_of(uint32_t i) { return 1000 + (i * 37) % (kPage - 1000); }

StoreConfig cfg_of(const std::string& dir, uint64_t slots, bool read_only,
                   ColdStart cs = ColdStart::kClear) {
  StoreConfig c;
  c.dirs = {dir};
  c.kinds = {KindConfig{kPage, 1.0}};
  c.budget_bytes = kFileHeaderBytes + slots * slot_bytes_for(kPage);
  c.name = "rd";
  c.cold_start = cs;
  c.write_threads = 1;
  c.read_threads = 2;
  c.read_only = read_only;
  return c;
}

std::string slab_of(const std::string& dir) { return dir + "/rd.kind0.slab"; }

int64_t put(Store& s, uint32_t i) {
  auto b = s.make_buffer(0);
  for (size_t o = 0; o < len_of(i); ++o) b->data()[kSlotHeaderBytes + o] = byte_of(i, o);
  return s.submit_put(0, {PutItem{key_of(i), b, len_of(i)}})->wait()[0];
}

// -1: miss; 1: the exact bytes of key i; 0: anything else (wrong bytes: a failure).
int read_of(Store& s, uint32_t i) {
  std::vector<uint8_t> dst(kPage, 0xEE);
  const int64_t r = s.submit_get(0, {GetItem{key_of(i), dst.data(), dst.size(), false}})->wait()[0];
  if (r < 0) return -1;
  if (static_cast<size_t>(r) != len_of(i)) return 0;
  for (size_t o = 0; o < len_of(i); ++o)
    if (dst[o] != byte_of(i, o)) return 0;
  return 1;
}

std::string file_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

std::set<std::string> listing(const std::string& dir) {
  std::set<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.insert(e.path().filename().string());
  return out;
}

struct Snapshot {
  std::set<std::string> files;
  std::map<std::string, std::string> bytes;
  std::map<std::string, timespec> mtime;
};
Snapshot snapshot(const std::string& dir) {
  Snapshot s;
  s.files = listing(dir);
  for (const std::string& f : s.files) {
    const std::string p = dir + "/" + f;
    s.bytes[p] = file_bytes(p);
    struct stat st{};
    EXPECT_EQ(::stat(p.c_str(), &st), 0);
    s.mtime[p] = st.st_mtim;
  }
  return s;
}

}  // namespace

// D14: the reader serves the pages the writer committed before it opened, byte for byte,
// while the writer stays open and locked (D13 is the writer's, the reader takes no lock).
TEST(DiskReader, SeesTheWritersPagesWhileTheWriterHoldsTheLock) {
  TempDir d;
  Store w(cfg_of(d.path, 32, false));
  for (uint32_t i = 0; i < 10; ++i) ASSERT_EQ(put(w, i), static_cast<int64_t>(PutResult::kStored));
  Store r(cfg_of(d.path, 32, true));
  EXPECT_TRUE(r.read_only());
  EXPECT_TRUE(w.slab(0, 0).locked());
  EXPECT_FALSE(r.slab(0, 0).locked());
  EXPECT_TRUE(r.slab(0, 0).read_only());
  for (uint32_t i = 0; i < 10; ++i) {
    EXPECT_EQ(r.lookup(0, key_of(i)), len_of(i));
    EXPECT_EQ(read_of(r, i), 1) << i;
  }
  EXPECT_EQ(read_of(r, 99), -1);
  EXPECT_EQ(r.stats().loaded_entries, 10u);
  // a second reader coexists with the first and the writer
  Store r2(cfg_of(d.path, 32, true));
  EXPECT_EQ(read_of(r2, 3), 1);
}

// D14: pages committed after the reader opened are found after refresh(); evicted and deleted
// ones disappear; a writer's clear() (new slab id) turns every old page into a miss.
// Issue 33 item 5: a refresh never finds a page the writer deleted (once remove() returned) or
// evicted (once the put whose batch evicted it returned): their slots are zeroed before that.
// Each round: puts that overflow the store (GC evicts), deletes, then a refresh; every key the
// reader indexes is one the writer indexes, with its exact bytes.
TEST(DiskReader, DeletedAndEvictedPagesAreGoneForARefresh) {
  for (const bool host : {false, true}) {
    std::unique_ptr<TempDir> d = std::make_unique<TempDir>(host ? "/dev/shm" : nullptr);
    StoreConfig wc = cfg_of(d->path, 40, false), rc = cfg_of(d->path, 40, true);
    wc.host = rc.host = host;
    Store w(wc);
    ASSERT_EQ(put(w, 0), static_cast<int64_t>(PutResult::kStored));
    Store r(rc);
    uint64_t refound = 0, checked = 0;
    uint32_t next = 1;
    std::mt19937 rng(7);
    for (int round = 0; round < 60; ++round) {
      for (int n = 0; n < 7; ++n) ASSERT_NE(put(w, next++), static_cast<int64_t>(PutResult::kError));
      for (int n = 0; n < 3; ++n)  // among the newest pages: mostly still indexed
        w.remove(0, key_of(next - 1 - static_cast<uint32_t>(rng() % std::min<uint32_t>(next, 30))));
      r.refresh();
      for (uint32_t i = 0; i < next; ++i) {
        if (!r.exists(0, key_of(i))) continue;
        ++checked;
        if (!w.exists(0, key_of(i))) ++refound;
        EXPECT_EQ(read_of(r, i), 1) << i;
      }
    }
    EXPECT_GT(w.stats().gc_reclaims, 100u) << "GC evicted pages";
    EXPECT_GT(w.stats().deletes, 80u);
    EXPECT_GT(checked, 1000u);
    EXPECT_EQ(refound, 0u) << (host ? "host" : "disk")
                           << ": pages a refresh found after the writer deleted or evicted them";
  }
}

TEST(DiskReader, RefreshPicksUpLaterPagesDeletesAndClears) {
  TempDir d;
  Store w(cfg_of(d.path, 32, false));
  ASSERT_EQ(put(w, 1), static_cast<int64_t>(PutResult::kStored));
  Store r(cfg_of(d.path, 32, true));
  ASSERT_EQ(put(w, 2), static_cast<int64_t>(PutResult::kStored));
  EXPECT_FALSE(r.exists(0, key_of(2)));  // not in the index loaded at open
  EXPECT_EQ(read_of(r, 2), -1);
  EXPECT_EQ(r.refresh(), 2u);
  EXPECT_EQ(read_of(r, 1), 1);
  EXPECT_EQ(read_of(r, 2), 1);
  EXPECT_EQ(r.stats().refreshes, 1u);

  // the writer's clear(): the reader's index still names the old slots; until the writer reuses
  // them they hold the old pages' exact bytes, afterwards they miss; never anything else
  w.clear();
  EXPECT_TRUE(r.exists(0, key_of(1)));
  EXPECT_NE(read_of(r, 1), 0);
  ASSERT_EQ(put(w, 3), static_cast<int64_t>(PutResult::kStored));
  EXPECT_NE(read_of(r, 1), 0);
  EXPECT_NE(read_of(r, 2), 0);
  EXPECT_EQ(r.refresh(), 1u);  // the new slab id: only page 3
  EXPECT_FALSE(r.exists(0, key_of(1)));
  EXPECT_EQ(read_of(r, 1), -1);
  EXPECT_EQ(read_of(r, 3), 1);

  // the writer closes: its freed slots are zeroed (D5) and the reader keeps serving the rest
  ASSERT_TRUE(w.remove(0, key_of(3)));
  ASSERT_EQ(put(w, 4), static_cast<int64_t>(PutResult::kStored));
  w.close();
  EXPECT_EQ(r.refresh(), 1u);
  EXPECT_EQ(read_of(r, 3), -1);
  EXPECT_EQ(read_of(r, 4), 1);
}

// D14: a reader never writes: every file in the directory keeps its bytes and mtime, no file
// (owner record, probe file) appears, and puts, removes and clears are refused with EROFS.
TEST(DiskReader, NeverWritesAnything) {
  TempDir d;
  {
    Store w(cfg_of(d.path, 16, false));
    for (uint32_t i = 0; i < 12; ++i) ASSERT_EQ(put(w, i), static_cast<int64_t>(PutResult::kStored));
    for (uint32_t i = 0; i < 4; ++i) ASSERT_TRUE(w.remove(0, key_of(i)));  // stale slots
  }
  {  // the reader also runs next to a live writer that has stale slots of its own
    Store w(cfg_of(d.path, 16, false, ColdStart::kLoad));
    for (uint32_t i = 4; i < 6; ++i) ASSERT_TRUE(w.remove(0, key_of(i)));
    const Snapshot before = snapshot(d.path);
    {
      Store r(cfg_of(d.path, 16, true));
      // 4 and 5 are deleted: their slots were zeroed before remove() returned, so a reader
      // does not find them (D14)
      for (uint32_t i = 0; i < 12; ++i) EXPECT_EQ(read_of(r, i), i < 6 ? -1 : 1) << i;
      EXPECT_EQ(r.refresh(), 6u);
      for (uint32_t i = 0; i < 12; ++i) EXPECT_EQ(read_of(r, i), i < 6 ? -1 : 1) << i;
      const auto erofs = [](auto&& f) {
        try {
          f();
        } catch (const std::system_error& e) {
          return e.code().value() == EROFS;
        }
        return false;
      };
      EXPECT_TRUE(erofs([&] { put(r, 50); }));
      EXPECT_TRUE(erofs([&] {
        r.submit_put_copy(0, {key_of(51)}, {"abc"}, {3});
      }));
      EXPECT_TRUE(erofs([&] { r.remove(0, key_of(7)); }));
      EXPECT_TRUE(erofs([&] { r.clear(); }));
      EXPECT_TRUE(erofs([&] { w.refresh(); }));  // refresh is a reader's
      r.close();
    }
    const Snapshot after = snapshot(d.path);
    EXPECT_EQ(after.files, before.files);
    for (const auto& [p, b] : before.bytes) {
      EXPECT_TRUE(after.bytes.at(p) == b) << p << " changed";
      EXPECT_EQ(after.mtime.at(p).tv_sec, before.mtime.at(p).tv_sec) << p;
      EXPECT_EQ(after.mtime.at(p).tv_nsec, before.mtime.at(p).tv_nsec) << p;
    }
  }
  // without a writer the reader still opens (no lock to wait for) and never takes the lock:
  // a writer opens next to it
  Store r(cfg_of(d.path, 16, true));
  Store w(cfg_of(d.path, 16, false, ColdStart::kLoad));
  EXPECT_EQ(read_of(r, 8), 1);
}

// D1 + D14: a writer evicting (GC), reusing, deleting and clearing slots while readers read
// them with stale indexes: every read is the exact bytes of its key or a miss, never anything
// else. Small pool, so GC reuses slots all the time.
TEST(DiskReader, ConcurrentEvictionGivesMissOrTheRightBytes) {
  TempDir d;
  constexpr uint64_t kSlots = 12;
  Store w(cfg_of(d.path, kSlots, false));
  for (uint32_t i = 0; i < kSlots / 2; ++i) ASSERT_GE(put(w, i), 0);
  std::atomic<bool> stop{false};
  std::atomic<uint32_t> written{kSlots / 2};
  std::thread writer([&] {
    std::mt19937 rng(7);
    for (uint32_t i = kSlots / 2; i < 6000 && !stop; ++i) {
      // batches of several pages (group commit), sometimes a delete or a clear
      std::vector<PutItem> items;
      for (uint32_t j = 0; j < 3; ++j, ++i) {
        auto b = w.make_buffer(0);
        for (size_t o = 0; o < len_of(i); ++o) b->data()[kSlotHeaderBytes + o] = byte_of(i, o);
        items.push_back(PutItem{key_of(i), b, len_of(i)});
      }
      w.submit_put(0, std::move(items))->wait();
      written = i;
      if (rng() % 50 == 0) w.remove(0, key_of(i - 1 - rng() % 3));
      if (rng() % 400 == 0) w.clear();
    }
  });
  std::atomic<uint64_t> hits{0}, misses{0}, wrong{0}, reads{0}, failed_verify{0};
  std::vector<std::thread> readers;
  for (int t = 0; t < 2; ++t) {
    readers.emplace_back([&, t] {
      Store r(cfg_of(d.path, kSlots, true));
      std::mt19937 rng(100 + t);
      for (int it = 0; it < 4000 && !stop; ++it) {
        if (it % 25 == 0) r.refresh();
        const uint32_t hi = written.load();
        const uint32_t i = hi - 1 - static_cast<uint32_t>(rng() % std::min<uint32_t>(hi, 24));
        const int v = read_of(r, i);
        ++reads;
        if (v == 1) ++hits;
        else if (v == -1) ++misses;
        else ++wrong;
      }
      failed_verify += r.stats().verify_failures;
    });
  }
  for (auto& t : readers) t.join();
  stop = true;
  writer.join();
  EXPECT_EQ(wrong.load(), 0u);
  EXPECT_GT(hits.load(), 0u);
  EXPECT_GT(misses.load(), 0u);
  EXPECT_GT(failed_verify.load(), 0u);  // indexed slots the writer had reused: the race ran
  EXPECT_EQ(reads.load(), hits.load() + misses.load());
}

// D14 errors: a missing slab is ENOENT and is not created; a slab that is not formatted, of
// another store or another geometry is std::invalid_argument and left as it was.
TEST(DiskReader, OpenErrorsCreateAndChangeNothing) {
  TempDir d;
  try {
    Store r(cfg_of(d.path, 16, true));
    ADD_FAILURE() << "opened a missing slab";
  } catch (const std::system_error& e) {
    EXPECT_EQ(e.code().value(), ENOENT);
    EXPECT_NE(std::string(e.what()).find(slab_of(d.path)), std::string::npos) << e.what();
  }
  EXPECT_TRUE(listing(d.path).empty());
  EXPECT_THROW(Store(cfg_of(d.path + "/nope", 16, true)), std::system_error);
  EXPECT_FALSE(fs::exists(d.path + "/nope"));

  // not formatted (what a writer leaves for an instant after creating the file): zeros
  { std::ofstream(slab_of(d.path), std::ios::binary) << std::string(kFileHeaderBytes + 16 * slot_bytes_for(kPage), '\0'); }
  const std::string zeros = file_bytes(slab_of(d.path));
  try {
    Store r(cfg_of(d.path, 16, true));
    ADD_FAILURE() << "opened an unformatted slab";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("no valid slab header"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(file_bytes(slab_of(d.path)) == zeros);
  fs::remove(slab_of(d.path));
  // empty (created, not yet preallocated)
  { std::ofstream(slab_of(d.path), std::ios::binary); }
  EXPECT_THROW(Store(cfg_of(d.path, 16, true)), std::invalid_argument);
  EXPECT_EQ(fs::file_size(slab_of(d.path)), 0u);
  fs::remove(slab_of(d.path));

  {
    Store w(cfg_of(d.path, 16, false));
    ASSERT_GE(put(w, 1), 0);
  }
  const std::string formatted = file_bytes(slab_of(d.path));
  // another geometry (a smaller budget: fewer slots)
  try {
    Store r(cfg_of(d.path, 8, true));
    ADD_FAILURE() << "opened a slab of another geometry";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("another store or geometry"), std::string::npos)
        << e.what();
  }
  // a larger budget: the file is shorter than the geometry needs
  EXPECT_THROW(Store(cfg_of(d.path, 64, true)), std::invalid_argument);
  // another store's slab under this store's name (the store tag differs)
  fs::rename(slab_of(d.path), d.path + "/other.kind0.slab");
  {
    StoreConfig c = cfg_of(d.path, 16, true);
    c.name = "other";
    EXPECT_THROW(Store{c}, std::invalid_argument);
  }
  fs::rename(d.path + "/other.kind0.slab", slab_of(d.path));
  EXPECT_TRUE(file_bytes(slab_of(d.path)) == formatted);
  // cold_start is ignored: a reader always loads
  Store r(cfg_of(d.path, 16, true, ColdStart::kClear));
  EXPECT_EQ(read_of(r, 1), 1);
  EXPECT_TRUE(file_bytes(slab_of(d.path)) == formatted);
}
