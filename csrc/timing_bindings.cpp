// Python bindings of the timing ring (timing_ring.hpp).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "timing_ring.hpp"

namespace py = pybind11;

namespace dynamix {
namespace {

py::dict drain(TimingRing& ring, std::optional<int64_t> max_events) {
  size_t limit = std::numeric_limits<size_t>::max();
  if (max_events) {
    if (*max_events < 0) throw py::value_error("drain(max_events) must be >= 0 or None");
    limit = static_cast<size_t>(*max_events);
  }
  // Take at most what is waiting now, so a drain under a busy producer still returns.
  const size_t want = std::min(limit, ring.size());
  std::vector<TimingEvent> events;
  {
    py::gil_scoped_release nogil;  // producers in other threads keep recording meanwhile
    events.reserve(want);
    TimingEvent ev;
    while (events.size() < want && ring.pop(ev)) events.push_back(ev);
  }
  const auto n = static_cast<py::ssize_t>(events.size());
  py::array_t<uint32_t> name_id(n);
  py::array_t<uint8_t> kind(n);
  py::array_t<uint64_t> nbytes(n);
  py::array_t<int64_t> start_ns(n);
  py::array_t<int64_t> end_ns(n);
  uint32_t* p_name = name_id.mutable_data();
  uint8_t* p_kind = kind.mutable_data();
  uint64_t* p_bytes = nbytes.mutable_data();
  int64_t* p_start = start_ns.mutable_data();
  int64_t* p_end = end_ns.mutable_data();
  for (py::ssize_t i = 0; i < n; ++i) {
    const TimingEvent& ev = events[static_cast<size_t>(i)];
    p_name[i] = ev.name_id;
    p_kind[i] = static_cast<uint8_t>(ev.kind);
    p_bytes[i] = ev.nbytes;
    p_start[i] = ev.start_ns;
    p_end[i] = ev.end_ns;
  }
  py::dict out;
  out["name_id"] = name_id;
  out["kind"] = kind;
  out["nbytes"] = nbytes;
  out["start_ns"] = start_ns;
  out["end_ns"] = end_ns;
  return out;
}

// Test hook: `threads` native threads (no GIL) each record `per_thread` events, retrying while
// the ring is full. Thread t records name_id=t, kind=t % kNumKinds, nbytes=i, start_ns=i,
// end_ns=i+t+1 for i = 0..per_thread-1, in that order. Returns the number of failed (full) attempts.
uint64_t record_concurrently(TimingRing& ring, int threads, int64_t per_thread) {
  if (threads < 1 || threads > 256) throw py::value_error("threads must be in [1, 256]");
  if (per_thread < 0) throw py::value_error("per_thread must be >= 0");
  std::vector<uint64_t> failures(static_cast<size_t>(threads), 0);
  {
    py::gil_scoped_release nogil;
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&ring, &failures, t, per_thread] {
        uint64_t fails = 0;
        for (int64_t i = 0; i < per_thread; ++i) {
          const TimingEvent ev{static_cast<uint32_t>(t), static_cast<uint32_t>(t) % kNumKinds,
                               static_cast<uint64_t>(i), i, i + t + 1};
          while (!ring.record(ev)) {
            ++fails;
            std::this_thread::yield();
          }
        }
        failures[static_cast<size_t>(t)] = fails;
      });
    }
    for (auto& th : pool) th.join();
  }
  uint64_t total = 0;
  for (uint64_t f : failures) total += f;
  return total;
}

// TimingRing.record as a METH_FASTCALL method: the hot path, called once per push_pull.
// pybind11's generic dispatcher costs ~300 ns for four int arguments on a slow core; parsing
// the vector of arguments directly costs a fraction of that. Same signature and errors as a
// pybind11 binding would have: record(name_id, nbytes, start_ns, end_ns, kind=0), keywords allowed.
constexpr int kRecordArgCount = 5;
constexpr int kRequiredArgs = 4;
constexpr const char* kRecordArgs[kRecordArgCount] = {"name_id", "nbytes", "start_ns", "end_ns", "kind"};

PyObject* record_fastcall(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  PyObject* vals[kRecordArgCount] = {nullptr, nullptr, nullptr, nullptr, nullptr};
  if (nargs > kRecordArgCount) {
    PyErr_Format(PyExc_TypeError, "record() takes 4 or 5 arguments (%zd given)", nargs);
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < nargs; ++i) vals[i] = args[i];
  if (kwnames != nullptr) {
    const Py_ssize_t nkw = PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t j = 0; j < nkw; ++j) {
      PyObject* key = PyTuple_GET_ITEM(kwnames, j);
      int idx = -1;
      for (int k = 0; k < kRecordArgCount; ++k) {
        if (PyUnicode_CompareWithASCIIString(key, kRecordArgs[k]) == 0) idx = k;
      }
      if (idx < 0) {
        PyErr_Format(PyExc_TypeError, "record() got an unexpected keyword argument '%U'", key);
        return nullptr;
      }
      if (vals[idx] != nullptr) {
        PyErr_Format(PyExc_TypeError, "record() got multiple values for argument '%s'", kRecordArgs[idx]);
        return nullptr;
      }
      vals[idx] = args[nargs + j];
    }
  }
  long long v[kRecordArgCount] = {0, 0, 0, 0, kPushPull};
  for (int k = 0; k < kRecordArgCount; ++k) {
    if (vals[k] == nullptr) {
      if (k >= kRequiredArgs) continue;  // kind defaults to push_pull
      PyErr_Format(PyExc_TypeError, "record() missing required argument '%s'", kRecordArgs[k]);
      return nullptr;
    }
    v[k] = PyLong_AsLongLong(vals[k]);  // ints and __index__ objects; float raises TypeError
    if (v[k] == -1 && PyErr_Occurred()) return nullptr;
  }
  if (v[3] < v[2]) {
    PyErr_SetString(PyExc_ValueError, "record(): end_ns must be >= start_ns");
    return nullptr;
  }
  if (v[0] < 0 || v[0] > static_cast<long long>(std::numeric_limits<uint32_t>::max())) {
    PyErr_SetString(PyExc_ValueError, "record(): name_id must be in [0, 2**32)");
    return nullptr;
  }
  if (v[1] < 0) {
    PyErr_SetString(PyExc_ValueError, "record(): nbytes must be >= 0");
    return nullptr;
  }
  if (v[4] < 0 || v[4] >= static_cast<long long>(kNumKinds)) {
    PyErr_Format(PyExc_ValueError, "record(): kind must be 0 (push_pull), 1 (push) or 2 (pull), got %lld", v[4]);
    return nullptr;
  }
  py::detail::make_caster<TimingRing> caster;
  if (!caster.load(self, false)) {
    PyErr_SetString(PyExc_TypeError, "record() needs a TimingRing");
    return nullptr;
  }
  auto* ring = static_cast<TimingRing*>(caster.value);
  if (ring == nullptr) {
    PyErr_SetString(PyExc_TypeError, "record() called on a TimingRing whose __init__ did not run");
    return nullptr;
  }
  const bool ok = ring->record(TimingEvent{static_cast<uint32_t>(v[0]), static_cast<uint32_t>(v[4]),
                                           static_cast<uint64_t>(v[1]), v[2], v[3]});
  return PyBool_FromLong(ok);
}

PyMethodDef record_method_def = {
    "record",
    reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(record_fastcall)),
    METH_FASTCALL | METH_KEYWORDS,
    "record($self, name_id, nbytes, start_ns, end_ns, kind=0)\n--\n\n"
    "Record one event (times in ns, nbytes in bytes) of `kind` (0 push_pull, 1 push, 2 pull; the\n"
    "index into TIMING_KINDS) and add it to the current step's aggregates of that kind.\n\n"
    "Returns False, and increments `dropped`, when the ring is full; the event still counts in\n"
    "end_step(). Raises ValueError if end_ns < start_ns, nbytes < 0, name_id is not a uint32 or\n"
    "kind is not 0, 1 or 2.",
};

py::dict kind_stats(const KindStats& k) {
  py::dict out;
  out["count"] = k.count;
  out["bytes"] = k.bytes;
  out["busy_ns"] = k.busy_ns;
  out["span_ns"] = k.span_ns;
  return out;
}

}  // namespace

void register_timing(py::module_& m) {
  py::tuple kinds(kNumKinds);
  for (uint32_t k = 0; k < kNumKinds; ++k) kinds[k] = py::str(kKindNames[k]);
  m.attr("TIMING_KINDS") = kinds;

  m.def("now_ns", &monotonic_ns,
        "now_ns() -> int\n\nCLOCK_MONOTONIC in nanoseconds; the same clock as time.monotonic_ns().");

  py::class_<TimingRing> cls(m, "TimingRing", R"doc(
Bounded lock-free multi-producer ring of timing events (push_pull, push, pull).

Each event is (name_id: uint32, kind: uint8 index into TIMING_KINDS, nbytes: uint64 bytes,
start_ns: int64, end_ns: int64), times in
CLOCK_MONOTONIC nanoseconds (see now_ns()). record() is safe from any number of threads and never
blocks; drain() and end_step() are meant for one consumer thread.

Args:
    capacity: events the ring holds, rounded up to a power of two (at least 2).

Raises:
    ValueError: capacity < 1 or > 2**30.
)doc");
  cls.def(py::init([](int64_t capacity) {
             if (capacity < 1 || static_cast<uint64_t>(capacity) > TimingRing::kMaxCapacity) {
               throw py::value_error("TimingRing capacity must be between 1 and 2**30 events, got " +
                                     std::to_string(capacity));
             }
             return std::make_unique<TimingRing>(static_cast<size_t>(capacity));
           }),
           py::arg("capacity") = 65536)
      .def("drain", &drain, py::arg("max_events") = py::none(),
           R"doc(Remove up to max_events waiting events (all waiting ones when None).

Returns a dict of equal-length numpy arrays: name_id (uint32), kind (uint8, index into
TIMING_KINDS), nbytes (uint64, bytes),
start_ns (int64), end_ns (int64), oldest first (record order per producer). Releases the GIL
while copying out. Raises ValueError if max_events < 0.)doc")
      .def(
          "end_step",
          [](TimingRing& ring) {
            const StepStats s = ring.end_step();
            py::dict out = kind_stats(s.total);
            py::dict kinds;
            for (uint32_t k = 0; k < kNumKinds; ++k) kinds[kKindNames[k]] = kind_stats(s.by_kind[k]);
            out["kinds"] = kinds;
            return out;
          },
          R"doc(Aggregates of the events recorded since the previous end_step(), then reset.

Returns {"count": events, "bytes": sum of nbytes, "busy_ns": sum of durations in ns,
"span_ns": last end_ns - first start_ns in ns (0 when empty), "kinds": {kind name: the same
four aggregates over that kind's events only}} with one entry per name of TIMING_KINDS. Dropped
events are included; drain() does not affect these.)doc")
      .def_property_readonly("capacity", &TimingRing::capacity, "Slots in the ring (a power of two).")
      .def_property_readonly("size", &TimingRing::size, "Events waiting to be drained.")
      .def_property_readonly("dropped", &TimingRing::dropped, "Events rejected because the ring was full.")
      .def("__repr__", [](const TimingRing& ring) {
        return "TimingRing(capacity=" + std::to_string(ring.capacity()) + ", size=" + std::to_string(ring.size()) +
               ", dropped=" + std::to_string(ring.dropped()) + ")";
      });

  PyObject* record_descr = PyDescr_NewMethod(reinterpret_cast<PyTypeObject*>(cls.ptr()), &record_method_def);
  if (record_descr == nullptr) throw py::error_already_set();
  cls.attr("record") = py::reinterpret_steal<py::object>(record_descr);

  m.def("_record_concurrently", &record_concurrently, py::arg("ring"), py::arg("threads"), py::arg("per_thread"),
        "Test hook: native threads record concurrently without the GIL; returns failed (full) attempts.");
}

}  // namespace dynamix
