// The host tier: HostPool, layouts, gather/scatter, host<->GPU page transfers. Argument
// conversion and GIL release only; python/vitrify/host.py is the public API.
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "bind.hpp"
#include "vitrify/error.hpp"
#include "vitrify/host.hpp"

namespace nb = nanobind;

namespace vitrify::bindings {
namespace {

using host::HostPool;

// The Python HostPool owns the native pool through a shared_ptr; numpy views of a slab hold
// another reference, so a view never outlives the memory it shows (close() drops only ours).
struct PoolHandle {
  std::shared_ptr<HostPool> pool;
  HostPool& get() const {
    if (!pool) throw std::invalid_argument("the HostPool is closed");
    return *pool;
  }
};

host::Registration parse_registration(const std::string& s) {
  if (s == "auto") return host::Registration::Auto;
  if (s == "on") return host::Registration::On;
  if (s == "off") return host::Registration::Off;
  throw std::invalid_argument("register must be 'auto', 'on' or 'off', got '" + s + "'");
}

host::Direction parse_direction(const std::string& s) {
  if (s == "h2d") return host::Direction::HostToDevice;
  if (s == "d2h") return host::Direction::DeviceToHost;
  throw std::invalid_argument("direction must be 'h2d' or 'd2h', got '" + s + "'");
}

host::TransferPath parse_path(const std::string& s) {
  if (s == "auto") return host::TransferPath::Auto;
  if (s == "batch") return host::TransferPath::Batch;
  if (s == "loop") return host::TransferPath::Loop;
  throw std::invalid_argument("path must be 'auto', 'batch' or 'loop', got '" + s + "'");
}

nb::dict slab_dict(const host::SlabPlan& s) {
  nb::dict d;
  d["index"] = s.index;
  d["first_page"] = s.first_page;
  d["pages"] = s.pages;
  d["bytes"] = s.bytes;
  d["map_bytes"] = s.map_bytes;
  return d;
}

using Pages = std::vector<size_t>;
using Bases = std::vector<uintptr_t>;

}  // namespace

void bind_host(nb::module_& m) {
  m.def(
      "host_plan_slabs",
      [](size_t total, size_t page, size_t ceiling, size_t align) {
        nb::list out;
        for (const auto& s : host::plan_slabs(total, page, ceiling, align)) out.append(slab_dict(s));
        return out;
      },
      nb::arg("total_bytes"), nb::arg("page_bytes"), nb::arg("max_slab_bytes"),
      nb::arg("map_align"));

  m.def(
      "host_check_hugetlbfs_capacity",
      [](const std::string& mount, size_t needed, uint64_t magic, uint64_t bsize, uint64_t free) {
        host::check_hugetlbfs_capacity(mount, needed, host::FsCapacity{magic, bsize, free});
      },
      nb::arg("mount"), nb::arg("needed"), nb::arg("fs_magic"), nb::arg("block_size"),
      nb::arg("free_blocks"));
  m.attr("HUGETLBFS_MAGIC") = host::kHugetlbfsMagic;

  nb::class_<PoolHandle>(m, "HostPool")
      .def(
          "__init__",
          [](PoolHandle* self, size_t total, size_t page, size_t ceiling, const std::string& mount,
             const std::string& reg, bool parallel, size_t reg_threads, bool prefault, int device,
             std::optional<std::tuple<uint64_t, uint64_t, uint64_t>> fake_statfs) {
            host::HostPoolOptions o;
            o.max_slab_bytes = ceiling;
            o.hugetlbfs_mount = mount;
            o.registration = parse_registration(reg);
            o.parallel_registration = parallel;
            o.registration_threads = reg_threads;
            o.prefault = prefault;
            o.device = device;
            if (fake_statfs) {
              const auto [magic, bsize, free] = *fake_statfs;
              o.statfs = [=](const std::string&) { return host::FsCapacity{magic, bsize, free}; };
            }
            std::shared_ptr<HostPool> p;
            {
              nb::gil_scoped_release nogil;
              p = std::make_shared<HostPool>(total, page, std::move(o));
            }
            new (self) PoolHandle{std::move(p)};
          },
          nb::arg("total_bytes"), nb::arg("page_bytes"), nb::arg("max_slab_bytes"),
          nb::arg("hugetlbfs_mount"), nb::arg("register"), nb::arg("parallel"),
          nb::arg("registration_threads"), nb::arg("prefault"), nb::arg("device"),
          nb::arg("fake_statfs").none())
      .def("close",
           [](PoolHandle& h) {
             std::shared_ptr<HostPool> p = std::move(h.pool);
             nb::gil_scoped_release nogil;
             p.reset();  // unregisters and unmaps unless a slab view still holds the pool
           })
      .def_prop_ro("closed", [](const PoolHandle& h) { return !h.pool; })
      .def_prop_ro("total_bytes", [](const PoolHandle& h) { return h.get().total_bytes(); })
      .def_prop_ro("page_bytes", [](const PoolHandle& h) { return h.get().page_bytes(); })
      .def_prop_ro("num_pages", [](const PoolHandle& h) { return h.get().num_pages(); })
      .def_prop_ro("num_slabs", [](const PoolHandle& h) { return h.get().num_slabs(); })
      .def_prop_ro("pages_per_slab", [](const PoolHandle& h) { return h.get().pages_per_slab(); })
      .def_prop_ro("max_slab_bytes", [](const PoolHandle& h) { return h.get().max_slab_bytes(); })
      .def_prop_ro("map_align", [](const PoolHandle& h) { return h.get().map_align(); })
      .def_prop_ro("device", [](const PoolHandle& h) { return h.get().device(); })
      .def_prop_ro("hugetlbfs_mount",
                   [](const PoolHandle& h) { return h.get().hugetlbfs_mount(); })
      .def_prop_ro("registered", [](const PoolHandle& h) { return h.get().registered(); })
      .def("slabs",
           [](const PoolHandle& h) {
             nb::list out;
             for (const auto& s : h.get().slabs()) out.append(slab_dict(s));
             return out;
           })
      .def("registration",
           [](const PoolHandle& h) {
             const auto& t = h.get().registration();
             nb::dict d;
             d["registered"] = t.registered;
             d["parallel"] = t.parallel;
             d["threads"] = t.threads;
             d["seconds"] = t.seconds;
             d["slab_seconds"] = t.slab_seconds;
             d["prefault_seconds"] = t.prefault_seconds;
             return d;
           })
      .def("slab_address",
           [](const PoolHandle& h, size_t s) {
             return reinterpret_cast<uintptr_t>(h.get().slab_base(s));
           })
      .def("slab_of", [](const PoolHandle& h, size_t page) { return h.get().slab_of(page); })
      .def("page_address",
           [](const PoolHandle& h, size_t page) {
             return reinterpret_cast<uintptr_t>(h.get().page_address(page));
           })
      .def("segments",
           [](const PoolHandle& h, size_t first, size_t count) {
             std::vector<std::tuple<size_t, size_t, size_t, uintptr_t, size_t>> out;
             for (const auto& s : h.get().segments(first, count))
               out.emplace_back(s.slab, s.first_page, s.pages, reinterpret_cast<uintptr_t>(s.ptr),
                                s.bytes);
             return out;
           })
      .def(
          "slab_array",
          [](const PoolHandle& h, size_t s) {
            HostPool& p = h.get();
            uint8_t* base = p.slab_base(s);
            const size_t n = p.slabs()[s].bytes;
            auto* keep = new std::shared_ptr<HostPool>(h.pool);
            nb::capsule owner(keep, [](void* k) noexcept {
              delete static_cast<std::shared_ptr<HostPool>*>(k);
            });
            return nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>(base, {n}, owner);
          },
          nb::rv_policy::reference)
      .def(
          "transfer",
          [](const PoolHandle& h, const std::string& direction,
             const std::vector<std::tuple<size_t, size_t, uint64_t>>& runs, uintptr_t stream,
             const std::string& path) {
            std::vector<host::PageRun> rs;
            rs.reserve(runs.size());
            for (const auto& [first, count, dptr] : runs)
              rs.push_back({first, count, static_cast<CUdeviceptr>(dptr)});
            const auto dir = parse_direction(direction);
            const auto how = parse_path(path);
            host::TransferStats st;
            {
              nb::gil_scoped_release nogil;
              st = host::transfer(h.get(), dir, rs, reinterpret_cast<CUstream>(stream), how);
            }
            nb::dict d;
            d["path"] = st.path == host::TransferPath::Batch ? "batch" : "loop";
            d["copies"] = st.copies;
            d["driver_calls"] = st.driver_calls;
            d["bytes"] = st.bytes;
            return d;
          },
          nb::arg("direction"), nb::arg("runs"), nb::arg("stream"), nb::arg("path"));

  nb::class_<host::HostRegistration>(m, "HostRegistration")
      .def(
          "__init__",
          [](host::HostRegistration* self, uintptr_t ptr, size_t bytes, int device,
             size_t ceiling) {
            nb::gil_scoped_release nogil;
            new (self) host::HostRegistration(reinterpret_cast<void*>(ptr), bytes, device, ceiling);
          },
          nb::arg("ptr"), nb::arg("nbytes"), nb::arg("device"), nb::arg("max_bytes"))
      .def("close",
           [](host::HostRegistration& r) {
             nb::gil_scoped_release nogil;
             r = host::HostRegistration();
           })
      .def_prop_ro("ptr", [](const host::HostRegistration& r) {
        return reinterpret_cast<uintptr_t>(r.ptr());
      })
      .def_prop_ro("nbytes", &host::HostRegistration::bytes);

  nb::class_<host::PageLayout>(m, "PageLayout")
      .def(
          "__init__",
          [](host::PageLayout* self, Bases comps, size_t comp_bytes, size_t layers, size_t pages,
             size_t slice, size_t layer_stride, size_t page_stride) {
            auto* l = new (self) host::PageLayout();
            l->components = std::move(comps);
            l->component_bytes = comp_bytes;
            l->layers = layers;
            l->pages = pages;
            l->slice_bytes = slice;
            l->layer_stride = layer_stride;
            l->page_stride = page_stride;
          },
          nb::arg("components"), nb::arg("component_bytes"), nb::arg("layers"), nb::arg("pages"),
          nb::arg("slice_bytes"), nb::arg("layer_stride"), nb::arg("page_stride"))
      .def_static("layer_first", &host::PageLayout::layer_first, nb::arg("components"),
                  nb::arg("layers"), nb::arg("pages"), nb::arg("page_tokens"), nb::arg("heads"),
                  nb::arg("head_dim"), nb::arg("item_bytes"))
      .def_static("page_first", &host::PageLayout::page_first, nb::arg("components"),
                  nb::arg("layers"), nb::arg("pages"), nb::arg("page_tokens"), nb::arg("heads"),
                  nb::arg("head_dim"), nb::arg("item_bytes"))
      .def("validate", &host::PageLayout::validate)
      .def_ro("components", &host::PageLayout::components)
      .def_ro("component_bytes", &host::PageLayout::component_bytes)
      .def_ro("layers", &host::PageLayout::layers)
      .def_ro("pages", &host::PageLayout::pages)
      .def_ro("slice_bytes", &host::PageLayout::slice_bytes)
      .def_ro("layer_stride", &host::PageLayout::layer_stride)
      .def_ro("page_stride", &host::PageLayout::page_stride)
      .def_prop_ro("blob_bytes", &host::PageLayout::blob_bytes);

  nb::class_<host::Copier>(m, "Copier")
      .def(nb::init<size_t, bool>(), nb::arg("threads"), nb::arg("streaming"))
      .def_prop_ro("threads", &host::Copier::threads)
      .def_prop_ro("streaming", &host::Copier::streaming)
      .def(
          "gather",
          [](host::Copier& c, const host::PageLayout& l, size_t page, uintptr_t dst, size_t cap) {
            nb::gil_scoped_release nogil;
            c.gather(l, page, reinterpret_cast<void*>(dst), cap);
          },
          nb::arg("layout"), nb::arg("page"), nb::arg("dst"), nb::arg("capacity"))
      .def(
          "scatter",
          [](host::Copier& c, uintptr_t src, size_t n, const host::PageLayout& l, size_t page) {
            nb::gil_scoped_release nogil;
            c.scatter(reinterpret_cast<const void*>(src), n, l, page);
          },
          nb::arg("src"), nb::arg("src_bytes"), nb::arg("layout"), nb::arg("page"))
      .def(
          "gather_pages",
          [](host::Copier& c, const host::PageLayout& l, const Pages& pages, uintptr_t dst,
             size_t stride, size_t cap) {
            nb::gil_scoped_release nogil;
            c.gather_pages(l, pages, reinterpret_cast<void*>(dst), stride, cap);
          },
          nb::arg("layout"), nb::arg("pages"), nb::arg("dst"), nb::arg("dst_stride"),
          nb::arg("capacity"))
      .def(
          "scatter_pages",
          [](host::Copier& c, uintptr_t src, size_t stride, size_t n, const host::PageLayout& l,
             const Pages& pages) {
            nb::gil_scoped_release nogil;
            c.scatter_pages(reinterpret_cast<const void*>(src), stride, n, l, pages);
          },
          nb::arg("src"), nb::arg("src_stride"), nb::arg("src_bytes"), nb::arg("layout"),
          nb::arg("pages"))
      .def(
          "gather_each",
          [](host::Copier& c, const host::PageLayout& l, const Pages& pages, const Bases& dsts,
             size_t each) {
            nb::gil_scoped_release nogil;
            c.gather_each(l, pages, dsts, each);
          },
          nb::arg("layout"), nb::arg("pages"), nb::arg("dsts"), nb::arg("each_bytes"))
      .def(
          "scatter_each",
          [](host::Copier& c, const Bases& srcs, size_t each, const host::PageLayout& l,
             const Pages& pages) {
            nb::gil_scoped_release nogil;
            c.scatter_each(srcs, each, l, pages);
          },
          nb::arg("srcs"), nb::arg("each_bytes"), nb::arg("layout"), nb::arg("pages"));
  m.def("host_default_copier", &host::default_copier, nb::rv_policy::reference);
  m.def("host_default_threads", &host::Copier::default_threads);

  nb::class_<host::Stream>(m, "Stream")
      .def(
          "__init__",
          [](host::Stream* self, int device) {
            nb::gil_scoped_release nogil;
            new (self) host::Stream(device);
          },
          nb::arg("device"))
      .def_prop_ro("handle",
                   [](const host::Stream& s) { return reinterpret_cast<uintptr_t>(s.get()); })
      .def("synchronize", [](const host::Stream& s) {
        nb::gil_scoped_release nogil;
        s.synchronize();
      });

  m.def("host_batch_copy_available", [] {
    nb::gil_scoped_release nogil;
    return host::batch_copy_available();
  });
  m.def(
      "host_memcpy_sync",
      [](const std::string& direction, int device, uint64_t dptr, uintptr_t hptr, size_t n) {
        const auto dir = parse_direction(direction);
        nb::gil_scoped_release nogil;
        host::memcpy_sync(dir, device, static_cast<CUdeviceptr>(dptr),
                          reinterpret_cast<void*>(hptr), n);
      },
      nb::arg("direction"), nb::arg("device"), nb::arg("device_ptr"), nb::arg("host_ptr"),
      nb::arg("nbytes"));
}

}  // namespace vitrify::bindings
