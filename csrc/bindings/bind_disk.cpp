// The disk tier: argument conversion and GIL release only (logic in csrc/src/disk).
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <utility>

#include "bind.hpp"
#include "vitrify/disk.hpp"
#include "vitrify/error.hpp"
#include "vitrify/file_io.hpp"
#include "vitrify/host.hpp"
#include "vitrify/page_mover.hpp"

namespace nb = nanobind;

namespace vitrify::bindings {
namespace {

using disk::Key;
using RoArray = nb::ndarray<nb::ro, nb::c_contig, nb::device::cpu>;
using RwArray = nb::ndarray<nb::c_contig, nb::device::cpu>;

// A slot buffer of one kind, shared with write jobs in flight.
struct SlotBuffer {
  disk::SlotBufferPtr buf;
  unsigned kind;
  size_t capacity;  // payload bytes (the kind's page_bytes)
};

// A ticket plus the slot buffers it must keep alive.
struct PyTicket {
  disk::Ticket t;
  std::vector<disk::SlotBufferPtr> keep;
};

Key to_key(const nb::bytes& b) {
  VITRIFY_EXPECT(b.size() == disk::kKeyBytes,
              "disk keys are " + std::to_string(disk::kKeyBytes) + " bytes, got " +
                  std::to_string(b.size()));
  Key k;
  std::memcpy(k.data(), b.c_str(), disk::kKeyBytes);
  return k;
}

std::vector<Key> to_keys(const std::vector<nb::bytes>& keys) {
  std::vector<Key> out;
  out.reserve(keys.size());
  for (const auto& b : keys) out.push_back(to_key(b));
  return out;
}

std::vector<int64_t> wait(const disk::Ticket& t) {
  nb::gil_scoped_release nogil;
  return t->wait();
}

disk::Ticket submit_copy(disk::Store& s, unsigned kind, const std::vector<nb::bytes>& keys,
                         const std::vector<RoArray>& datas, bool dirty = false) {
  VITRIFY_EXPECT(keys.size() == datas.size(), "got " + std::to_string(keys.size()) + " keys and " +
                                               std::to_string(datas.size()) + " payloads");
  std::vector<Key> ks = to_keys(keys);
  std::vector<const void*> srcs;
  std::vector<size_t> lens;
  for (const auto& a : datas) {
    srcs.push_back(a.data());
    lens.push_back(a.nbytes());
  }
  nb::gil_scoped_release nogil;
  return s.submit_put_copy(kind, ks, srcs, lens, dirty);
}

std::vector<disk::PutItem> put_items(unsigned kind, const std::vector<nb::bytes>& keys,
                                     const std::vector<SlotBuffer*>& bufs,
                                     const std::vector<size_t>& lens) {
  VITRIFY_EXPECT(keys.size() == bufs.size() && keys.size() == lens.size(),
              "keys, buffers and lengths differ in count");
  std::vector<disk::PutItem> items;
  for (size_t i = 0; i < keys.size(); ++i) {
    VITRIFY_EXPECT(bufs[i] != nullptr, "buffer " + std::to_string(i) + " is None");
    VITRIFY_EXPECT(bufs[i]->kind == kind, "buffer " + std::to_string(i) + " belongs to kind " +
                                           std::to_string(bufs[i]->kind) + ", not " +
                                           std::to_string(kind));
    items.push_back(disk::PutItem{to_key(keys[i]), bufs[i]->buf, lens[i]});
  }
  return items;
}

PyObject* g_slab_locked = nullptr;  // vitrify.disk.SlabLockedError (an OSError)
PyObject* g_host_space = nullptr;   // vitrify.disk.HostSpaceError (an OSError, ENOSPC)

// disk::HostSpaceShort -> HostSpaceError(ENOSPC, message) with mount, needed_bytes, free_bytes.
void raise_host_space(const disk::HostSpaceShort& e) {
  PyObject* exc = PyObject_CallFunction(g_host_space, "is", e.code().value(), e.what());
  if (exc == nullptr) return;
  raise_with_attributes(g_host_space, exc,
                        {{"mount", PyUnicode_FromString(e.mount().c_str())},
                         {"needed_bytes", PyLong_FromUnsignedLongLong(e.needed())},
                         {"free_bytes", PyLong_FromUnsignedLongLong(e.free_bytes())}});
}

// disk::SlabBusy -> SlabLockedError(EBUSY, message) with path, holder_pid and holder_host.
void raise_slab_locked(const disk::SlabBusy& e) {
  PyObject* exc = PyObject_CallFunction(g_slab_locked, "is", e.code().value(), e.what());
  if (exc == nullptr) return;  // the call already set an exception
  const bool known = e.holder_pid() >= 0;  // else no owner record: None for both
  raise_with_attributes(
      g_slab_locked, exc,
      {{"path", PyUnicode_FromString(e.path().c_str())},
       {"holder_pid", known ? PyLong_FromLong(e.holder_pid()) : Py_NewRef(Py_None)},
       {"holder_host", known ? PyUnicode_FromString(e.holder_host().c_str())
                             : Py_NewRef(Py_None)}});
}

nb::dict stats_dict(const disk::StoreStats& s) {
  nb::dict d;
  nb::list kinds;
  for (const auto& k : s.kinds) {
    nb::dict kd;
    kd["page_bytes"] = k.page_bytes;
    kd["slot_bytes"] = k.slot_bytes;
    kd["slots_total"] = k.slots_total;
    kd["slots_used"] = k.slots_used;
    kd["entries"] = k.entries;
    kd["dirty"] = k.dirty;
    kd["occupancy"] = k.slots_total ? double(k.slots_used) / double(k.slots_total) : 0.0;
    kinds.append(kd);
  }
  d["kinds"] = kinds;
#define VITRIFY_STAT(f) d[#f] = s.f
  VITRIFY_STAT(spills); VITRIFY_STAT(spill_bytes); VITRIFY_STAT(reloads); VITRIFY_STAT(reload_bytes);
  VITRIFY_STAT(misses); VITRIFY_STAT(verify_failures); VITRIFY_STAT(dedup_hits); VITRIFY_STAT(gc_runs);
  VITRIFY_STAT(gc_reclaims); VITRIFY_STAT(deletes); VITRIFY_STAT(write_errors); VITRIFY_STAT(put_failures);
  VITRIFY_STAT(loaded_entries); VITRIFY_STAT(clears); VITRIFY_STAT(refreshes); VITRIFY_STAT(in_flight_writes); VITRIFY_STAT(in_flight_reads);
  VITRIFY_STAT(write_queue_depth); VITRIFY_STAT(read_queue_depth); VITRIFY_STAT(direct_io);
#undef VITRIFY_STAT
  return d;
}

}  // namespace

void bind_disk(nb::module_& m) {
  m.def("disk_set_denied_engines", &disk::set_denied_engines, nb::arg("names"),
        "The D25 test hook: the named disk engines (comma-separated) refuse with EPERM; \"\": "
        "none (vitrify.disk hands it VITRIFY_DISK_ENGINE_DENY at each open).");
  m.attr("DISK_KEY_BYTES") = disk::kKeyBytes;
  m.attr("DISK_SLOT_HEADER_BYTES") = disk::kSlotHeaderBytes;
  m.attr("DISK_FILE_HEADER_BYTES") = disk::kFileHeaderBytes;
  m.def("disk_slot_bytes_for", &disk::slot_bytes_for, nb::arg("payload_bytes"));
  m.def("disk_store_tag", &disk::store_tag, nb::arg("name"));
  m.def("disk_slab_lock_held", &disk::slab_lock_held, nb::arg("path"),
        "Whether an open store holds the OFD lock of the slab file `path`.");
  m.def(
      "disk_slab_header",
      [](const std::string& path) -> nb::object {
        const auto h = disk::read_slab_header(path);
        if (!h) return nb::none();
        nb::dict d;
        d["kind"] = h->kind;
        d["slot_bytes"] = h->slot_bytes;
        d["slot_count"] = h->slot_count;
        d["store_tag"] = h->store_tag;
        d["slab_id"] = h->slab_id;
        d["created_ns"] = h->created_ns;
        return d;
      },
      nb::arg("path"), "The verified file header of a slab file as a dict, or None.");
  m.def(
      "disk_slab_owner",
      [](const std::string& path) -> nb::object {
        const disk::SlabOwner o = disk::read_slab_owner(path);
        if (o.pid < 0) return nb::none();
        return nb::make_tuple(o.pid, o.host, o.since);
      },
      nb::arg("path"), "(pid, host, since) from the slab's owner record, or None.");
  m.def(
      "disk_host_fs",
      [](const std::string& dir) {
        const disk::HostFs f = disk::host_fs(dir);
        return nb::make_tuple(f.mount, f.type, f.block_size, f.free_bytes);
      },
      nb::arg("dir"), "(mount, type, block_size, free_bytes) of a host-tier directory.");

  g_slab_locked = PyErr_NewExceptionWithDoc(
      "vitrify.disk.SlabLockedError",
      "A slab file of the store is locked by another open store (this process or another); "
      "the message names the file and the holder. Attributes: path, holder_pid and holder_host "
      "(None when the holder left no owner record).",
      PyExc_OSError, nullptr);
  m.attr("SlabLockedError") = nb::handle(g_slab_locked);
  g_host_space = PyErr_NewExceptionWithDoc(
      "vitrify.disk.HostSpaceError",
      "The host tier's directory has too little free memory for the store's slabs (errno "
      "ENOSPC); nothing was grown or left behind. Attributes: mount, needed_bytes (what the "
      "slabs still need), free_bytes (what the mount has free).",
      PyExc_OSError, nullptr);
  m.attr("HostSpaceError") = nb::handle(g_host_space);
  // Registered after bind_common's translator, so tried before its std::system_error case.
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const disk::SlabBusy& e) {
      raise_slab_locked(e);
    } catch (const disk::HostSpaceShort& e) {
      raise_host_space(e);
    }
  });

  nb::class_<SlotBuffer>(m, "DiskSlotBuffer",
                         "A 4 KiB-aligned slot image of one payload kind; gather the payload "
                         "into view() (the 64-byte slot header before it belongs to the store).")
      .def_prop_ro("kind", [](const SlotBuffer& b) { return b.kind; })
      .def_prop_ro("capacity", [](const SlotBuffer& b) { return b.capacity; })
      .def_prop_ro("address", [](const SlotBuffer& b) {
        return reinterpret_cast<uintptr_t>(b.buf->data() + disk::kSlotHeaderBytes);
      })
      .def(
          "view",
          [](SlotBuffer& b) {
            size_t shape[1] = {b.capacity};
            return nb::ndarray<nb::memview, uint8_t, nb::ndim<1>, nb::c_contig>(
                b.buf->data() + disk::kSlotHeaderBytes, 1, shape, nb::find(&b));
          },
          "A writable memoryview (format B) over the payload area; zero-copy.");

  nb::class_<PyTicket>(m, "DiskTicket", "Acknowledgements of one submitted batch.")
      .def("wait", [](PyTicket& t) { return wait(t.t); },
           "Block (GIL released) until every operation finished; per-operation results.")
      .def("done", [](PyTicket& t) { return t.t->done(); });

  nb::class_<disk::Store>(m, "DiskStore")
      .def(
          "__init__",
          [](disk::Store* self, std::vector<std::string> dirs, uint64_t budget_bytes,
             std::vector<uint64_t> page_bytes, std::vector<double> shares, std::string name,
             std::string cold_start, std::string direct_io, unsigned write_threads,
             unsigned read_threads, unsigned queue_capacity, unsigned max_batch, double gc_high,
             double gc_low, unsigned load_threads, std::string slab_lock, bool read_only,
             bool host, int register_device, unsigned register_threads, std::string engine,
             unsigned queue_depth) {
            VITRIFY_EXPECT(page_bytes.size() == shares.size(),
                        "page_bytes and shares differ in count");
            disk::StoreConfig c;
            c.dirs = std::move(dirs);
            c.budget_bytes = budget_bytes;
            for (size_t i = 0; i < page_bytes.size(); ++i)
              c.kinds.push_back(disk::KindConfig{page_bytes[i], shares[i]});
            c.name = std::move(name);
            c.cold_start = disk::parse_cold_start(cold_start);
            c.direct_io = file_io::parse_direct_io(direct_io);
            c.write_threads = write_threads;
            c.read_threads = read_threads;
            c.queue_capacity = queue_capacity;
            c.max_batch = max_batch;
            c.gc_high = gc_high;
            c.gc_low = gc_low;
            c.load_threads = load_threads;
            c.slab_locking = disk::parse_slab_locking(slab_lock);
            c.read_only = read_only;
            c.host = host;
            c.register_device = register_device;
            c.register_threads = register_threads;
            c.engine = disk::parse_io_engine(engine);
            c.queue_depth = queue_depth;
            nb::gil_scoped_release nogil;
            new (self) disk::Store(std::move(c));
          },
          nb::arg("dirs"), nb::arg("budget_bytes"), nb::arg("page_bytes"), nb::arg("shares"),
          nb::arg("name"), nb::arg("cold_start"), nb::arg("direct_io"), nb::arg("write_threads"),
          nb::arg("read_threads"), nb::arg("queue_capacity"), nb::arg("max_batch"),
          nb::arg("gc_high"), nb::arg("gc_low"), nb::arg("load_threads") = 0,
          nb::arg("slab_lock") = "auto", nb::arg("read_only") = false, nb::arg("host") = false,
          nb::arg("register_device") = -1, nb::arg("register_threads") = 8,
          nb::arg("engine") = "auto", nb::arg("queue_depth") = 64)
      .def("close",
           [](disk::Store& s) {
             nb::gil_scoped_release nogil;
             s.close();
           })
      .def("clear",
           [](disk::Store& s) {
             nb::gil_scoped_release nogil;
             s.clear();
           })
      .def("refresh",
           [](disk::Store& s) {
             nb::gil_scoped_release nogil;
             return s.refresh();
           })
      .def("read_only", &disk::Store::read_only)
      .def("engine", [](const disk::Store& s) { return std::string(s.engine_name()); },
           "The slot-transfer engine in use: io_uring, aio, psync, or mapped (host tier).")
      .def("engine_fallback", &disk::Store::engine_fallback,
           "Why engine=auto passed over the engines it did not take (\"\": none).")
      .def(
          "registration",
          [](const disk::Store& s) {
            const host::RegistrationTiming& r = s.registration();
            nb::dict d;
            d["registered"] = r.registered;
            d["device"] = s.config().register_device;
            d["parallel"] = r.parallel;
            d["threads"] = r.threads;
            d["seconds"] = r.seconds;
            d["ranges"] = r.slab_seconds.size();
            d["range_seconds"] = r.slab_seconds;
            return d;
          },
          "The slab mappings' CUDA registration: registered, device (-1: none), parallel, "
          "threads, seconds, ranges, range_seconds.")
      .def("kind_count", &disk::Store::kind_count)
      .def("page_bytes", &disk::Store::page_bytes)
      .def("slot_bytes", &disk::Store::slot_bytes)
      .def("slab_path", [](disk::Store& s, unsigned k, unsigned d) { return s.slab(k, d).path(); })
      .def("slab_direct", [](disk::Store& s, unsigned k, unsigned d) { return s.slab(k, d).direct(); })
      .def("slot_offset",
           [](disk::Store& s, unsigned k, unsigned d, uint64_t slot) {
             return s.slab(k, d).slot_offset(slot);
           })
      .def("buffer",
           [](disk::Store& s, unsigned kind) {
             return SlotBuffer{s.make_buffer(kind), kind, static_cast<size_t>(s.page_bytes(kind))};
           })
      .def("put",
           [](disk::Store& s, unsigned kind, const std::vector<nb::bytes>& keys,
              const std::vector<RoArray>& datas) { return wait(submit_copy(s, kind, keys, datas)); })
      .def(
          "put_async",
          [](disk::Store& s, unsigned kind, const std::vector<nb::bytes>& keys,
             const std::vector<RoArray>& datas, bool dirty) {
            return PyTicket{submit_copy(s, kind, keys, datas, dirty), {}};
          },
          nb::arg("kind"), nb::arg("keys"), nb::arg("datas"), nb::arg("dirty") = false)
      .def("mark_clean",
           [](disk::Store& s, unsigned kind, const std::vector<nb::bytes>& keys) {
             std::vector<Key> ks = to_keys(keys);
             nb::gil_scoped_release nogil;
             return s.mark_clean(kind, ks);
           })
      .def("keys",
           [](disk::Store& s, unsigned kind, bool dirty_only) {
             std::vector<Key> ks;
             {
               nb::gil_scoped_release nogil;
               ks = s.keys(kind, dirty_only);
             }
             nb::list out;
             for (const Key& k : ks)
               out.append(nb::bytes(reinterpret_cast<const char*>(k.data()), k.size()));
             return out;
           })
      .def("put_buffers_async",
           [](disk::Store& s, unsigned kind, const std::vector<nb::bytes>& keys,
              const std::vector<SlotBuffer*>& bufs, const std::vector<size_t>& lens) {
             std::vector<disk::PutItem> items = put_items(kind, keys, bufs, lens);
             PyTicket t;
             for (auto& it : items) t.keep.push_back(it.buffer);
             nb::gil_scoped_release nogil;
             t.t = s.submit_put(kind, std::move(items));
             return t;
           })
      .def("put_buffers",
           [](disk::Store& s, unsigned kind, const std::vector<nb::bytes>& keys,
              const std::vector<SlotBuffer*>& bufs, const std::vector<size_t>& lens) {
             std::vector<disk::PutItem> items = put_items(kind, keys, bufs, lens);
             nb::gil_scoped_release nogil;
             return s.submit_put(kind, std::move(items))->wait();
           })
      .def("get_many",
           [](disk::Store& s, unsigned kind, const std::vector<nb::bytes>& keys) {
             std::vector<Key> ks = to_keys(keys);
             std::vector<nb::object> outs(ks.size());
             std::vector<disk::GetItem> items;
             for (size_t i = 0; i < ks.size(); ++i) {
               const auto len = s.lookup(kind, ks[i]);
               uint8_t* dst = nullptr;
               if (len) {
                 PyObject* b = PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(*len));
                 if (b == nullptr) throw nb::python_error();
                 outs[i] = nb::steal(b);
                 dst = reinterpret_cast<uint8_t*>(PyBytes_AS_STRING(b));
               }
               items.push_back(disk::GetItem{ks[i], dst, len.value_or(0), false, true});
             }
             std::vector<int64_t> r;
             {
               nb::gil_scoped_release nogil;
               r = s.submit_get(kind, std::move(items))->wait();
             }
             nb::list out;
             for (size_t i = 0; i < ks.size(); ++i) {
               const bool hit = r[i] >= 0 && outs[i].is_valid();
               out.append(hit ? outs[i] : nb::none());
             }
             return out;
           })
      .def("get_into",
           [](disk::Store& s, unsigned kind, const std::vector<nb::bytes>& keys,
              std::vector<RwArray> outs) {
             VITRIFY_EXPECT(keys.size() == outs.size(), "keys and outputs differ in count");
             std::vector<disk::GetItem> items;
             for (size_t i = 0; i < keys.size(); ++i)
               items.push_back(disk::GetItem{to_key(keys[i]), static_cast<uint8_t*>(outs[i].data()),
                                             outs[i].nbytes(), false});
             nb::gil_scoped_release nogil;
             return s.submit_get(kind, std::move(items))->wait();
           })
      .def("get_buffers_async",
           [](disk::Store& s, unsigned kind, const std::vector<nb::bytes>& keys,
              const std::vector<SlotBuffer*>& bufs) {
             VITRIFY_EXPECT(keys.size() == bufs.size(), "keys and buffers differ in count");
             std::vector<disk::GetItem> items;
             PyTicket t;
             for (size_t i = 0; i < keys.size(); ++i) {
               VITRIFY_EXPECT(bufs[i] != nullptr && bufs[i]->kind == kind,
                           "buffer " + std::to_string(i) + " is None or of another kind");
               t.keep.push_back(bufs[i]->buf);
               items.push_back(disk::GetItem{to_key(keys[i]), bufs[i]->buf->data(),
                                             bufs[i]->buf->size(), true});
             }
             nb::gil_scoped_release nogil;
             t.t = s.submit_get(kind, std::move(items));
             return t;
           })
      .def("get_buffers",
           [](disk::Store& s, unsigned kind, const std::vector<nb::bytes>& keys,
              const std::vector<SlotBuffer*>& bufs) {
             VITRIFY_EXPECT(keys.size() == bufs.size(), "keys and buffers differ in count");
             std::vector<disk::GetItem> items;
             std::vector<disk::SlotBufferPtr> keep;
             for (size_t i = 0; i < keys.size(); ++i) {
               VITRIFY_EXPECT(bufs[i] != nullptr && bufs[i]->kind == kind,
                           "buffer " + std::to_string(i) + " is None or of another kind");
               keep.push_back(bufs[i]->buf);
               items.push_back(disk::GetItem{to_key(keys[i]), bufs[i]->buf->data(),
                                             bufs[i]->buf->size(), true});
             }
             nb::gil_scoped_release nogil;
             return s.submit_get(kind, std::move(items))->wait();
           })
      .def("lookup",
           [](disk::Store& s, unsigned kind, const std::vector<nb::bytes>& keys) {
             std::vector<Key> ks = to_keys(keys);
             std::vector<int64_t> out;
             nb::gil_scoped_release nogil;
             for (const Key& k : ks) {
               const auto len = s.lookup(kind, k);
               out.push_back(len ? static_cast<int64_t>(*len) : -1);
             }
             return out;
           })
      .def("remove",
           [](disk::Store& s, unsigned kind, const std::vector<nb::bytes>& keys) {
             std::vector<Key> ks = to_keys(keys);
             std::vector<bool> out;
             nb::gil_scoped_release nogil;
             for (const Key& k : ks) out.push_back(s.remove(kind, k));
             return out;
           })
      .def("stats", [](disk::Store& s) {
        disk::StoreStats st;
        {
          nb::gil_scoped_release nogil;
          st = s.stats();
        }
        return stats_dict(st);
      });

  // One native call per batch (GIL released throughout): python/vitrify/disk.py PageMover.
  nb::class_<disk::PageMover>(m, "DiskPageMover",
                              "Host KV pages <-> one kind of a DiskStore, pipelined natively.")
      .def(nb::init<size_t, size_t, host::Copier&>(), nb::arg("slot_bytes"), nb::arg("chunk"),
           nb::arg("copier"), nb::keep_alive<1, 4>())  // the copier outlives the mover
      .def_prop_ro("slot_bytes", &disk::PageMover::slot_bytes)
      .def_prop_ro("chunk", &disk::PageMover::chunk)
      .def(
          "put_pages",
          [](disk::PageMover& mv, disk::Store& s, unsigned kind, const std::vector<nb::bytes>& keys,
             const host::PageLayout& layout, const std::vector<size_t>& pages, size_t blob_bytes,
             bool dirty) {
            const std::vector<Key> ks = to_keys(keys);
            disk::PutPagesResult r;
            {
              nb::gil_scoped_release nogil;
              r = mv.put_pages(s, ks, kind, layout, pages, blob_bytes, dirty);
            }
            std::vector<int> results;
            results.reserve(r.results.size());
            for (disk::PutResult x : r.results) results.push_back(static_cast<int>(x));
            return std::make_pair(std::move(results), r.present);
          },
          nb::arg("store"), nb::arg("kind"), nb::arg("keys"), nb::arg("layout"), nb::arg("pages"),
          nb::arg("blob_bytes"), nb::arg("dirty") = false,
          "(per-key PutResult values, keys already stored before the call)")
      .def(
          "get_pages",
          [](disk::PageMover& mv, disk::Store& s, unsigned kind, const std::vector<nb::bytes>& keys,
             const host::PageLayout& layout, const std::vector<size_t>& pages, size_t blob_bytes) {
            const std::vector<Key> ks = to_keys(keys);
            disk::GetPagesResult r;
            {
              nb::gil_scoped_release nogil;
              r = mv.get_pages(s, ks, kind, layout, pages, blob_bytes);
            }
            std::vector<std::pair<size_t, size_t>> dropped;
            for (const disk::DroppedPage& d : r.dropped) dropped.emplace_back(d.index, d.bytes);
            return std::make_pair(std::move(r.hits), std::move(dropped));
          },
          nb::arg("store"), nb::arg("kind"), nb::arg("keys"), nb::arg("layout"), nb::arg("pages"),
          nb::arg("blob_bytes"),
          "(per-key hit, [(key index, stored bytes)] of pages dropped for their length)");
}

}  // namespace vitrify::bindings
