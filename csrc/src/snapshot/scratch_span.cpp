// ScratchSpan: a VMM reservation with chosen granules mapped (tests and benchmarks only).
#include <algorithm>
#include <chrono>
#include <string>

#include "vitrify/driver.hpp"
#include "vitrify/snapshot.hpp"

namespace vitrify::snapshot {

ScratchSpan::ScratchSpan(int device, uint64_t size, uint64_t base_hint,
                         const std::vector<bool>& mapped)
    : device_(device) {
  driver::ContextGuard ctx(device);
  const auto& d = driver::cu();
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  size_t g = 0;
  VITRIFY_CU(d.cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  granularity_ = g;
  VITRIFY_EXPECT(size > 0 && size % g == 0, "ScratchSpan size must be a positive multiple of the "
              "granularity " + std::to_string(g) + ", got " + std::to_string(size));
  VITRIFY_EXPECT(mapped.size() == size / g, "ScratchSpan needs one mapped flag per granule (" +
              std::to_string(size / g) + "), got " + std::to_string(mapped.size()));
  CUdeviceptr p = 0;
  VITRIFY_CU(d.cuMemAddressReserve(&p, size, base_hint ? driver::reserve_alignment(base_hint) : g,
                                static_cast<CUdeviceptr>(base_hint), 0));
  base_ = p;
  size_ = size;
  try {
    CUmemAccessDesc access{};
    access.location = prop.location;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    for (size_t i = 0; i < mapped.size();) {
      if (!mapped[i]) { ++i; continue; }
      size_t j = i;
      while (j < mapped.size() && mapped[j]) ++j;
      const uint64_t off = i * g, bytes = (j - i) * g;
      CUmemGenericAllocationHandle hnd = 0;
      VITRIFY_CU(d.cuMemCreate(&hnd, bytes, &prop, 0));
      const CUresult r = d.cuMemMap(base_ + off, bytes, 0, hnd, 0);
      if (r != CUDA_SUCCESS) {
        (void)d.cuMemRelease(hnd);
        VITRIFY_CU(r);
      }
      maps_.push_back({off, bytes, hnd});
      VITRIFY_CU(d.cuMemSetAccess(base_ + off, bytes, &access, 1));
      i = j;
    }
  } catch (...) {
    release();
    throw;
  }
}

ScratchSpan::~ScratchSpan() { release(); }

void ScratchSpan::release() noexcept {
  if (base_ == 0) return;
  try {
    driver::ContextGuard ctx(device_);
    const auto& d = driver::cu();
    (void)d.cuCtxSynchronize();
    for (const Mapping& m : maps_) {
      (void)d.cuMemUnmap(base_ + m.offset, m.bytes);
      (void)d.cuMemRelease(m.handle);
    }
    (void)d.cuMemAddressFree(base_, size_);
  } catch (...) {
  }
  maps_.clear();
  base_ = 0;
}

}  // namespace vitrify::snapshot

namespace vitrify::snapshot {

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
