// The O_DIRECT disk tier: slab files of fixed-size slots (slab.cpp), the pure per-kind
// SlotIndex (index, slot pool, GC order: index.cpp), and the Store (background I/O threads,
// store.cpp) built on them. Format and invariants: csrc/src/disk/DESIGN.md.
//
//   slab file : 4 KiB file header, then slot i at 4096 + i * slot_bytes (slot_bytes % 4096 == 0)
//   slot      : 64-byte SlotHeader, payload, zero pad to the next 4 KiB
//
// Verify-on-read: a slot that is absent, torn, from another slab, for another key or slot, or
// whose CRC does not match reads as a miss — never an exception, never wrong bytes.
#pragma once

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "vitrify/aligned.hpp"
#include "vitrify/file_io.hpp"
#include "vitrify/host.hpp"

namespace vitrify::disk {

constexpr size_t kBlock = 4096;            // O_DIRECT transfer granule and slot alignment
constexpr size_t kFileHeaderBytes = 4096;  // slot 0 starts here
constexpr size_t kSlotHeaderBytes = 64;    // the payload starts here inside a slot buffer
constexpr size_t kKeyBytes = 32;
constexpr uint32_t kSlotMagic = 0x4C535456;  // "VTSL" little-endian
constexpr uint32_t kFileMagic = 0x46535456;  // "VTSF"
constexpr uint16_t kFormatVersion = 1;
// Slot header flags (byte 5; zero in every slot written before flags existed, whose u16
// version field read 1 there). kSlotDirty: a host-tier page put in write-back mode that the
// disk behind it has not acknowledged yet (D24); GC never evicts it.
constexpr uint8_t kSlotDirty = 0x01;
constexpr uint8_t kKnownSlotFlags = kSlotDirty;
constexpr uint64_t kMaxSlotsPerSlab = 0xFFFFFFFFull;  // a slot header's index is 32-bit

using Key = std::array<uint8_t, kKeyBytes>;

struct KeyHash {
  size_t operator()(const Key& k) const noexcept;
};

// The 64-byte header at the start of every slot (little-endian, packed; see DESIGN.md).
struct SlotHeader {
  uint32_t magic;        //  0  kSlotMagic
  uint8_t version;       //  4  kFormatVersion
  uint8_t flags;         //  5  kSlotDirty (host tier); other bits must be 0
  uint16_t kind;         //  6  payload kind of the slab
  uint32_t slot;         //  8  this slot's index in its slab
  uint32_t payload_len;  // 12  payload bytes following the header
  uint32_t slab_id;      // 16  id of the slab (file) generation that wrote the slot
  uint32_t seq;          // 20  store-wide write sequence (GC order on `load`)
  uint8_t key[kKeyBytes];  // 24  content key
  uint32_t payload_crc;  // 56  CRC32C of the payload bytes
  uint32_t header_crc;   // 60  CRC32C of bytes [0, 60)
};
static_assert(sizeof(SlotHeader) == kSlotHeaderBytes, "slot header must be 64 bytes");

// The first bytes of the 4 KiB file header (the rest is zero).
struct FileHeader {
  uint32_t magic;        //  0  kFileMagic
  uint16_t version;      //  4  kFormatVersion
  uint16_t kind;         //  6  payload kind
  uint64_t slot_bytes;   //  8
  uint64_t slot_count;   // 16
  uint64_t store_tag;    // 24  hash of the store name: a slab of another store never matches
  uint32_t slab_id;      // 32  changes on every format (clear); slot headers must carry it
  uint32_t page_bytes;   // 36  the kind's page size when formatted (0: not recorded, older slabs)
  uint64_t created_ns;   // 40  CLOCK_REALTIME at format
  uint32_t pad;          // 48  zero
  uint32_t header_crc;   // 52  CRC32C of bytes [0, 52)
};
static_assert(sizeof(FileHeader) == 56, "file header layout");

enum class ColdStart { kClear, kLoad };

// "clear" | "load"; anything else is std::invalid_argument naming it.
ColdStart parse_cold_start(const std::string& text);

// How a disk store's I/O threads move slot bytes (DESIGN.md "I/O engines", D25). kAuto: the
// first of io_uring, Linux native AIO and psync that the kernel grants when the store opens
// (probed, never assumed); kIoUring / kAio: that engine or a std::system_error naming it and
// the errno the kernel answered; kPsync: one synchronous pread/pwrite per slot per thread.
enum class IoEngine { kAuto, kIoUring, kAio, kPsync };
// "auto" | "io_uring" | "aio" | "psync" (any letter case); anything else is
// std::invalid_argument naming it.
IoEngine parse_io_engine(const std::string& text);
// The name parse_io_engine accepts for `engine`.
const char* io_engine_name(IoEngine engine) noexcept;
// The test hook of D25 (DESIGN.md): the engines named in `list` (comma-separated) refuse as a
// seccomp filter would (EPERM), before any system call; "" denies none. Process-wide. The core
// reads no environment variable: Python hands it VITRIFY_DISK_ENGINE_DENY (vitrify.config)
// each time a DiskStore opens.
void set_denied_engines(const std::string& list);
namespace detail {
class IoEngineImpl;  // csrc/src/disk/detail/io_engine.hpp
}

// 64-bit tag of a store name (FNV-1a), stored in every file header of that store.
uint64_t store_tag(const std::string& name) noexcept;

// Smallest slot that holds a header plus `payload_bytes`, rounded up to 4 KiB.
constexpr uint64_t slot_bytes_for(uint64_t payload_bytes) noexcept {
  return round_up(kSlotHeaderBytes + payload_bytes, kBlock);
}

struct SlabGeometry {
  uint16_t kind = 0;
  uint64_t slot_bytes = 0;  // multiple of 4096, > 64, < 4 GiB
  uint64_t slot_count = 0;  // >= 1
  uint64_t store_tag = 0;
  uint64_t page_bytes = 0;  // the kind's page size (recorded in the file header; 0: unchecked)
};
// Why the verified file header `fh` does not describe `geo` ("" when it does), naming both the
// on-disk and the requested values; a header that records no page size (0) matches any.
std::string geometry_mismatch(const FileHeader& fh, const SlabGeometry& geo);

// A slot as found by a header-only scan (cold start `load`).
struct ScannedSlot {
  uint64_t slot;
  Key key;
  uint32_t payload_len;
  uint32_t seq;
  bool dirty = false;  // the header carries kSlotDirty
};

// ---------------------------------------------------------------------------------------------
// The owner lock of a slab file (lock.cpp, DESIGN.md D13)
// ---------------------------------------------------------------------------------------------

// How a slab file is locked. kAuto: an OFD lock (fcntl F_OFD_SETLK, write lock on the whole
// file), or flock(LOCK_EX | LOCK_NB) where the kernel refuses OFD locks with EINVAL. kFlock:
// always flock (for tests of the fallback; it does not conflict with an OFD lock, so every
// opener of one directory must use the same method).
enum class SlabLocking { kAuto, kFlock };
enum class LockMethod { kNone, kOfd, kFlock };

// "auto" | "flock"; anything else is std::invalid_argument naming it.
SlabLocking parse_slab_locking(const std::string& text);

// The slab file is locked by another open store, in this process or another one. An OSError
// (errno EBUSY) whose one-line message names the slab file and the holder from its owner record
// (`<slab>.owner`): process id, host and since when, or "an unknown holder" without a record.
class SlabBusy : public std::system_error {
 public:
  SlabBusy(std::string path, int holder_pid, std::string holder_host, std::string message);
  const char* what() const noexcept override { return message_.c_str(); }
  const std::string& path() const noexcept { return path_; }
  int holder_pid() const noexcept { return holder_pid_; }  // -1: unknown
  const std::string& holder_host() const noexcept { return holder_host_; }  // "": unknown

 private:
  std::string path_;
  int holder_pid_;
  std::string holder_host_;
  std::string message_;
};

// The holder of a slab lock as its owner record names it.
struct SlabOwner {
  int pid = -1;          // -1: no (readable) record
  std::string host;      // gethostname(2) of the holder
  std::string since;     // when it took the lock, UTC, ISO 8601
};
// The owner record of the slab file `slab_path` ("<slab_path>.owner"), or pid -1 when it is
// missing or unreadable. Never throws.
SlabOwner read_slab_owner(const std::string& slab_path) noexcept;
// The path of the owner record of `slab_path`.
inline std::string slab_owner_path(const std::string& slab_path) { return slab_path + ".owner"; }

// Owns the exclusive lock on an open slab file descriptor (not the descriptor: the caller keeps
// the descriptor open, in an Fd declared before this object, for as long as the lock lives).
// Taking it writes the owner record; releasing it removes the record, then unlocks. Move-only;
// the destructor releases and never throws. Closing the descriptor (or the holder's death, even
// by SIGKILL) drops the lock in the kernel; a stale owner record is simply overwritten.
class SlabLock {
 public:
  SlabLock() noexcept = default;
  // Locks `fd` (open read-write on `path`) without waiting. Throws SlabBusy when another open
  // file description holds it, std::system_error (OSError naming the call, the path and errno)
  // on any other failure of fcntl, flock or writing the owner record (nothing stays locked).
  SlabLock(int fd, const std::string& path, SlabLocking locking);
  ~SlabLock() { release(); }
  SlabLock(SlabLock&& other) noexcept;
  SlabLock& operator=(SlabLock&& other) noexcept;
  SlabLock(const SlabLock&) = delete;
  SlabLock& operator=(const SlabLock&) = delete;

  // Removes the owner record, then unlocks (errors are logged). Idempotent.
  void release() noexcept;
  bool held() const noexcept { return method_ != LockMethod::kNone; }
  LockMethod method() const noexcept { return method_; }

 private:
  int fd_ = -1;
  LockMethod method_ = LockMethod::kNone;
  std::string path_;
};

// A slab file opened by file_io::open_file and locked, before anything in it is read or
// written. `file` is declared before `lock`, so the lock is released before the fd closes.
struct LockedSlab {
  std::string path;
  file_io::OpenedFile file;
  SlabLock lock;
  bool created = false;  // this open created the file (a failed store open removes it)
  dev_t dev = 0;         // the file's identity when opened: removed only if the path still
  ino_t ino = 0;         // names it
  uint64_t size = 0;     // its size when opened (a failed open restores a grown file's size)
};
// Opens (creating it empty if missing) and locks `path`; throws as SlabLock does, or as
// file_io::open_regular_file when the open fails (a link or any non-regular file at `path` is
// refused naming it, before anything is written). `host` (a host-tier slab, DESIGN.md H2): the file is
// created 0600 and buffered; one of another user is refused (std::system_error EACCES naming
// the file and both uids) before it is locked, and an own file with wider permissions is
// chmod-ed to 0600.
LockedSlab lock_slab(const std::string& path, file_io::DirectIo dio, SlabLocking locking,
                     bool host = false);
// Whether another open file description holds an OFD lock on `path` (fcntl F_OFD_GETLK; a
// flock, the fallback of D13, is not seen). False when the file cannot be opened. Never throws.
bool slab_lock_held(const std::string& path) noexcept;
// The verified file header of the slab file `path` (any kind, geometry or store), or nullopt
// when it is missing, unreadable, too short or its header does not verify. Never throws.
std::optional<FileHeader> read_slab_header(const std::string& path) noexcept;

// Host slabs (H2): std::system_error EACCES naming `path` and both uids when the open file `fd`
// belongs to another user; with `fix_mode`, an own file readable by others is chmod-ed 0600.
void check_host_owner(int fd, const std::string& path, bool fix_mode);

// ---------------------------------------------------------------------------------------------
// Host tier: slabs in shared memory (tmpfs, hugetlbfs), mapped (DESIGN.md, Host tier)
// ---------------------------------------------------------------------------------------------

// Owns one mmap(2) of a slab file (MAP_SHARED): munmap exactly once, never throws. Move-only.
class SlabMapping {
 public:
  SlabMapping() noexcept = default;
  // Maps [0, bytes) of `fd` read-write or read-only; std::system_error naming mmap and `path`.
  SlabMapping(int fd, size_t bytes, bool writable, const std::string& path);
  ~SlabMapping() { reset(); }
  SlabMapping(SlabMapping&& o) noexcept : p_(o.p_), n_(o.n_) { o.p_ = nullptr; o.n_ = 0; }
  SlabMapping& operator=(SlabMapping&& o) noexcept;
  SlabMapping(const SlabMapping&) = delete;
  SlabMapping& operator=(const SlabMapping&) = delete;
  void reset() noexcept;
  uint8_t* data() const noexcept { return p_; }
  size_t size() const noexcept { return n_; }
  explicit operator bool() const noexcept { return p_ != nullptr; }

 private:
  uint8_t* p_ = nullptr;
  size_t n_ = 0;
};

// The filesystem of a host-tier directory.
struct HostFs {
  std::string mount;        // mount point (the topmost ancestor on the same device)
  std::string type;         // "tmpfs" or "hugetlbfs"
  uint64_t block_size = 0;  // file sizes are rounded to it (the huge page size on hugetlbfs)
  uint64_t free_bytes = 0;  // what a new slab may still take there
};
// statfs of `dir`; std::invalid_argument (ValueError) naming the directory and its filesystem
// when it is not in memory (tmpfs or hugetlbfs), std::system_error when statfs fails.
HostFs host_fs(const std::string& dir);
// The host tier's directory has too little free memory for its slabs (H5): a std::system_error
// ENOSPC (Python vitrify.disk.HostSpaceError, an OSError) that also carries the mount, the bytes
// needed and the bytes free, so a caller can run without the host tier or with a smaller one.
class HostSpaceShort : public std::system_error {
 public:
  HostSpaceShort(std::string mount, uint64_t needed, uint64_t free_bytes, const std::string& message)
      : std::system_error(ENOSPC, std::generic_category(), message),
        mount_(std::move(mount)), needed_(needed), free_(free_bytes), message_(message) {}
  const char* what() const noexcept override { return message_.c_str(); }
  const std::string& mount() const noexcept { return mount_; }
  uint64_t needed() const noexcept { return needed_; }
  uint64_t free_bytes() const noexcept { return free_; }

 private:
  std::string mount_;
  uint64_t needed_, free_;
  std::string message_;
};
// Throws HostSpaceShort (ENOSPC), one line naming the mount, its filesystem, the bytes needed
// and the bytes free, when `needed` > fs.free_bytes.
void check_host_space(const HostFs& fs, const std::string& what, uint64_t needed);

// One preallocated slab file. Thread-safe for concurrent slot I/O on distinct or equal slots
// (pread/pwrite on one fd); open/format are not concurrent with I/O.
class SlabFile {
 public:
  // Opens or creates `path`, preallocates it (posix_fallocate) and, with kClear — or with kLoad
  // when the file is new or its header does not verify — formats it (new file header with a new
  // slab id, so every old slot becomes inert). `formatted()` says which happened. kLoad of a slab
  // whose verified header describes another geometry or store (kind, page size, slot size, slot
  // count, store tag) is std::invalid_argument naming the on-disk and the requested values,
  // before anything in the file changed (D7): only kClear ever wipes stored pages. Opened by file_io::open_file (`dio`: O_DIRECT or buffered). Throws
  // std::system_error (OSError) on I/O errors, and for DirectIo::kOn where O_DIRECT is refused.
  // The file is locked for this SlabFile (lock_slab, D13) before anything in it is read or
  // written, until release_lock() or destruction; SlabBusy when another open store holds it.
  SlabFile(const std::string& path, const SlabGeometry& geometry, ColdStart mode,
           file_io::DirectIo dio, SlabLocking locking = SlabLocking::kAuto);
  // The same with a file already opened and locked by lock_slab. `host`: a host-tier slab
  // (lock_slab(..., host = true)) on tmpfs or hugetlbfs: sized to a multiple of the filesystem's
  // block, never shrunk (a larger file is std::invalid_argument: readers may have it mapped),
  // mapped MAP_SHARED, and every slot transfer is a memcpy (DESIGN.md H1-H4).
  SlabFile(LockedSlab locked, const SlabGeometry& geometry, ColdStart mode, bool host = false);
  // Opens an existing slab O_RDONLY for a read-only store (D14): takes no lock, never creates,
  // truncates, preallocates or formats it. O_DIRECT as `dio` says (kAuto falls back to buffered
  // when open refuses it; no probe file is created). Throws std::system_error (OSError, e.g.
  // ENOENT) when the file cannot be opened, std::invalid_argument (ValueError) when it is
  // shorter than `geometry`, has no valid file header or belongs to another store or geometry.
  // `host`: a host-tier slab, mapped PROT_READ; a file of another user is refused (EACCES).
  static std::unique_ptr<SlabFile> open_read_only(const std::string& path,
                                                  const SlabGeometry& geometry,
                                                  file_io::DirectIo dio, bool host = false);
  ~SlabFile();
  SlabFile(const SlabFile&) = delete;
  SlabFile& operator=(const SlabFile&) = delete;

  // Writes one slot with a single transfer of round_up(64 + payload_len, 4096) bytes from `buf`
  // (4 KiB-aligned, at least that many bytes; the payload already at buf + 64). Fills the
  // header in place and zeroes the pad; no copy. A host slab instead copies the payload into
  // its mapping, checksumming it on the way, and writes header and pad there (H4); `buf` is
  // only read. Does not sync: call sync() before publishing.
  // Throws std::system_error on an I/O error, std::invalid_argument on bad arguments.
  void write_aligned(uint64_t slot, const Key& key, uint8_t* buf, size_t payload_len,
                     uint32_t seq, uint8_t flags = 0);
  // Host slabs (D24): rewrites the mapped header of `slot` with `flags` (and its CRC), when it
  // verifies for `key`; false otherwise (nothing written). A reader copying the slot meanwhile
  // sees the header change and misses (D21); a SIGKILL mid-write leaves a header that does not
  // verify (a miss). std::invalid_argument on a disk slab, EROFS on a read-only one.
  bool set_slot_flags(uint64_t slot, const Key& key, uint8_t flags);

  // write_aligned's preparation alone, for an engine that transfers the slot itself (D25): the
  // same checks, then the header filled in place and the pad zeroed; returns the bytes to
  // write from `buf` at slot_offset(slot). Disk slabs only (std::invalid_argument on a host
  // slab). Throws as write_aligned does.
  size_t prepare_write(uint64_t slot, const Key& key, uint8_t* buf, size_t payload_len,
                       uint32_t seq, uint8_t flags = 0);
  // The bytes read_raw would transfer for these arguments, or nullopt when read_raw would
  // refuse them (-1). Never throws.
  std::optional<size_t> read_length(uint64_t slot, const uint8_t* buf, size_t buf_bytes,
                                    size_t expected_len = SIZE_MAX) const noexcept;
  // The slab's descriptor, for an engine's transfers (D25); owned by this SlabFile.
  int fd() const noexcept { return fd_.get(); }

  // Reads slot `slot` with one transfer into `buf` (4 KiB-aligned, `buf_bytes` long) and
  // verifies it against `key`. `expected_len` (or SIZE_MAX: unknown, read the whole slot)
  // bounds the transfer. Returns the payload length (payload at buf + 64), or nullopt on any
  // mismatch or I/O error. Never throws.
  std::optional<size_t> read_into(uint64_t slot, const Key& key, uint8_t* buf, size_t buf_bytes,
                                  size_t expected_len = SIZE_MAX) const noexcept;
  // read_into in two steps (to verify on another thread): read_raw transfers what read_into
  // would and returns the bytes read, or -1 on an error or a bad argument; verify_read then
  // checks the buffer exactly as read_into does. Never throw.
  ssize_t read_raw(uint64_t slot, uint8_t* buf, size_t buf_bytes,
                   size_t expected_len = SIZE_MAX) const noexcept;
  std::optional<size_t> verify_read(uint64_t slot, const Key& key, const uint8_t* buf, ssize_t got,
                                    size_t expected_len = SIZE_MAX) const noexcept;

  // Header-only scan of every slot; returns the slots whose header verifies for this slab, in
  // slot order. Payload CRCs are checked later, on read. Large slots cost one 4 KiB read each;
  // slots of at most kScanBatchBytes / 2 are read kScanBatchBytes at a time (many headers per
  // read). `threads` workers scan contiguous slot ranges in parallel (fewer when the slab has
  // under kScanMinSlotsPerThread slots per worker); the result does not depend on `threads`.
  // Throws std::system_error on an I/O error, std::invalid_argument for threads == 0.
  std::vector<ScannedSlot> scan(unsigned threads = 1) const;
  static constexpr uint64_t kScanBatchBytes = 256 * 1024;
  static constexpr uint64_t kScanMinSlotsPerThread = 256;

  // Formats the slab again exactly as cold start `clear` does: the file header gets
  // slab_id + 1, so every slot written so far stops verifying. Not concurrent with slot I/O.
  // Throws std::system_error on an I/O error.
  void reformat();

  // Read-only slabs (D14): reads the file header again and adopts its slab id (a writer's
  // clear() or reopen changes it). Returns "" when it verifies and matches this geometry,
  // otherwise why not; then the slab id becomes 0, so no slot verifies until a later reload.
  // Not concurrent with slot I/O. Never throws.
  std::string reload_header() noexcept;
  bool read_only() const noexcept { return read_only_; }

  // Overwrites the slot's first 4 KiB with zeros so its header never verifies again.
  // Throws std::system_error on an I/O error.
  void invalidate(uint64_t slot);

  // fdatasync(2): everything written so far is durable. A host slab: nothing to do (the bytes
  // are in shared memory once copied; H3).
  void sync();
  // Host slabs: sets the file's mtime to now (`vitrify tier ls` shows it as the last use).
  // Never throws.
  void mark_used() noexcept;
  bool host() const noexcept { return static_cast<bool>(map_); }
  const SlabMapping& mapping() const noexcept { return map_; }
  // Host slabs: the slot header of `slot` as the mapping holds it now, when it verifies for
  // this slab, `key` and `expected_len` (SIZE_MAX: any length), and where its payload lies in
  // the mapping; nullopt otherwise, and always on a disk slab. The payload's CRC is the
  // caller's to check on the bytes it copies (Store::read_mapped). Never throws.
  struct MappedSlot {
    SlotHeader header;
    const uint8_t* payload;
  };
  std::optional<MappedSlot> mapped_slot(uint64_t slot, const Key& key,
                                        size_t expected_len = SIZE_MAX) const noexcept;

  // Gives up the owner lock (removes the owner record, then unlocks); the fd stays open but
  // no more slot I/O may follow. Store::close() calls it last. Never throws.
  void release_lock() noexcept { lock_.release(); }
  bool locked() const noexcept { return lock_.held(); }
  LockMethod lock_method() const noexcept { return lock_.method(); }

  const SlabGeometry& geometry() const noexcept { return geo_; }
  const std::string& path() const noexcept { return path_; }
  bool direct() const noexcept { return direct_; }
  bool formatted() const noexcept { return formatted_; }
  uint32_t slab_id() const noexcept { return slab_id_; }
  uint64_t slot_offset(uint64_t slot) const noexcept { return kFileHeaderBytes + slot * geo_.slot_bytes; }
  // Why O_DIRECT is off ("" when on).
  const std::string& buffered_reason() const noexcept { return buffered_reason_; }

 private:
  SlabFile() = default;  // open_read_only
  static void check_geometry(const SlabGeometry& geo);
  void check_writable() const;
  bool verify_header(const SlotHeader& h, uint64_t slot) const noexcept;
  std::vector<ScannedSlot> scan_range(uint64_t first, uint64_t last) const;
  void format();
  // The slab's bytes [off, off + n): pread/pwrite, or a memcpy on a host slab's mapping.
  // read_at returns the bytes read (fewer only past the end); both throw as pread_full and
  // pwrite_full do.
  size_t read_at(void* buf, size_t n, uint64_t off) const;
  void write_at(const void* buf, size_t n, uint64_t off);
  void map_host(bool writable);
  static void fill_slot(SlotHeader& h, uint8_t* buf, size_t payload_len, size_t n) noexcept;
  // write_aligned's and prepare_write's checks (writable, known flags, slot in range, payload
  // fits, buffer aligned) and the slot's header without its CRCs.
  SlotHeader slot_header(uint64_t slot, const Key& key, const uint8_t* buf, size_t payload_len,
                         uint32_t seq, uint8_t flags) const;

  std::string path_;
  SlabGeometry geo_;
  file_io::Fd fd_;
  SlabLock lock_;  // on fd_; declared after it, so released before fd_ closes
  SlabMapping map_;  // host slabs only: the whole slab, MAP_SHARED
  bool direct_ = false;
  bool formatted_ = false;
  bool read_only_ = false;
  uint32_t slab_id_ = 0;
  std::string buffered_reason_;
};

// ---------------------------------------------------------------------------------------------
// Store
// ---------------------------------------------------------------------------------------------

struct KindConfig {
  uint64_t page_bytes = 0;  // largest payload of this kind; slot = slot_bytes_for(page_bytes)
  double share = 1.0;       // share of the budget (relative to the other kinds)
};

struct StoreConfig {
  std::vector<std::string> dirs;   // one slab file per kind in each directory ("drive")
  uint64_t budget_bytes = 0;       // all slab files together (file headers included)
  std::vector<KindConfig> kinds;   // kind i is payload kind i
  std::string name = "vitrify";       // files are <dir>/<name>.kind<i>.slab
  ColdStart cold_start = ColdStart::kClear;
  file_io::DirectIo direct_io = file_io::DirectIo::kAuto;
  unsigned write_threads = 2;      // per drive
  unsigned read_threads = 2;       // per drive
  unsigned queue_capacity = 64;    // jobs per drive queue; submitters wait when full
  unsigned max_batch = 32;         // writes per fdatasync (group commit) on one write thread
  double gc_high = 0.90;           // GC starts when a kind is this full ...
  double gc_low = 0.85;            // ... and reclaims coldest entries down to this
  unsigned load_threads = 0;       // cold start `load`: header-scan threads per slab file
                                   // (0: kDefaultLoadThreads; 1: one read after another)
  int verify_stage = -1;           // payload CRC on a second thread, overlapping the next read:
                                   // -1 when read_threads == 1, 0 never, 1 always
  SlabLocking slab_locking = SlabLocking::kAuto;  // how slab files are locked (D13)
  // The slot-transfer engine of a disk store (D25; a host store's slots are memcpy'd and take
  // kAuto or kPsync only). With io_uring or aio an I/O thread puts a whole batch in flight at
  // once: a write thread its group-commit batch (max_batch), a read thread up to queue_depth
  // queued reads, at most queue_depth transfers in flight per thread.
  IoEngine engine = IoEngine::kAuto;
  unsigned queue_depth = 64;       // [1, 4096]
  // A reader of a store that another Store writes (D14): the existing slabs are opened
  // O_RDONLY without a lock and their headers scanned (cold_start is ignored); puts, remove()
  // and clear() are refused; refresh() picks up the writer's later pages. write_threads unused.
  bool read_only = false;
  // The host tier (DESIGN.md H1-H9): `dirs` are in shared memory (tmpfs such as /dev/shm, or
  // hugetlbfs); slab files are created 0600, mapped, and written and read with memcpy; the
  // filesystem's free space is checked before any slab grows (ENOSPC naming the mount, the
  // need and what is free). direct_io must be kAuto or kOff (it is off).
  bool host = false;
  // Host stores: register every slab mapping with the CUDA driver (cuMemHostRegister, in the
  // primary context of this device; -1: not registered), so a GPU can copy pages straight out
  // of it. Ranges of at most register_max_bytes, registered on up to register_threads threads;
  // read-only stores register READ_ONLY. Errors (no driver, a refused range) propagate from
  // the constructor, with nothing left registered.
  int register_device = -1;
  unsigned register_threads = 8;
  uint64_t register_max_bytes = host::kDefaultMaxSlabBytes;
};
constexpr unsigned kDefaultLoadThreads = 8;  // I/O-bound: threads mostly wait for the drive

enum class PutResult : int8_t {
  kPending = -1,
  kStored = 0,     // written, synced and indexed
  kDuplicate = 1,  // the key was already present (or being stored): nothing written
  kFull = 2,       // no free slot even after GC (counted in put_failures)
  kError = 3,      // the write or sync failed (counted in write_errors)
  kCancelled = 4,  // deleted or store closed before it was indexed
};

struct KindStats {
  uint64_t page_bytes, slot_bytes, slots_total, slots_used, entries;
  uint64_t dirty = 0;  // entries marked dirty (D24)
};

struct StoreStats {
  std::vector<KindStats> kinds;
  uint64_t spills = 0;          // pages written and indexed
  uint64_t spill_bytes = 0;
  uint64_t reloads = 0;         // reads that returned verified bytes
  uint64_t reload_bytes = 0;
  uint64_t misses = 0;          // reads of keys not in the index
  uint64_t verify_failures = 0; // indexed slots that did not verify (or I/O errors): a miss
  uint64_t dedup_hits = 0;
  uint64_t gc_runs = 0;
  uint64_t gc_reclaims = 0;
  uint64_t deletes = 0;
  uint64_t write_errors = 0;
  uint64_t put_failures = 0;    // kFull
  uint64_t loaded_entries = 0;  // entries rebuilt by cold start `load`
  uint64_t clears = 0;          // Store::clear() calls
  uint64_t refreshes = 0;       // Store::refresh() calls (read-only stores)
  uint64_t in_flight_writes = 0;  // puts given a slot and not yet acknowledged (queued included)
  uint64_t in_flight_reads = 0;
  uint64_t write_queue_depth = 0;
  uint64_t read_queue_depth = 0;
  bool direct_io = false;       // every slab file uses O_DIRECT
};

// Shared state of one batch of submitted operations; waited on by the submitter.
class Completion {
 public:
  explicit Completion(size_t n) : results_(n, -1), remaining_(n) {}
  // Blocks until every operation of the batch finished; returns per-operation results
  // (PutResult values for puts; payload length or -1 for reads).
  std::vector<int64_t> wait();
  bool done() const;
  void finish(size_t index, int64_t result);

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<int64_t> results_;
  size_t remaining_;
};
using Ticket = std::shared_ptr<Completion>;

// A 4 KiB-aligned buffer of one slot of a kind: callers gather the payload straight into
// data() + kSlotHeaderBytes; the first 64 bytes belong to the store.
using SlotBufferPtr = std::shared_ptr<AlignedBuffer>;

struct PutItem {
  Key key;
  SlotBufferPtr buffer;   // owns the slot image (payload at +64)
  size_t payload_len = 0;
  bool dirty = false;     // host stores: write it kSlotDirty, never evicted until marked clean
};

struct GetItem {
  Key key;
  uint8_t* dst = nullptr;       // where the payload goes
  size_t dst_bytes = 0;         // capacity of dst
  bool dst_is_slot = false;     // dst is a slot buffer (aligned, payload lands at dst + 64)
  bool miss_if_small = false;   // a too-small dst is a miss instead of std::invalid_argument
};

// ---------------------------------------------------------------------------------------------
// SlotIndex: the pure bookkeeping of one payload kind (index.cpp)
// ---------------------------------------------------------------------------------------------

// Where an indexed payload lives.
struct SlotLocation {
  uint32_t drive = 0;
  uint64_t slot = 0;
  uint32_t len = 0;
  bool operator==(const SlotLocation&) const = default;
};

// A slot found by the cold-start scan of drive `drive` (input of SlotIndex::load).
struct FoundSlot {
  uint32_t drive;
  ScannedSlot s;
};

// A duplicate put waiting on the write in flight for its key: (ticket, result index).
using Joiner = std::pair<Ticket, size_t>;

// Per kind: the key -> slot index, the pending (in flight) puts, the free-slot stacks per drive,
// the stale sets, and the GC order (a lazy-deletion min-heap on access ticks). No file I/O, no
// threads, no driver: the Store decides with it and does the I/O (store.cpp). Like
// region::Layout, a put is planned without mutating (plan_put) and then committed (touch, join,
// allocate); the slot is published only by finish_put, after the caller made the write durable
// (D3). Every reclaim erases the index entry first, then returns the slot (D4).
// Not thread-safe: the Store calls it with its mutex held.
class SlotIndex {
 public:
  // `slots_per_drive[d]`: slot count of this kind's slab on drive d (each >= 1). GC runs when
  // slots_used() >= gc_high * slots_total() and reclaims down to floor(gc_low * slots_total()).
  // Every slot starts free. Throws std::invalid_argument for no drives, an empty drive, or
  // gc thresholds outside 0 < gc_low < gc_high <= 1.
  SlotIndex(std::vector<uint64_t> slots_per_drive, double gc_high, double gc_low);

  struct PutPlan {
    enum Action : uint8_t {
      kDuplicate,  // the key is indexed: touch() it, write nothing (D6)
      kJoin,       // a write of the key is in flight: join() it (D2)
      kAllocate,   // allocate(key, plan) a slot of `drive`
      kFull,       // no free slot on any drive: collect() and plan again (D9)
    } action;
    uint32_t drive = 0;  // kAllocate: the drive with the most free slots (lowest on ties)
  };
  PutPlan plan_put(const Key& key) const noexcept;
  // Takes the top free slot of plan.drive for `key` and records the put as pending (the slot
  // is no longer stale: the write replaces its header). plan must be plan_put(key)'s kAllocate
  // with nothing changed since (the key neither indexed nor pending, a free slot on plan.drive);
  // otherwise std::invalid_argument.
  uint64_t allocate(const Key& key, const PutPlan& plan);
  // A duplicate put joins the pending write of `key` (and un-cancels a removed one).
  // std::invalid_argument when nothing is pending for `key`.
  void join(const Key& key, Joiner joiner);

  struct PutOutcome {
    bool published = false;       // the entry is indexed now
    bool cancelled = false;       // written, but removed (or cleared) while in flight
    std::vector<Joiner> joiners;  // duplicates that joined: acknowledge them
  };
  // Ends the pending put of `key` in (drive, slot): `durable` means the slot write and its
  // sync succeeded. Publishes the entry (the newest in GC order; `dirty`: marked dirty, out
  // of GC order, D24) when durable and not cancelled; otherwise frees the slot (stale).
  PutOutcome finish_put(const Key& key, uint32_t drive, uint64_t slot, uint32_t len, bool durable,
                        bool dirty = false);
  bool pending(const Key& key) const { return pending_.count(key) != 0; }

  // D24: a dirty entry is never reclaimed by GC (collect skips it; delete and a failed
  // verification still remove it). mark_clean puts it back into GC order as the newest entry;
  // the location of the entry it cleaned, nullopt when `key` is not indexed or not dirty.
  std::optional<SlotLocation> mark_clean(const Key& key);
  bool dirty(const Key& key) const;
  uint64_t dirty_count() const noexcept { return dirty_count_; }
  // Every indexed key (dirty_only: the dirty ones), in no particular order.
  std::vector<Key> keys(bool dirty_only) const;

  // D5, D14: with hold_freed_slots() (the Store sets it), a freed slot is held back — still
  // counted in slots_used, on no free stack — until the caller zeroed its header and returned
  // it with release_held, so a slot is never reused, and a reader's scan never finds the page
  // it held, once the slot was freed and released. take_held() hands over the held slots and
  // the index generation (clear and load start a new one: slots taken before are then part of
  // the fresh pool, and release_held of an older generation does nothing).
  void hold_freed_slots() noexcept { hold_ = true; }
  struct Held {
    uint64_t generation = 0;
    std::vector<std::pair<uint32_t, uint64_t>> slots;  // (drive, slot)
  };
  Held take_held();
  bool has_held() const noexcept { return !held_.empty(); }
  uint64_t slots_out() const noexcept { return held_out_; }  // freed, not yet released
  // Returns a held slot to its free stack; `zeroed` false: its header may still verify, so it
  // is stale (close() zeroes it, D5).
  void release_held(uint64_t generation, uint32_t drive, uint64_t slot, bool zeroed);

  std::optional<SlotLocation> find(const Key& key) const;
  // A read or a duplicate put: the entry becomes the newest in GC order (D8). False when the
  // key is not indexed.
  bool touch(const Key& key);
  // Unpublishes the entry, then frees its slot (D4); or cancels a pending put of the key.
  // True when the key was indexed or pending (and not already cancelled).
  bool remove(const Key& key);
  // A read of `at` failed verification: drops the entry if it still points there (D1, D4).
  bool drop_if_at(const Key& key, const SlotLocation& at);

  // GC (D8): due when slots_used() >= gc_high * slots_total(); collect() reclaims the coldest
  // entries down to gc_target() slots (in-flight slots are never reclaimed). Return reclaims.
  bool gc_due() const noexcept;
  uint64_t gc_target() const noexcept;
  size_t collect() { return collect_to(gc_target()); }
  size_t collect_to(uint64_t target_used);

  // Cold start `load` (D7): rebuilds the index, GC order and free stacks from the scanned
  // slots (any order; each drive/slot at most once): oldest `seq` first, a later duplicate
  // wins (ties on (drive, slot)), its older slot becomes free and stale. Returns the number
  // of entries; `next_seq` becomes the max of itself and every seq + 1 (32-bit).
  size_t load(std::vector<FoundSlot> found, uint32_t& next_seq);  // dirty slots stay dirty
  // Live clear (D12): every slot free, nothing indexed, pending or stale. Returns the joiners
  // of the pending puts (acknowledge them cancelled).
  std::vector<Joiner> clear();

  // Free slots of `drive` whose old header may still verify (close() zeroes them, D5).
  const std::unordered_set<uint64_t>& stale(uint32_t drive) const { return stale_.at(drive); }
  void clear_stale(uint32_t drive) { stale_.at(drive).clear(); }

  uint64_t slots_total() const noexcept { return slots_total_; }
  // indexed + pending (D10) + freed slots not yet released (held; GC does not count them)
  uint64_t slots_used() const noexcept { return slots_used_ + held_out_; }
  uint64_t entries() const noexcept { return index_.size(); }
  uint64_t pending() const noexcept { return pending_.size(); }
  uint64_t free_slots(uint32_t drive) const { return free_.at(drive).size(); }
  size_t drives() const noexcept { return free_.size(); }
  // GC heap elements, stale ones included (kept <= 2 * entries + 1024 by publishing).
  size_t heap_size() const noexcept { return heap_.size(); }

 private:
  struct Entry {
    SlotLocation at;
    uint64_t last_access;  // tick
    uint64_t heap_tick;    // tick of this entry's GC-heap element (0: in no heap element)
    bool dirty = false;    // D24: out of GC order until mark_clean
  };
  struct HeapItem {
    uint64_t tick;
    Key key;
    bool operator>(const HeapItem& o) const noexcept { return tick > o.tick; }
  };
  struct Pending {
    bool cancelled = false;
    std::vector<Joiner> joiners;
  };
  void free_slot(uint32_t drive, uint64_t slot);
  void erase_entry(std::unordered_map<Key, Entry, KeyHash>::iterator e);
  void reset_pool();
  void rebuild_heap();

  std::vector<uint64_t> slot_counts_;  // per drive
  double gc_high_, gc_low_;
  uint64_t slots_total_ = 0;
  uint64_t slots_used_ = 0;
  uint64_t tick_ = 0;
  std::vector<std::vector<uint64_t>> free_;  // per drive, a stack: lowest slot on top at first
  std::vector<std::unordered_set<uint64_t>> stale_;  // per drive
  std::unordered_map<Key, Entry, KeyHash> index_;
  std::unordered_map<Key, Pending, KeyHash> pending_;
  std::vector<HeapItem> heap_;  // min-heap on tick (lazy deletion)
  uint64_t dirty_count_ = 0;
  bool hold_ = false;
  uint64_t held_out_ = 0;  // freed and not yet released (held or taken)
  uint64_t generation_ = 1;  // bumped by clear() and load()
  std::vector<std::pair<uint32_t, uint64_t>> held_;  // freed, not yet released (hold_)
};

// Thread safety (store.cpp): every public method may be called from any thread, concurrently
// with the others, except that construction and destruction must not race with any call.
//  - mu_ guards each kind's SlotIndex (index, slot pools, GC heap, pending puts), the spare
//    buffers and the counters; each drive queue has its own mutex; the I/O threads work
//    outside mu_ (slot I/O on SlabFile is safe on one fd). submit_put(), submit_put_copy(),
//    submit_get(), lookup()/exists(), remove() and stats() only take mu_ (and a queue mutex)
//    briefly; a submit blocks while the drive queue is full (queue_capacity), until an I/O
//    thread takes a job.
//  - clear() and close() are serialised with each other (clear_mu_); clear() also waits at the
//    gate until no slot I/O is in progress. Puts and gets racing a clear() are either
//    cancelled/missed or served after it; close() is idempotent, and calls after it complete
//    at once (kCancelled, miss).
//  - A Ticket (Completion) may be waited on or polled from any thread. Put buffers must stay
//    unmodified, and get destinations valid, until their ticket completes.
//  - kind_count(), page_bytes(), slot_bytes(), make_buffer() and config() read state fixed at
//    construction. slab() is for tests and tools: its geometry/path are fixed, but slab_id()
//    changes during clear() and must not be read concurrently with it.
//  - The I/O threads, close() and clear() log errors through vitrify::log, sometimes holding
//    mu_ or the gate; the Python sink takes the GIL, so a caller holding the GIL must release
//    it around calls that can wait for them (csrc/bindings/bind_disk.cpp does).
class Store {
 public:
  // Locks every slab file (D13) before it reads or writes any of them: SlabBusy when another
  // open store (this process or another) holds one, and then nothing stays locked.
  explicit Store(StoreConfig config);
  ~Store();  // close()
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  // Stops the I/O threads after draining their queues, zeroes freed slot headers (D5), then
  // releases every slab lock (D13); later calls fail with kCancelled/miss.
  void close() noexcept;

  // Drops every entry of every kind, as cold start `clear` would, keeping files and threads:
  // waits for the slot writes and reads in progress, acknowledges queued puts kCancelled and
  // queued reads as misses, then reformats every slab (slab_id + 1: every old slot stops
  // verifying, so a later `load` sees only what is put after this) and empties the index, the
  // GC heaps and the slot pools. Puts submitted concurrently are either cancelled or stored
  // after the clear. No-op on a closed store. Throws std::system_error when a slab header
  // cannot be rewritten (the index is empty anyway; that slab's old slots become misses).
  void clear();

  // Read-only stores (D14): waits until no slot read is in progress (new reads wait), reads
  // every file header again (a writer's clear changes the slab id), scans the slot headers and
  // replaces the index with what it found, so pages the writer committed since the open (or the
  // last refresh) become visible and pages it reclaimed disappear. Queued reads keep their old
  // locations: verification (D1) makes a reused slot a miss. Returns the entries now indexed.
  // std::system_error (EROFS) on a writable store; 0 on a closed one. Throws std::system_error
  // when a scan fails (the index is then empty until a refresh succeeds).
  size_t refresh();
  bool read_only() const noexcept { return cfg_.read_only; }

  size_t kind_count() const noexcept { return kinds_.size(); }
  uint64_t page_bytes(unsigned kind) const;
  uint64_t slot_bytes(unsigned kind) const;
  // A fresh slot buffer for `kind` (slot_bytes long, aligned).
  SlotBufferPtr make_buffer(unsigned kind) const;

  // Submit writes; each item's buffer is kept alive (and must not be modified) until the
  // ticket completes. Results are PutResult values.
  Ticket submit_put(unsigned kind, std::vector<PutItem> items);
  // Copying convenience: copies each source into a pooled slot buffer, then submits.
  // `dirty` (host stores, D24): the pages are written kSlotDirty and published dirty.
  Ticket submit_put_copy(unsigned kind, const std::vector<Key>& keys,
                         const std::vector<const void*>& srcs, const std::vector<size_t>& lens,
                         bool dirty = false);
  // Submit reads; results are payload lengths or -1 (miss). dst must stay valid until done.
  Ticket submit_get(unsigned kind, std::vector<GetItem> items);

  // Host stores only (DESIGN.md H9): reads without a queue, straight out of the mapping, on the
  // caller's threads. The keys found in the index whose mapped slot header verifies for the key
  // (D1; and of `expected_len` bytes, SIZE_MAX: any) are handed to `copy` in one call, as
  // (key index, mapped payload, length); copy puts the bytes where the caller wants them and
  // returns, per item, the CRC32C of the bytes it copied, or nullopt to decline the item (a
  // miss, not a verify failure). A result is the payload length only when that CRC equals the
  // header's and the slot header is unchanged after the copy, else -1 (absent, torn, rewritten
  // or corrupt: a miss; corrupt entries are dropped as submit_get's are). Reads touch (D8) and
  // are counted as submit_get's; no clear() or refresh() runs during the call.
  // std::invalid_argument on a disk store; anything copy throws after the counters are settled.
  struct MappedPayload {
    size_t index;         // into keys
    const uint8_t* data;  // in the slab mapping
    size_t bytes;
  };
  using MappedCopy = std::function<std::vector<std::optional<uint32_t>>(
      const std::vector<MappedPayload>&)>;
  std::vector<int64_t> read_mapped(unsigned kind, const std::vector<Key>& keys,
                                   size_t expected_len, const MappedCopy& copy);
  bool host() const noexcept { return cfg_.host; }

  // Indexed length of `key` (no I/O), or nullopt.
  std::optional<size_t> lookup(unsigned kind, const Key& key) const;
  bool exists(unsigned kind, const Key& key) const { return lookup(kind, key).has_value(); }
  // Removes the index entry, then frees the slot, zeroing its header before remove() returns
  // (D14: a reader's later refresh does not find it); a put of `key` still in flight is waited
  // for first and then removed. True when the key was present (or pending); false on a closed
  // store.
  bool remove(unsigned kind, const Key& key);

  // Host stores (D24): the dirty entries among `keys` become clean (back in GC order, their
  // mapped headers rewritten without kSlotDirty). Per key, true when it was dirty.
  // std::invalid_argument on a disk store, EROFS on a reader.
  std::vector<bool> mark_clean(unsigned kind, const std::vector<Key>& keys);
  // Every indexed key of `kind` (dirty_only: the dirty ones; after `load`, the dirty pages the
  // slot headers held), in no particular order.
  std::vector<Key> keys(unsigned kind, bool dirty_only) const;

  StoreStats stats() const;
  const StoreConfig& config() const noexcept { return cfg_; }
  // The engine the I/O threads use (D25): never kAuto; a host store's is "mapped" in
  // engine_name() (its slots are copied, not transferred).
  IoEngine engine() const noexcept { return engine_; }
  const char* engine_name() const noexcept { return cfg_.host ? "mapped" : io_engine_name(engine_); }
  // Why `auto` passed over the engines it did not take ("" when it took the first), one
  // refusal per engine separated by "; " (the Python layer logs it at DEBUG).
  const std::string& engine_fallback() const noexcept { return engine_fallback_; }
  // The slab mappings' CUDA registration (StoreConfig::register_device): registered, threads,
  // wall seconds, each range's seconds. Not registered without a register_device, and after
  // close(), which unregisters.
  const host::RegistrationTiming& registration() const noexcept { return registration_; }
  // The slab file of (kind, drive), for tests and tools.
  const SlabFile& slab(unsigned kind, unsigned drive) const;

 private:
  struct KindState {
    KindConfig cfg;
    uint64_t slot_bytes = 0;
    std::optional<SlotIndex> index;  // index, pending puts, slot pool, GC order (under mu_)
    std::vector<std::unique_ptr<SlabFile>> slabs;  // per drive
    std::vector<SlotBufferPtr> spare;  // pooled slot buffers for copying puts
  };
  struct WriteJob {
    unsigned kind;
    Key key;
    uint32_t drive;
    uint64_t slot;
    SlotBufferPtr buffer;
    size_t len;
    uint32_t seq;
    Ticket ticket;
    size_t index;
    uint64_t epoch;  // clears_ when the slot was allocated; older jobs are cancelled
    bool dirty = false;  // written kSlotDirty, published dirty (D24)
  };
  struct ReadJob {
    unsigned kind;
    Key key;
    uint32_t drive;
    uint64_t slot;
    uint32_t len;
    GetItem item;
    Ticket ticket;
    size_t index;
    uint64_t epoch;
  };
  template <class Job>
  struct Queue {
    std::mutex mu;
    std::condition_variable not_empty, not_full;
    std::deque<Job> jobs;
    bool stop = false;
  };
  struct Drive {
    Queue<WriteJob> writes;
    Queue<ReadJob> reads;
    std::vector<std::thread> threads;
  };

  // Moves `job` into the queue (waiting while it is full); false when the store is closing.
  template <class Job>
  bool push(Queue<Job>& q, Job& job);
  void enqueue_puts(unsigned kind, std::vector<PutItem>& items, const Ticket& t,
                    const std::vector<size_t>* where);
  // `engine`: the thread's io_uring / aio engine (D25), nullptr for psync.
  void write_loop(unsigned drive, detail::IoEngineImpl* engine);
  void read_loop(unsigned drive, detail::IoEngineImpl* engine);
  void read_loop_staged(unsigned drive, uint64_t max_slot);
  // io_uring / aio (D25): a batch of queued reads in flight at once, each verified as it lands.
  void read_loop_batched(unsigned drive, uint64_t max_slot, detail::IoEngineImpl& engine);
  // io_uring / aio: the slot writes of one group-commit batch in flight at once; res[i] becomes
  // kError for a write that failed.
  void write_batch(unsigned drive, std::vector<WriteJob>& batch, std::vector<PutResult>& res,
                   std::vector<SlabFile*>& touched, detail::IoEngineImpl& engine);
  // Probes and creates one engine per I/O thread (D25) before any thread starts.
  void open_engines(size_t threads);
  bool next_read(unsigned drive, ReadJob& j);
  bool current_epoch(const ReadJob& j) const;
  void complete_read(ReadJob& j, std::optional<size_t> r);
  struct Ack {  // a put's acknowledgement, sent after the write loop settled its batch
    Ticket ticket;
    size_t index;
    int64_t result;
  };
  // Publishes or undoes one write (mu_ held); its acknowledgements (and its joiners') go to
  // `acks` when given, else out at once.
  void finish_write(WriteJob& job, PutResult r, std::vector<Ack>* acks = nullptr);
  // D5, D14: zero and release the freed (held) slots: settle_freed inside the gate without mu_,
  // settle_freed_locked with mu_ held (I/O under the mutex: the full-pool GC and close only).
  void settle_freed();
  void settle_freed_locked(KindState& k);
  bool zero_slot(KindState& k, uint32_t drive, uint64_t slot) noexcept;
  void load_index();
  void refuse_if_read_only(const char* what) const;
  // I/O threads hold the gate around each batch of slot I/O; clear() closes it and waits
  // until no I/O is in progress (new I/O waits while a clear is pending).
  void gate_enter();
  void gate_leave();
  struct GateGuard {  // holds the gate for its scope
    explicit GateGuard(Store* store) : s(store) { s->gate_enter(); }
    ~GateGuard() { s->gate_leave(); }
    GateGuard(const GateGuard&) = delete;
    GateGuard& operator=(const GateGuard&) = delete;
    Store* s;
  };
  KindState& kind_state(unsigned kind);
  const KindState& kind_state(unsigned kind) const;

  void register_mappings();
  // A slab file as a writer's open found it, for undoing a failed open (D22).
  struct OpenedSlab {
    std::string path;
    dev_t dev;
    ino_t ino;
    bool created;   // this open created it: removed
    uint64_t size;  // its size before: a disk slab grown since is cut back to it
  };
  static void undo_failed_open(const std::vector<OpenedSlab>& opened, bool host) noexcept;

  StoreConfig cfg_;
  std::vector<KindState> kinds_;
  // After kinds_: destroyed first, so nothing is unmapped while registered.
  std::vector<host::HostRegistration> registrations_;
  host::RegistrationTiming registration_;
  std::vector<std::unique_ptr<Drive>> drives_;
  IoEngine engine_ = IoEngine::kPsync;
  std::string engine_fallback_;
  // io_uring / aio: one engine (its ring or context) per I/O thread, in thread start order.
  std::vector<std::unique_ptr<detail::IoEngineImpl>> engines_;
  mutable std::mutex mu_;  // every kind's SlotIndex and spare buffers, the counters below
  std::condition_variable settled_cv_;  // on mu_: puts finished (remove waits for its key's)
  uint32_t seq_ = 0;
  uint64_t epoch_ = 0;  // bumped by clear(); jobs of an older epoch own no slot any more
  bool closed_ = false;
  std::mutex gate_mu_;
  std::condition_variable gate_cv_;
  unsigned gate_active_ = 0;   // I/O threads inside the gate
  unsigned gate_clearing_ = 0; // clear() calls waiting or running
  std::mutex clear_mu_;        // one clear at a time
  // Closes the gate and waits until no slot I/O is inside it; reopens it when destroyed.
  class ClosedGate {
   public:
    explicit ClosedGate(Store& s);
    ~ClosedGate();
    ClosedGate(const ClosedGate&) = delete;
    ClosedGate& operator=(const ClosedGate&) = delete;

   private:
    Store& s_;
  };
  StoreStats counters_;
  uint64_t in_flight_writes_ = 0;  // under mu_: jobs created and not yet acknowledged
  std::atomic<uint64_t> in_flight_reads_{0};
  std::atomic<uint64_t> write_queue_depth_{0}, read_queue_depth_{0};
};

}  // namespace vitrify::disk
