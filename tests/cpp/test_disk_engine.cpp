// The disk store's I/O engines (DESIGN.md "I/O engines", D25): io_uring, Linux native AIO and
// psync give the same bytes, the same files and the same errors. Every engine the kernel of the
// machine running the test grants is tested; one it refuses is skipped with the reason.
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <random>
#include <system_error>

#include <gtest/gtest.h>

#include "disk/detail/io_engine.hpp"
#include "temp_dir.hpp"
#include "vitrify/disk.hpp"

namespace fs = std::filesystem;
using namespace vitrify::disk;
using vitrify::test::ShmDir;
using vitrify::test::TempDir;

namespace {

const IoEngine kAll[] = {IoEngine::kPsync, IoEngine::kAio, IoEngine::kIoUring};

// The engines this kernel grants (a refusal is printed, not failed: the GPU machine's kernel
// and container differ from this one).
std::vector<IoEngine> granted() {
  std::vector<IoEngine> out;
  for (IoEngine e : kAll) {
    try {
      detail::make_engine(e, 8);
      out.push_back(e);
    } catch (const std::system_error& err) {
      std::printf("engine %s not granted here: %s\n", io_engine_name(e), err.what());
    }
  }
  return out;
}

// Denies engines (the D25 test hook, set_denied_engines) for one scope.
struct Deny {
  explicit Deny(const char* list) { vitrify::disk::set_denied_engines(list); }
  ~Deny() { vitrify::disk::set_denied_engines(""); }
};

uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
Key key_of(uint64_t i) {
  Key k{};
  for (int w = 0; w < 4; ++w) {
    const uint64_t v = mix(i * 4 + w + 1000);
    std::memcpy(k.data() + 8 * w, &v, 8);
  }
  return k;
}
size_t len_of(uint64_t i, size_t max_len) { return mix(i ^ 0x5EED) % (max_len + 1); }
void fill(uint64_t i, uint8_t* p, size_t n) {
  uint64_t s = mix(i + 31);
  for (size_t j = 0; j < n; ++j) {
    if (j % 8 == 0) s = mix(s);
    p[j] = static_cast<uint8_t>(s >> (8 * (j % 8)));
  }
}

StoreConfig cfg_for(const std::string& dir, uint64_t page, uint64_t slots, IoEngine e) {
  StoreConfig c;
  c.dirs = {dir};
  c.kinds = {KindConfig{page, 1.0}};
  c.budget_bytes = kFileHeaderBytes + slots * slot_bytes_for(page);
  c.name = "engine";
  c.engine = e;
  return c;
}

std::vector<int64_t> put_range(Store& s, uint64_t from, uint64_t to, size_t max_len) {
  std::vector<PutItem> items;
  for (uint64_t i = from; i < to; ++i) {
    auto b = s.make_buffer(0);
    const size_t n = len_of(i, max_len);
    fill(i, b->data() + kSlotHeaderBytes, n);
    items.push_back(PutItem{key_of(i), b, n});
  }
  return s.submit_put(0, std::move(items))->wait();
}

// Reads keys [from, to) in one batch, half into plain buffers and half into slot buffers;
// returns per key its bytes, or nullopt on a miss.
std::vector<std::optional<std::vector<uint8_t>>> get_range(Store& s, uint64_t from, uint64_t to,
                                                           size_t max_len) {
  std::vector<GetItem> items;
  std::vector<std::vector<uint8_t>> plain(to - from);
  std::vector<SlotBufferPtr> slots(to - from);
  for (uint64_t i = from; i < to; ++i) {
    const size_t k = i - from;
    if (i % 2 == 0) {
      plain[k].resize(max_len + 1);
      items.push_back(GetItem{key_of(i), plain[k].data(), plain[k].size(), false});
    } else {
      slots[k] = s.make_buffer(0);
      items.push_back(GetItem{key_of(i), slots[k]->data(), slots[k]->size(), true});
    }
  }
  const auto r = s.submit_get(0, std::move(items))->wait();
  std::vector<std::optional<std::vector<uint8_t>>> out(to - from);
  for (uint64_t i = from; i < to; ++i) {
    const size_t k = i - from;
    if (r[k] < 0) continue;
    const uint8_t* p = i % 2 == 0 ? plain[k].data() : slots[k]->data() + kSlotHeaderBytes;
    out[k] = std::vector<uint8_t>(p, p + r[k]);
  }
  return out;
}

std::vector<uint8_t> file_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), {});
}

// A slab file with what differs between two stores by design blanked out: the slab id (random
// at format), the creation time, and the header CRCs over them (DESIGN.md D7).
std::vector<uint8_t> normalized(const std::string& path, uint64_t slot_bytes) {
  std::vector<uint8_t> b = file_bytes(path);
  if (b.size() < kFileHeaderBytes) return b;
  std::memset(b.data() + 32, 0, 4);   // slab_id
  std::memset(b.data() + 40, 0, 8);   // created_ns
  std::memset(b.data() + 52, 0, 4);   // header_crc
  for (uint64_t off = kFileHeaderBytes; off + kSlotHeaderBytes <= b.size(); off += slot_bytes) {
    uint32_t magic;
    std::memcpy(&magic, b.data() + off, 4);
    if (magic != kSlotMagic) continue;
    std::memset(b.data() + off + 16, 0, 4);  // slab_id
    std::memset(b.data() + off + 60, 0, 4);  // header_crc
  }
  return b;
}

// The workload of the identity test: puts of many lengths (several batches, duplicates),
// deletes, reads of every key; returns what the reads saw.
std::map<uint64_t, std::optional<std::vector<uint8_t>>> workload(Store& s, size_t page) {
  for (auto v : put_range(s, 0, 40, page)) EXPECT_EQ(v, static_cast<int64_t>(PutResult::kStored));
  for (auto v : put_range(s, 20, 40, page)) EXPECT_EQ(v, static_cast<int64_t>(PutResult::kDuplicate));
  for (auto v : put_range(s, 40, 90, page)) EXPECT_EQ(v, static_cast<int64_t>(PutResult::kStored));
  for (uint64_t i = 0; i < 90; i += 7) EXPECT_TRUE(s.remove(0, key_of(i)));
  std::map<uint64_t, std::optional<std::vector<uint8_t>>> seen;
  const auto got = get_range(s, 0, 90, page);
  for (uint64_t i = 0; i < 90; ++i) seen[i] = got[i];
  return seen;
}

}  // namespace

TEST(DiskEngine, NamesParseAndBadNamesAreOneLineErrors) {
  for (IoEngine e : {IoEngine::kAuto, IoEngine::kIoUring, IoEngine::kAio, IoEngine::kPsync})
    EXPECT_EQ(parse_io_engine(io_engine_name(e)), e);
  EXPECT_EQ(parse_io_engine("IO_URING"), IoEngine::kIoUring);
  try {
    parse_io_engine("libaio");
    FAIL() << "libaio parsed";
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(),
                 "engine must be \"auto\", \"io_uring\", \"aio\" or \"psync\", got \"libaio\"");
  }
  TempDir d;
  StoreConfig c = cfg_for(d.path, 4000, 8, IoEngine::kAuto);
  c.queue_depth = 0;
  try {
    Store s(c);
    FAIL() << "queue_depth 0 accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "queue_depth must be in [1, 4096], got 0");
  }
}

// D25: the engine's transfers are the bytes pread/pwrite would move, with more transfers than
// the depth (a window refilled as completions come in), on an O_DIRECT file and a buffered one.
TEST(DiskEngine, TransfersMoveExactlyTheBytesOfPreadAndPwrite) {
  TempDir disk;
  ShmDir shm;
  for (IoEngine e : granted()) {
    for (const std::string& dir : {disk.path, shm.path}) {
      SCOPED_TRACE(std::string(io_engine_name(e)) + " in " + dir);
      const std::string path = dir + std::string("/f-") + io_engine_name(e);
      auto opened = vitrify::file_io::open_file(path, O_RDWR | O_CREAT, vitrify::file_io::DirectIo::kAuto);
      const int fd = opened.fd.get();
      auto engine = detail::make_engine(e, 4);
      constexpr size_t kOps = 37;
      std::vector<vitrify::AlignedBuffer> bufs;
      detail::IoOps ops(kOps);
      uint64_t off = 0;
      std::mt19937_64 rng(7);
      for (size_t i = 0; i < kOps; ++i) {
        const size_t n = kBlock * (1 + rng() % 16);
        bufs.emplace_back(n, kBlock);
        for (size_t j = 0; j < n; ++j) bufs.back().data()[j] = static_cast<uint8_t>(rng());
        ops[i].fd = fd;
        ops[i].write = true;
        ops[i].buf = bufs.back().data();
        ops[i].len = n;
        ops[i].off = off;
        off += n;
      }
      std::vector<int> calls(kOps, 0);
      engine->run(ops, [&](size_t i) { ++calls[i]; });
      for (size_t i = 0; i < kOps; ++i) {
        EXPECT_EQ(calls[i], 1) << i;
        EXPECT_EQ(ops[i].error, 0) << i;
        EXPECT_EQ(ops[i].done, ops[i].len) << i;
      }
      ASSERT_EQ(::fdatasync(fd), 0);
      // read back with plain pread, then with the engine into fresh buffers
      for (size_t i = 0; i < kOps; ++i) {
        vitrify::AlignedBuffer back(ops[i].len, kBlock);
        ASSERT_EQ(::pread(fd, back.data(), ops[i].len, static_cast<off_t>(ops[i].off)),
                  static_cast<ssize_t>(ops[i].len));
        EXPECT_EQ(std::memcmp(back.data(), bufs[i].data(), ops[i].len), 0) << i;
      }
      // reads: 3 ops at first, the rest appended by refill two at a time while others land
      std::vector<vitrify::AlignedBuffer> rbufs;
      for (size_t i = 0; i < kOps; ++i) rbufs.emplace_back(ops[i].len, kBlock);
      detail::IoOps reads;
      const auto add = [&](size_t k) {
        for (size_t m = 0; m < k && reads.size() < kOps; ++m) {
          const size_t i = reads.size();
          detail::IoOp r;
          r.fd = fd;
          r.buf = rbufs[i].data();
          r.len = ops[i].len;
          r.off = ops[i].off;
          reads.push_back(r);
        }
      };
      add(3);
      std::vector<int> rcalls(kOps, 0);
      size_t refills = 0;
      engine->run(reads, [&](size_t i) { ++rcalls[i]; }, [&] {
        ++refills;
        add(2);
      });
      ASSERT_EQ(reads.size(), kOps);
      EXPECT_GE(refills, (kOps - 3) / 2);
      for (size_t i = 0; i < kOps; ++i) {
        EXPECT_EQ(rcalls[i], 1) << i;
        EXPECT_EQ(reads[i].error, 0) << i;
        ASSERT_EQ(reads[i].done, reads[i].len) << i;
        EXPECT_EQ(std::memcmp(rbufs[i].data(), bufs[i].data(), ops[i].len), 0) << i;
      }
    }
  }
}

// A read that reaches the end of the file stops there (a short read: the bytes up to the end,
// no error), one past the end moves nothing; a failed transfer names its call and errno.
TEST(DiskEngine, ShortReadAtTheEndOfAFileAndErrorsNameTheCall) {
  ShmDir shm;  // tmpfs, opened buffered: any file length
  const std::string path = shm.path + "/short";
  {
    std::vector<uint8_t> bytes(5000);
    for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i * 13 + 1);
    std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), 5000);
  }
  const int fd = ::open(path.c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  for (IoEngine e : granted()) {
    SCOPED_TRACE(io_engine_name(e));
    auto engine = detail::make_engine(e, 2);
    vitrify::AlignedBuffer a(8192, kBlock), b(4096, kBlock), c(4096, kBlock);
    std::memset(a.data(), 0xEE, 8192);
    detail::IoOps ops(3);
    ops[0].fd = fd, ops[0].buf = a.data(), ops[0].len = 8192, ops[0].off = 0;
    ops[1].fd = fd, ops[1].buf = b.data(), ops[1].len = 4096, ops[1].off = 8192;
    ops[2].fd = fd, ops[2].write = true, ops[2].buf = c.data(), ops[2].len = 4096;  // O_RDONLY
    engine->run(ops, [](size_t) {});
    EXPECT_EQ(ops[0].error, 0);
    ASSERT_EQ(ops[0].done, 5000u);
    for (size_t i = 0; i < 5000; ++i) ASSERT_EQ(a.data()[i], static_cast<uint8_t>(i * 13 + 1)) << i;
    EXPECT_EQ(a.data()[5000], 0xEE);  // nothing past the end was written into the buffer
    EXPECT_EQ(ops[1].error, 0);
    EXPECT_EQ(ops[1].done, 0u);
    EXPECT_EQ(ops[2].error, EBADF);
    ASSERT_NE(ops[2].failed_call, nullptr);
    const std::string call = ops[2].failed_call;
    EXPECT_TRUE(call == "pwrite" || call == "io_uring write" || call == "aio pwrite" ||
                call == "io_submit")
        << call;
  }
  ::close(fd);
}

// A forced engine the kernel refuses is a one-line std::system_error naming the engine and the
// errno, and the open leaves nothing behind (D22); auto falls back to the next engine.
TEST(DiskEngine, RefusedEngineIsAnErrorNamingItAndAutoFallsBack) {
  const std::vector<IoEngine> have = granted();
  {
    Deny deny("io_uring");
    try {
      detail::make_engine(IoEngine::kIoUring, 8);
      FAIL() << "denied engine created";
    } catch (const std::system_error& e) {
      EXPECT_EQ(e.code().value(), EPERM);
      EXPECT_NE(std::string(e.what()).find("disk engine \"io_uring\" is not available"),
                std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("EPERM"), std::string::npos) << e.what();
      EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos);
    }
    TempDir d;
    try {
      Store s(cfg_for(d.path, 4000, 8, IoEngine::kIoUring));
      FAIL() << "store opened on a denied engine";
    } catch (const std::system_error& e) {
      EXPECT_EQ(e.code().value(), EPERM);
      EXPECT_NE(std::string(e.what()).find("\"io_uring\""), std::string::npos) << e.what();
    }
    EXPECT_TRUE(fs::is_empty(d.path)) << "the refused open left files behind";
    Store s(cfg_for(d.path, 4000, 8, IoEngine::kAuto));
    const bool aio = std::find(have.begin(), have.end(), IoEngine::kAio) != have.end();
    EXPECT_EQ(s.engine(), aio ? IoEngine::kAio : IoEngine::kPsync);
  }
  {
    Deny deny("aio, io_uring");
    TempDir d;
    Store s(cfg_for(d.path, 4000, 8, IoEngine::kAuto));
    EXPECT_EQ(s.engine(), IoEngine::kPsync);
    EXPECT_STREQ(s.engine_name(), "psync");
    EXPECT_THROW(Store(cfg_for(d.path + "/x", 4000, 8, IoEngine::kAio)), std::system_error);
  }
  TempDir d;
  Store s(cfg_for(d.path, 4000, 8, IoEngine::kAuto));
  EXPECT_EQ(s.engine(), have.back());  // io_uring when granted, else aio, else psync
  ShmDir shm;
  StoreConfig hc = cfg_for(shm.path, 4000, 8, IoEngine::kAuto);
  hc.host = true;
  Store h(hc);
  EXPECT_STREQ(h.engine_name(), "mapped");
  hc.engine = IoEngine::kIoUring;
  hc.name = "other";
  try {
    Store bad(hc);
    FAIL() << "host store took io_uring";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("does not apply to a host-tier store"), std::string::npos);
  }
}

// D25: the same workload on every granted engine reads the same bytes and leaves the same slab
// files (slab id and creation time aside), on an O_DIRECT drive and on tmpfs (buffered).
TEST(DiskEngine, SameWorkloadSameBytesAndSameFilesOnEveryEngine) {
  const std::vector<IoEngine> have = granted();
  for (bool on_tmpfs : {false, true}) {
    SCOPED_TRACE(on_tmpfs ? "tmpfs (buffered)" : "drive (O_DIRECT)");
    const size_t page = 20000;  // 20 KiB pages of lengths 0..20000: 1 to 5 blocks
    std::map<IoEngine, std::map<uint64_t, std::optional<std::vector<uint8_t>>>> seen;
    std::map<IoEngine, std::vector<uint8_t>> files;
    std::vector<std::unique_ptr<TempDir>> dirs;
    for (IoEngine e : have) {
      dirs.push_back(std::make_unique<TempDir>(on_tmpfs ? "/dev/shm" : nullptr));
      StoreConfig c = cfg_for(dirs.back()->path, page, 128, e);
      c.queue_depth = 8;  // batches of 40 and 50: more transfers than the depth
      if (on_tmpfs) c.direct_io = vitrify::file_io::DirectIo::kOff;  // the buffered fallback
      std::string path;
      {
        Store s(c);
        ASSERT_EQ(s.engine(), e);
        seen[e] = workload(s, page);
        path = s.slab(0, 0).path();
        EXPECT_EQ(s.stats().verify_failures, 0u);
      }
      files[e] = normalized(path, slot_bytes_for(page));
      // load on the same engine finds exactly the live set
      StoreConfig lc = c;
      lc.cold_start = ColdStart::kLoad;
      Store again(lc);
      EXPECT_EQ(again.stats().kinds[0].entries, 90u - 13u);
      const auto got = get_range(again, 0, 90, page);
      for (uint64_t i = 0; i < 90; ++i) EXPECT_EQ(got[i], seen[e][i]) << io_engine_name(e) << " " << i;
    }
    // every key's bytes are its content (a miss only for the deleted ones), on every engine
    for (IoEngine e : have)
      for (uint64_t i = 0; i < 90; ++i) {
        if (i % 7 == 0) {
          EXPECT_FALSE(seen[e][i].has_value()) << io_engine_name(e) << " " << i;
          continue;
        }
        ASSERT_TRUE(seen[e][i].has_value()) << io_engine_name(e) << " " << i;
        std::vector<uint8_t> want(len_of(i, page));
        fill(i, want.data(), want.size());
        EXPECT_EQ(*seen[e][i], want) << io_engine_name(e) << " " << i;
      }
    for (IoEngine e : have) {
      EXPECT_EQ(seen[e], seen[have.front()]) << io_engine_name(e);
      EXPECT_EQ(files[e], files[have.front()]) << io_engine_name(e) << " vs "
                                               << io_engine_name(have.front());
    }
  }
}

// A truncated slab (a short read in the middle of a batch) reads as misses for the cut slots
// and exact bytes for the whole ones, on every engine; on tmpfs, through the buffered fallback.
TEST(DiskEngine, TruncatedSlabOnTmpfsReadsAsMissesOnEveryEngine) {
  for (IoEngine e : granted()) {
    SCOPED_TRACE(io_engine_name(e));
    ShmDir shm;
    const size_t page = 6000;
    StoreConfig c = cfg_for(shm.path, page, 16, e);
    c.direct_io = vitrify::file_io::DirectIo::kOff;  // tmpfs accepts O_DIRECT since Linux 6.6
    Store s(c);
    EXPECT_FALSE(s.slab(0, 0).direct());
    for (uint64_t i = 0; i < 10; ++i) {  // lengths 6000: two blocks each, one slot per key
      auto b = s.make_buffer(0);
      fill(i, b->data() + kSlotHeaderBytes, page);
      ASSERT_EQ(s.submit_put(0, {PutItem{key_of(i), b, page}})->wait()[0],
                static_cast<int64_t>(PutResult::kStored));
    }
    ASSERT_EQ(::truncate(s.slab(0, 0).path().c_str(),
                         static_cast<off_t>(kFileHeaderBytes + 5 * slot_bytes_for(page) + 100)),
              0);
    std::vector<GetItem> items;
    std::vector<std::vector<uint8_t>> dst(10, std::vector<uint8_t>(page));
    for (uint64_t i = 0; i < 10; ++i) items.push_back(GetItem{key_of(i), dst[i].data(), page, false});
    const auto r = s.submit_get(0, std::move(items))->wait();
    for (uint64_t i = 0; i < 10; ++i) {
      if (i < 5) {
        ASSERT_EQ(r[i], static_cast<int64_t>(page)) << i;
        std::vector<uint8_t> want(page);
        fill(i, want.data(), page);
        EXPECT_EQ(dst[i], want) << i;
      } else {
        EXPECT_EQ(r[i], -1) << i;
      }
    }
    EXPECT_EQ(s.stats().verify_failures, 5u);
  }
}

// D3 on every engine: a write that fails (EFBIG past RLIMIT_FSIZE; the write straddling the
// limit first moves part of its bytes: a short write, then the error) is acknowledged kError,
// counted, its slot freed; the writes before it are stored.
TEST(DiskEngine, FailedAndShortWritesAreErrorsAndFreeTheirSlotsOnEveryEngine) {
  for (IoEngine e : granted()) {
    SCOPED_TRACE(io_engine_name(e));
    ShmDir shm;  // buffered: a write may stop short at the limit
    const size_t page = 4000;
    StoreConfig c = cfg_for(shm.path, page, 16, e);
    c.direct_io = vitrify::file_io::DirectIo::kOff;
    c.write_threads = 1;
    Store s(c);
    struct rlimit old{};
    ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
    auto prev = ::signal(SIGXFSZ, SIG_IGN);
    struct rlimit lim = old;
    lim.rlim_cur = kFileHeaderBytes + 4 * 4096 + 2048;  // slot 4 straddles the limit
    ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &lim), 0);
    std::vector<PutItem> items;
    for (uint64_t i = 0; i < 8; ++i) {
      auto b = s.make_buffer(0);
      fill(i, b->data() + kSlotHeaderBytes, page);
      items.push_back(PutItem{key_of(i), b, page});
    }
    const auto r = s.submit_put(0, std::move(items))->wait();
    ::setrlimit(RLIMIT_FSIZE, &old);
    ::signal(SIGXFSZ, prev);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(r[i], static_cast<int64_t>(PutResult::kStored)) << i;
    for (int i = 4; i < 8; ++i) EXPECT_EQ(r[i], static_cast<int64_t>(PutResult::kError)) << i;
    const auto st = s.stats();
    EXPECT_EQ(st.write_errors, 4u);
    EXPECT_EQ(st.kinds[0].entries, 4u);
    EXPECT_EQ(st.kinds[0].slots_used, 4u);
    const auto got = get_range(s, 0, 8, page);
    for (uint64_t i = 0; i < 8; ++i) EXPECT_EQ(got[i].has_value(), i < 4) << i;
  }
}
