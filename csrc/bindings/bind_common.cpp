// Errors, logging, settings and build facts shared by every area.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include <cstdio>
#include <optional>
#include <string>
#include <system_error>

#include "bind.hpp"
#include "vitrify/build_info.hpp"
#include "vitrify/crc32c.hpp"
#include "vitrify/driver.hpp"
#include "vitrify/error.hpp"
#include "vitrify/file_io.hpp"
#include "vitrify/fs.hpp"
#include "vitrify/graph_cuda.hpp"
#include "vitrify/log.hpp"

namespace nb = nanobind;

namespace vitrify::bindings {

void raise_with_attributes(PyObject* type, PyObject* exc,
                           std::initializer_list<std::pair<const char*, PyObject*>> attrs) {
  bool all = true;
  for (const auto& [name, value] : attrs) all = all && value != nullptr;
  if (!all) PyErr_Clear();  // a failed creation: the exception still carries its message
  for (const auto& [name, value] : attrs) {
    if (all) PyObject_SetAttrString(exc, name, value);
    Py_XDECREF(value);
  }
  PyErr_SetObject(type, exc);
  Py_DECREF(exc);
}

namespace {

PyObject* g_cuda_error = nullptr;
PyObject* g_cuda_oom = nullptr;
PyObject* g_unavailable = nullptr;
PyObject* g_log_callable = nullptr;  // strong reference, replaced under the GIL

void raise_cuda(PyObject* type, const CudaError& e) {
  PyObject* exc = PyObject_CallFunction(type, "s", e.what());
  if (exc == nullptr) return;  // the call already set an exception
  raise_with_attributes(type, exc,
                        {{"code", PyLong_FromLong(e.code())},
                         {"result_name", PyUnicode_FromString(e.name().c_str())},
                         {"call", PyUnicode_FromString(e.call().c_str())},
                         {"where", PyUnicode_FromString(e.where().c_str())}});
}

void translate(const std::exception_ptr& p, void*) {
  try {
    std::rethrow_exception(p);
  } catch (const CudaOutOfMemory& e) {
    raise_cuda(g_cuda_oom, e);
  } catch (const CudaError& e) {
    raise_cuda(g_cuda_error, e);
  } catch (const DriverUnavailable& e) {
    PyErr_SetString(g_unavailable, e.what());
  } catch (const OutOfSpace& e) {
    PyErr_SetString(PyExc_MemoryError, e.what());
  } catch (const std::system_error& e) {
    PyObject* args = Py_BuildValue("(is)", e.code().value(), e.what());
    if (args != nullptr) {
      PyErr_SetObject(PyExc_OSError, args);  // OSError picks the errno subclass itself
      Py_DECREF(args);
    }
  }
}

// Whether the interpreter is shutting down: a native thread that asks for the GIL then is
// ended by Python (pthread_exit), and unwinding that through this noexcept function aborts the
// process ("terminate called without an active exception").
bool interpreter_finalizing() noexcept {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

void log_sink(int level, const char* message) noexcept {
  if (!Py_IsInitialized() || interpreter_finalizing()) {
    // Too late for Python's logging: the message still reaches stderr (one line).
    if (level >= log::kWarning) std::fprintf(stderr, "vitrify.native: %s\n", message);
    return;
  }
  PyGILState_STATE st = PyGILState_Ensure();
  if (g_log_callable != nullptr) {
    PyObject* r = PyObject_CallFunction(g_log_callable, "is", level, message);
    if (r == nullptr)
      PyErr_Clear();  // logging must never raise into native code
    else
      Py_DECREF(r);
  }
  PyGILState_Release(st);
}

void set_log_sink(nb::object callable, int level) {
  Py_XDECREF(g_log_callable);
  g_log_callable = nullptr;
  if (callable.is_none()) {
    log::set_sink(nullptr, 0);
    return;
  }
  g_log_callable = callable.release().ptr();
  log::set_sink(&log_sink, level);
}

}  // namespace

void bind_common(nb::module_& m) {
  g_cuda_error = PyErr_NewExceptionWithDoc(
      "vitrify.CudaError",
      "A CUDA driver call failed. Attributes: code (CUresult), result_name, call, where.",
      PyExc_RuntimeError, nullptr);
  PyObject* oom_bases = PyTuple_Pack(2, g_cuda_error, PyExc_MemoryError);
  g_cuda_oom = PyErr_NewExceptionWithDoc(
      "vitrify.CudaOutOfMemoryError", "The CUDA driver returned CUDA_ERROR_OUT_OF_MEMORY.",
      oom_bases, nullptr);
  Py_DECREF(oom_bases);
  g_unavailable = PyErr_NewExceptionWithDoc(
      "vitrify.CudaUnavailableError",
      "The CUDA driver could not be loaded or initialised on this machine.", PyExc_RuntimeError,
      nullptr);
  m.attr("CudaError") = nb::handle(g_cuda_error);
  m.attr("CudaOutOfMemoryError") = nb::handle(g_cuda_oom);
  m.attr("CudaUnavailableError") = nb::handle(g_unavailable);
  nb::register_exception_translator(&translate);

  m.def("_set_log_sink", &set_log_sink, nb::arg("callable").none(), nb::arg("level"),
        "Route native log messages at `level` and above to callable(level, message); "
        "None removes the sink.");
  // The settings the core needs, read and validated once by vitrify.config and passed down at
  // import (the core itself reads no VITRIFY_* variable).
  m.def(
      "configure",
      [](const std::string& libcuda_path, std::optional<int> log_level,
         const std::string& cupti_path) {
        driver::set_library_path(libcuda_path);
        if (log_level) log::set_stderr_level(*log_level);
        graph::ModuleRecorder::instance().set_cupti_path(cupti_path);
      },
      nb::kw_only(), nb::arg("libcuda_path") = "", nb::arg("log_level").none() = nb::none(),
      nb::arg("cupti_path") = "",
      "Hand the core its settings: the CUDA driver library (\"\": libcuda.so.1; before anything "
      "loads the driver), the stderr log level without a sink (None: WARNING), the libcupti "
      "to load (\"\": search).");
  m.def("_log", [](int level, const std::string& msg) { log::write(level, msg); },
        "Emit a native log message (for tests of the log path).");

  m.def("build_info", [] {
    const BuildInfo b = build_info();
    nb::dict d;
    d["version"] = b.version;
    d["git_sha"] = b.git_sha;
    d["build_type"] = b.build_type;
    d["compiler"] = b.compiler;
    d["cuda_headers"] = b.cuda_headers;
    d["crc32c_hardware"] = b.crc32c_hardware;
    return d;
  });

  m.def(
      "crc32c",
      [](nb::bytes data, uint32_t crc) { return crc32c(data.c_str(), data.size(), crc); },
      nb::arg("data"), nb::arg("crc") = 0,
      "CRC32C (Castagnoli) of `data`, continuing from `crc`.");

  // The direct-I/O modes (VITRIFY_DIRECT_IO, every `direct_io` argument): the names of the one
  // native enum, and its parser (any letter case -> the canonical name; else ValueError).
  m.attr("DIRECT_IO_MODES") = nb::make_tuple(file_io::direct_io_name(file_io::DirectIo::kAuto),
                                             file_io::direct_io_name(file_io::DirectIo::kOn),
                                             file_io::direct_io_name(file_io::DirectIo::kOff));
  m.def(
      "parse_direct_io",
      [](const std::string& text) {
        return std::string(file_io::direct_io_name(file_io::parse_direct_io(text)));
      },
      nb::arg("text"));

  m.def(
      "probe_direct_io",
      [](const std::string& directory) {
        fs::DirectIoProbe p;
        {
          nb::gil_scoped_release nogil;
          p = fs::probe_direct_io(directory);
        }
        nb::dict d;
        d["supported"] = p.supported;
        d["reason"] = p.reason;
        d["fs_type"] = p.fs_type;
        d["fs_magic"] = p.fs_magic;
        d["block_size"] = p.block_size;
        return d;
      },
      nb::arg("directory"));

  // Raises each translated error kind, so tests can check the Python mapping on any machine.
  m.def("_raise_for_test", [](const std::string& kind) {
    if (kind == "cuda") throw CudaError(1, "CUDA_ERROR_INVALID_VALUE", "cuTest(x)", "here:1", "");
    if (kind == "cuda_oom")
      throw CudaOutOfMemory(2, "CUDA_ERROR_OUT_OF_MEMORY", "cuTest(x)", "here:1", "");
    if (kind == "unavailable") throw DriverUnavailable("no driver");
    if (kind == "space") throw OutOfSpace("region full");
    if (kind == "os") detail::throw_errno(ENOENT, "open", "/nonexistent");
    if (kind == "value") VITRIFY_EXPECT(false, "bad value");
    throw std::runtime_error("unknown kind " + kind);
  });
}

}  // namespace vitrify::bindings
