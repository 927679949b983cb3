// Python bindings of the shared-memory mailbox (mailbox.hpp). The public Python API is
// dynamix_byteps.control.mailbox; this is its native half (_core.Mailbox) plus test hooks.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#include "mailbox.hpp"

namespace py = pybind11;

namespace dynamix {
namespace {

using mailbox::Mailbox;
using mailbox::MetricsRecord;
using mailbox::ReadStatus;

// A Python int (or __index__ object) in [0, 2**64); ValueError outside, TypeError for non-ints.
uint64_t to_u64(const py::handle& obj, const char* what) {
  py::object index = py::reinterpret_steal<py::object>(PyNumber_Index(obj.ptr()));
  if (!index) {
    PyErr_Clear();
    throw py::type_error(std::string(what) + " must be an int, got " + std::string(py::str(py::type::of(obj).attr("__name__"))));
  }
  const unsigned long long v = PyLong_AsUnsignedLongLong(index.ptr());
  if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
    PyErr_Clear();
    throw py::value_error(std::string(what) + " must be in [0, 2**64), got " + std::string(py::repr(obj)));
  }
  return static_cast<uint64_t>(v);
}

py::object read_metrics(Mailbox& mb, const py::object& newer_than) {
  MetricsRecord rec;
  if (mb.read_metrics(to_u64(newer_than, "newer_than"), rec) != ReadStatus::kOk) return py::none();
  py::array_t<double> values(static_cast<py::ssize_t>(rec.count));
  if (rec.count) std::memcpy(values.mutable_data(), rec.values, rec.count * sizeof(double));
  return py::make_tuple(rec.version, rec.step, std::move(values));
}

using F64Array = py::array_t<double, py::array::c_style | py::array::forcecast>;

std::string type_name(const py::handle& obj) { return py::str(py::type::of(obj).attr("__name__")); }

// Metrics values: a list or tuple of numbers is read item by item (PyFloat_AsDouble: floats,
// ints, numpy scalars), anything else goes through numpy (no copy for a contiguous float64
// array). TypeError for non-numbers, ValueError for arrays that are not 1-D or too long.
uint64_t publish_metrics(Mailbox& mb, const py::object& step, const py::object& values_obj) {
  const uint64_t s = to_u64(step, "step");
  PyObject* obj = values_obj.ptr();
  if (PyList_Check(obj) || PyTuple_Check(obj)) {
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(obj);
    if (n > static_cast<Py_ssize_t>(mailbox::kMetricsCapacity)) {
      throw py::value_error("publish_metrics: " + std::to_string(n) + " values, at most " +
                            std::to_string(mailbox::kMetricsCapacity));
    }
    double values[mailbox::kMetricsCapacity];
    PyObject** items = PySequence_Fast_ITEMS(obj);
    for (Py_ssize_t i = 0; i < n; ++i) {
      values[i] = PyFloat_AsDouble(items[i]);
      if (values[i] == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        throw py::type_error("publish_metrics: values[" + std::to_string(i) + "] is a " + type_name(items[i]) +
                             ", not a number");
      }
    }
    return mb.publish_metrics(s, values, static_cast<size_t>(n));
  }
  const F64Array values = F64Array::ensure(values_obj);
  if (!values) {
    PyErr_Clear();
    throw py::type_error("publish_metrics: values must be a sequence of numbers, got " + type_name(values_obj));
  }
  if (values.ndim() != 1) {
    throw py::value_error("publish_metrics: values must be 1-D, got " + std::to_string(values.ndim()) + " dimensions");
  }
  return mb.publish_metrics(s, values.data(), static_cast<size_t>(values.shape(0)));
}

// ---- test hooks: native-speed writer and reader without the GIL ----------------------------
//
// The writer publishes self-checking metrics records; the reader verifies every record it gets.
// Record with version v: step = v, count = 1 + v % 32, values[i] = v + i. The reader counts a
// record that breaks these rules as torn, and a version not above the previous one (it asks
// with newer_than = last version seen) as backwards; "retries" counts attempts that found a
// write in progress (odd seq) or a seq that changed during the copy.

std::shared_ptr<mailbox::Mapping> live_mapping(const Mailbox& mb) {
  auto m = mb.mapping();
  if (!m) throw py::value_error("mailbox " + mb.name() + " is closed");
  return m;
}

uint64_t hammer_write(const Mailbox& mb, double seconds) {
  if (!mb.is_creator()) throw py::value_error("this handle is not the writer of the metrics slot");
  auto map = live_mapping(mb);  // keeps the segment mapped even if Python closes the handle
  mailbox::Segment& seg = *map->seg;
  uint64_t writes = 0;
  py::gil_scoped_release nogil;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  double values[mailbox::kMetricsCapacity];
  do {
    for (int burst = 0; burst < 64; ++burst, ++writes) {
      const uint64_t v = seg.metrics.version.load(std::memory_order_relaxed) + 1;
      const uint32_t count = 1 + static_cast<uint32_t>(v % mailbox::kMetricsCapacity);
      for (uint32_t i = 0; i < count; ++i) values[i] = static_cast<double>(v + i);
      mailbox::write_metrics(seg.metrics, v, values, count);
    }
  } while (std::chrono::steady_clock::now() < deadline);
  return writes;
}

py::dict hammer_read(const Mailbox& mb, double seconds) {
  auto map = live_mapping(mb);
  const mailbox::Segment& seg = *map->seg;
  uint64_t ok = 0, empty = 0, not_newer = 0, busy = 0, retries = 0, torn = 0, backwards = 0, last = 0;
  {
    py::gil_scoped_release nogil;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    MetricsRecord m;
    do {
      for (int burst = 0; burst < 64; ++burst) {
        int attempts = 0;
        const ReadStatus r = mailbox::read_metrics(seg.metrics, last, m, &attempts);
        retries += static_cast<uint64_t>(attempts - 1);
        if (r == ReadStatus::kEmpty) {
          ++empty;
        } else if (r == ReadStatus::kNotNewer) {
          ++not_newer;
        } else if (r == ReadStatus::kBusy) {
          ++busy;
        } else {
          ++ok;
          const uint64_t v = m.version;
          bool good = m.step == v && m.count == 1 + v % mailbox::kMetricsCapacity;
          for (uint32_t i = 0; good && i < m.count; ++i) good = m.values[i] == static_cast<double>(v + i);
          if (!good) ++torn;
          if (v <= last) ++backwards;
          last = v;
        }
      }
    } while (std::chrono::steady_clock::now() < deadline);
  }
  py::dict out;
  out["ok"] = ok;
  out["empty"] = empty;
  out["not_newer"] = not_newer;
  out["busy"] = busy;
  out["retries"] = retries;  // attempts that met a write in progress or a changed seq, then retried
  out["torn"] = torn;
  out["backwards"] = backwards;
  out["last_version"] = last;
  return out;
}

}  // namespace

void register_mailbox(py::module_& m) {
  static py::exception<mailbox::LayoutError> layout_error(m, "MailboxLayoutError", PyExc_ValueError);
  static py::exception<mailbox::NotReadyError> not_ready_error(m, "MailboxNotReadyError", layout_error.ptr());
  static py::exception<mailbox::RoleError> role_error(m, "MailboxRoleError", PyExc_RuntimeError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const mailbox::OsError& e) {
      // OSError(errno, message, filename) picks the subclass: FileNotFoundError, FileExistsError, ...
      py::object err = py::reinterpret_borrow<py::object>(PyExc_OSError)(e.err, e.what(), e.filename);
      PyErr_SetObject(PyExc_OSError, err.ptr());
    } catch (const mailbox::NotReadyError& e) {
      PyErr_SetString(not_ready_error.ptr(), e.what());
    } catch (const mailbox::LayoutError& e) {
      PyErr_SetString(layout_error.ptr(), e.what());
    } catch (const mailbox::RoleError& e) {
      PyErr_SetString(role_error.ptr(), e.what());
    }
  });

  m.attr("MAILBOX_MAGIC") = mailbox::kMagic;
  m.attr("MAILBOX_LAYOUT_VERSION") = mailbox::kLayoutVersion;
  m.attr("MAILBOX_METRICS_CAPACITY") = mailbox::kMetricsCapacity;
  m.attr("MAILBOX_SEGMENT_BYTES") = sizeof(mailbox::Segment);
  m.attr("MAILBOX_MAX_READ_ATTEMPTS") = mailbox::kMaxReadAttempts;

  py::class_<Mailbox>(m, "Mailbox",
                      "Native shared-memory seqlock mailbox (see csrc/mailbox.hpp). Use "
                      "dynamix_byteps.control.mailbox.Mailbox instead.")
      .def_static(
          "create",
          [](const std::string& name) {
            int64_t replaced = 0;
            std::unique_ptr<Mailbox> mb = Mailbox::create(name, &replaced);
            return py::make_tuple(py::cast(std::move(mb)), replaced);
          },
          py::arg("name"), "create(name) -> (Mailbox, pid of the dead owner of a replaced stale segment or 0)")
      .def_static("open", &Mailbox::open, py::arg("name"))
      .def("close", &Mailbox::close)
      .def("publish_metrics", &publish_metrics, py::arg("step"), py::arg("values"))
      .def("read_metrics", &read_metrics, py::arg("newer_than") = 0)
      .def_property_readonly("name", &Mailbox::name)
      .def_property_readonly("closed", &Mailbox::closed)
      .def_property_readonly("is_creator", &Mailbox::is_creator)
      .def_property_readonly("owner_pid", &Mailbox::owner_pid)
      .def_property_readonly("owner_alive", &Mailbox::owner_alive)
      .def_property_readonly("busy_reads", &Mailbox::busy_reads);

  m.def("_mailbox_hammer_write", &hammer_write, py::arg("mailbox"), py::arg("seconds"),
        "Test hook: publish self-checking metrics for `seconds` without the GIL; returns the count.");
  m.def("_mailbox_hammer_read", &hammer_read, py::arg("mailbox"), py::arg("seconds"),
        "Test hook: read the metrics for `seconds` without the GIL, verifying each record; returns counters.");
}

}  // namespace dynamix
