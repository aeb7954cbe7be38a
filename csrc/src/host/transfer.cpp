// Batched host<->GPU page copies on a caller's stream; host ranges come from HostPool::segments().
#include <algorithm>
#include <string>

#include "vitrify/driver.hpp"
#include "vitrify/error.hpp"
#include "vitrify/host.hpp"

namespace vitrify::host {

namespace {

std::string n(size_t v) { return std::to_string(v); }

// The batch API takes at most this many copies per call here (no documented limit; this keeps
// the argument arrays small and the driver's per-call work bounded).
constexpr size_t kMaxBatch = 1024;

bool legacy_stream(CUstream s) {
  // NULL and CU_STREAM_LEGACY are the legacy default stream, which cuMemcpyBatchAsync refuses.
  return s == nullptr || s == CU_STREAM_LEGACY;
}

struct Piece {
  size_t slab;
  CUdeviceptr device;
  uint8_t* host;
  size_t bytes;
};

}  // namespace

bool batch_copy_available() {
  if (!driver::available()) return false;
  const auto& t = driver::cu();
  return t.cuMemcpyBatchAsync != nullptr || t.cuMemcpyBatchAsync_v12080 != nullptr;
}

TransferStats transfer(const HostPool& pool, Direction direction, const std::vector<PageRun>& runs,
                       CUstream stream, TransferPath path) {
  // Expand every run through segments(): each piece lies inside one slab (one registration).
  std::vector<Piece> pieces;
  size_t bytes = 0;
  for (size_t r = 0; r < runs.size(); ++r) {
    const PageRun& run = runs[r];
    VITRIFY_EXPECT(run.count == 0 || run.device_ptr != 0,
                "page run " + n(r) + " has a null device pointer");
    for (const Segment& s : pool.segments(run.first_page, run.count)) {
      const CUdeviceptr dev = run.device_ptr + (s.first_page - run.first_page) * pool.page_bytes();
      // Merge with the previous piece when both sides continue it inside the same slab.
      if (!pieces.empty()) {
        Piece& last = pieces.back();
        if (last.slab == s.slab && last.host + last.bytes == s.ptr &&
            last.device + last.bytes == dev) {
          last.bytes += s.bytes;
          bytes += s.bytes;
          continue;
        }
      }
      pieces.push_back({s.slab, dev, s.ptr, s.bytes});
      bytes += s.bytes;
    }
  }

  const auto& d = driver::cu();
  const bool have_batch = d.cuMemcpyBatchAsync != nullptr || d.cuMemcpyBatchAsync_v12080 != nullptr;
  TransferStats st;
  st.bytes = bytes;
  st.copies = pieces.size();
  if (path == TransferPath::Batch) {
    if (!have_batch)
      throw DriverUnavailable("cuMemcpyBatchAsync is not available in this driver (version " +
                              std::to_string(d.driver_version) +
                              "; it needs CUDA 12.8 or newer): use the loop path");
    VITRIFY_EXPECT(!legacy_stream(stream),
                "cuMemcpyBatchAsync refuses the legacy NULL stream: pass a created stream "
                "(torch.cuda.Stream().cuda_stream) or use the loop path");
  }
  const bool use_batch =
      path == TransferPath::Batch || (path == TransferPath::Auto && have_batch && !legacy_stream(stream));
  st.path = use_batch ? TransferPath::Batch : TransferPath::Loop;
  if (pieces.empty()) return st;

  driver::ContextGuard ctx(pool.device());
  const bool h2d = direction == Direction::HostToDevice;
  if (!use_batch) {
    for (const Piece& p : pieces) {
      if (h2d)
        VITRIFY_CU(d.cuMemcpyHtoDAsync(p.device, p.host, p.bytes, stream));
      else
        VITRIFY_CU(d.cuMemcpyDtoHAsync(p.host, p.device, p.bytes, stream));
      ++st.driver_calls;
    }
    return st;
  }

  std::vector<CUdeviceptr> dsts, srcs;
  std::vector<size_t> sizes;
  dsts.reserve(std::min(pieces.size(), kMaxBatch));
  srcs.reserve(dsts.capacity());
  sizes.reserve(dsts.capacity());
  CUmemcpyAttributes attr{};
  attr.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
  attr.flags = CU_MEMCPY_FLAG_DEFAULT;
  size_t attr_index = 0;
  for (size_t first = 0; first < pieces.size(); first += kMaxBatch) {
    const size_t count = std::min(kMaxBatch, pieces.size() - first);
    dsts.clear();
    srcs.clear();
    sizes.clear();
    for (size_t i = first; i < first + count; ++i) {
      const Piece& p = pieces[i];
      const CUdeviceptr host = reinterpret_cast<CUdeviceptr>(p.host);
      dsts.push_back(h2d ? p.device : host);
      srcs.push_back(h2d ? host : p.device);
      sizes.push_back(p.bytes);
    }
    if (d.cuMemcpyBatchAsync != nullptr) {
      VITRIFY_CU(d.cuMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), count, &attr,
                                   &attr_index, 1, stream));
    } else {
      size_t fail = SIZE_MAX;
      const CUresult r = d.cuMemcpyBatchAsync_v12080(dsts.data(), srcs.data(), sizes.data(), count,
                                                     &attr, &attr_index, 1, &fail, stream);
      if (r != CUDA_SUCCESS)
        detail::throw_cuda(r,
                           ("cuMemcpyBatchAsync_v12080 (copy " +
                            (fail == SIZE_MAX ? std::string("?") : n(first + fail)) + " of " +
                            n(pieces.size()) + ")")
                               .c_str(),
                           __FILE__, __LINE__);
    }
    ++st.driver_calls;
  }
  return st;
}

void memcpy_sync(Direction direction, int device, CUdeviceptr device_ptr, void* host, size_t bytes) {
  VITRIFY_EXPECT(device_ptr != 0 && host != nullptr, "memcpy_sync: null pointer");
  driver::ContextGuard ctx(device);
  if (direction == Direction::HostToDevice)
    VITRIFY_CU(driver::cu().cuMemcpyHtoD(device_ptr, host, bytes));
  else
    VITRIFY_CU(driver::cu().cuMemcpyDtoH(host, device_ptr, bytes));
}

Stream::Stream(int device) : device_(device) {
  driver::ContextGuard ctx(device);
  VITRIFY_CU(driver::cu().cuStreamCreate(&stream_, CU_STREAM_NON_BLOCKING));
}

Stream::~Stream() {
  if (stream_ == nullptr) return;
  try {
    driver::ContextGuard ctx(device_);
    (void)driver::cu().cuStreamDestroy(stream_);
  } catch (...) {
    // Destructors never throw.
  }
}

void Stream::synchronize() const {
  driver::ContextGuard ctx(device_);
  VITRIFY_CU(driver::cu().cuStreamSynchronize(stream_));
}

}  // namespace vitrify::host
