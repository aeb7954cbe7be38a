// ScratchSpan: a VMM reservation with chosen granules mapped (tests and benchmarks only).
#include <algorithm>
#include <chrono>
#include <string>

#include "region/vmm.hpp"
#include "vitrify/driver.hpp"
#include "vitrify/snapshot.hpp"

namespace vitrify::snapshot {

// Every driver object has its one owner from the region's VMM layer (region/vmm.hpp, R9): a
// failure midway unwinds by letting the owners built so far die.
struct ScratchSpan::Owners {
  std::unique_ptr<region::detail::Reservation> reservation;
  std::vector<std::unique_ptr<region::detail::Mapping>> mappings;  // released before the reservation

  ~Owners() { mappings.clear(); }
};

ScratchSpan::ScratchSpan(int device, uint64_t size, uint64_t base_hint,
                         const std::vector<bool>& mapped)
    : device_(device) {
  driver::ContextGuard ctx(device);
  granularity_ = region::detail::granularity(device);
  const uint64_t g = granularity_;
  VITRIFY_EXPECT(size > 0 && size % g == 0, "ScratchSpan size must be a positive multiple of the "
              "granularity " + std::to_string(g) + ", got " + std::to_string(size));
  VITRIFY_EXPECT(mapped.size() == size / g, "ScratchSpan needs one mapped flag per granule (" +
              std::to_string(size / g) + "), got " + std::to_string(mapped.size()));
  auto owners = std::make_unique<Owners>();
  owners->reservation = std::make_unique<region::detail::Reservation>(base_hint, size);
  const uint64_t base = owners->reservation->ptr();
  for (size_t i = 0; i < mapped.size();) {
    if (!mapped[i]) { ++i; continue; }
    size_t j = i;
    while (j < mapped.size() && mapped[j]) ++j;  // one physical allocation per mapped run
    const uint64_t off = i * g, bytes = (j - i) * g;
    owners->mappings.push_back(std::make_unique<region::detail::Mapping>(
        base + off, region::detail::PhysicalMemory(bytes, device), device));
    i = j;
  }
  base_ = base;
  size_ = size;
  owners_ = std::move(owners);
}

ScratchSpan::~ScratchSpan() {
  if (!owners_) return;
  try {
    driver::ContextGuard ctx(device_);
    (void)driver::cu().cuCtxSynchronize();  // nothing in flight touches the span when it goes
    owners_.reset();
  } catch (...) {
    owners_.reset();  // no context: the owners still try, and never throw
  }
}

void ScratchSpan::write(uint64_t offset, const void* src, size_t n) {
  VITRIFY_EXPECT(offset <= size_ && n <= size_ - offset, "write of " + std::to_string(n) +
              " bytes at " + std::to_string(offset) + " leaves the ScratchSpan");
  driver::ContextGuard ctx(device_);
  VITRIFY_CU(driver::cu().cuMemcpyHtoD(base_ + offset, src, n));
}

void ScratchSpan::read(uint64_t offset, void* dst, size_t n) const {
  VITRIFY_EXPECT(offset <= size_ && n <= size_ - offset, "read of " + std::to_string(n) +
              " bytes at " + std::to_string(offset) + " leaves the ScratchSpan");
  driver::ContextGuard ctx(device_);
  VITRIFY_CU(driver::cu().cuMemcpyDtoH(dst, base_ + offset, n));
}

double measure_pinned_h2d(int device, uint64_t dst, uint64_t bytes, int reps) {
  VITRIFY_EXPECT(bytes > 0 && reps > 0, "measure_pinned_h2d needs bytes > 0 and reps > 0");
  AlignedBuffer host(bytes, 4096);
  for (uint64_t i = 0; i < bytes; i += 4096) host.data()[i] = static_cast<uint8_t>(i >> 12);
  auto be = make_driver_backend(device);
  auto pin = be->pin(host.data(), host.size());
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    be->to_device(dst, host.data(), bytes);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  pin.reset();
  return best;
}

}  // namespace vitrify::snapshot
