// Span files: the bulk path device <-> pinned staging <-> file (format in DESIGN.md).
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <exception>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "snapshot/handoff.hpp"
#include "vitrify/crc32c.hpp"
#include "vitrify/file_io.hpp"
#include "vitrify/log.hpp"
#include "vitrify/snapshot.hpp"

namespace vitrify::snapshot {
namespace {

constexpr char kMagic[8] = {'V', 'T', 'R', 'F', 'S', 'P', 'A', 'N'};
constexpr uint32_t kVersion = 1;
constexpr uint64_t kBlock = 4096;  // header size, data/table alignment, O_DIRECT unit
constexpr unsigned kCachedReadLanes = 8;     // restore lanes when the page cache serves the file
constexpr size_t kCachedPiece = 1ull << 20;  // what a lane reads, then checksums, at a time

// The first bytes of the 4 KiB header block; all fields little-endian (x86-64/aarch64 native).
struct RawHeader {
  char magic[8];
  uint32_t version;
  uint32_t header_bytes;
  uint64_t base, start, end;
  uint64_t chunk_bytes, granularity;
  uint64_t interval_count;
  uint64_t data_offset, data_bytes;
  uint64_t table_offset, table_bytes;
  uint64_t file_bytes;
  uint32_t table_crc;
  uint32_t header_crc;  // CRC32C of the bytes of this struct before this field
};
static_assert(sizeof(RawHeader) == 112, "span file header layout");
static_assert(offsetof(RawHeader, header_crc) == 108, "span file header layout");

uint64_t chunk_count(uint64_t data_bytes, uint64_t chunk_bytes) {
  return (data_bytes + chunk_bytes - 1) / chunk_bytes;
}

[[noreturn]] void corrupt(const std::string& path, const std::string& what) {
  throw SpanFileError("span file " + path + ": " + what);
}

// Opens a span file through the file-I/O layer (to read: file_io::open_for_reading, so a link
// is never followed and a FIFO, directory or device is refused without blocking); says at debug
// level why `auto` chose buffered I/O.
file_io::OpenedFile open_span_file(const std::string& path, int flags, file_io::DirectIo mode) {
  file_io::OpenedFile f = (flags & O_ACCMODE) == O_RDONLY
                              ? file_io::open_for_reading(path, mode, "span file")
                              : file_io::open_file(path, flags, mode);
  if (!f.direct && mode == file_io::DirectIo::kAuto && log::enabled(log::kDebug))
    log::debug("snapshot: no O_DIRECT for " + path + ": " + f.buffered_reason);
  return f;
}

// Reads exactly n bytes; a short file is a SpanFileError naming `what`.
void pread_all(int fd, uint8_t* p, size_t n, uint64_t off, const std::string& path,
               const std::string& what) {
  if (file_io::pread_full(fd, p, n, off, path) < n)
    corrupt(path, "truncated: end of file inside " + what);
}

// Reads one chunk of n bytes (n a multiple of kBlock) as `lanes` concurrent preads of
// contiguous, block-aligned parts (more requests in flight than one synchronous read: the
// drive's depth), on file_io::on_threads (this thread included), and returns the CRC32C of its
// first `crc_bytes` bytes: each lane checksums its own part, so the check runs on every lane
// instead of one thread. With `sub` > 0 a lane reads its part `sub` bytes at a time and
// checksums each piece while it is still in the core's cache (a file the page cache holds:
// the copy out of the cache is then the only pass over memory); with 0 it reads its part in one
// request (O_DIRECT: the kernel keeps the whole part in flight) and checksums it after. The
// first failure is rethrown once every part has returned.
uint32_t pread_crc_parallel(int fd, uint8_t* p, size_t n, size_t crc_bytes, uint64_t off,
                            const std::string& path, const std::string& what, unsigned lanes,
                            size_t sub) {
  lanes = std::max(1u, lanes);
  const size_t part = std::max(kBlock, round_up((n + lanes - 1) / lanes, kBlock));
  const unsigned parts = static_cast<unsigned>((n + part - 1) / part);
  std::vector<uint32_t> crc(parts, 0);
  std::atomic<unsigned> next{0};
  std::mutex mu;
  std::exception_ptr first;
  auto work = [&] {
    for (unsigned i; (i = next.fetch_add(1)) < parts;) {
      const size_t lo = size_t(i) * part, hi = std::min(n, lo + part);
      try {
        const size_t step = sub > 0 ? sub : hi - lo;
        uint32_t c = 0;
        for (size_t at = lo; at < hi; at += step) {
          const size_t m = std::min(step, hi - at);
          pread_all(fd, p + at, m, off + at, path, what);
          if (at < crc_bytes) c = crc32c(p + at, std::min(m, crc_bytes - at), c);
        }
        crc[i] = c;
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!first) first = std::current_exception();
      }
    }
  };
  if (parts <= 1)
    work();
  else
    file_io::on_threads(parts, work);
  if (first) std::rethrow_exception(first);
  uint32_t out = 0;
  for (unsigned i = 0; i < parts; ++i) {
    const size_t lo = size_t(i) * part;
    if (lo >= crc_bytes) break;
    const size_t len = std::min(part, crc_bytes - lo);
    out = i == 0 ? crc[0] : crc32c_combine(out, crc[i], len);
  }
  return out;
}

void check_options(const FileOptions& opt) {
  VITRIFY_EXPECT(opt.chunk_bytes >= kBlock && opt.chunk_bytes % kBlock == 0 &&
                  opt.chunk_bytes <= (uint64_t(1) << 34),
              "chunk_bytes must be a positive multiple of 4096 up to 16 GiB, got " +
                  std::to_string(opt.chunk_bytes));
  VITRIFY_EXPECT(opt.granularity > 0 && (opt.granularity & (opt.granularity - 1)) == 0,
              "granularity must be a power of two, got " + std::to_string(opt.granularity));
  VITRIFY_EXPECT(opt.read_lanes >= 1 && opt.read_lanes <= 64,
                 "read_lanes must be 1..64, got " + std::to_string(opt.read_lanes));
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

struct Staging {
  AlignedBuffer buf[2];
  std::unique_ptr<Pinned> pin[2];
  Staging(CopyBackend& be, uint64_t bytes) {
    for (int i = 0; i < 2; ++i) {
      buf[i] = AlignedBuffer(bytes, kBlock);
      pin[i] = be.pin(buf[i].data(), buf[i].size());
    }
  }
  ~Staging() {
    pin[0].reset();  // unregister before the buffers are freed
    pin[1].reset();
  }
};

// Header + tables of an open span file, validated.
SpanFileInfo read_info(int fd, const std::string& path) {
  AlignedBuffer hb(kBlock, kBlock);
  pread_all(fd, hb.data(), kBlock, 0, path, "the header");
  RawHeader h;
  std::memcpy(&h, hb.data(), sizeof h);
  if (std::memcmp(h.magic, kMagic, sizeof kMagic) != 0) corrupt(path, "not a span file (bad magic)");
  if (h.header_crc != crc32c(&h, offsetof(RawHeader, header_crc)))
    corrupt(path, "header CRC32C mismatch");
  if (h.version != kVersion)
    corrupt(path, "version " + std::to_string(h.version) + ", this vitrify reads version " +
                      std::to_string(kVersion));
  if (h.header_bytes != kBlock || h.data_offset != kBlock || h.chunk_bytes == 0 ||
      h.chunk_bytes > (uint64_t(1) << 34) || h.end < h.start || h.data_bytes > h.end - h.start || h.data_bytes > (uint64_t(1) << 50) ||
      h.chunk_bytes % kBlock != 0 || h.table_offset % kBlock != 0 ||
      h.table_offset != round_up(h.data_offset + h.data_bytes, kBlock) ||
      h.interval_count > (uint64_t(1) << 40) / 16 ||
      h.table_bytes != h.interval_count * 16 + chunk_count(h.data_bytes, h.chunk_bytes) * 4 ||
      h.file_bytes != h.table_offset + round_up(h.table_bytes, kBlock))
    corrupt(path, "inconsistent header fields");
  struct stat st{};
  VITRIFY_SYSCALL(::fstat(fd, &st), path);
  if (static_cast<uint64_t>(st.st_size) < h.file_bytes)
    corrupt(path, "truncated: " + std::to_string(st.st_size) + " bytes, the header says " +
                      std::to_string(h.file_bytes));

  SpanFileInfo info;
  info.version = h.version;
  info.base = h.base;
  info.start = h.start;
  info.end = h.end;
  info.chunk_bytes = h.chunk_bytes;
  info.granularity = h.granularity;
  info.data_bytes = h.data_bytes;
  info.file_bytes = h.file_bytes;
  AlignedBuffer tb(round_up(h.table_bytes, kBlock), kBlock);
  if (h.table_bytes > 0)
    pread_all(fd, tb.data(), tb.size(), h.table_offset, path, "the tables");
  if (crc32c(tb.data(), h.table_bytes) != h.table_crc) corrupt(path, "table CRC32C mismatch");
  info.intervals.resize(h.interval_count);
  std::memcpy(info.intervals.data(), tb.data(), h.interval_count * 16);
  info.chunk_crcs.resize(chunk_count(h.data_bytes, h.chunk_bytes));
  std::memcpy(info.chunk_crcs.data(), tb.data() + h.interval_count * 16,
              info.chunk_crcs.size() * 4);
  if (!is_normalized(info.intervals) || total_bytes(info.intervals) != h.data_bytes ||
      (!info.intervals.empty() &&
       (info.intervals.front().begin < h.start || info.intervals.back().end > h.end)))
    corrupt(path, "interval table is inconsistent with the header");
  return info;
}

// Joins a pipeline thread on every exit path; on an error exit it first fails the handoff so a
// blocked thread wakes up.
class Joiner {
 public:
  Joiner(detail::Handoff& h, std::thread& t) : h_(h), t_(t) {}
  ~Joiner() {
    if (std::uncaught_exceptions() > 0) h_.fail(nullptr);
    if (t_.joinable()) t_.join();
  }

 private:
  detail::Handoff& h_;
  std::thread& t_;
};

}  // namespace

FileStats dump_to_file(CopyBackend& be, uint64_t base, uint64_t start, uint64_t end,
                       const std::string& path, const FileOptions& opt) {
  check_options(opt);
  VITRIFY_EXPECT(start <= end, "span start " + std::to_string(start) + " is past its end " +
                                std::to_string(end));
  VITRIFY_EXPECT(base + end >= base, "span end overflows the address space");
  const auto t0 = std::chrono::steady_clock::now();
  FileStats st;
  const file_io::OpenedFile file =
      open_span_file(path, O_WRONLY | O_CREAT | O_TRUNC, opt.direct_io);
  st.direct_io = file.direct;
  const int fd = file.fd.get();
  const uint64_t cb = opt.chunk_bytes;
  // A span smaller than a chunk needs (and pins) only its own size.
  Staging stage(be, std::max(kBlock, round_up(std::min(cb, end - start), kBlock)));
  uint64_t fill[2] = {0, 0};
  std::vector<uint32_t> crcs;
  uint32_t data_crc = 0;  // CRC32C of the data area as written (padding included)

  // Consumer: checksum and write each full slot at its place in the data area (S6).
  detail::Handoff h(2);
  std::thread writer([&] {
    try {
      for (uint64_t k = 0;; ++k) {
        const int s = h.acquire_full();
        if (s < 0) return;
        uint8_t* p = stage.buf[s].data();
        const uint64_t n = fill[s];
        crcs.push_back(crc32c(p, n));
        const uint64_t padded = round_up(n, kBlock);
        std::memset(p + n, 0, padded - n);
        data_crc = crc32c_combine(data_crc, crc32c(p + n, padded - n, crcs.back()), padded);
        file_io::pwrite_full(fd, p, padded, kBlock + k * cb, path);
        h.release(s);
      }
    } catch (...) {
      h.fail(std::current_exception());
    }
  });
  {
    Joiner join(h, writer);
    auto add = [&](uint64_t b, uint64_t e) {
      if (!st.intervals.empty() && st.intervals.back().end == b)
        st.intervals.back().end = e;
      else
        st.intervals.push_back({b, e});
    };
    int cur = h.acquire_free();
    fill[cur] = 0;
    uint64_t off = start;
    while (off < end && cur >= 0) {
      const uint64_t take = std::min(cb - fill[cur], end - off);
      uint8_t* dst = stage.buf[cur].data();
      if (be.try_to_host(dst + fill[cur], base + off, take)) {
        add(off, off + take);
        fill[cur] += take;
      } else {  // holes: granule trial copies, packing what copied (S3)
        for (const Interval& p : split_aligned(base, off, off + take, opt.granularity))
          if (be.try_to_host(dst + fill[cur], base + p.begin, p.size())) {
            add(p.begin, p.end);
            fill[cur] += p.size();
          }
      }
      off += take;
      if (fill[cur] == cb) {
        h.publish(cur);
        cur = h.acquire_free();
        if (cur >= 0) fill[cur] = 0;
      }
      if (opt.progress) opt.progress(off - start, end - start);
    }
    if (cur >= 0 && fill[cur] > 0) h.publish(cur);
    h.close();
  }
  h.rethrow();
  st.bytes = total_bytes(st.intervals);

  RawHeader hd{};
  std::memcpy(hd.magic, kMagic, sizeof kMagic);
  hd.version = kVersion;
  hd.header_bytes = kBlock;
  hd.base = base;
  hd.start = start;
  hd.end = end;
  hd.chunk_bytes = cb;
  hd.granularity = opt.granularity;
  hd.interval_count = st.intervals.size();
  hd.data_offset = kBlock;
  hd.data_bytes = st.bytes;
  hd.table_offset = round_up(kBlock + st.bytes, kBlock);
  hd.table_bytes = st.intervals.size() * 16 + crcs.size() * 4;
  hd.file_bytes = hd.table_offset + round_up(hd.table_bytes, kBlock);
  if (crcs.size() != chunk_count(st.bytes, cb))
    throw Error("span file " + path + ": internal error, " + std::to_string(crcs.size()) +
                " chunk CRCs for " + std::to_string(st.bytes) + " bytes");
  uint32_t table_block_crc = 0;  // CRC32C of the table area as written (padding included)
  if (hd.table_bytes > 0) {
    AlignedBuffer tb(round_up(hd.table_bytes, kBlock), kBlock);
    std::memcpy(tb.data(), st.intervals.data(), st.intervals.size() * 16);
    std::memcpy(tb.data() + st.intervals.size() * 16, crcs.data(), crcs.size() * 4);
    hd.table_crc = crc32c(tb.data(), hd.table_bytes);
    table_block_crc = crc32c(tb.data(), tb.size());
    file_io::pwrite_full(fd, tb.data(), tb.size(), hd.table_offset, path);
  } else {
    hd.table_crc = crc32c(nullptr, 0);
  }
  // Invariant 7: data and tables are durable before the header that makes the file valid.
  VITRIFY_SYSCALL(::fdatasync(fd), path);
  hd.header_crc = crc32c(&hd, offsetof(RawHeader, header_crc));
  AlignedBuffer hb(kBlock, kBlock);
  std::memcpy(hb.data(), &hd, sizeof hd);
  file_io::pwrite_full(fd, hb.data(), kBlock, 0, path);
  VITRIFY_SYSCALL(::fdatasync(fd), path);
  // The whole file's CRC32C from what was written (header, data, table: contiguous blocks), so
  // an archive's manifest need not read the file back.
  st.file_crc32c = crc32c_combine(
      crc32c_combine(crc32c(hb.data(), kBlock), data_crc, hd.table_offset - kBlock),
      table_block_crc, hd.file_bytes - hd.table_offset);
  st.file_bytes = hd.file_bytes;
  st.seconds = seconds_since(t0);
  return st;
}

SpanFileInfo read_span_file_info(const std::string& path) {
  const file_io::OpenedFile file =
      file_io::open_for_reading(path, file_io::DirectIo::kOff, "span file");
  return read_info(file.fd.get(), path);
}

FileStats restore_from_file(CopyBackend& be, const std::string& path, uint64_t base,
                            uint64_t ceiling, const FileOptions& opt) {
  const auto t0 = std::chrono::steady_clock::now();
  VITRIFY_EXPECT(opt.read_lanes >= 1 && opt.read_lanes <= 64,
                 "read_lanes must be 1..64, got " + std::to_string(opt.read_lanes));
  FileStats st;
  const file_io::OpenedFile file = open_span_file(path, O_RDONLY, opt.direct_io);
  st.direct_io = file.direct;
  const int fd = file.fd.get();
  const SpanFileInfo info = read_info(fd, path);
  VITRIFY_EXPECT(base + info.end >= base, "restore base overflows the address space");
  const uint64_t cb = info.chunk_bytes;
  const uint64_t chunks = info.chunk_crcs.size();
  Staging stage(be, std::max(kBlock, round_up(std::min(cb, info.data_bytes), kBlock)));
  uint64_t len[2] = {0, 0};
  uint32_t got_crc[2] = {0, 0};
  // A file read through the page cache is a copy out of memory: more lanes, each checksumming
  // 1 MiB pieces while they are in its cache. O_DIRECT: the drive's depth, whole parts.
  const unsigned lanes = file.direct ? opt.read_lanes
                                     : std::max(opt.read_lanes, kCachedReadLanes);
  const size_t sub = file.direct ? 0 : kCachedPiece;

  // Producer: the reader thread fills free slots with consecutive chunks.
  detail::Handoff h(2);
  std::thread reader([&] {
    try {
      for (uint64_t k = 0; k < chunks; ++k) {
        const int s = h.acquire_free();
        if (s < 0) return;
        len[s] = std::min(cb, info.data_bytes - k * cb);
        got_crc[s] = pread_crc_parallel(fd, stage.buf[s].data(), round_up(len[s], kBlock), len[s],
                                        kBlock + k * cb, path, "chunk " + std::to_string(k),
                                        lanes, sub);
        h.publish(s);
      }
      h.close();
    } catch (...) {
      h.fail(std::current_exception());
    }
  });
  int pending = -1;  // the slot whose device copy may still be in flight
  try {
    Joiner join(h, reader);
    size_t iv = 0;        // interval holding the next data byte
    uint64_t within = 0;  // offset of that byte inside intervals[iv]
    for (uint64_t k = 0; k < chunks; ++k) {
      const int s = h.acquire_full();
      if (s < 0) break;
      // The previous chunk's copy had the whole read of this chunk to finish: hand its buffer
      // back to the reader now, so the next read overlaps this chunk's CRC and copy.
      if (pending >= 0) {
        be.wait(pending);
        h.release(pending);
        pending = -1;
      }
      const uint8_t* p = stage.buf[s].data();
      const uint32_t got = got_crc[s];  // the reader's lanes checksummed the bytes they read
      if (got != info.chunk_crcs[k]) {  // S8: a bad chunk is never written
        char buf[64];
        std::snprintf(buf, sizeof buf, "stored %08x, computed %08x", info.chunk_crcs[k], got);
        corrupt(path, "chunk " + std::to_string(k) + " of " + std::to_string(chunks) +
                          " (file offset " + std::to_string(kBlock + k * cb) + ", " +
                          std::to_string(len[s]) + " bytes): CRC32C mismatch, " + buf);
      }
      uint64_t pos = 0;
      while (pos < len[s]) {
        const Interval& i = info.intervals[iv];
        const uint64_t take = std::min(i.size() - within, len[s] - pos);
        const uint64_t dst = i.begin + within;
        const uint64_t keep = dst >= ceiling ? 0 : std::min(take, ceiling - dst);
        if (keep > 0) {
          be.to_device_async(base + dst, p + pos, keep, s);
          st.bytes_written += keep;
          if (!st.intervals.empty() && st.intervals.back().end == dst)
            st.intervals.back().end = dst + keep;
          else
            st.intervals.push_back({dst, dst + keep});
        }
        st.bytes_dropped += take - keep;
        pos += take;
        within += take;
        if (within == i.size()) ++iv, within = 0;
      }
      be.to_device_async(0, nullptr, 0, s);  // marks the lane even when nothing was copied
      pending = s;
      if (opt.progress) opt.progress(std::min(info.data_bytes, (k + 1) * cb), info.data_bytes);
    }
    if (pending >= 0) {
      be.wait(pending);
      h.release(pending);
      pending = -1;
    }
  } catch (...) {
    // Staging memory must not be unregistered under an in-flight copy.
    for (int lane = 0; lane < 2; ++lane) try { be.wait(lane); } catch (...) {}
    throw;
  }
  h.rethrow();
  st.bytes = info.data_bytes;
  st.seconds = seconds_since(t0);
  return st;
}

void verify_span_file(const std::string& path, const FileOptions& opt) {
  const file_io::OpenedFile file = open_span_file(path, O_RDONLY, opt.direct_io);
  const int fd = file.fd.get();
  const SpanFileInfo info = read_info(fd, path);
  AlignedBuffer buf(std::max(kBlock, round_up(std::min(info.chunk_bytes, info.data_bytes), kBlock)),
                    kBlock);
  for (uint64_t k = 0; k < info.chunk_crcs.size(); ++k) {
    const uint64_t n = std::min(info.chunk_bytes, info.data_bytes - k * info.chunk_bytes);
    pread_all(fd, buf.data(), round_up(n, kBlock), kBlock + k * info.chunk_bytes, path,
              "chunk " + std::to_string(k));
    if (crc32c(buf.data(), n) != info.chunk_crcs[k])
      corrupt(path, "chunk " + std::to_string(k) + " of " + std::to_string(info.chunk_crcs.size()) +
                        " (file offset " + std::to_string(kBlock + k * info.chunk_bytes) +
                        "): CRC32C mismatch");
    if (opt.progress) opt.progress((k + 1) * info.chunk_bytes, info.data_bytes);
  }
}

uint32_t file_crc32c(const std::string& path) {
  const file_io::OpenedFile file = file_io::open_for_reading(path, file_io::DirectIo::kOff, "file");
  const int fd = file.fd.get();
  (void)::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);  // a hint; no answer changes anything
  constexpr size_t kBuf = 8 << 20;
  AlignedBuffer buf[2] = {AlignedBuffer(kBuf, kBlock), AlignedBuffer(kBuf, kBlock)};
  size_t got[2] = {0, 0};
  // A reader thread fills one buffer while this thread checksums the other.
  detail::Handoff h(2);
  std::thread reader([&] {
    try {
      uint64_t off = 0;
      for (;;) {
        const int s = h.acquire_free();
        if (s < 0) return;
        const size_t r = file_io::pread_full(fd, buf[s].data(), kBuf, off, path);
        if (r == 0) {
          h.release(s);
          h.close();
          return;
        }
        got[s] = r;
        off += r;
        h.publish(s);
      }
    } catch (...) {
      h.fail(std::current_exception());
    }
  });
  uint32_t crc = 0;
  {
    Joiner join(h, reader);
    for (;;) {
      const int s = h.acquire_full();
      if (s < 0) break;
      crc = crc32c(buf[s].data(), got[s], crc);
      h.release(s);
    }
  }
  h.rethrow();
  return crc;
}

}  // namespace vitrify::snapshot
