// PageMover: the gather -> write and read -> scatter pipelines between a host page layout and a
// Store kind, on the Store's tickets and the host Copier. Invariants D15-D21: DESIGN.md.
#include "vitrify/page_mover.hpp"

#include <algorithm>
#include <exception>
#include <string>
#include <utility>

#include "vitrify/error.hpp"
#include "vitrify/log.hpp"

namespace vitrify::disk {

namespace {

std::string n(size_t v) { return std::to_string(v); }

// The tickets of the (at most two) chunks in flight. Destroying it waits for every ticket it
// still holds, so an exception leaving put_pages/get_pages never leaves a staging buffer in a
// write or a read (D18). Never throws.
class InFlight {
 public:
  InFlight() = default;
  ~InFlight() {
    for (Ticket& t : tickets_) settle(t);
  }
  InFlight(const InFlight&) = delete;
  InFlight& operator=(const InFlight&) = delete;

  bool busy(size_t side) const noexcept { return tickets_[side] != nullptr; }
  void hold(size_t side, Ticket t) noexcept { tickets_[side] = std::move(t); }
  // Waits for the chunk of `side` and forgets its ticket.
  std::vector<int64_t> take(size_t side) {
    std::vector<int64_t> r = tickets_[side]->wait();
    tickets_[side].reset();
    return r;
  }

 private:
  static void settle(Ticket& t) noexcept {
    if (!t) return;
    try {
      t->wait();
    } catch (const std::exception& e) {  // the buffers stay alive through the store's jobs
      log::error(std::string("vitrify.disk: page mover: waiting for a chunk in flight: ") +
                 e.what());
    }
    t.reset();
  }
  std::array<Ticket, 2> tickets_;
};

}  // namespace

PageMover::PageMover(size_t slot_bytes, size_t chunk, host::Copier& copier)
    : slot_bytes_(slot_bytes), chunk_(chunk), copier_(copier) {
  VITRIFY_EXPECT(chunk >= 1, "PageMover: chunk must be >= 1 page, got 0");
  VITRIFY_EXPECT(slot_bytes > kSlotHeaderBytes && slot_bytes % kBlock == 0,
                 "PageMover: slot_bytes must be a multiple of " + n(kBlock) + " above the " +
                     n(kSlotHeaderBytes) + "-byte slot header, got " + n(slot_bytes));
  VITRIFY_EXPECT(chunk <= (size_t{1} << 20), "PageMover: chunk of " + n(chunk) +
                                                 " pages is above the limit of 1048576");
  // Allocated once (D15): every call reuses these buffers.
  for (auto* sets : {&put_sets_, &get_sets_})
    for (StagingSet& set : *sets) {
      set.reserve(chunk);
      for (size_t i = 0; i < chunk; ++i)
        set.push_back(std::make_shared<AlignedBuffer>(slot_bytes, kBlock));
    }
}

void PageMover::check_call(const Store& store, size_t keys, unsigned kind,
                           const host::PageLayout& layout, size_t pages,
                           size_t blob_bytes) const {
  VITRIFY_EXPECT(keys == pages, "PageMover: " + n(keys) + " keys for " + n(pages) + " pages");
  VITRIFY_EXPECT(blob_bytes == layout.blob_bytes(),
                 "PageMover: blob_bytes " + n(blob_bytes) + " differs from the layout's page of " +
                     n(layout.blob_bytes()) + " bytes");
  // Any payload of the kind fits a staging slot, so every read lands whole (D17).
  const uint64_t need = store.slot_bytes(kind);  // throws for a kind out of range
  VITRIFY_EXPECT(need <= slot_bytes_ && slot_bytes_for(blob_bytes) <= slot_bytes_,
                 "PageMover: staging slots of " + n(slot_bytes_) + " bytes are smaller than the " +
                     n(std::max<uint64_t>(need, slot_bytes_for(blob_bytes))) +
                     "-byte slots of kind " + std::to_string(kind));
}

PutPagesResult PageMover::put_pages(Store& store, const std::vector<Key>& keys, unsigned kind,
                                    const host::PageLayout& layout,
                                    const std::vector<size_t>& pages, size_t blob_bytes,
                                    bool dirty) {
  check_call(store, keys.size(), kind, layout, pages.size(), blob_bytes);
  PutPagesResult out;
  out.results.assign(keys.size(), PutResult::kDuplicate);
  if (keys.empty()) return out;
  const std::lock_guard lk(put_mu_);  // D19
  // Dedup before any copy (D16): an indexed key is neither gathered nor written.
  std::vector<size_t> todo;
  todo.reserve(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    if (store.lookup(kind, keys[i])) {
      ++out.present;
    } else {
      todo.push_back(i);
      out.results[i] = PutResult::kPending;
    }
  }
  std::array<std::vector<size_t>, 2> part;  // key indices of the chunk in each set
  const auto collect = [&](InFlight& flight, size_t side) {
    const std::vector<int64_t> r = flight.take(side);
    for (size_t j = 0; j < part[side].size(); ++j)
      out.results[part[side][j]] = static_cast<PutResult>(r[j]);
  };
  InFlight flight;
  std::vector<size_t> chunk_pages;
  std::vector<uintptr_t> dsts;
  for (size_t start = 0, ci = 0; start < todo.size(); start += chunk_, ++ci) {
    const size_t side = ci % 2;
    if (flight.busy(side)) collect(flight, side);  // its buffers are free again (D18)
    const size_t count = std::min(chunk_, todo.size() - start);
    part[side].assign(todo.begin() + static_cast<std::ptrdiff_t>(start),
                      todo.begin() + static_cast<std::ptrdiff_t>(start + count));
    const StagingSet& set = put_sets_[side];
    chunk_pages.clear();
    dsts.clear();
    std::vector<PutItem> items;
    items.reserve(count);
    for (size_t j = 0; j < count; ++j) {
      const size_t i = part[side][j];
      chunk_pages.push_back(pages[i]);
      dsts.push_back(reinterpret_cast<uintptr_t>(set[j]->data() + kSlotHeaderBytes));
      items.push_back(PutItem{keys[i], set[j], blob_bytes, dirty});
    }
    // Chunk i - 1 is being written meanwhile from the other set (D15).
    copier_.gather_each(layout, chunk_pages, dsts, slot_bytes_ - kSlotHeaderBytes);
    flight.hold(side, store.submit_put(kind, std::move(items)));
  }
  for (size_t side : {size_t{0}, size_t{1}})
    if (flight.busy(side)) collect(flight, side);
  return out;
}

GetPagesResult PageMover::get_pages(Store& store, const std::vector<Key>& keys, unsigned kind,
                                    const host::PageLayout& layout,
                                    const std::vector<size_t>& pages, size_t blob_bytes) {
  check_call(store, keys.size(), kind, layout, pages.size(), blob_bytes);
  GetPagesResult out;
  out.hits.assign(keys.size(), false);
  if (keys.empty()) return out;
  if (store.host()) return get_pages_mapped(store, keys, kind, layout, pages, blob_bytes);
  const std::lock_guard lk(get_mu_);  // D19
  const size_t chunks = (keys.size() + chunk_ - 1) / chunk_;
  const auto first_of = [&](size_t ci) { return ci * chunk_; };
  const auto count_of = [&](size_t ci) { return std::min(chunk_, keys.size() - ci * chunk_); };
  InFlight flight;
  const auto submit = [&](size_t ci) {
    const StagingSet& set = get_sets_[ci % 2];
    std::vector<GetItem> items;
    items.reserve(count_of(ci));
    for (size_t j = 0; j < count_of(ci); ++j)
      items.push_back(GetItem{keys[first_of(ci) + j], set[j]->data(), set[j]->size(), true});
    flight.hold(ci % 2, store.submit_get(kind, std::move(items)));
  };
  // Two chunks in flight (D15): chunk i + 1 is queued before chunk i is waited on, so the read
  // threads never drain while chunk i is scattered; chunk i + 2 reuses chunk i's set.
  for (size_t ci = 0; ci < std::min<size_t>(2, chunks); ++ci) submit(ci);
  std::vector<uintptr_t> srcs;
  std::vector<size_t> hit_pages, hit_keys;
  for (size_t ci = 0; ci < chunks; ++ci) {
    const size_t side = ci % 2;
    const std::vector<int64_t> r = flight.take(side);
    const StagingSet& set = get_sets_[side];
    srcs.clear();
    hit_pages.clear();
    hit_keys.clear();
    for (size_t j = 0; j < r.size(); ++j) {
      const size_t i = first_of(ci) + j;
      if (r[j] < 0) continue;  // absent or failed verification (D1): a miss
      if (static_cast<uint64_t>(r[j]) != blob_bytes) {  // not a page of this layout (D17)
        out.dropped.push_back(DroppedPage{i, static_cast<size_t>(r[j])});
        if (!store.read_only()) store.remove(kind, keys[i]);
        continue;
      }
      srcs.push_back(reinterpret_cast<uintptr_t>(set[j]->data() + kSlotHeaderBytes));
      hit_pages.push_back(pages[i]);
      hit_keys.push_back(i);
    }
    if (!srcs.empty()) {
      copier_.scatter_each(srcs, blob_bytes, layout, hit_pages);
      for (size_t i : hit_keys) out.hits[i] = true;  // only after the bytes are in place
    }
    if (ci + 2 < chunks) submit(ci + 2);
  }
  return out;
}

// A host store's pages go from the slab mapping straight into their host pages, the CRC
// computed in the same pass (D21): no staging, no read queue.
GetPagesResult PageMover::get_pages_mapped(Store& store, const std::vector<Key>& keys,
                                           unsigned kind, const host::PageLayout& layout,
                                           const std::vector<size_t>& pages, size_t blob_bytes) {
  GetPagesResult out;
  out.hits.assign(keys.size(), false);
  std::vector<size_t> wrong_size;
  const std::vector<int64_t> r = store.read_mapped(
      kind, keys, SIZE_MAX, [&](const std::vector<Store::MappedPayload>& items) {
        std::vector<std::optional<uint32_t>> crcs(items.size());
        std::vector<uintptr_t> srcs;
        std::vector<size_t> dst_pages, slots;
        for (size_t j = 0; j < items.size(); ++j) {
          if (items[j].bytes != blob_bytes) {  // not a page of this layout (D17)
            out.dropped.push_back(DroppedPage{items[j].index, items[j].bytes});
            wrong_size.push_back(items[j].index);
            continue;
          }
          srcs.push_back(reinterpret_cast<uintptr_t>(items[j].data));
          dst_pages.push_back(pages[items[j].index]);
          slots.push_back(j);
        }
        const std::vector<uint32_t> got =
            copier_.scatter_crc_each(srcs, blob_bytes, layout, dst_pages);
        for (size_t m = 0; m < slots.size(); ++m) crcs[slots[m]] = got[m];
        return crcs;
      });
  for (size_t i = 0; i < keys.size(); ++i) out.hits[i] = r[i] >= 0;
  if (!store.read_only())
    for (size_t i : wrong_size) store.remove(kind, keys[i]);
  return out;
}

}  // namespace vitrify::disk
