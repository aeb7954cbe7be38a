// PageMover: KV pages between a host page layout (vitrify/host.hpp) and one payload kind of a
// disk Store (vitrify/disk.hpp), pipelined in native code so an engine makes one call per batch.
// Invariants D15-D21: csrc/src/disk/DESIGN.md ("Page mover").
//
//   put_pages: skip keys already indexed -> gather chunk i into staging set i % 2 ->
//              submit_put(chunk i) || gather chunk i + 1 -> wait -> per-key PutResult
//   get_pages: submit_get(chunks 0, 1) -> wait chunk i -> scatter its verified hits ||
//              chunk i + 1 is read -> submit_get(chunk i + 2) into chunk i's set -> per-key hit
//   get_pages of a host store (D21): Store::read_mapped -> the Copier copies every page from the
//              slab mapping into its host page and checksums it in the same pass -> per-key hit
//
// The mover owns its staging buffers: two sets of `chunk` slot buffers per direction, allocated
// once by the constructor. It does no I/O and no copy of its own: gather/scatter are the host
// Copier's, writes, reads, verification (D1) and dedup (D6) the Store's.
//
// Thread safety: one mutex per direction. put_pages calls run one after another (they share the
// put staging sets), and so do get_pages calls; a put and a get may run at the same time, on one
// store or on different ones. The Store and the Copier are thread-safe themselves. No mutex of
// the mover is held while calling anything but the Store and the Copier.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

#include "vitrify/disk.hpp"
#include "vitrify/host.hpp"

namespace vitrify::disk {

struct PutPagesResult {
  // Per key: the store's acknowledgement (kStored, kDuplicate, kFull, kError, kCancelled), or
  // kDuplicate for a key the index already held before the call (not gathered, not written).
  std::vector<PutResult> results;
  size_t present = 0;  // keys the index already held before the call
};

struct DroppedPage {
  size_t index = 0;  // position of the key in the call
  size_t bytes = 0;  // the stored payload length (not the page size asked for)
};

struct GetPagesResult {
  // Per key: true when the page was read, verified and scattered into its host page; false for
  // a miss (absent, failed verification, wrong length). A disk store's miss leaves its host
  // page untouched; a host store's miss found only after the copy (a torn or corrupt page,
  // D21) leaves it holding unspecified bytes: hand a missed page to nobody.
  std::vector<bool> hits;
  // Keys whose stored payload was not `blob_bytes` long: reported as misses and removed from
  // the store (a read-only store keeps them: it never removes anything, D14).
  std::vector<DroppedPage> dropped;
};

class PageMover {
 public:
  // Staging for `chunk` pages (>= 1) per chunk, each slot buffer `slot_bytes` long (a multiple of
  // 4096 above the 64-byte slot header; use Store::slot_bytes(kind)). `copier` gathers and
  // scatters and must outlive the mover. Throws std::invalid_argument for bad sizes,
  // std::bad_alloc when the 4 * chunk buffers cannot be allocated.
  PageMover(size_t slot_bytes, size_t chunk, host::Copier& copier);
  ~PageMover() = default;
  PageMover(const PageMover&) = delete;
  PageMover& operator=(const PageMover&) = delete;

  size_t slot_bytes() const noexcept { return slot_bytes_; }
  size_t chunk() const noexcept { return chunk_; }

  // Writes host page pages[i] of `layout` under keys[i] into `kind` of `store`. Keys the index
  // already holds are skipped (PutPagesResult::present). The rest go in chunks of `chunk`: chunk
  // i + 1 is gathered into the other staging set while chunk i is written. `blob_bytes` must be
  // layout.blob_bytes(), and the kind's slots no larger than this mover's. Returns after every
  // write was acknowledged. Exceptions of the Store or the Copier (std::invalid_argument for a
  // bad page index or payload size, std::system_error EROFS on a read-only store, ...) propagate
  // after every chunk already submitted was acknowledged (D18); those chunks may be stored.
  // `dirty` (a host store, D24): the pages are written dirty, for a write-back to a disk.
  PutPagesResult put_pages(Store& store, const std::vector<Key>& keys, unsigned kind,
                           const host::PageLayout& layout, const std::vector<size_t>& pages,
                           size_t blob_bytes, bool dirty = false);

  // Reads keys[i] from `kind` of `store` and scatters each verified page of exactly `blob_bytes`
  // into host page pages[i] of `layout` (pages of the hits must be distinct). Two chunks of
  // reads are in flight while one is scattered; a host store's pages are copied straight from
  // its mapping instead, all in one parallel pass (D21), and get_pages calls may overlap. A page of another length is removed from the
  // store and missed (GetPagesResult::dropped). Same preconditions and error behaviour as
  // put_pages: nothing is in flight when an exception propagates; pages scattered before it
  // stay written.
  GetPagesResult get_pages(Store& store, const std::vector<Key>& keys, unsigned kind,
                           const host::PageLayout& layout, const std::vector<size_t>& pages,
                           size_t blob_bytes);

 private:
  using StagingSet = std::vector<SlotBufferPtr>;
  void check_call(const Store& store, size_t keys, unsigned kind, const host::PageLayout& layout,
                  size_t pages, size_t blob_bytes) const;
  GetPagesResult get_pages_mapped(Store& store, const std::vector<Key>& keys, unsigned kind,
                                  const host::PageLayout& layout,
                                  const std::vector<size_t>& pages, size_t blob_bytes);

  size_t slot_bytes_;
  size_t chunk_;
  host::Copier& copier_;
  std::mutex put_mu_;  // owns put_sets_ for one put_pages call
  std::mutex get_mu_;  // owns get_sets_ for one get_pages call
  std::array<StagingSet, 2> put_sets_;
  std::array<StagingSet, 2> get_sets_;
};

}  // namespace vitrify::disk
