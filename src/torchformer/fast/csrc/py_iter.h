// A C++ iterator as a plain CPython iterator type: Python's `for` calls its next() through the
// type's tp_iternext slot, one C call, where a pybind11 class with a `__next__` method went
// through a method lookup, an argument tuple and pybind11's dispatcher (overload resolution, the
// type casters of `self`).
//
// Why: between two native decode steps everything that code touches is cold (each step streams the
// weights through both cores' L1 and L2), so its cost is its cache lines, not its instructions. At
// the toy shape (int4, 2 threads, fast/native_step.py's loop) the time from one next() returning
// to the next one starting was ~27 us a token through pybind11's `__next__`.
#pragma once

#include <torch/extension.h>

#include <exception>
#include <memory>

// State: `PyObject* next()`, called with the GIL: a new reference, or null at the end with no
// Python error set (the iterator protocol's "exhausted"); C++ exceptions become Python errors (a
// c10::Error a RuntimeError with its message, as pybind11 translates it).
template <class State>
class PyIterator {
 public:
  // The type, made once (`name`: the module-qualified name, which must outlive it).
  static PyTypeObject* type(const char* name) {
    static PyTypeObject* made = make(name);
    return made;
  }

  // A new iterator over `state`, which keeps `owner` (the Python object state points into) alive.
  static pybind11::object wrap(PyTypeObject* t, std::unique_ptr<State> state, pybind11::handle owner) {
    PyObject* self = t->tp_alloc(t, 0);
    if (!self) throw pybind11::error_already_set();
    auto* o = reinterpret_cast<Object*>(self);
    o->state = state.release();
    o->owner = owner.inc_ref().ptr();
    return pybind11::reinterpret_steal<pybind11::object>(self);
  }

 private:
  struct Object {
    PyObject_HEAD
    State* state;
    PyObject* owner;
  };

  static PyObject* next(PyObject* self) {
    try {
      return reinterpret_cast<Object*>(self)->state->next();
    } catch (pybind11::error_already_set& e) {
      e.restore();
    } catch (const c10::Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
    } catch (const std::exception& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
    return nullptr;
  }

  static void dealloc(PyObject* self) {
    auto* o = reinterpret_cast<Object*>(self);
    PyTypeObject* t = Py_TYPE(self);
    delete o->state;
    Py_XDECREF(o->owner);
    t->tp_free(self);
    Py_DECREF(t);  // a heap type's instances hold a reference to it
  }

  static PyTypeObject* make(const char* name) {
    static PyType_Slot slots[] = {{Py_tp_iter, reinterpret_cast<void*>(PyObject_SelfIter)},
                                  {Py_tp_iternext, reinterpret_cast<void*>(next)},
                                  {Py_tp_dealloc, reinterpret_cast<void*>(dealloc)},
                                  {0, nullptr}};
    static PyType_Spec spec = {name, sizeof(Object), 0, Py_TPFLAGS_DEFAULT, slots};
    PyObject* t = PyType_FromSpec(&spec);
    if (!t) throw pybind11::error_already_set();
    return reinterpret_cast<PyTypeObject*>(t);
  }
};
