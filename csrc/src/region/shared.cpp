// SharedBuffer: VMM memory exported as a POSIX file descriptor (invariant R14 in DESIGN.md).
// The driver objects are owned by vmm.hpp's owners (R9): one Reservation, one Mapping holding
// the PhysicalMemory (created here, or adopted from cuMemImportFromShareableHandle).
#include "vitrify/shared_buffer.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "region/vmm.hpp"
#include "vitrify/driver.hpp"
#include "vitrify/error.hpp"

namespace vitrify::region {
namespace {

constexpr CUmemAllocationHandleType kFdHandle = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;

// An optional entry point a shared buffer cannot do without: named when the driver lacks it.
template <typename F>
F need(F f, const char* name) {
  if (f == nullptr)
    throw DriverUnavailable(std::string("the CUDA driver (version ") +
                            std::to_string(driver::table().driver_version) + ") lacks " + name +
                            ", which a shared buffer (VMM memory exported as a file descriptor) "
                            "needs");
  return f;
}

void check_device(int device) {
  const int n = driver::device_count();
  VITRIFY_EXPECT(device >= 0 && device < n, "device ordinal " + std::to_string(device) +
                                             " out of range: this machine has " +
                                             std::to_string(n) + " CUDA device(s)");
}

void check_fd_support(int device) { detail::check_fd_support(device, "a shared buffer"); }

uint64_t rounded_size(uint64_t size, int device, uint64_t* granularity) {
  VITRIFY_EXPECT(size > 0, "shared buffer size must be positive, got 0");
  const uint64_t g = detail::granularity(device, kFdHandle);
  VITRIFY_EXPECT(size <= UINT64_MAX - (g - 1),
                 "shared buffer size " + std::to_string(size) + " is too large");
  *granularity = g;
  return (size + g - 1) / g * g;
}

}  // namespace

// Declared in this order so that they die mappings first (unmap, then cuMemRelease: the later
// pieces of import_fds, then the first), then the reservation (cuMemAddressFree): the reverse of
// how they were made.
struct SharedBuffer::Owners {
  mutable std::mutex mu;
  std::unique_ptr<detail::Reservation> reservation;
  std::unique_ptr<detail::Mapping> mapping;             // piece 0, at the reservation's start
  std::vector<std::unique_ptr<detail::Mapping>> more;   // import_fds: pieces 1.., consecutive
};

namespace {

// Reserves an address range for `mem` anywhere and maps it there read-write for `device`. A
// failure lets the local owners die: nothing is left behind (R9).
std::unique_ptr<SharedBuffer::Owners> map_anywhere(detail::PhysicalMemory&& mem, int device) {
  auto owners = std::make_unique<SharedBuffer::Owners>();
  owners->reservation = std::make_unique<detail::Reservation>(0, mem.size());
  owners->mapping =
      std::make_unique<detail::Mapping>(owners->reservation->ptr(), std::move(mem), device);
  return owners;
}

}  // namespace

SharedBuffer::SharedBuffer(std::unique_ptr<Owners> owners, uint64_t size, int device,
                           bool imported)
    : owners_(std::move(owners)), size_(size), device_(device), imported_(imported) {}

SharedBuffer::SharedBuffer(uint64_t size, int device) : device_(device) {
  VITRIFY_EXPECT(size > 0, "shared buffer size must be positive, got 0");  // before the driver
  check_device(device);
  const auto& d = driver::cu();
  (void)need(d.cuMemExportToShareableHandle, "cuMemExportToShareableHandle");
  (void)need(d.cuMemImportFromShareableHandle, "cuMemImportFromShareableHandle");
  driver::ContextGuard ctx(device);
  check_fd_support(device);
  uint64_t g = 0;
  size_ = rounded_size(size, device, &g);
  detail::PhysicalMemory mem(size_, device, kFdHandle);
  owners_ = map_anywhere(std::move(mem), device);
}

SharedBuffer SharedBuffer::import_fd(int fd, uint64_t size, int device) {
  VITRIFY_EXPECT(size > 0, "shared buffer size must be positive, got 0");
  VITRIFY_EXPECT(fd >= 0, "import_fd: fd must be a file descriptor (>= 0), got " +
                              std::to_string(fd));
  check_device(device);
  auto import = need(driver::cu().cuMemImportFromShareableHandle, "cuMemImportFromShareableHandle");
  if (::fcntl(fd, F_GETFD) == -1)
    vitrify::detail::throw_errno(errno, "import_fd", "", "fd " + std::to_string(fd));
  driver::ContextGuard ctx(device);
  uint64_t g = 0;
  const uint64_t want = rounded_size(size, device, &g);
  // The fake driver's fds (memfds) say how large the allocation is; the real driver's need not.
  struct stat st {};
  if (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_size > 0 &&
      static_cast<uint64_t>(st.st_size) != want)
    vitrify::detail::throw_invalid("import_fd: the shared buffer behind fd " + std::to_string(fd) +
                          " holds " + std::to_string(st.st_size) + " bytes, not the " +
                          std::to_string(want) + " bytes asked for (size " +
                          std::to_string(size) + " rounded up to the granularity " +
                          std::to_string(g) + "): pass the exporter's size()");
  CUmemGenericAllocationHandle h = 0;
  // POSIX fds travel in the pointer-sized argument by value.
  const int r = import(&h, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)), kFdHandle);
  if (r != 0)
    vitrify::detail::throw_cuda(r, ("cuMemImportFromShareableHandle(fd " + std::to_string(fd) + ")").c_str(),
                       __FILE__, __LINE__);
  detail::PhysicalMemory mem = detail::PhysicalMemory::adopt(h, want);  // owned from here on
  try {
    return SharedBuffer(map_anywhere(std::move(mem), device), want, device, true);
  } catch (const CudaError& e) {
    // The driver does not say how large an imported allocation is; mapping more than it holds
    // is what fails here when the sizes differ.
    if (e.call() != "cuMemMap" || e.code() != CUDA_ERROR_INVALID_VALUE) throw;
    throw CudaError(e.code(), e.name(), e.call(), e.where(),
                    "mapping " + std::to_string(want) + " bytes of the buffer imported from fd " +
                        std::to_string(fd) +
                        " failed: is the exporter's buffer smaller? pass the exporter's size()");
  }
}

SharedBuffer SharedBuffer::import_fds(const std::vector<std::pair<int, uint64_t>>& pieces,
                                      int device) {
  VITRIFY_EXPECT(!pieces.empty(), "import_fds: no pieces given");
  for (size_t i = 0; i < pieces.size(); ++i) {
    VITRIFY_EXPECT(pieces[i].first >= 0, "import_fds: piece " + std::to_string(i) +
                                             ": fd must be a file descriptor (>= 0), got " +
                                             std::to_string(pieces[i].first));
    VITRIFY_EXPECT(pieces[i].second > 0,
                   "import_fds: piece " + std::to_string(i) + ": size must be positive, got 0");
  }
  check_device(device);
  auto import = need(driver::cu().cuMemImportFromShareableHandle, "cuMemImportFromShareableHandle");
  for (size_t i = 0; i < pieces.size(); ++i)
    if (::fcntl(pieces[i].first, F_GETFD) == -1)
      vitrify::detail::throw_errno(errno, "import_fds", "",
                                   "piece " + std::to_string(i) + ", fd " +
                                       std::to_string(pieces[i].first));
  driver::ContextGuard ctx(device);
  const uint64_t g = detail::granularity(device, kFdHandle);
  uint64_t total = 0;
  for (size_t i = 0; i < pieces.size(); ++i) {
    const auto [fd, size] = pieces[i];
    VITRIFY_EXPECT(size % g == 0, "import_fds: piece " + std::to_string(i) + " (fd " +
                                      std::to_string(fd) + ") has size " + std::to_string(size) +
                                      ", not a multiple of the allocation granularity " +
                                      std::to_string(g) + " of device " + std::to_string(device));
    VITRIFY_EXPECT(size <= UINT64_MAX - total, "import_fds: the pieces' total size overflows");
    total += size;
    // The fake driver's fds (memfds) say how large the allocation is; the real driver's need not.
    struct stat st {};
    if (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_size > 0 &&
        static_cast<uint64_t>(st.st_size) != size)
      vitrify::detail::throw_invalid("import_fds: piece " + std::to_string(i) + ": the allocation "
                                     "behind fd " + std::to_string(fd) + " holds " +
                                     std::to_string(st.st_size) + " bytes, not the " +
                                     std::to_string(size) + " bytes given");
  }
  // One range for all pieces; a failure part-way lets `owners` die: the pieces mapped so far are
  // unmapped and released, then the range is freed (R9).
  auto owners = std::make_unique<Owners>();
  owners->reservation = std::make_unique<detail::Reservation>(0, total);
  uint64_t off = 0;
  for (size_t i = 0; i < pieces.size(); ++i) {
    const auto [fd, size] = pieces[i];
    CUmemGenericAllocationHandle h = 0;
    const int r = import(&h, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)), kFdHandle);
    if (r != 0)
      vitrify::detail::throw_cuda(
          r, ("cuMemImportFromShareableHandle(fd " + std::to_string(fd) + ")").c_str(), __FILE__,
          __LINE__);
    detail::PhysicalMemory mem = detail::PhysicalMemory::adopt(h, size);  // owned from here on
    auto m = std::make_unique<detail::Mapping>(owners->reservation->ptr() + off, std::move(mem),
                                               device);
    if (i == 0)
      owners->mapping = std::move(m);
    else
      owners->more.push_back(std::move(m));
    off += size;
  }
  return SharedBuffer(std::move(owners), total, device, true);
}

SharedBuffer::~SharedBuffer() { (void)release(); }

SharedBuffer::SharedBuffer(SharedBuffer&& o) noexcept
    : owners_(std::move(o.owners_)), size_(o.size_), device_(o.device_), imported_(o.imported_) {}

int SharedBuffer::export_fd() const {
  VITRIFY_EXPECT(owners_ != nullptr, "export_fd: the shared buffer was released");
  std::lock_guard<std::mutex> lk(owners_->mu);
  VITRIFY_EXPECT(owners_->mapping != nullptr, "export_fd: the shared buffer was released");
  VITRIFY_EXPECT(owners_->more.empty(),
                 "export_fd: this buffer was imported from " +
                     std::to_string(owners_->more.size() + 1) +
                     " pieces (import_fds); export each piece from its owner instead");
  auto exp = need(driver::cu().cuMemExportToShareableHandle, "cuMemExportToShareableHandle");
  driver::ContextGuard ctx(device_);
  int fd = -1;
  const int r = exp(&fd, owners_->mapping->handle(), kFdHandle, 0);
  if (r != 0) vitrify::detail::throw_cuda(r, "cuMemExportToShareableHandle", __FILE__, __LINE__);
  // The caller owns the fd; it must not leak into programs this process executes.
  const int flags = ::fcntl(fd, F_GETFD);
  if (flags == -1 || ::fcntl(fd, F_SETFD, flags | FD_CLOEXEC) == -1) {
    const int err = errno;
    ::close(fd);
    vitrify::detail::throw_errno(err, "fcntl", "", "FD_CLOEXEC on the exported fd " + std::to_string(fd));
  }
  return fd;
}

int SharedBuffer::release() noexcept {
  if (owners_ == nullptr) return 0;
  std::lock_guard<std::mutex> lk(owners_->mu);
  if (owners_->mapping == nullptr && owners_->reservation == nullptr) return 0;
  std::optional<driver::ContextGuard> ctx;
  try {
    ctx.emplace(device_);
  } catch (...) {
    // Without a context the owners below still try; the driver says what failed.
  }
  int first = 0;
  for (auto it = owners_->more.rbegin(); it != owners_->more.rend(); ++it) {
    const int r = (*it)->release();  // cuMemUnmap, then cuMemRelease
    if (first == 0) first = r;
  }
  owners_->more.clear();
  if (owners_->mapping) {
    const int r = owners_->mapping->release();  // cuMemUnmap, then cuMemRelease
    if (first == 0) first = r;
    owners_->mapping.reset();
  }
  if (owners_->reservation) {
    const int r = owners_->reservation->release();  // cuMemAddressFree
    if (first == 0) first = r;
    owners_->reservation.reset();
  }
  return first;
}

bool SharedBuffer::released() const noexcept {
  if (owners_ == nullptr) return true;
  std::lock_guard<std::mutex> lk(owners_->mu);
  return owners_->mapping == nullptr;
}

uint64_t SharedBuffer::ptr() const noexcept {
  if (owners_ == nullptr) return 0;
  std::lock_guard<std::mutex> lk(owners_->mu);
  return owners_->mapping ? owners_->mapping->ptr() : 0;
}

namespace {
void check_range(const char* what, uint64_t offset, size_t n, uint64_t size) {
  VITRIFY_EXPECT(offset <= size && n <= size - offset,
                 std::string(what) + " of " + std::to_string(n) + " bytes at offset " +
                     std::to_string(offset) + " runs past the end of the shared buffer (" +
                     std::to_string(size) + " bytes)");
}
}  // namespace

void SharedBuffer::write(uint64_t offset, const void* src, size_t n) {
  check_range("write", offset, n, size_);
  VITRIFY_EXPECT(owners_ != nullptr, "write: the shared buffer was released");
  std::lock_guard<std::mutex> lk(owners_->mu);
  VITRIFY_EXPECT(owners_->mapping != nullptr, "write: the shared buffer was released");
  if (n == 0) return;
  driver::ContextGuard ctx(device_);
  VITRIFY_CU(driver::cu().cuMemcpyHtoD(owners_->mapping->ptr() + offset, src, n));
}

void SharedBuffer::read(uint64_t offset, void* dst, size_t n) const {
  check_range("read", offset, n, size_);
  VITRIFY_EXPECT(owners_ != nullptr, "read: the shared buffer was released");
  std::lock_guard<std::mutex> lk(owners_->mu);
  VITRIFY_EXPECT(owners_->mapping != nullptr, "read: the shared buffer was released");
  if (n == 0) return;
  driver::ContextGuard ctx(device_);
  VITRIFY_CU(driver::cu().cuMemcpyDtoH(dst, owners_->mapping->ptr() + offset, n));
}

}  // namespace vitrify::region
