// dynamix_byteps._core: the native part of dynamix_byteps (see DESIGN.md, "Native core").
// Each component registers its Python API from its own translation unit.
#include <pybind11/pybind11.h>

namespace py = pybind11;

namespace dynamix {
void register_timing(py::module_& m);  // timing_bindings.cpp
void register_mailbox(py::module_& m);  // mailbox_bindings.cpp
}

PYBIND11_MODULE(_core, m) {
  m.doc() = "Native core of dynamix_byteps: push_pull timing ring and shared-memory mailbox (no torch dependency).";
  dynamix::register_timing(m);
  dynamix::register_mailbox(m);
}
