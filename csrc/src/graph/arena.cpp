// FixedArena: one VMM reservation at a chosen address, mapped in full, bump-allocated.
#include "graph/cuda_util.hpp"
#include "vitrify/graph_cuda.hpp"
#include "vitrify/log.hpp"
#include "vitrify/region.hpp"

namespace vitrify::graph {

FixedArena::FixedArena(uint64_t base, size_t size, int device) : device_(device) {
  VITRIFY_EXPECT(size > 0, "FixedArena size must be positive");
  const auto& d = driver::cu();
  driver::ContextGuard ctx(device);
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  size_t gran = 0;
  VITRIFY_CU(d.cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  VITRIFY_EXPECT(gran > 0, "the driver reports allocation granularity 0");
  VITRIFY_EXPECT(base % gran == 0, "FixedArena base " + std::to_string(base) +
                                    " is not a multiple of the granularity " + std::to_string(gran));
  size_ = (size + gran - 1) / gran * gran;
  try {
    // The H200 driver (580, CUDA 13.0) honours a hint only with a large alignment (measured in
    // the region work; driver::reserve_alignment): reserve from the 1 GiB boundary at or below
    // `base` with 1 GiB alignment and place the arena at `base` inside that reservation, so any
    // granularity-aligned base (a 2 MiB relocation shift) can be had.
    constexpr uint64_t kAlign = uint64_t(1) << 30;
    const uint64_t start = base & ~(kAlign - 1);
    reserve_start_ = start;
    reserve_size_ = (base - start) + size_;
    CUdeviceptr p = 0;
    VITRIFY_CU(d.cuMemAddressReserve(&p, reserve_size_, base != 0 ? kAlign : 0,
                                     CUdeviceptr(start), 0));
    reserved_ = true;
    if (base == 0) reserve_start_ = p;
    if (base != 0 && p != start) {
      reserve_start_ = p;
      throw Error("FixedArena: asked the driver for [" + std::to_string(start) + ", +" +
                  std::to_string(reserve_size_) + ") and got " + std::to_string(p) +
                  " (that range is taken in this process)");
    }
    base_ = base != 0 ? base : p;
    VITRIFY_CU(d.cuMemCreate(&handle_, size_, &prop, 0));
    created_ = true;
    VITRIFY_CU(d.cuMemMap(base_, size_, 0, handle_, 0));
    mapped_ = true;
    CUmemAccessDesc access{};
    access.location = prop.location;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    VITRIFY_CU(d.cuMemSetAccess(base_, size_, &access, 1));
  } catch (...) {
    release();
    throw;
  }
}

void FixedArena::release() noexcept {
  if (!driver::available()) return;
  const auto& d = driver::cu();
  if (mapped_) d.cuMemUnmap(base_, size_);
  if (created_) d.cuMemRelease(handle_);
  if (reserved_) d.cuMemAddressFree(reserve_start_, reserve_size_);
  mapped_ = created_ = reserved_ = false;
}

FixedArena::~FixedArena() { release(); }

size_t FixedArena::used() const {
  std::lock_guard<std::mutex> lock(mu_);
  return cursor_;
}

uint64_t FixedArena::allocate(size_t n, size_t align) {
  VITRIFY_EXPECT(align > 0 && (align & (align - 1)) == 0,
              "alignment must be a power of two, got " + std::to_string(align));
  std::lock_guard<std::mutex> lock(mu_);
  // The region's window guards (region R13), so integer pairs never point into a live allocation.
  const uint64_t aligned = (uint64_t(cursor_) + align - 1) & ~uint64_t(align - 1);
  const uint64_t start = region::skip_guards(cursor_, n, align);
  if (start > size_ || n > size_ - start)
    throw OutOfSpace("FixedArena at " + std::to_string(base_) + " is full: " +
                     std::to_string(n) + " bytes requested, " +
                     std::to_string(size_ - std::min(start, size_)) + " of " +
                     std::to_string(size_) + " left");
  if (start != aligned) skipped_.emplace_back(cursor_, start);
  cursor_ = start + n;
  return base_ + start;
}

std::vector<std::pair<uint64_t, uint64_t>> FixedArena::live_ranges() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::pair<uint64_t, uint64_t>> out;
  uint64_t from = 0;
  for (const auto& [a, b] : skipped_) {
    if (a > from) out.emplace_back(from, a - from);
    from = b;
  }
  if (cursor_ > from) out.emplace_back(from, cursor_ - from);
  return out;
}

void FixedArena::write(size_t offset, const void* src, size_t n) {
  VITRIFY_EXPECT(offset <= size_ && n <= size_ - offset,
              "FixedArena write [" + std::to_string(offset) + ", +" + std::to_string(n) +
                  ") outside its " + std::to_string(size_) + " bytes");
  if (n == 0) return;
  driver::ContextGuard ctx(device_);
  VITRIFY_CU(driver::cu().cuMemcpyHtoD(base_ + offset, src, n));
}

void FixedArena::read(size_t offset, void* dst, size_t n) const {
  VITRIFY_EXPECT(offset <= size_ && n <= size_ - offset,
              "FixedArena read [" + std::to_string(offset) + ", +" + std::to_string(n) +
                  ") outside its " + std::to_string(size_) + " bytes");
  if (n == 0) return;
  driver::ContextGuard ctx(device_);
  VITRIFY_CU(driver::cu().cuMemcpyDtoH(dst, base_ + offset, n));
}

namespace {
std::mutex g_arena_mu;
std::shared_ptr<FixedArena>& arena_slot() {
  static auto* a = new std::shared_ptr<FixedArena>();  // leaked: torch may free at exit
  return *a;
}
}  // namespace

void install_arena(std::shared_ptr<FixedArena> arena) {
  std::lock_guard<std::mutex> lock(g_arena_mu);
  arena_slot() = std::move(arena);
}

std::shared_ptr<FixedArena> installed_arena() {
  std::lock_guard<std::mutex> lock(g_arena_mu);
  return arena_slot();
}

}  // namespace vitrify::graph

extern "C" __attribute__((visibility("default"))) void* vitrify_graph_arena_malloc(long size, int,
                                                                               void*) {
  auto a = vitrify::graph::installed_arena();
  if (!a || size < 0) return nullptr;
  try {
    return reinterpret_cast<void*>(a->allocate(size_t(size), 512));
  } catch (const std::exception& e) {
    vitrify::log::error(std::string("vitrify_graph_arena_malloc: ") + e.what());
    return nullptr;
  }
}

extern "C" __attribute__((visibility("default"))) void vitrify_graph_arena_free(void*, long, int,
                                                                             void*) {}
