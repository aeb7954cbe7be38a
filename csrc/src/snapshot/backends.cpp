// Copy backends: the CUDA driver (real) and host memory posing as a device (CPU tests).
#include <algorithm>
#include <cstring>
#include <string>

#include "vitrify/driver.hpp"
#include "vitrify/host.hpp"
#include "vitrify/snapshot.hpp"

namespace vitrify::snapshot {
namespace {

// ---- the driver -----------------------------------------------------------------------------

// Registered host memory (one host::HostRegistration: unregistered on destruction). The driver
// seam keeps the primary context alive for the process, so it may outlive the backend that made
// it (a pinned Snapshot does).
class DriverPinned final : public Pinned {
 public:
  DriverPinned(int device, void* p, size_t n)
      : reg_(p, n, device, std::max(n, host::kDefaultMaxSlabBytes)) {}

 private:
  host::HostRegistration reg_;
};

class DriverBackend final : public CopyBackend {
 public:
  explicit DriverBackend(int device) : device_(device), guard_(device) {
    const auto& d = driver::cu();
    VITRIFY_CU(d.cuStreamCreate(&stream_, CU_STREAM_NON_BLOCKING));
    for (auto& e : events_) {
      const CUresult r = d.cuEventCreate(&e, CU_EVENT_DISABLE_TIMING);
      if (r != CUDA_SUCCESS) {
        release();
        VITRIFY_CU(r);
      }
    }
  }
  ~DriverBackend() override { release(); }

  bool try_to_host(void* dst, uint64_t src, size_t n) override {
    if (n == 0) return true;
    const CUresult r = driver::cu().cuMemcpyDtoH(dst, static_cast<CUdeviceptr>(src), n);
    if (r == CUDA_ERROR_INVALID_VALUE) return false;  // part of the range is not mapped
    VITRIFY_CU(r);
    return true;
  }
  void to_device(uint64_t dst, const void* src, size_t n) override {
    if (n == 0) return;
    VITRIFY_CU(driver::cu().cuMemcpyHtoD(static_cast<CUdeviceptr>(dst), src, n));
  }
  void to_device_async(uint64_t dst, const void* src, size_t n, int lane) override {
    VITRIFY_EXPECT(lane == 0 || lane == 1, "lane must be 0 or 1, got " + std::to_string(lane));
    if (n > 0)
      VITRIFY_CU(driver::cu().cuMemcpyHtoDAsync(static_cast<CUdeviceptr>(dst), src, n, stream_));
    VITRIFY_CU(driver::cu().cuEventRecord(events_[lane], stream_));
  }
  void wait(int lane) override {
    VITRIFY_EXPECT(lane == 0 || lane == 1, "lane must be 0 or 1, got " + std::to_string(lane));
    VITRIFY_CU(driver::cu().cuEventSynchronize(events_[lane]));
  }
  std::unique_ptr<Pinned> pin(void* p, size_t n) override {
    return std::make_unique<DriverPinned>(device_, p, n);
  }

 private:
  void release() noexcept {
    try {
      const auto& d = driver::cu();
      if (stream_) (void)d.cuStreamSynchronize(stream_);
      for (auto& e : events_)
        if (e) (void)d.cuEventDestroy(e), e = nullptr;
      if (stream_) (void)d.cuStreamDestroy(stream_), stream_ = nullptr;
    } catch (...) {
    }
  }
  int device_;
  driver::ContextGuard guard_;
  CUstream stream_ = nullptr;
  CUevent events_[2] = {nullptr, nullptr};
};

class NoPin final : public Pinned {};

}  // namespace

std::unique_ptr<CopyBackend> make_driver_backend(int device) {
  return std::make_unique<DriverBackend>(device);
}

// ---- host memory --------------------------------------------------------------------------------

HostBackend::HostBackend(size_t size, Intervals holes, size_t alignment)
    : mem_(size, alignment), size_(size), holes_(merge(std::move(holes))) {
  VITRIFY_EXPECT(size > 0, "HostBackend size must be positive");
  for (const Interval& h : holes_)
    VITRIFY_EXPECT(h.end <= size, "hole [" + std::to_string(h.begin) + ", " + std::to_string(h.end) +
                                   ") lies beyond the " + std::to_string(size) + "-byte span");
}

bool HostBackend::mapped(uint64_t addr, size_t n) const noexcept {
  const uint64_t b = base();
  if (addr < b || addr - b > size_ || n > size_ - (addr - b)) return false;
  const uint64_t lo = addr - b, hi = lo + n;
  for (const Interval& h : holes_)
    if (h.begin < hi && lo < h.end) return false;
  return true;
}

bool HostBackend::try_to_host(void* dst, uint64_t src, size_t n) {
  ++to_host_calls_;
  if (n == 0) return true;
  if (!mapped(src, n)) return false;
  std::memcpy(dst, reinterpret_cast<const void*>(src), n);
  return true;
}

void HostBackend::to_device(uint64_t dst, const void* src, size_t n) {
  if (n == 0) return;
  if (!mapped(dst, n))
    throw CudaError(CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE",
                    "HostBackend::to_device(" + std::to_string(dst) + ", " + std::to_string(n) +
                        ")",
                    "host backend", "the range touches an unmapped hole or leaves the span");
  std::memcpy(reinterpret_cast<void*>(dst), src, n);
  bytes_to_device_ += n;
}

void HostBackend::to_device_async(uint64_t dst, const void* src, size_t n, int lane) {
  VITRIFY_EXPECT(lane == 0 || lane == 1, "lane must be 0 or 1, got " + std::to_string(lane));
  if (!deferred_) {
    to_device(dst, src, n);  // host memory: completes at once
    return;
  }
  if (n > 0 && !mapped(dst, n)) to_device(dst, src, n);  // throws like the driver would
  lanes_[lane].push_back({dst, src, n});
}

void HostBackend::wait(int lane) {
  VITRIFY_EXPECT(lane == 0 || lane == 1, "lane must be 0 or 1, got " + std::to_string(lane));
  std::vector<Pending> todo;
  todo.swap(lanes_[lane]);
  for (const Pending& p : todo) to_device(p.dst, p.src, p.n);
}

std::unique_ptr<Pinned> HostBackend::pin(void*, size_t) { return std::make_unique<NoPin>(); }

}  // namespace vitrify::snapshot
