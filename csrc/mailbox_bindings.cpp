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

using mailbox::AssignmentRecord;
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

py::object read_assignment(Mailbox& mb, const py::object& newer_than) {
  AssignmentRecord rec;
  if (mb.read_assignment(to_u64(newer_than, "newer_than"), rec) != ReadStatus::kOk) return py::none();
  py::tuple sizes(rec.n);
  for (uint32_t i = 0; i < rec.n; ++i) {
    PyObject* v = PyLong_FromUnsignedLong(rec.sizes[i]);
    if (!v) throw py::error_already_set();
    PyTuple_SET_ITEM(sizes.ptr(), i, v);
  }
  return py::make_tuple(rec.version, rec.effective_step, std::move(sizes));
}

using F64Array = py::array_t<double, py::array::c_style | py::array::forcecast>;
using I64Array = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

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

[[noreturn]] void bad_size(size_t i, const std::string& what) {
  throw py::value_error("publish_assignment: batch_sizes[" + std::to_string(i) + "] = " + what +
                        " is not an integer in [0, 2**32)");
}

// Batch sizes: integers only (Python ints, numpy integers; not bools or floats), 1..1024 of
// them, each in [0, 2**32); ValueError otherwise.
void publish_assignment(Mailbox& mb, const py::object& version, const py::object& effective_step,
                        const py::object& sizes_obj) {
  const uint64_t v = to_u64(version, "version");
  const uint64_t e = to_u64(effective_step, "effective_step");
  uint32_t sizes[mailbox::kMaxBatchSizes];
  size_t n = 0;
  auto check_count = [](size_t count) {
    if (count < 1 || count > mailbox::kMaxBatchSizes) {
      throw py::value_error("publish_assignment: " + std::to_string(count) + " batch sizes, need 1 to " +
                            std::to_string(mailbox::kMaxBatchSizes));
    }
  };
  PyObject* obj = sizes_obj.ptr();
  if (PyList_Check(obj) || PyTuple_Check(obj)) {
    n = static_cast<size_t>(PySequence_Fast_GET_SIZE(obj));
    check_count(n);
    PyObject** items = PySequence_Fast_ITEMS(obj);
    for (size_t i = 0; i < n; ++i) {
      PyObject* item = items[i];
      if (PyBool_Check(item) || PyFloat_Check(item)) bad_size(i, py::repr(item));
      py::object index = py::reinterpret_steal<py::object>(PyNumber_Index(item));
      if (!index) {
        PyErr_Clear();
        bad_size(i, py::repr(item));
      }
      int overflow = 0;
      const long long b = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
      if (overflow || b < 0 || b > static_cast<long long>(UINT32_MAX)) bad_size(i, py::repr(item));
      sizes[i] = static_cast<uint32_t>(b);
    }
  } else {
    const py::array arr = py::array::ensure(sizes_obj);
    if (!arr) {
      PyErr_Clear();
      throw py::value_error("publish_assignment: batch_sizes must be a sequence of integers, got " +
                            type_name(sizes_obj));
    }
    if (arr.ndim() != 1) {
      throw py::value_error("publish_assignment: batch_sizes must be 1-D, got " + std::to_string(arr.ndim()) +
                            " dimensions");
    }
    n = static_cast<size_t>(arr.shape(0));
    check_count(n);
    const char kind = arr.dtype().kind();
    if (kind != 'i' && kind != 'u') {
      throw py::value_error("publish_assignment: batch_sizes must be integers, got dtype " +
                            std::string(py::str(arr.dtype())));
    }
    const I64Array as_i64 = I64Array::ensure(arr);  // a copy unless already contiguous int64
    if (!as_i64) throw py::error_already_set();
    const int64_t* src = as_i64.data();
    for (size_t i = 0; i < n; ++i) {
      // uint64 values >= 2**63 wrap to negative here, and are rejected like other negatives.
      if (src[i] < 0 || src[i] > static_cast<int64_t>(UINT32_MAX)) bad_size(i, std::to_string(src[i]));
      sizes[i] = static_cast<uint32_t>(src[i]);
    }
  }
  mb.publish_assignment(v, e, sizes, n);
}

// ---- test hooks: native-speed writers and readers without the GIL ---------------------------
//
// Writers publish self-checking records; readers verify every record they get. Metrics record
// with version v: step = v, count = 1 + v % 32, values[i] = v + i. Assignment record with
// version v: effective_step = 3 v, n = 1 + v % 1024, sizes[i] = uint32(7 v + i). A reader
// counts a record that breaks these rules as torn, and a version not above the previous one
// (it asks with newer_than = last version seen) as backwards; "retries" counts attempts that
// found a write in progress (odd seq) or a seq that changed during the copy.

bool is_metrics_slot(const std::string& slot) {
  if (slot == "metrics") return true;
  if (slot == "assignment") return false;
  throw py::value_error("slot must be 'metrics' or 'assignment', got '" + slot + "'");
}

std::shared_ptr<mailbox::Mapping> live_mapping(const Mailbox& mb) {
  auto m = mb.mapping();
  if (!m) throw py::value_error("mailbox " + mb.name() + " is closed");
  return m;
}

uint64_t hammer_write(const Mailbox& mb, const std::string& slot, double seconds) {
  const bool metrics = is_metrics_slot(slot);
  if (metrics != mb.is_creator()) throw py::value_error("this handle is not the writer of the " + slot + " slot");
  auto map = live_mapping(mb);  // keeps the segment mapped even if Python closes the handle
  mailbox::Segment& seg = *map->seg;
  uint64_t writes = 0;
  py::gil_scoped_release nogil;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  double values[mailbox::kMetricsCapacity];
  uint32_t sizes[mailbox::kMaxBatchSizes];
  do {
    for (int burst = 0; burst < 64; ++burst, ++writes) {
      if (metrics) {
        const uint64_t v = seg.metrics.version.load(std::memory_order_relaxed) + 1;
        const uint32_t count = 1 + static_cast<uint32_t>(v % mailbox::kMetricsCapacity);
        for (uint32_t i = 0; i < count; ++i) values[i] = static_cast<double>(v + i);
        mailbox::write_metrics(seg.metrics, v, values, count);
      } else {
        const uint64_t v = seg.assignment.version.load(std::memory_order_relaxed) + 1;
        const uint32_t n = 1 + static_cast<uint32_t>(v % mailbox::kMaxBatchSizes);
        for (uint32_t i = 0; i < n; ++i) sizes[i] = static_cast<uint32_t>(7 * v + i);
        mailbox::write_assignment(seg.assignment, v, 3 * v, sizes, n);
      }
    }
  } while (std::chrono::steady_clock::now() < deadline);
  return writes;
}

py::dict hammer_read(const Mailbox& mb, const std::string& slot, double seconds) {
  const bool metrics = is_metrics_slot(slot);
  auto map = live_mapping(mb);
  const mailbox::Segment& seg = *map->seg;
  uint64_t ok = 0, empty = 0, not_newer = 0, busy = 0, retries = 0, torn = 0, backwards = 0, last = 0;
  {
    py::gil_scoped_release nogil;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    MetricsRecord m;
    AssignmentRecord a;
    do {
      for (int burst = 0; burst < 64; ++burst) {
        int attempts = 0;
        const ReadStatus r = metrics ? mailbox::read_metrics(seg.metrics, last, m, &attempts)
                                     : mailbox::read_assignment(seg.assignment, last, a, &attempts);
        retries += static_cast<uint64_t>(attempts - 1);
        if (r == ReadStatus::kEmpty) {
          ++empty;
        } else if (r == ReadStatus::kNotNewer) {
          ++not_newer;
        } else if (r == ReadStatus::kBusy) {
          ++busy;
        } else {
          ++ok;
          const uint64_t v = metrics ? m.version : a.version;
          bool good = true;
          if (metrics) {
            good = m.step == v && m.count == 1 + v % mailbox::kMetricsCapacity;
            for (uint32_t i = 0; good && i < m.count; ++i) good = m.values[i] == static_cast<double>(v + i);
          } else {
            good = a.effective_step == 3 * v && a.n == 1 + v % mailbox::kMaxBatchSizes;
            for (uint32_t i = 0; good && i < a.n; ++i) good = a.sizes[i] == static_cast<uint32_t>(7 * v + i);
          }
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
  m.attr("MAILBOX_MAX_BATCH_SIZES") = mailbox::kMaxBatchSizes;
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
      .def("publish_assignment", &publish_assignment, py::arg("version"), py::arg("effective_step"),
           py::arg("batch_sizes"))
      .def("read_assignment", &read_assignment, py::arg("newer_than") = 0)
      .def_property_readonly("name", &Mailbox::name)
      .def_property_readonly("closed", &Mailbox::closed)
      .def_property_readonly("is_creator", &Mailbox::is_creator)
      .def_property_readonly("owner_pid", &Mailbox::owner_pid)
      .def_property_readonly("busy_reads", &Mailbox::busy_reads);

  m.def("_mailbox_hammer_write", &hammer_write, py::arg("mailbox"), py::arg("slot"), py::arg("seconds"),
        "Test hook: publish self-checking records into `slot` for `seconds` without the GIL; returns the count.");
  m.def("_mailbox_hammer_read", &hammer_read, py::arg("mailbox"), py::arg("slot"), py::arg("seconds"),
        "Test hook: read `slot` for `seconds` without the GIL, verifying each record; returns counters.");
}

}  // namespace dynamix
