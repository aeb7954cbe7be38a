// PageLayout validation and factories; Copier: multi-threaded gather/scatter of KV pages.
#include <algorithm>
#include <cstring>
#include <string>
#include <thread>
#include <utility>

#include "vitrify/crc32c.hpp"
#include "vitrify/error.hpp"
#include "vitrify/host.hpp"

#if defined(__x86_64__) && defined(__SSE2__)
#include <emmintrin.h>
#define VITRIFY_STREAMING_STORES 1
#endif

namespace vitrify::host {

namespace {

std::string n(size_t v) { return std::to_string(v); }

size_t mul(size_t a, size_t b, const char* what) {
  size_t r = 0;
  VITRIFY_EXPECT(!__builtin_mul_overflow(a, b, &r),
              std::string(what) + " overflows: " + n(a) + " * " + n(b));
  return r;
}

size_t add(size_t a, size_t b, const char* what) {
  size_t r = 0;
  VITRIFY_EXPECT(!__builtin_add_overflow(a, b, &r),
              std::string(what) + " overflows: " + n(a) + " + " + n(b));
  return r;
}

// Bytes from a component's base to the end of its last slice.
size_t span_of(const PageLayout& l) {
  const size_t a = mul(l.layers - 1, l.layer_stride, "layout span (layers-1)*layer_stride");
  const size_t b = mul(l.pages - 1, l.page_stride, "layout span (pages-1)*page_stride");
  return add(add(a, b, "layout span"), l.slice_bytes, "layout span");
}

constexpr size_t kParallelMinBytes = size_t(1) << 20;  // below: one thread
constexpr size_t kBytesPerTask = size_t(512) << 10;    // at least this much per task
// A parallel copy is cut into up to this many tasks per thread, claimed one at a time, so a thread
// the OS takes off its core (an engine's own threads share the cores) holds up one small task
// instead of a 1/threads share of the batch.
constexpr size_t kTasksPerThread = 8;
// Copies of at least this many bytes in total use non-temporal stores: the destination (a slot
// buffer bound for disk, or pool pages bound for the GPU) is not read back by this CPU soon, and
// streaming stores skip the read-for-ownership of every destination line.
constexpr size_t kStreamMinBytes = size_t(8) << 20;

// Tasks for a parallel copy of `total` bytes made of `units` indivisible pieces.
size_t task_count(size_t total, size_t units, size_t threads) {
  if (total < kParallelMinBytes || threads <= 1) return 1;
  return std::max<size_t>(1, std::min({units, threads * kTasksPerThread,
                                       (total + kBytesPerTask - 1) / kBytesPerTask}));
}

void copy_bytes(uint8_t* dst, const uint8_t* src, size_t n, bool streaming) {
#ifdef VITRIFY_STREAMING_STORES
  if (streaming && n >= 256) {
    const size_t head = (64 - reinterpret_cast<uintptr_t>(dst) % 64) % 64;
    std::memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    const size_t blocks = n / 64;
    for (size_t i = 0; i < blocks; ++i, dst += 64, src += 64) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 32));
      const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 48), d);
    }
    std::memcpy(dst, src, n % 64);
    return;
  }
#else
  (void)streaming;
#endif
  std::memcpy(dst, src, n);
}

void store_fence(bool streaming) {
#ifdef VITRIFY_STREAMING_STORES
  if (streaming) _mm_sfence();  // streaming stores are weakly ordered: publish before returning
#else
  (void)streaming;
#endif
}

}  // namespace

// ---- layouts ------------------------------------------------------------------------------------

void PageLayout::validate() const {
  VITRIFY_EXPECT(!components.empty() && components.size() <= 16,
              "a page layout needs 1 to 16 components (K, V, ...), got " + n(components.size()));
  VITRIFY_EXPECT(layers > 0, "layout layers must be positive, got 0");
  VITRIFY_EXPECT(pages > 0, "layout pages must be positive, got 0");
  VITRIFY_EXPECT(slice_bytes > 0, "layout slice_bytes must be positive, got 0");
  (void)mul(mul(components.size(), layers, "blob size"), slice_bytes, "blob size");
  const size_t span = span_of(*this);
  VITRIFY_EXPECT(span <= component_bytes,
              "layout out of range: the slice of layer " + n(layers - 1) + ", page " +
                  n(pages - 1) + " ends at byte " + n(span) + " of a component, beyond its " +
                  n(component_bytes) + " bytes (layers=" + n(layers) + " pages=" + n(pages) +
                  " slice_bytes=" + n(slice_bytes) + " layer_stride=" + n(layer_stride) +
                  " page_stride=" + n(page_stride) + ")");
  // Distinct (layer, page) slices must not overlap: the strides, sorted, must nest.
  struct Dim {
    size_t stride, count;
    const char* name;
  };
  std::vector<Dim> dims;
  if (layers > 1) dims.push_back({layer_stride, layers, "layer_stride"});
  if (pages > 1) dims.push_back({page_stride, pages, "page_stride"});
  std::sort(dims.begin(), dims.end(), [](const Dim& a, const Dim& b) { return a.stride < b.stride; });
  if (!dims.empty())
    VITRIFY_EXPECT(dims[0].stride >= slice_bytes,
                std::string("layout slices overlap: ") + dims[0].name + " " + n(dims[0].stride) +
                    " is smaller than slice_bytes " + n(slice_bytes));
  if (dims.size() == 2) {
    const size_t inner = (dims[0].count - 1) * dims[0].stride + slice_bytes;  // < span, no overflow
    VITRIFY_EXPECT(dims[1].stride >= inner,
                std::string("layout slices overlap: ") + dims[1].name + " " + n(dims[1].stride) +
                    " is smaller than the " + n(inner) + " bytes spanned along " + dims[0].name +
                    " (strides must nest: layer_first has page_stride=slice, layer_stride=pages*"
                    "slice; page_first the reverse)");
  }
  // Components: non-null, in the address space, and not overlapping each other.
  std::vector<std::pair<uintptr_t, size_t>> spans;
  for (size_t c = 0; c < components.size(); ++c) {
    VITRIFY_EXPECT(components[c] != 0, "layout component " + n(c) + " has a null base address");
    VITRIFY_EXPECT(components[c] <= UINTPTR_MAX - component_bytes,
                "layout component " + n(c) + ": base + component_bytes overflows the address space");
    spans.emplace_back(components[c], c);
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i)
    VITRIFY_EXPECT(spans[i].first - spans[i - 1].first >= span,
                "layout components " + n(spans[i - 1].second) + " and " + n(spans[i].second) +
                    " overlap: their bases are " + n(spans[i].first - spans[i - 1].first) +
                    " bytes apart but each spans " + n(span) + " bytes");
}

namespace {
size_t slice_of(size_t page_tokens, size_t heads, size_t head_dim, size_t item_bytes) {
  VITRIFY_EXPECT(page_tokens > 0 && heads > 0 && head_dim > 0 && item_bytes > 0,
              "page_tokens, heads, head_dim and item_bytes must be positive, got " +
                  n(page_tokens) + ", " + n(heads) + ", " + n(head_dim) + ", " + n(item_bytes));
  return mul(mul(mul(page_tokens, heads, "slice bytes"), head_dim, "slice bytes"), item_bytes,
             "slice bytes");
}
}  // namespace

namespace {
// A layout whose slices are `page_tokens * heads * head_dim * item_bytes` long; `layer_major`
// puts all pages of a layer together ([layer][page], SGLang's layer_first), else all layers of
// a page ([page][layer], page_first).
PageLayout dense_layout(std::vector<uintptr_t> components, size_t layers, size_t pages,
                        size_t page_tokens, size_t heads, size_t head_dim, size_t item_bytes,
                        bool layer_major) {
  PageLayout l;
  l.components = std::move(components);
  l.layers = layers;
  l.pages = pages;
  l.slice_bytes = slice_of(page_tokens, heads, head_dim, item_bytes);
  if (layer_major) {
    l.page_stride = l.slice_bytes;
    l.layer_stride = mul(pages, l.slice_bytes, "layer_first layer_stride");
    l.component_bytes = mul(layers, l.layer_stride, "layer_first component bytes");
  } else {
    l.layer_stride = l.slice_bytes;
    l.page_stride = mul(layers, l.slice_bytes, "page_first page_stride");
    l.component_bytes = mul(pages, l.page_stride, "page_first component bytes");
  }
  l.validate();
  return l;
}
}  // namespace

PageLayout PageLayout::layer_first(std::vector<uintptr_t> components, size_t layers, size_t pages,
                                   size_t page_tokens, size_t heads, size_t head_dim,
                                   size_t item_bytes) {
  return dense_layout(std::move(components), layers, pages, page_tokens, heads, head_dim,
                      item_bytes, true);
}

PageLayout PageLayout::page_first(std::vector<uintptr_t> components, size_t layers, size_t pages,
                                  size_t page_tokens, size_t heads, size_t head_dim,
                                  size_t item_bytes) {
  return dense_layout(std::move(components), layers, pages, page_tokens, heads, head_dim,
                      item_bytes, false);
}

// ---- copier -------------------------------------------------------------------------------------

size_t Copier::default_threads() {
  const unsigned hc = std::thread::hardware_concurrency();
  return std::clamp<size_t>(hc == 0 ? 4 : hc, 1, 16);
}

Copier::Copier(size_t threads, bool streaming) : pool_(threads), streaming_(streaming) {}

Copier& default_copier() {
  // Intentionally leaked: worker threads must not be joined during static destruction.
  static Copier* c = new Copier();
  return *c;
}

void Copier::copy(const std::vector<Copy>& copies) {
  size_t total = 0;
  std::vector<size_t> ends;  // prefix sums: copy i covers [ends[i] - bytes, ends[i])
  ends.reserve(copies.size());
  for (const Copy& c : copies) {
    total = add(total, c.bytes, "total copy size");
    ends.push_back(total);
  }
  if (total == 0) return;
  const size_t tasks = task_count(total, total, threads());
  const bool streaming = streaming_ && total >= kStreamMinBytes;
  auto run_range = [&](size_t lo, size_t hi) {
    size_t i = std::upper_bound(ends.begin(), ends.end(), lo) - ends.begin();
    while (lo < hi && i < copies.size()) {
      const size_t start = ends[i] - copies[i].bytes;
      const size_t off = lo - start;
      const size_t len = std::min(hi, ends[i]) - lo;
      copy_bytes(copies[i].dst + off, copies[i].src + off, len, streaming);
      lo += len;
      ++i;
    }
    store_fence(streaming);
  };
  if (tasks <= 1) {
    run_range(0, total);
    return;
  }
  const unsigned __int128 T = total;
  pool_.run(tasks, [&](size_t t) {
    const size_t lo = static_cast<size_t>(T * t / tasks);
    const size_t hi = static_cast<size_t>(T * (t + 1) / tasks);
    run_range(lo, hi);
  });
}

namespace {

void check_distinct(const std::vector<size_t>& pages, const char* what) {
  std::vector<size_t> sorted = pages;
  std::sort(sorted.begin(), sorted.end());
  const auto dup = std::adjacent_find(sorted.begin(), sorted.end());
  VITRIFY_EXPECT(dup == sorted.end(),
                 std::string(what) + ": page " + (dup == sorted.end() ? std::string() : n(*dup)) +
                     " appears twice (two sources for one page)");
}

void check_page(const PageLayout& l, size_t page) {
  VITRIFY_EXPECT(page < l.pages, "page " + n(page) + " out of range: the layout has " +
                                  n(l.pages) + " pages");
}

void add_page(const PageLayout& l, size_t page, uint8_t* blob, bool to_blob,
              std::vector<Copier::Copy>& out) {
  const size_t L = l.layers;
  for (size_t c = 0; c < l.components.size(); ++c)
    for (size_t layer = 0; layer < L; ++layer) {
      uint8_t* mem = reinterpret_cast<uint8_t*>(l.components[c]) + layer * l.layer_stride +
                     page * l.page_stride;
      uint8_t* b = blob + (c * L + layer) * l.slice_bytes;
      if (to_blob)
        out.push_back({b, mem, l.slice_bytes});
      else
        out.push_back({mem, b, l.slice_bytes});
    }
}

void check_buffer(const void* p, size_t have, size_t need, const char* what) {
  VITRIFY_EXPECT(p != nullptr, std::string(what) + " is a null pointer");
  VITRIFY_EXPECT(have >= need, std::string(what) + " holds " + n(have) + " bytes, " + n(need) +
                                " needed (a page blob is components*layers*slice_bytes)");
}

size_t batch_extent(size_t count, size_t stride, size_t blob, const char* what) {
  VITRIFY_EXPECT(stride >= blob, std::string(what) + " stride " + n(stride) +
                                  " is smaller than a page blob of " + n(blob) + " bytes");
  return add(mul(count - 1, stride, what), blob, what);
}

}  // namespace

void Copier::gather(const PageLayout& layout, size_t page, void* dst, size_t capacity) {
  layout.validate();
  check_page(layout, page);
  check_buffer(dst, capacity, layout.blob_bytes(), "gather destination");
  std::vector<Copy> copies;
  copies.reserve(layout.components.size() * layout.layers);
  add_page(layout, page, static_cast<uint8_t*>(dst), true, copies);
  copy(copies);
}

void Copier::scatter(const void* src, size_t src_bytes, const PageLayout& layout, size_t page) {
  layout.validate();
  check_page(layout, page);
  check_buffer(src, src_bytes, layout.blob_bytes(), "scatter source");
  std::vector<Copy> copies;
  copies.reserve(layout.components.size() * layout.layers);
  add_page(layout, page, const_cast<uint8_t*>(static_cast<const uint8_t*>(src)), false, copies);
  copy(copies);
}

void Copier::gather_pages(const PageLayout& layout, const std::vector<size_t>& pages, void* dst,
                          size_t dst_stride, size_t capacity) {
  layout.validate();
  if (pages.empty()) return;
  for (size_t p : pages) check_page(layout, p);
  const size_t need = batch_extent(pages.size(), dst_stride, layout.blob_bytes(), "gather_pages");
  check_buffer(dst, capacity, need, "gather_pages destination");
  std::vector<Copy> copies;
  copies.reserve(pages.size() * layout.components.size() * layout.layers);
  for (size_t i = 0; i < pages.size(); ++i)
    add_page(layout, pages[i], static_cast<uint8_t*>(dst) + i * dst_stride, true, copies);
  copy(copies);
}

void Copier::scatter_pages(const void* src, size_t src_stride, size_t src_bytes,
                           const PageLayout& layout, const std::vector<size_t>& pages) {
  layout.validate();
  if (pages.empty()) return;
  for (size_t p : pages) check_page(layout, p);
  check_distinct(pages, "scatter_pages");
  const size_t need = batch_extent(pages.size(), src_stride, layout.blob_bytes(), "scatter_pages");
  check_buffer(src, src_bytes, need, "scatter_pages source");
  std::vector<Copy> copies;
  copies.reserve(pages.size() * layout.components.size() * layout.layers);
  for (size_t i = 0; i < pages.size(); ++i)
    add_page(layout, pages[i],
             const_cast<uint8_t*>(static_cast<const uint8_t*>(src)) + i * src_stride, false,
             copies);
  copy(copies);
}

namespace {

void check_each(const PageLayout& l, const std::vector<size_t>& pages,
                const std::vector<uintptr_t>& bufs, size_t each, const char* what) {
  VITRIFY_EXPECT(bufs.size() == pages.size(), std::string(what) + ": " + n(bufs.size()) +
                                               " buffers for " + n(pages.size()) + " pages");
  for (size_t p : pages) check_page(l, p);
  for (uintptr_t b : bufs) check_buffer(reinterpret_cast<const void*>(b), each, l.blob_bytes(), what);
}

}  // namespace

void Copier::gather_each(const PageLayout& layout, const std::vector<size_t>& pages,
                         const std::vector<uintptr_t>& dsts, size_t each_bytes) {
  layout.validate();
  check_each(layout, pages, dsts, each_bytes, "gather_each destination");
  std::vector<Copy> copies;
  copies.reserve(pages.size() * layout.components.size() * layout.layers);
  for (size_t i = 0; i < pages.size(); ++i)
    add_page(layout, pages[i], reinterpret_cast<uint8_t*>(dsts[i]), true, copies);
  copy(copies);
}

void Copier::scatter_each(const std::vector<uintptr_t>& srcs, size_t each_bytes,
                          const PageLayout& layout, const std::vector<size_t>& pages) {
  layout.validate();
  check_each(layout, pages, srcs, each_bytes, "scatter_each source");
  check_distinct(pages, "scatter_each");
  std::vector<Copy> copies;
  copies.reserve(pages.size() * layout.components.size() * layout.layers);
  for (size_t i = 0; i < pages.size(); ++i)
    add_page(layout, pages[i], reinterpret_cast<uint8_t*>(srcs[i]), false, copies);
  copy(copies);
}

std::vector<uint32_t> Copier::scatter_crc_each(const std::vector<uintptr_t>& srcs,
                                               size_t each_bytes, const PageLayout& layout,
                                               const std::vector<size_t>& pages) {
  layout.validate();
  check_each(layout, pages, srcs, each_bytes, "scatter_crc_each source");
  check_distinct(pages, "scatter_crc_each");
  std::vector<uint32_t> crcs(pages.size(), 0);
  if (pages.empty()) return crcs;
  // The pages' slices in blob order, page after page: slice k is slice k % per_page of page
  // k / per_page. A task copies a contiguous run of slices and chains the CRC of each page's
  // slices it holds; the runs' CRCs of one page are combined afterwards, in order.
  const size_t per_page = layout.components.size() * layout.layers;
  const size_t slices = pages.size() * per_page;
  const size_t total = pages.size() * layout.blob_bytes();
  const size_t tasks = task_count(total, slices, threads());
  const bool streaming = streaming_ && total >= kStreamMinBytes;
  struct Run {
    size_t page_index;
    uint32_t crc;
    size_t bytes;
  };
  std::vector<std::vector<Run>> runs(tasks);
  auto run_slices = [&](size_t t) {
    const size_t lo = slices * t / tasks, hi = slices * (t + 1) / tasks;
    for (size_t k = lo; k < hi;) {
      const size_t i = k / per_page;
      const size_t end = std::min(hi, (i + 1) * per_page);
      const size_t first = k;
      uint32_t crc = 0;
      for (; k < end; ++k) {
        const size_t s = k % per_page, c = s / layout.layers, layer = s % layout.layers;
        uint8_t* mem = reinterpret_cast<uint8_t*>(layout.components[c]) +
                       layer * layout.layer_stride + pages[i] * layout.page_stride;
        const auto* blob = reinterpret_cast<const uint8_t*>(srcs[i]) + s * layout.slice_bytes;
        crc = crc32c_copy(mem, blob, layout.slice_bytes, crc, streaming);
      }
      runs[t].push_back({i, crc, (end - first) * layout.slice_bytes});
    }
  };
  if (tasks == 1)
    run_slices(0);
  else
    pool_.run(tasks, run_slices);
  std::vector<bool> started(pages.size(), false);
  for (const std::vector<Run>& task_runs : runs)
    for (const Run& r : task_runs) {
      crcs[r.page_index] = started[r.page_index]
                               ? crc32c_combine(crcs[r.page_index], r.crc, r.bytes)
                               : r.crc;
      started[r.page_index] = true;
    }
  return crcs;
}

}  // namespace vitrify::host
