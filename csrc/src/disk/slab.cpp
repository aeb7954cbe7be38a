// SlabFile: one preallocated file of fixed-size slots, written and read with single O_DIRECT
// transfers (buffered + fdatasync where O_DIRECT is refused). See DESIGN.md.
#if defined(__x86_64__)
#include <emmintrin.h>
#endif
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <algorithm>
#include <atomic>
#include <exception>
#include <random>
#include <thread>

#include "vitrify/crc32c.hpp"
#include "vitrify/disk.hpp"
#include "vitrify/error.hpp"
#include "vitrify/file_io.hpp"
#include "vitrify/log.hpp"

namespace vitrify::disk {

size_t KeyHash::operator()(const Key& k) const noexcept {
  uint64_t w[4];
  std::memcpy(w, k.data(), sizeof w);
  uint64_t h = 0x9E3779B97F4A7C15ull;
  for (uint64_t x : w) {
    h ^= x + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 31;
  }
  return static_cast<size_t>(h);
}

namespace {

// Orders every earlier store, non-temporal ones included, before every later one.
void store_fence() noexcept {
#if defined(__x86_64__)
  _mm_sfence();
#endif
  std::atomic_thread_fence(std::memory_order_seq_cst);
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
  return s;
}

uint32_t new_slab_id() {
  std::random_device rd;
  uint32_t v = rd() ^ static_cast<uint32_t>(
                          std::chrono::steady_clock::now().time_since_epoch().count());
  return v == 0 ? 1 : v;
}

}  // namespace

ColdStart parse_cold_start(const std::string& text) {
  const std::string t = lower(text);
  if (t == "clear") return ColdStart::kClear;
  if (t == "load") return ColdStart::kLoad;
  VITRIFY_EXPECT(false, "cold start mode must be \"clear\" or \"load\", got \"" + text + "\"");
  return ColdStart::kClear;
}

uint64_t store_tag(const std::string& name) noexcept {
  uint64_t h = 0xCBF29CE484222325ull;
  for (unsigned char c : name) {
    h ^= c;
    h *= 0x100000001B3ull;
  }
  return h;
}

SlabFile::SlabFile(const std::string& path, const SlabGeometry& geometry, ColdStart mode,
                   file_io::DirectIo dio, SlabLocking locking)
    : SlabFile(lock_slab(path, dio, locking), geometry, mode) {}

void SlabFile::check_geometry(const SlabGeometry& geo) {
  VITRIFY_EXPECT(geo.slot_bytes > kSlotHeaderBytes && geo.slot_bytes % kBlock == 0 &&
                  geo.slot_bytes <= (uint64_t{1} << 32),
              "slot_bytes must be a multiple of 4096 in (64, 4 GiB], got " +
                  std::to_string(geo.slot_bytes));
  VITRIFY_EXPECT(geo.slot_count >= 1 && geo.slot_count <= 0xFFFFFFFFull,
              "slot_count must be in [1, 2^32), got " + std::to_string(geo.slot_count));
}

void SlabFile::check_writable() const {
  if (read_only_)
    vitrify::detail::throw_errno(EROFS, "write", path_, "slab opened read-only");
}

SlabFile::SlabFile(LockedSlab locked, const SlabGeometry& geometry, ColdStart mode, bool host)
    : path_(std::move(locked.path)), geo_(geometry) {
  check_geometry(geo_);
  VITRIFY_EXPECT(locked.lock.held() && locked.file.fd,
                 "slab file " + path_ + " must be open and locked (lock_slab)");
  const std::string& path = path_;
  // Locked before anything in the file is read or written (D13); both owners are members now,
  // so the lock is released, then the fd closed, if the rest of the constructor throws.
  fd_ = std::move(locked.file.fd);
  lock_ = std::move(locked.lock);
  direct_ = locked.file.direct;
  buffered_reason_ = std::move(locked.file.buffered_reason);
  if (!direct_ && !host)
    log::info("vitrify.disk: buffered I/O for " + path + ": " + buffered_reason_);

  uint64_t size = kFileHeaderBytes + geo_.slot_count * geo_.slot_bytes;
  struct stat st{};
  VITRIFY_SYSCALL(::fstat(fd_.get(), &st), path);
  const bool fresh = st.st_size == 0;  // created now (or empty): nothing to load
  // The header first, before the file is resized or written: `load` of a slab of another
  // geometry or store refuses here, with every stored page as it was (D7).
  FileHeader fh{};
  bool valid = false;
  bool ours = fresh;  // vitrify's: empty, a slab header (damaged or not), or a zeroed header
  if (static_cast<uint64_t>(st.st_size) >= kFileHeaderBytes) {
    AlignedBuffer hb(kFileHeaderBytes);
    const size_t r = file_io::pread_full(fd_.get(), hb.data(), kFileHeaderBytes, 0, path);
    std::memcpy(&fh, hb.data(), sizeof fh);
    valid = r == kFileHeaderBytes && fh.magic == kFileMagic && fh.version == kFormatVersion &&
            fh.header_crc == crc32c(&fh, offsetof(FileHeader, header_crc)) && fh.slab_id != 0;
    const auto* b = static_cast<const unsigned char*>(hb.data());
    // a zeroed header: a slab whose creation stopped before its header was written (D22)
    ours = r == kFileHeaderBytes &&
           (fh.magic == kFileMagic || std::all_of(b, b + kFileHeaderBytes,
                                                  [](unsigned char c) { return c == 0; }));
  }
  // D23: vitrify formats only files it made; anything else at a slab path is the user's.
  VITRIFY_EXPECT(ours, "slab file \"" + path + "\" exists (" + std::to_string(st.st_size) +
                           " bytes) and is not a vitrify slab (no slab header): vitrify never "
                           "overwrites a file it did not create; remove it or choose another "
                           "directory or name");
  VITRIFY_EXPECT(mode != ColdStart::kLoad || valid || fresh || fh.magic != kFileMagic,
                 "cold_start=\"load\" refuses slab file \"" + path + "\": its header is "
                 "damaged (format version or checksum does not verify), so none of its pages "
                 "can be trusted; open it with cold_start=\"clear\" to wipe it");
  if (mode == ColdStart::kLoad && valid) {
    const std::string why = geometry_mismatch(fh, geo_);
    VITRIFY_EXPECT(why.empty(),
                   "cold_start=\"load\" refuses slab file \"" + path + "\": " + why +
                       "; load keeps pages only under the geometry they were written with: open "
                       "it with the same kinds, budget and directories, or with "
                       "cold_start=\"clear\" to wipe it");
  }
  if (host) {
    // H1: a whole number of the filesystem's blocks (huge pages on hugetlbfs), never shrunk:
    // a reader may have the old size mapped, and a shrink would make its reads fault.
    struct statfs sfs{};
    VITRIFY_SYSCALL(::fstatfs(fd_.get(), &sfs), path);
    size = round_up(size, sfs.f_bsize > 0 ? static_cast<uint64_t>(sfs.f_bsize) : kBlock);
    VITRIFY_EXPECT(static_cast<uint64_t>(st.st_size) <= size,
                   "host slab " + path + " holds " + std::to_string(st.st_size) +
                       " bytes, more than the " + std::to_string(size) +
                       " of this geometry; a host slab is never shrunk (readers may map it): "
                       "remove it with `vitrify tier clear` or use another name");
  } else if (static_cast<uint64_t>(st.st_size) > size) {
    VITRIFY_SYSCALL(::ftruncate(fd_.get(), static_cast<off_t>(size)), path);
  }
  const int fa = ::posix_fallocate(fd_.get(), 0, static_cast<off_t>(size));
  if (fa != 0)
    vitrify::detail::throw_errno(fa, "posix_fallocate", path, std::to_string(size) + " bytes");
  if (host) map_ = SlabMapping(fd_.get(), static_cast<size_t>(size), true, path);

  if (mode == ColdStart::kLoad && valid) {
    slab_id_ = fh.slab_id;
  } else {
    // kLoad here: the file is new, or holds no valid header (so no slot of it can verify).
    if (mode == ColdStart::kLoad && fresh)
      log::info("vitrify.disk: " + path + " is new; formatted it empty");
    else if (mode == ColdStart::kLoad)
      log::warning("vitrify.disk: " + path + " has a zeroed header (its creation stopped "
                   "before the header was written); starting it empty");
    // The next generation of a valid slab is id + 1, so its old slots never match again.
    slab_id_ = valid ? fh.slab_id + 1 : new_slab_id();
    if (slab_id_ == 0) slab_id_ = 1;
    format();
  }
}

SlabFile::~SlabFile() = default;

// D14: no lock, no O_CREAT, no probe file, nothing written; a file the writer has not formatted
// (yet) is an error here, never formatted.
std::unique_ptr<SlabFile> SlabFile::open_read_only(const std::string& path,
                                                   const SlabGeometry& geometry,
                                                   file_io::DirectIo dio, bool host) {
  check_geometry(geometry);
  std::unique_ptr<SlabFile> s(new SlabFile());
  s->path_ = path;
  s->geo_ = geometry;
  s->read_only_ = true;
  // Never through a link, never a FIFO or device (issue 32): O_NOFOLLOW, O_NONBLOCK for the
  // open (cleared after), and a regular file or a one-line refusal naming the path.
  const auto refuse_odd = [&](int err) {
    struct stat ls{};
    if ((err == ELOOP || err == ENXIO || err == EWOULDBLOCK) &&
        ::lstat(path.c_str(), &ls) == 0 && !S_ISREG(ls.st_mode))
      file_io::refuse_not_regular(ls, path, host ? "host slab file" : "slab file");
  };
  constexpr int kFlags = O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC;
  if (host) {
    s->buffered_reason_ = "host slab (mapped)";  // opened below, without O_DIRECT
  } else if (dio != file_io::DirectIo::kOff) {
    int fd;
    do fd = ::open(path.c_str(), kFlags | O_DIRECT);
    while (fd == -1 && errno == EINTR);
    if (fd >= 0) {
      s->fd_.reset(fd);
      s->direct_ = true;
    } else if (errno == EINVAL && dio == file_io::DirectIo::kAuto) {
      s->buffered_reason_ = std::string("open(O_DIRECT) refused: ") + std::strerror(EINVAL);
    } else {
      const int err = errno;
      refuse_odd(err);
      vitrify::detail::throw_errno(err, "open", path, "read-only");
    }
  } else {
    s->buffered_reason_ = "direct_io is off";
  }
  if (!s->fd_) {
    int fd;
    do fd = ::open(path.c_str(), kFlags);
    while (fd == -1 && errno == EINTR);
    if (fd == -1) {
      const int err = errno;
      refuse_odd(err);
      vitrify::detail::throw_errno(err, "open", path, "read-only");
    }
    s->fd_.reset(fd);
  }
  struct stat st{};
  VITRIFY_SYSCALL(::fstat(s->fd_.get(), &st), path);
  if (!S_ISREG(st.st_mode))
    file_io::refuse_not_regular(st, path, host ? "host slab file" : "slab file");
  {
    const int fl = ::fcntl(s->fd_.get(), F_GETFL);
    if (fl == -1 || ::fcntl(s->fd_.get(), F_SETFL, fl & ~O_NONBLOCK) == -1)
      vitrify::detail::throw_errno(errno, "fcntl", path, "F_SETFL, clearing O_NONBLOCK");
  }
  if (host) check_host_owner(s->fd_.get(), path, false);
  const uint64_t size = kFileHeaderBytes + geometry.slot_count * geometry.slot_bytes;
  VITRIFY_EXPECT(static_cast<uint64_t>(st.st_size) >= size,
                 "slab file " + path + " holds " + std::to_string(st.st_size) +
                     " bytes, fewer than the " + std::to_string(size) +
                     " its geometry needs; a read-only store never formats or grows a slab");
  if (host) {
    // The writer sized the file to whole filesystem blocks (H1); hugetlbfs maps only those.
    struct statfs sfs{};
    VITRIFY_SYSCALL(::fstatfs(s->fd_.get(), &sfs), path);
    const uint64_t whole = round_up(size, sfs.f_bsize > 0 ? static_cast<uint64_t>(sfs.f_bsize)
                                                          : kBlock);
    const uint64_t bytes = std::min<uint64_t>(whole, static_cast<uint64_t>(st.st_size));
    s->map_ = SlabMapping(s->fd_.get(), static_cast<size_t>(bytes), false, path);
  }
  const std::string why = s->reload_header();
  VITRIFY_EXPECT(why.empty(), "slab file " + path + " " + why +
                                  "; a read-only store never formats a slab");
  return s;
}

std::string SlabFile::reload_header() noexcept {
  slab_id_ = 0;  // nothing verifies unless the header does
  try {
    AlignedBuffer hb(kFileHeaderBytes);
    const size_t r = read_at(hb.data(), kFileHeaderBytes, 0);
    FileHeader fh{};
    std::memcpy(&fh, hb.data(), sizeof fh);
    if (r != kFileHeaderBytes || fh.magic != kFileMagic || fh.version != kFormatVersion ||
        fh.header_crc != crc32c(&fh, offsetof(FileHeader, header_crc)) || fh.slab_id == 0)
      return "has no valid slab header";
    const std::string why = geometry_mismatch(fh, geo_);
    if (!why.empty()) return "belongs to another store or geometry: " + why;
    slab_id_ = fh.slab_id;
    return {};
  } catch (const std::exception& e) {
    return std::string("cannot be read: ") + e.what();
  }
}

std::string geometry_mismatch(const FileHeader& fh, const SlabGeometry& geo) {
  const auto describe = [](uint64_t kind, uint64_t page, uint64_t slot, uint64_t count) {
    return "kind " + std::to_string(kind) +
           (page != 0 ? ", page_bytes " + std::to_string(page) : std::string()) + ", slot_bytes " +
           std::to_string(slot) + ", " + std::to_string(count) + " slots";
  };
  const bool page_differs = fh.page_bytes != 0 && geo.page_bytes != 0 &&
                            fh.page_bytes != geo.page_bytes;
  if (fh.kind == geo.kind && fh.slot_bytes == geo.slot_bytes && fh.slot_count == geo.slot_count &&
      !page_differs) {
    if (fh.store_tag == geo.store_tag) return {};
    return "it belongs to another store (store tag " + std::to_string(fh.store_tag) +
           " on disk, " + std::to_string(geo.store_tag) + " for this store's name)";
  }
  const uint64_t page = fh.page_bytes != 0 ? geo.page_bytes : 0;  // compare like with like
  return "on disk " + describe(fh.kind, fh.page_bytes, fh.slot_bytes, fh.slot_count) +
         ", requested " + describe(geo.kind, page, geo.slot_bytes, geo.slot_count);
}

std::optional<FileHeader> read_slab_header(const std::string& path) noexcept {
  try {
    const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) return std::nullopt;
    file_io::Fd owned(fd);
    struct stat st{};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) return std::nullopt;
    FileHeader fh{};
    if (file_io::pread_full(fd, &fh, sizeof fh, 0, path) != sizeof fh) return std::nullopt;
    if (fh.magic != kFileMagic || fh.version != kFormatVersion || fh.slab_id == 0 ||
        fh.header_crc != crc32c(&fh, offsetof(FileHeader, header_crc)))
      return std::nullopt;
    return fh;
  } catch (...) {
    return std::nullopt;
  }
}

void SlabFile::format() {
  check_writable();
  AlignedBuffer hb(kFileHeaderBytes);
  FileHeader fh{};
  fh.magic = kFileMagic;
  fh.version = kFormatVersion;
  fh.kind = geo_.kind;
  fh.slot_bytes = geo_.slot_bytes;
  fh.slot_count = geo_.slot_count;
  fh.store_tag = geo_.store_tag;
  fh.slab_id = slab_id_;
  fh.page_bytes = static_cast<uint32_t>(geo_.page_bytes);
  fh.created_ns = static_cast<uint64_t>(
      std::chrono::system_clock::now().time_since_epoch() / std::chrono::nanoseconds(1));
  fh.header_crc = crc32c(&fh, offsetof(FileHeader, header_crc));
  std::memcpy(hb.data(), &fh, sizeof fh);
  write_at(hb.data(), kFileHeaderBytes, 0);
  sync();
  formatted_ = true;
}

void SlabFile::sync() {
  check_writable();
  if (map_) return;  // H3: in shared memory once copied; no drive behind it
  VITRIFY_SYSCALL(::fdatasync(fd_.get()), path_);
}

void SlabFile::mark_used() noexcept {
  if (fd_) (void)::futimens(fd_.get(), nullptr);
}

size_t SlabFile::read_at(void* buf, size_t n, uint64_t off) const {
  if (!map_) return file_io::pread_full(fd_.get(), buf, n, off, path_);
  if (off >= map_.size()) return 0;
  const size_t got = std::min<uint64_t>(n, map_.size() - off);
  std::memcpy(buf, map_.data() + off, got);
  return got;
}

void SlabFile::write_at(const void* buf, size_t n, uint64_t off) {
  if (!map_) return file_io::pwrite_full(fd_.get(), buf, n, off, path_);
  if (off > map_.size() || n > map_.size() - off)
    vitrify::detail::throw_errno(ENOSPC, "memcpy", path_,
                                 std::to_string(n) + " bytes at " + std::to_string(off) +
                                     " past the mapping of " + std::to_string(map_.size()));
  std::memcpy(map_.data() + off, buf, n);
}

SlotHeader SlabFile::slot_header(uint64_t slot, const Key& key, const uint8_t* buf,
                                 size_t payload_len, uint32_t seq, uint8_t flags) const {
  check_writable();
  VITRIFY_EXPECT((flags & ~kKnownSlotFlags) == 0,
                 "slot flags " + std::to_string(flags) + " are not known flags");
  VITRIFY_EXPECT(slot < geo_.slot_count, "slot " + std::to_string(slot) + " out of range [0, " +
                                          std::to_string(geo_.slot_count) + ") in " + path_);
  VITRIFY_EXPECT(payload_len <= geo_.slot_bytes - kSlotHeaderBytes,
              "payload of " + std::to_string(payload_len) + " bytes does not fit a slot of " +
                  std::to_string(geo_.slot_bytes) + " bytes (max " +
                  std::to_string(geo_.slot_bytes - kSlotHeaderBytes) + ")");
  VITRIFY_EXPECT(is_aligned(reinterpret_cast<uintptr_t>(buf), kBlock),
              "slot buffer must be 4096-byte aligned");
  SlotHeader h{};
  h.magic = kSlotMagic;
  h.version = kFormatVersion;
  h.flags = flags;
  h.kind = geo_.kind;
  h.slot = static_cast<uint32_t>(slot);
  h.payload_len = static_cast<uint32_t>(payload_len);
  h.slab_id = slab_id_;
  h.seq = seq;
  std::memcpy(h.key, key.data(), kKeyBytes);
  return h;
}

void SlabFile::write_aligned(uint64_t slot, const Key& key, uint8_t* buf, size_t payload_len,
                             uint32_t seq, uint8_t flags) {
  if (!map_) {  // a disk slab: the slot image in buf, then one write
    const size_t n = prepare_write(slot, key, buf, payload_len, seq, flags);
    file_io::pwrite_full(fd_.get(), buf, n, slot_offset(slot), path_);
    return;
  }
  SlotHeader h = slot_header(slot, key, buf, payload_len, seq, flags);
  const size_t n = round_up(kSlotHeaderBytes + payload_len, kBlock);
  // H4 commit order: the old header goes first, then the payload, then the new header, so a
  // header that verifies was written after its payload (a copy cut short by SIGKILL leaves a
  // slot whose header does not verify, or whose payload CRC does not match: a miss). The
  // payload's CRC is taken on the copy into the mapping (one pass over the slot buffer).
  uint8_t* at = map_.data() + slot_offset(slot);
  VITRIFY_EXPECT(slot_offset(slot) + n <= map_.size(), "slot past the mapping of " + path_);
  std::memset(at, 0, kSlotHeaderBytes);
  // The payload goes out with non-temporal stores, which x86 may make visible before the
  // ordinary stores above: a store fence, not only a compiler barrier, keeps the zeroed
  // header first (crc32c_copy fences its streaming stores before the header below).
  store_fence();
  h.payload_crc = crc32c_copy(at + kSlotHeaderBytes, buf + kSlotHeaderBytes, payload_len, 0,
                              /*streaming=*/true);
  std::memset(at + kSlotHeaderBytes + payload_len, 0, n - kSlotHeaderBytes - payload_len);
  h.header_crc = crc32c(&h, offsetof(SlotHeader, header_crc));
  std::atomic_thread_fence(std::memory_order_release);
  std::memcpy(at, &h, sizeof h);
}

// The disk slot image in `buf`: header (with both CRCs) in place, pad zeroed. Every engine
// writes exactly these bytes (D25).
void SlabFile::fill_slot(SlotHeader& h, uint8_t* buf, size_t payload_len, size_t n) noexcept {
  h.payload_crc = crc32c(buf + kSlotHeaderBytes, payload_len);
  h.header_crc = crc32c(&h, offsetof(SlotHeader, header_crc));
  std::memcpy(buf, &h, sizeof h);
  std::memset(buf + kSlotHeaderBytes + payload_len, 0, n - kSlotHeaderBytes - payload_len);
}

size_t SlabFile::prepare_write(uint64_t slot, const Key& key, uint8_t* buf, size_t payload_len,
                               uint32_t seq, uint8_t flags) {
  check_writable();
  VITRIFY_EXPECT(!map_, "prepare_write is for disk slabs; a host slab's slots are copied (" +
                            path_ + ")");
  SlotHeader h = slot_header(slot, key, buf, payload_len, seq, flags);
  const size_t n = round_up(kSlotHeaderBytes + payload_len, kBlock);
  fill_slot(h, buf, payload_len, n);
  return n;
}

bool SlabFile::set_slot_flags(uint64_t slot, const Key& key, uint8_t flags) {
  check_writable();
  VITRIFY_EXPECT(map_, "slot flags are rewritten in place only in a host slab (mapped), not in " +
                           path_);
  VITRIFY_EXPECT((flags & ~kKnownSlotFlags) == 0,
                 "slot flags " + std::to_string(flags) + " are not known flags");
  VITRIFY_EXPECT(slot < geo_.slot_count, "slot " + std::to_string(slot) + " out of range");
  uint8_t* at = map_.data() + slot_offset(slot);
  SlotHeader h;
  std::memcpy(&h, at, sizeof h);
  if (!verify_header(h, slot) || std::memcmp(h.key, key.data(), kKeyBytes) != 0) return false;
  if (h.flags == flags) return true;
  h.flags = flags;
  h.header_crc = crc32c(&h, offsetof(SlotHeader, header_crc));
  std::atomic_thread_fence(std::memory_order_release);
  std::memcpy(at, &h, sizeof h);
  return true;
}

void SlabFile::invalidate(uint64_t slot) {
  check_writable();
  VITRIFY_EXPECT(slot < geo_.slot_count, "slot " + std::to_string(slot) + " out of range");
  AlignedBuffer zero(kBlock);
  write_at(zero.data(), kBlock, slot_offset(slot));
}

bool SlabFile::verify_header(const SlotHeader& h, uint64_t slot) const noexcept {
  return h.magic == kSlotMagic && h.version == kFormatVersion &&
         (h.flags & ~kKnownSlotFlags) == 0 &&
         h.header_crc == crc32c(&h, offsetof(SlotHeader, header_crc)) && h.kind == geo_.kind &&
         h.slot == slot && h.slab_id == slab_id_ &&
         h.payload_len <= geo_.slot_bytes - kSlotHeaderBytes;
}

std::optional<size_t> SlabFile::read_length(uint64_t slot, const uint8_t* buf, size_t buf_bytes,
                                            size_t expected_len) const noexcept {
  if (slot >= geo_.slot_count || buf == nullptr) return std::nullopt;
  if (direct_ && !is_aligned(reinterpret_cast<uintptr_t>(buf), kBlock)) return std::nullopt;
  size_t n = geo_.slot_bytes;
  if (expected_len != SIZE_MAX) {
    if (expected_len > geo_.slot_bytes - kSlotHeaderBytes) return std::nullopt;
    n = round_up(kSlotHeaderBytes + expected_len, kBlock);
  }
  if (buf_bytes < n) return std::nullopt;
  return n;
}

ssize_t SlabFile::read_raw(uint64_t slot, uint8_t* buf, size_t buf_bytes,
                           size_t expected_len) const noexcept {
  const std::optional<size_t> n = read_length(slot, buf, buf_bytes, expected_len);
  if (!n) return -1;
  try {
    return static_cast<ssize_t>(read_at(buf, *n, slot_offset(slot)));
  } catch (...) {  // an I/O error reads as a miss
    return -1;
  }
}

std::optional<SlabFile::MappedSlot> SlabFile::mapped_slot(uint64_t slot, const Key& key,
                                                          size_t expected_len) const noexcept {
  if (!map_ || slot >= geo_.slot_count) return std::nullopt;
  const uint64_t off = slot_offset(slot);
  if (off + geo_.slot_bytes > map_.size()) return std::nullopt;
  MappedSlot m{};
  std::memcpy(&m.header, map_.data() + off, sizeof m.header);
  // H4's reader side: the header is read before the payload (and again after it, by the caller).
  std::atomic_thread_fence(std::memory_order_acquire);
  if (!verify_header(m.header, slot) || std::memcmp(m.header.key, key.data(), kKeyBytes) != 0)
    return std::nullopt;
  if (expected_len != SIZE_MAX && m.header.payload_len != expected_len) return std::nullopt;
  m.payload = map_.data() + off + kSlotHeaderBytes;
  return m;
}

std::optional<size_t> SlabFile::verify_read(uint64_t slot, const Key& key, const uint8_t* buf,
                                            ssize_t got, size_t expected_len) const noexcept {
  if (buf == nullptr || got < static_cast<ssize_t>(kSlotHeaderBytes)) return std::nullopt;
  SlotHeader h;
  std::memcpy(&h, buf, sizeof h);
  if (!verify_header(h, slot) || std::memcmp(h.key, key.data(), kKeyBytes) != 0)
    return std::nullopt;
  if (expected_len != SIZE_MAX && h.payload_len != expected_len) return std::nullopt;
  if (kSlotHeaderBytes + h.payload_len > static_cast<size_t>(got)) return std::nullopt;
  if (crc32c(buf + kSlotHeaderBytes, h.payload_len) != h.payload_crc) return std::nullopt;
  return h.payload_len;
}

std::optional<size_t> SlabFile::read_into(uint64_t slot, const Key& key, uint8_t* buf,
                                          size_t buf_bytes, size_t expected_len) const noexcept {
  return verify_read(slot, key, buf, read_raw(slot, buf, buf_bytes, expected_len), expected_len);
}

std::vector<ScannedSlot> SlabFile::scan_range(uint64_t first, uint64_t last) const {
  std::vector<ScannedSlot> out;
  // Small slots: one read covers the headers of several adjacent slots (the bytes between
  // headers come along); large slots: one 4 KiB read per header.
  const uint64_t per_read =
      geo_.slot_bytes <= kScanBatchBytes / 2 ? kScanBatchBytes / geo_.slot_bytes : 1;
  AlignedBuffer b(per_read == 1 ? kBlock : per_read * geo_.slot_bytes, kBlock);
  for (uint64_t s0 = first; s0 < last; s0 += per_read) {
    const uint64_t n = std::min(per_read, last - s0);
    const size_t bytes = n == 1 ? kBlock : static_cast<size_t>(n * geo_.slot_bytes);
    const size_t r = read_at(b.data(), bytes, slot_offset(s0));
    for (uint64_t i = 0; i < n; ++i) {
      const uint64_t at = i * geo_.slot_bytes;
      if (r < at + kSlotHeaderBytes) break;  // truncated file
      SlotHeader h;
      std::memcpy(&h, b.data() + at, sizeof h);
      if (!verify_header(h, s0 + i)) continue;
      ScannedSlot ss{s0 + i, {}, h.payload_len, h.seq, (h.flags & kSlotDirty) != 0};
      std::memcpy(ss.key.data(), h.key, kKeyBytes);
      out.push_back(ss);
    }
  }
  return out;
}

std::vector<ScannedSlot> SlabFile::scan(unsigned threads) const {
  VITRIFY_EXPECT(threads >= 1, "scan needs at least one thread");
  // Contiguous ranges of at least kScanMinSlotsPerThread slots, one per worker; the results
  // are concatenated in range order, so the output is the serial scan's, slot by slot.
  const uint64_t count = geo_.slot_count;
  const uint64_t workers =
      std::max<uint64_t>(1, std::min<uint64_t>(threads, count / kScanMinSlotsPerThread));
  if (workers == 1) return scan_range(0, count);
  std::vector<std::vector<ScannedSlot>> parts(workers);
  std::vector<std::exception_ptr> errors(workers);
  std::vector<std::thread> pool;
  pool.reserve(workers);
  const auto bounds = [&](uint64_t w) { return count * w / workers; };
  try {
    for (uint64_t w = 0; w < workers; ++w)
      pool.emplace_back([&, w] {
        try {
          parts[w] = scan_range(bounds(w), bounds(w + 1));
        } catch (...) {
          errors[w] = std::current_exception();
        }
      });
  } catch (...) {  // could not start a thread: finish with the ones that run, then report
    for (auto& t : pool) t.join();
    throw;
  }
  for (auto& t : pool) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
  std::vector<ScannedSlot> out;
  size_t total = 0;
  for (auto& p : parts) total += p.size();
  out.reserve(total);
  for (auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

void SlabFile::reformat() {
  check_writable();
  slab_id_ = slab_id_ + 1 == 0 ? 1 : slab_id_ + 1;
  format();
}

}  // namespace vitrify::disk
