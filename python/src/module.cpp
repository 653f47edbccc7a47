// kvevict._ext: the nanobind module under the Python package. Each topic binds
// its own calls (bindings.hpp); this file makes the module and its exceptions.
#include "bindings.hpp"

namespace kvevict_py {

/// Set at import (NB_MODULE below).
exception_types exceptions;

namespace {

PyObject* new_exception(nb::module_& m, const char* name, PyObject* base1, PyObject* base2, const char* doc) {
  nb::object bases = base2 ? nb::make_tuple(nb::handle(base1), nb::handle(base2)) : nb::make_tuple(nb::handle(base1));
  const std::string qualified = concat("kvevict.", name);
  PyObject* type = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, bases.ptr(), nullptr);
  if (!type) throw nb::python_error();
  m.attr(name) = nb::handle(type);
  return type;
}

}  // namespace
}  // namespace kvevict_py

NB_MODULE(_ext, m) {
  using namespace kvevict_py;
  m.doc() = "kvevict's C++ batched API over DLPack arrays (internal: use the kvevict package).";
  // Descriptors live in caches of the Python package (kvevict.ops) and in
  // torch's op registry until the interpreter exits: not leaks.
  nb::set_leak_warnings(false);

  exceptions.error = new_exception(m, "Error", PyExc_Exception, nullptr, "Base of every error kvevict raises.");
  exceptions.invalid_argument = new_exception(m, "InvalidArgument", exceptions.error, PyExc_ValueError,
                                              "A shape, dtype, stride, device, pointer or configuration that cannot be used.");
  exceptions.budget_error = new_exception(m, "BudgetError", exceptions.invalid_argument, nullptr,
                                          "A budget that does not fit the capacity, or whose parts do not add up.");
  exceptions.out_of_range = new_exception(m, "OutOfRange", exceptions.invalid_argument, PyExc_IndexError,
                                          "An index (sequence, head, slot, page id, length) outside its range.");
  exceptions.non_finite_error = new_exception(m, "NonFiniteError", exceptions.invalid_argument, nullptr,
                                              "NaN or infinity in an input, or a score that would overflow.");
  exceptions.state_error = new_exception(m, "StateError", exceptions.error, PyExc_RuntimeError,
                                         "A call that is valid in itself but not in the current state.");
  exceptions.cuda_error = new_exception(m, "CudaError", exceptions.error, PyExc_RuntimeError,
                                        "A CUDA runtime call or kernel launch failed.");
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const kvevict::budget_error& e) {
      PyErr_SetString(exceptions.budget_error, e.what());
    } catch (const kvevict::out_of_range& e) {
      PyErr_SetString(exceptions.out_of_range, e.what());
    } catch (const kvevict::non_finite_error& e) {
      PyErr_SetString(exceptions.non_finite_error, e.what());
    } catch (const kvevict::invalid_argument& e) {
      PyErr_SetString(exceptions.invalid_argument, e.what());
    } catch (const kvevict::state_error& e) {
      PyErr_SetString(exceptions.state_error, e.what());
    } catch (const cuda_failure& e) {
      PyErr_SetString(exceptions.cuda_error, e.what());
    } catch (const kvevict::error& e) {
      PyErr_SetString(exceptions.error, e.what());
    }
  });

  bind_state(m);
  bind_views(m);
  bind_decode(m);
  bind_multi_token(m);
  bind_prefill(m);
  bind_sequence(m);
  bind_bench(m);
#ifdef KVEVICT_PY_CUDA
  m.attr("CUDA") = true;
#else
  m.attr("CUDA") = false;
#endif
}
