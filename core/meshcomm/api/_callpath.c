/* The compiled parts of the core's call path (meshcomm.api._callpath).
 *
 * Guard: the one-thread guard of a world, the same bookkeeping as the pure-Python
 * meshcomm.api.guard.WorldGuard (its docstrings are the contract), run on every operation.
 * Its state is only read and written while this code holds the GIL and calls no Python, so
 * no lock is needed (this module does not declare free-threading support: a free-threaded
 * interpreter runs it with the GIL). The messages of the rare paths (a refused thread, a
 * discarded result) come from the Python module's helpers, so both guards say the same.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "pythread.h"

typedef struct {
    PyObject_HEAD
    long long issued;   /* tickets handed out */
    long long inflight; /* operations entered and not yet left */
    long long marked;   /* tickets up to this one were in flight when another thread intruded */
    unsigned long owner; /* the thread whose operations are in flight (when any are) */
    PyObject *first_op;  /* the operation first in flight since the guard was last idle */
    PyObject *intruder;  /* what the intruding thread did, or NULL */
} Guard;

/* The helper ``name`` of meshcomm.api.guard called with ``args`` (a new reference, or NULL). */
static PyObject *call_helper(const char *name, PyObject *args) {
    if (args == NULL)
        return NULL;
    PyObject *module = PyImport_ImportModule("meshcomm.api.guard");
    PyObject *result = NULL;
    if (module != NULL) {
        PyObject *f = PyObject_GetAttrString(module, name);
        if (f != NULL) {
            result = PyObject_CallObject(f, args);
            Py_DECREF(f);
        }
        Py_DECREF(module);
    }
    Py_DECREF(args);
    return result;
}

/* Raise the exception object a helper returned. */
static PyObject *raise_returned(PyObject *exc) {
    if (exc != NULL) {
        PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
        Py_DECREF(exc);
    }
    return NULL;
}

static PyObject *Guard_enter(Guard *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "enter(op, who) takes 2 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *op = args[0], *who = args[1];
    unsigned long me = PyThread_get_thread_ident();
    if (!self->inflight) { /* the common case: nothing in flight */
        self->owner = me;
        Py_INCREF(op);
        Py_XSETREF(self->first_op, op);
    } else if (self->owner != me) {
        /* taken before any Python runs (the helpers may let other threads in) */
        long long issued = self->issued;
        int mark = self->marked < issued;
        unsigned long holder = self->owner;
        PyObject *running = self->first_op;
        Py_XINCREF(running);
        if (mark) {
            PyObject *text = call_helper("_intrusion", Py_BuildValue("(kO)", me, op));
            if (text == NULL) {
                Py_XDECREF(running);
                return NULL;
            }
            if (self->marked < issued) {
                self->marked = issued;
                Py_XSETREF(self->intruder, text);
            } else {
                Py_DECREF(text);
            }
        }
        PyObject *exc = call_helper(
            "_refusal", Py_BuildValue("(OOkkO)", op, who, me, holder, running ? running : Py_None));
        Py_XDECREF(running);
        return raise_returned(exc);
    }
    self->inflight += 1;
    self->issued += 1;
    return PyLong_FromLongLong(self->issued);
}

static PyObject *Guard_leave(Guard *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_Format(PyExc_TypeError, "leave(ticket, op, who, ok) takes 4 arguments (%zd given)", nargs);
        return NULL;
    }
    long long ticket = PyLong_AsLongLong(args[0]);
    if (ticket == -1 && PyErr_Occurred())
        return NULL;
    int ok = PyObject_IsTrue(args[3]);
    if (ok < 0)
        return NULL;
    self->inflight -= 1;
    if (ticket <= self->marked && self->intruder != NULL && ok) {
        PyObject *intruder = self->intruder;
        Py_INCREF(intruder);
        PyObject *exc = call_helper("_discarded", Py_BuildValue("(OOkO)", args[2], args[1], self->owner, intruder));
        Py_DECREF(intruder);
        return raise_returned(exc);
    }
    Py_RETURN_NONE;
}

static PyObject *Guard_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) || (kwds && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "Guard() takes no arguments");
        return NULL;
    }
    Guard *self = (Guard *)type->tp_alloc(type, 0);
    return (PyObject *)self; /* zeroed: idle, nothing issued */
}

static void Guard_dealloc(Guard *self) {
    Py_XDECREF(self->first_op);
    Py_XDECREF(self->intruder);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Guard_methods[] = {
    {"enter", (PyCFunction)(void (*)(void))Guard_enter, METH_FASTCALL,
     "enter(op, who) -> ticket: register op as in flight; raise DistributedError if another thread's are."},
    {"leave", (PyCFunction)(void (*)(void))Guard_leave, METH_FASTCALL,
     "leave(ticket, op, who, ok): op ended; raise DistributedError if another thread intruded "
     "while it was in flight and ok."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject GuardType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "meshcomm.api._callpath.Guard",
    .tp_basicsize = sizeof(Guard),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The one-thread guard of a world, compiled (see meshcomm.api.guard.WorldGuard).",
    .tp_new = Guard_new,
    .tp_dealloc = (destructor)Guard_dealloc,
    .tp_methods = Guard_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "meshcomm.api._callpath", "The compiled parts of meshcomm's call path.", -1, NULL,
};

PyMODINIT_FUNC PyInit__callpath(void) {
    if (PyType_Ready(&GuardType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&GuardType);
    if (PyModule_AddObject(m, "Guard", (PyObject *)&GuardType) < 0) {
        Py_DECREF(&GuardType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
