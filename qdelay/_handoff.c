/* qdelay._handoff: the blocking client's one-shot wake-up (client/handoff.py has its Python
 * twin, Gate and open_all, and the reason).
 *
 * A Gate is a lock made held; open() releases it once, wait(timeout) blocks (the GIL
 * released) until it is open. open_all(gates) opens every gate of a list with the GIL
 * released: the I/O loop wakes a batch's 16 callers in one call, and the first one woken
 * takes the GIL at once instead of waiting for the loop to finish waking the others (with
 * the GIL held, each wake-up is a futex call and every woken thread then blocks again on
 * the GIL: ~3.3 voluntary switches a send() against ~1.6 this way, measured in
 * docs/benchmarks.md). Only public CPython API (pythread.h) is used. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pythread.h>
#include <math.h>
#include <time.h>

/* whether a str is the given ASCII name (public API only: PyUnicode_CompareWithASCIIString) */
static int is_name(PyObject *s, const char *name) {
    return PyUnicode_Check(s) && PyUnicode_CompareWithASCIIString(s, name) == 0;
}

typedef struct {
    PyObject_HEAD
    PyThread_type_lock lock; /* held until open() */
    char opened;             /* set (with the GIL held) before the lock is released */
} Gate;

static PyTypeObject GateType;

static PyObject *gate_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) || (kwds && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "Gate() takes no arguments");
        return NULL;
    }
    Gate *self = (Gate *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->lock = PyThread_allocate_lock();
    if (self->lock == NULL) {
        Py_DECREF(self);
        PyErr_SetString(PyExc_MemoryError, "cannot allocate a lock");
        return NULL;
    }
    PyThread_acquire_lock(self->lock, NOWAIT_LOCK); /* a fresh lock: taken at once */
    self->opened = 0;
    return (PyObject *)self;
}

static void gate_dealloc(Gate *self) {
    if (self->lock != NULL) {
        if (!self->opened) /* never opened: still held (a lock is freed unlocked) */
            PyThread_release_lock(self->lock);
        PyThread_free_lock(self->lock);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static double monotonic(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* wait(timeout=None) -> bool: True once open, False after ``timeout`` seconds (by position
 * or keyword, as the twin; NaN is a ValueError, as threading.Lock says; one beyond
 * PY_TIMEOUT_MAX waits without limit, as the twin). Signals are handled as
 * threading.Lock.acquire handles them: the handler runs, and its exception
 * (KeyboardInterrupt) is raised from here. */
static PyObject *gate_wait(Gate *self, PyObject *const *args, Py_ssize_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    if (nargs + nkw > 1) {
        PyErr_SetString(PyExc_TypeError, "wait() takes at most one argument");
        return NULL;
    }
    if (nkw == 1 && !is_name(PyTuple_GET_ITEM(kwnames, 0), "timeout")) {
        PyErr_Format(PyExc_TypeError, "wait() got an unexpected keyword argument '%S'", PyTuple_GET_ITEM(kwnames, 0));
        return NULL;
    }
    PyObject *arg = nargs + nkw == 1 ? args[0] : Py_None;
    double timeout = -1.0;
    if (arg != Py_None) {
        timeout = PyFloat_AsDouble(arg);
        if (timeout == -1.0 && PyErr_Occurred())
            return NULL;
        if (isnan(timeout)) {
            PyErr_SetString(PyExc_ValueError, "Invalid value NaN (not a number)");
            return NULL;
        }
        if (timeout < 0)
            timeout = 0;
    }
    PyLockStatus r = PyThread_acquire_lock_timed(self->lock, 0, 0); /* open already: no GIL release */
    if (r != PY_LOCK_ACQUIRED && timeout != 0) {
        double end = timeout > 0 ? monotonic() + timeout : 0;
        double max_s = (double)PY_TIMEOUT_MAX / 1e6;
        for (;;) {
            PY_TIMEOUT_T us = -1;
            if (timeout > 0) {
                double left = end - monotonic();
                if (left <= 0) {
                    r = PY_LOCK_FAILURE;
                    break;
                }
                us = left > max_s ? PY_TIMEOUT_MAX : (PY_TIMEOUT_T)(left * 1e6);
            }
            Py_BEGIN_ALLOW_THREADS
            r = PyThread_acquire_lock_timed(self->lock, us, 1);
            Py_END_ALLOW_THREADS
            if (r != PY_LOCK_INTR)
                break;
            if (Py_MakePendingCalls() < 0) /* a signal handler raised */
                return NULL;
        }
    }
    if (r == PY_LOCK_ACQUIRED) {
        /* held again by the waiter: let go at once, so that the gate stays open (a second
         * wait returns True, and it is freed unlocked) */
        PyThread_release_lock(self->lock);
        Py_RETURN_TRUE;
    }
    Py_RETURN_FALSE;
}

static PyObject *gate_open(Gate *self, PyObject *unused) {
    if (!self->opened) {
        self->opened = 1;
        PyThread_release_lock(self->lock);
    }
    Py_RETURN_NONE;
}

static PyObject *gate_is_open(Gate *self, void *closure) { return PyBool_FromLong(self->opened); }

/* open_all(gates: list[Gate]): opens each not yet open, in order, with the GIL released. */
static PyObject *open_all(PyObject *module, PyObject *gates) {
    if (!PyList_Check(gates)) {
        PyErr_SetString(PyExc_TypeError, "open_all: a list of Gate");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(gates);
    Gate *stack[64];
    Gate **opening = n <= 64 ? stack : PyMem_New(Gate *, n);
    if (opening == NULL)
        return PyErr_NoMemory();
    Py_ssize_t k = 0;
    for (Py_ssize_t i = 0; i < n; i++) { /* every item checked before any is opened */
        if (Py_TYPE(PyList_GET_ITEM(gates, i)) != &GateType) {
            if (opening != stack)
                PyMem_Free(opening);
            PyErr_Format(PyExc_TypeError, "open_all: item %zd is not a Gate", i);
            return NULL;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Gate *g = (Gate *)PyList_GET_ITEM(gates, i);
        if (!g->opened) {
            g->opened = 1;
            Py_INCREF(g); /* alive while the GIL is released, whatever happens to the list */
            opening[k++] = g;
        }
    }
    if (k == 1) {
        PyThread_release_lock(opening[0]->lock);
    } else if (k > 1) {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < k; i++)
            PyThread_release_lock(opening[i]->lock);
        Py_END_ALLOW_THREADS
    }
    for (Py_ssize_t i = 0; i < k; i++)
        Py_DECREF(opening[i]);
    if (opening != stack)
        PyMem_Free(opening);
    Py_RETURN_NONE;
}

static PyMethodDef gate_methods[] = {
    {"wait", (PyCFunction)(void (*)(void))gate_wait, METH_FASTCALL | METH_KEYWORDS,
     "wait(timeout=None) -> bool: True once open, False after timeout seconds (the GIL released)"},
    {"open", (PyCFunction)gate_open, METH_NOARGS, "open(): wake the waiter (once; again is a no-op)"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef gate_getset[] = {
    {"is_open", (getter)gate_is_open, NULL, "opened already", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject GateType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "qdelay._handoff.Gate",
    .tp_basicsize = sizeof(Gate),
    .tp_dealloc = (destructor)gate_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A one-shot wake-up: made closed; open() once, wait(timeout) until open.",
    .tp_methods = gate_methods,
    .tp_getset = gate_getset,
    .tp_new = gate_new,
};

static PyMethodDef methods[] = {
    {"open_all", open_all, METH_O, "open_all(gates): open every Gate of the list, the GIL released"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_handoff", NULL, -1, methods};

PyMODINIT_FUNC PyInit__handoff(void) {
    if (PyType_Ready(&GateType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&GateType);
    if (PyModule_AddObject(m, "Gate", (PyObject *)&GateType) < 0) {
        Py_DECREF(&GateType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
