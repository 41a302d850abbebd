/* The compiled parts of the core's call path (meshcomm.api._callpath).
 *
 * Guard: the one-thread guard of a world, the same bookkeeping as the pure-Python
 * meshcomm.api.guard.WorldGuard (its docstrings are the contract), run on every operation.
 * Its state is only read and written while this code holds the GIL and calls no Python, so
 * no lock is needed (this module does not declare free-threading support: a free-threaded
 * interpreter runs it with the GIL). The messages of the rare paths (a refused thread, a
 * discarded result) come from the Python module's helpers, so both guards say the same.
 *
 * Lane: a group's blocking all_sum/all_max/all_min into a new result or out= (run), a start
 * of a persistent all-reduce (start) and a blocking barrier (barrier), the steps the
 * pure-Python Group._all_reduce (or _start_persistent, Group._barrier_run), _submit and
 * _execute take, in one C call: the guard, the call's number, the observer's record, the call
 * check or shape key, the result array and the hand-off to the backend (its sum_now for a
 * sum, when it has one, else its all_reduce; a persistent start's check and start through
 * Group._persistent_run). What it does not handle itself (another array type, an out= that
 * does not fit, a closed group, queued asynchronous operations, an observer that must run
 * the operation itself) goes to the Python path before anything happened. Arrays are read
 * and made through NumPy's C API, and the operation in progress is kept in C fields for the
 * stall inspector (Running).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>
#include "pythread.h"
#include <stdint.h>
#include <string.h>
#include <time.h>

/* the ints 0 and 1, made once (3.10 has no Py_GetConstant) */
static PyObject *zero_obj, *one_obj;

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

/* ---------------------------------------------------------------------------------------- */
/* Running: what a lane's operation in progress is, for the stall inspector                 */

/* The lanes write it at each operation's begin and end (C fields: no Python object is made
 * per call); the observer reads it as ``current()`` (Recorder.current) when it wants to know. */
typedef struct {
    PyObject_HEAD
    PyObject *prefix; /* the group's (name, rank, world rank, size) */
    PyObject *op;     /* the operation's name */
    long long seq;
    double t0;
    int on;
} Running;

static PyObject *minus_one;

static PyObject *Running_current(Running *self, PyObject *Py_UNUSED(ignored)) {
    if (!self->on || self->prefix == NULL)
        Py_RETURN_NONE;
    Py_ssize_t np = PyTuple_GET_SIZE(self->prefix);
    PyObject *seq = PyLong_FromLongLong(self->seq), *t0 = seq ? PyFloat_FromDouble(self->t0) : NULL;
    PyObject *cur = t0 ? PyTuple_New(np + 4) : NULL;
    if (cur == NULL) {
        Py_XDECREF(seq);
        Py_XDECREF(t0);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < np; i++)
        PyTuple_SET_ITEM(cur, i, Py_NewRef(PyTuple_GET_ITEM(self->prefix, i)));
    PyTuple_SET_ITEM(cur, np, seq);
    PyTuple_SET_ITEM(cur, np + 1, Py_NewRef(self->op));
    PyTuple_SET_ITEM(cur, np + 2, Py_NewRef(minus_one));
    PyTuple_SET_ITEM(cur, np + 3, t0);
    return cur;
}

static int Running_traverse(Running *self, visitproc visit, void *arg) {
    Py_VISIT(self->prefix);
    Py_VISIT(self->op);
    return 0;
}

static int Running_clear(Running *self) {
    Py_CLEAR(self->prefix);
    Py_CLEAR(self->op);
    return 0;
}

static void Running_dealloc(Running *self) {
    PyObject_GC_UnTrack(self);
    Running_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Running_methods[] = {
    {"current", (PyCFunction)Running_current, METH_NOARGS,
     "current() -> prefix + (seq, op, -1, start time) of the operation in progress, or None."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject RunningType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "meshcomm.api._callpath.Running",
    .tp_basicsize = sizeof(Running),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "What the compiled lanes' operation in progress is (for an observer's current).",
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)Running_dealloc,
    .tp_traverse = (traverseproc)Running_traverse,
    .tp_clear = (inquiry)Running_clear,
    .tp_methods = Running_methods,
};

/* ---------------------------------------------------------------------------------------- */
/* Lane                                                                                     */

/* set once by setup(): what every lane needs from NumPy and the core */
static PyObject *movable, *shape_keys, *calls_differ, *kept_errors;
static PyObject *s_closed, *s_world_closed, *s_thread, *s_pending, *s_calls, *s_user_op, *s_user_no, *s_active, *s_lane_record,
    *s_check, *s_in_flight, *s_all_reduce, *s_shape_key, *s_empty, *s_min_bytes, *s_reshape, *s_call_key,
    *s_all_reduce_py, *s_sum_now, *s_persistent_run, *s_start_persistent, *s_calls_differ, *s_unexpected, *s_dtype, *s_shape,
    *s_barrier, *s_submit_barrier, *s_direct_out, *no_shape;
/* the operations' names (3: a persistent all-reduce's start, 4: a barrier) and the reductions' ops */
enum { N_OPS = 5, BARRIER = 4 };
static PyObject *NAMES[N_OPS], *OPS[3];

/* the progress record's per-operation fields (meshcomm.trace.progress: _STATE_AT, _NOW, _STATE, _SEQ) */
enum { STATE_AT = 12, TIME_AT = 16, OP_AT = 24, OP_LEN = 24, GROUP_AT = 48, GROUP_LEN = 64, SEQ_AT = 112,
       PEER_AT = 120, RECORD_END = 124, SLOT_SEQ = 64, RUNNING = 1, FINISHED = 2, FAILED = 3 };

typedef struct {
    PyObject_HEAD
    PyObject *group, *world, *worker, *b, *moves, *who;
    Guard *guard;
    PyObject *observers; /* the module meshcomm.api.observer (its ``active``) */
    int plain, keyed, piped;
    Py_ssize_t min_bytes; /* results of this many bytes come from the backend's empty() */
    int direct_out;       /* the backend writes results into callers' out= arrays */
    PyObject *rec;        /* the observer the records below came from, or NULL */
    PyObject *records[N_OPS]; /* per operation: its lane_record (a tuple, or None), NULL until asked */
    /* per operation, on a group whose backend carries the call check (piped): the last call's
     * dtype and shape, and the call_key and _in_flight that Group._check set for them */
    PyObject *key_dtype[N_OPS], *key_shape[N_OPS], *key[N_OPS], *in_flight[N_OPS];
} Lane;

/* The wall clock for the records of the stall inspector, which reads them in seconds: the
 * coarse clock where there is one (a few ms of resolution, a quarter of the fine one's cost) */
static double wall_now(void) {
    struct timespec ts;
#ifdef CLOCK_REALTIME_COARSE
    clock_gettime(CLOCK_REALTIME_COARSE, &ts);
#else
    clock_gettime(CLOCK_REALTIME, &ts);
#endif
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Write ``n`` bytes of ``data`` at ``at`` and ``n2`` bytes of ``data2`` at ``at2`` (none when
 * ``n2`` is 0) into the writable buffer ``mm``, in one hold of it (-1 on an error). */
static int write_record(PyObject *mm, Py_ssize_t at, const void *data, Py_ssize_t n, Py_ssize_t at2,
                        const void *data2, Py_ssize_t n2) {
    Py_buffer view;
    if (PyObject_GetBuffer(mm, &view, PyBUF_WRITABLE) < 0)
        return -1;
    int rc = 0;
    if (at + n > view.len || at2 + n2 > view.len) {
        PyErr_SetString(PyExc_ValueError, "the progress record is shorter than its layout");
        rc = -1;
    } else {
        memcpy((char *)view.buf + at, data, (size_t)n);
        if (n2)
            memcpy((char *)view.buf + at2, data2, (size_t)n2);
    }
    PyBuffer_Release(&view);
    return rc;
}

/* The progress record's begin: state, time, op, group, sequence, peer -1, and the group's slot. */
static int record_begin(PyObject *record, double now, long long seq) {
    PyObject *mm = PyTuple_GET_ITEM(record, 1);
    if (mm == Py_None)
        return 0;
    PyObject *op_b = PyTuple_GET_ITEM(record, 2), *group_b = PyTuple_GET_ITEM(record, 3);
    long long slot = PyLong_AsLongLong(PyTuple_GET_ITEM(record, 4));
    if (slot == -1 && PyErr_Occurred())
        return -1;
    char head[RECORD_END - STATE_AT];
    int32_t state = RUNNING, peer = -1;
    int64_t seq64 = seq;
    memset(head, 0, sizeof head);
    memcpy(head, &state, 4);
    memcpy(head + (TIME_AT - STATE_AT), &now, 8);
    memcpy(head + (OP_AT - STATE_AT), PyBytes_AS_STRING(op_b), (size_t)Py_MIN(PyBytes_GET_SIZE(op_b), OP_LEN));
    memcpy(head + (GROUP_AT - STATE_AT), PyBytes_AS_STRING(group_b),
           (size_t)Py_MIN(PyBytes_GET_SIZE(group_b), GROUP_LEN));
    memcpy(head + (SEQ_AT - STATE_AT), &seq64, 8);
    memcpy(head + (PEER_AT - STATE_AT), &peer, 4);
    /* the group's slot gets the sequence too (slot 0: the group has none) */
    return write_record(mm, STATE_AT, head, sizeof head, slot ? slot + SLOT_SEQ : 0, &seq64, slot ? 8 : 0);
}

static int record_end(PyObject *record, int ok) {
    PyObject *mm = PyTuple_GET_ITEM(record, 1);
    if (mm == Py_None)
        return 0;
    char tail[12];
    int32_t state = ok ? FINISHED : FAILED;
    double now = wall_now();
    memcpy(tail, &state, 4);
    memcpy(tail + 4, &now, 8);
    return write_record(mm, STATE_AT, tail, sizeof tail, 0, NULL, 0);
}

/* The record of op ``k`` from the active observer: a tuple (see Recorder.lane_record), Py_None
 * when the observer must run the operation itself, NULL on an error (borrowed). */
static PyObject *lane_record(Lane *self, PyObject *active, int k) {
    if (self->rec != active) {
        for (int i = 0; i < N_OPS; i++)
            Py_CLEAR(self->records[i]);
        Py_INCREF(active);
        Py_XSETREF(self->rec, active);
    }
    if (self->records[k] == NULL) {
        PyObject *r = PyObject_CallMethodObjArgs(active, s_lane_record, self->group, NAMES[k], NULL);
        if (r == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_AttributeError))
                return NULL;
            PyErr_Clear(); /* an observer without lane_record runs every operation itself */
            r = Py_NewRef(Py_None);
        } else if (r != Py_None && (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) != 6 ||
                                    !PyTuple_Check(PyTuple_GET_ITEM(r, 0)) ||
                                    (PyTuple_GET_ITEM(r, 1) != Py_None &&
                                     (!PyBytes_Check(PyTuple_GET_ITEM(r, 2)) || !PyBytes_Check(PyTuple_GET_ITEM(r, 3)))) ||
                                    !PyObject_TypeCheck(PyTuple_GET_ITEM(r, 5), &RunningType))) {
            Py_DECREF(r);
            PyErr_SetString(PyExc_TypeError,
                            "lane_record must return None or (prefix, buffer, op, group, slot, running)");
            return NULL;
        }
        self->records[k] = r;
    }
    return self->records[k];
}

/* Group._all_reduce(OPS[k], x, out, False): the Python path (out NULL: None). */
static PyObject *slow(Lane *self, int k, PyObject *x, PyObject *out) {
    return PyObject_CallMethodObjArgs(self->group, s_all_reduce_py, OPS[k], x, out ? out : Py_None, Py_False, NULL);
}

/* Whether the shape tuple ``shape`` (of ints) is ``ndim`` and ``dims`` (-1 on an error). */
static int same_shape(PyObject *shape, int ndim, const npy_intp *dims) {
    if (PyTuple_GET_SIZE(shape) != ndim)
        return 0;
    for (int i = 0; i < ndim; i++) {
        Py_ssize_t d = PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, i));
        if (d == -1 && PyErr_Occurred())
            return -1;
        if (d != dims[i])
            return 0;
    }
    return 1;
}

/* The shape of array ``x`` as a tuple, or () for no array (the barrier): a new reference. */
static PyObject *shape_of(PyObject *x) {
    return x == NULL ? Py_NewRef(no_shape) : PyObject_GetAttr(x, s_shape);
}

/* Group._check of operation ``k`` on array ``x`` (NULL: no array, the barrier), its backend
 * method ``method``. On a piped group its outcome depends only on the call's dtype and shape
 * (the backend's call_key and the group's _in_flight): a repeat of the last call sets the two
 * remembered from it; any other call runs Group._check and, if it set a key, remembers what
 * it set. 1 when the check ran apart from the operation (Group._check's True: it was a
 * barrier), 0 when not, -1 on an error. */
static int piped_key(Lane *self, int k, PyObject *x, PyObject *dtype, PyObject *method) {
    if (self->piped && self->key[k] != NULL && self->key_dtype[k] == dtype) {
        int same = x == NULL ? PyTuple_GET_SIZE(self->key_shape[k]) == 0
                             : same_shape(self->key_shape[k], PyArray_NDIM((PyArrayObject *)x),
                                          PyArray_DIMS((PyArrayObject *)x));
        if (same < 0)
            return -1;
        if (same) {
            if (PyObject_SetAttr(self->moves, s_call_key, self->key[k]) < 0)
                return -1;
            return PyObject_SetAttr(self->group, s_in_flight, self->in_flight[k]);
        }
    }
    PyObject *shape = shape_of(x);
    if (shape == NULL)
        return -1;
    PyObject *r = PyObject_CallMethodObjArgs(self->group, s_check, NAMES[k], shape, dtype, zero_obj, method, NULL);
    if (r == NULL) {
        Py_DECREF(shape);
        return -1;
    }
    int ran = PyObject_IsTrue(r);
    Py_DECREF(r);
    if (ran != 0 || !self->piped) {
        Py_DECREF(shape);
        return ran;
    }
    PyObject *key = PyObject_GetAttr(self->moves, s_call_key);
    PyObject *flight = key ? PyObject_GetAttr(self->group, s_in_flight) : NULL;
    if (flight == NULL) {
        Py_XDECREF(key);
        Py_DECREF(shape);
        return -1;
    }
    if (key == Py_None) { /* the check ran apart from the data (Group._check): nothing to remember */
        Py_DECREF(key);
        Py_DECREF(flight);
        Py_DECREF(shape);
        return 0;
    }
    Py_XSETREF(self->key[k], key);
    Py_XSETREF(self->in_flight[k], flight);
    Py_XSETREF(self->key_shape[k], shape);
    Py_XSETREF(self->key_dtype[k], Py_NewRef(dtype));
    return 0;
}

/* The all-reduce proper, as the run of Group._all_reduce does it, into a new result or into
 * ``out`` (not NULL: it fits, see out_fits) (a new reference, or NULL). */
static PyObject *reduced(Lane *self, int k, PyObject *x, int ndim, Py_ssize_t nbytes, PyObject *dtype, PyObject *out) {
    PyObject *shape = NULL, *res = NULL, *send = NULL, *recv = NULL, *r;
    if (!self->plain) {
        if (piped_key(self, k, x, dtype, s_all_reduce) < 0)
            goto done;
    } else if (self->keyed) {
        PyObject *key = ndim == 1 ? Py_NewRef(zero_obj) : NULL;
        if (key == NULL && (shape = shape_of(x)) != NULL)
            key = PyObject_GetItem(shape_keys, shape);
        if (key == NULL)
            goto done;
        int rc = PyObject_SetAttr(self->moves, s_shape_key, key);
        Py_DECREF(key);
        if (rc < 0)
            goto done;
    }
    if (out != NULL) { /* the backend writes straight into the caller's array (direct_out) */
        res = Py_NewRef(out);
    } else if (nbytes >= self->min_bytes) { /* the backend's own kind of array (Backend.empty) */
        if (shape == NULL && (shape = shape_of(x)) == NULL)
            goto done;
        res = PyObject_CallMethodObjArgs(self->moves, s_empty, shape, dtype, NULL);
    } else { /* np.empty(x.shape, x.dtype) */
        PyArray_Descr *descr = PyArray_DESCR((PyArrayObject *)x);
        Py_INCREF(descr); /* the new array takes this reference */
        res = PyArray_NewFromDescr(&PyArray_Type, descr, ndim, PyArray_DIMS((PyArrayObject *)x), NULL, NULL, 0, NULL);
    }
    if (res == NULL)
        goto done;
    if (ndim == 1) {
        send = Py_NewRef(x);
        recv = Py_NewRef(res);
    } else {
        send = PyObject_CallMethodObjArgs(x, s_reshape, minus_one, NULL);
        recv = send ? PyObject_CallMethodObjArgs(res, s_reshape, minus_one, NULL) : NULL;
        if (recv == NULL) {
            Py_CLEAR(res);
            goto done;
        }
    }
    if (k == 0) { /* a sum: the backend's own shorter way first (Backend.sum_now), when it has one */
        PyObject *now = PyObject_GetAttr(self->moves, s_sum_now);
        if (now == NULL) {
            Py_CLEAR(res);
            goto done;
        }
        if (now != Py_None) {
            PyObject *now_args[2] = {send, recv};
            r = PyObject_Vectorcall(now, now_args, 2, NULL);
            Py_DECREF(now);
            int taken = r == NULL ? -1 : PyObject_IsTrue(r);
            Py_XDECREF(r);
            if (taken != 0) {
                if (taken < 0)
                    Py_CLEAR(res);
                goto done;
            }
        } else {
            Py_DECREF(now);
        }
    }
    r = PyObject_CallMethodObjArgs(self->moves, s_all_reduce, send, recv, OPS[k], NULL);
    if (r == NULL)
        Py_CLEAR(res);
    else
        Py_DECREF(r);
done:
    Py_XDECREF(send);
    Py_XDECREF(recv);
    Py_XDECREF(shape);
    return res;
}

/* The error the operation raised, as Group._execute maps it (the error stays set). */
static void map_error(Lane *self, int k) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL && value != NULL)
        PyException_SetTraceback(value, tb);
    PyObject *mapped = NULL;
    int from_none = 0;
    if (value == NULL || !PyObject_TypeCheck(value, (PyTypeObject *)PyExc_Exception)) {
        /* KeyboardInterrupt, SystemExit: as they are */
    } else if (PyObject_IsInstance(value, calls_differ) == 1) {
        mapped = PyObject_CallMethodObjArgs(self->group, s_calls_differ, value, NULL);
        from_none = 1;
    } else if (PyObject_IsInstance(value, kept_errors) != 1) {
        mapped = PyObject_CallMethodObjArgs(self->group, s_unexpected, NAMES[k], value, NULL);
    }
    if (PyErr_Occurred()) { /* a helper failed: its error replaces the operation's */
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        Py_XDECREF(mapped);
        return;
    }
    if (mapped == NULL || mapped == value) {
        Py_XDECREF(mapped);
        if (mapped == value && from_none && value != NULL) { /* raise exc from None */
            PyException_SetCause(value, NULL);
        }
        PyErr_Restore(type, value, tb);
        return;
    }
    /* raise mapped from exc (from None for CallsDiffer) */
    PyException_SetContext(mapped, Py_NewRef(value));
    if (from_none) {
        PyException_SetCause(mapped, NULL); /* also sets __suppress_context__ */
    } else {
        PyException_SetCause(mapped, Py_NewRef(value));
    }
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    PyErr_SetObject((PyObject *)Py_TYPE(mapped), mapped);
    Py_DECREF(mapped);
}

/* What one operation of the lane runs between the guard's enter and leave (a new
 * reference, or NULL with the error set). */
typedef PyObject *(*lane_body)(Lane *self, int k, void *ctx);

/* Operation NAMES[k] as the group's _submit and _execute run it: refused to the Python path
 * (``slow``, called before anything happened) when the group or world is closed, asynchronous
 * operations are queued, or the observer runs operations itself; else the guard, the call's
 * number, the observer's record around ``body``, the error mapping, the guard's leave. */
static PyObject *lane_call(Lane *self, int k, lane_body body, void *ctx, PyObject *(*slow_path)(Lane *, void *)) {
    PyObject *flag = PyObject_GetAttr(self->group, s_closed);
    int closed = flag ? PyObject_IsTrue(flag) : -1;
    Py_XDECREF(flag);
    if (closed == 0) {
        flag = PyObject_GetAttr(self->world, s_world_closed);
        closed = flag ? PyObject_IsTrue(flag) : -1;
        Py_XDECREF(flag);
    }
    if (closed == 0) {
        PyObject *thread = PyObject_GetAttr(self->worker, s_thread);
        if (thread == NULL) {
            closed = -1;
        } else if (thread != Py_None) {
            PyObject *pending = PyObject_CallMethodNoArgs(self->worker, s_pending);
            closed = pending ? PyObject_IsTrue(pending) : -1;
            Py_XDECREF(pending);
        }
        Py_XDECREF(thread);
    }
    PyObject *record = NULL, *active = NULL;
    if (closed == 0) {
        active = PyObject_GetAttr(self->observers, s_active);
        if (active == NULL) {
            closed = -1;
        } else if (active != Py_None) {
            record = lane_record(self, active, k);
            if (record == NULL)
                closed = -1;
            else if (record == Py_None)
                closed = 1; /* the observer runs the operation itself */
        }
    }
    if (closed != 0) {
        Py_XDECREF(active);
        return closed < 0 ? NULL : slow_path(self, ctx);
    }
    /* held for the call: another thread's refused call may replace the lane's records */
    record = active == Py_None ? NULL : Py_NewRef(record);

    /* the guard (its compiled enter), the call's number */
    PyObject *enter_args[2] = {NAMES[k], self->who};
    PyObject *ticket_obj = Guard_enter(self->guard, enter_args, 2);
    if (ticket_obj == NULL) {
        Py_DECREF(active);
        Py_XDECREF(record);
        return NULL;
    }
    PyObject *result = NULL;
    int ok = 0;
    PyObject *calls = PyObject_GetAttr(self->group, s_calls), *n = NULL;
    if (calls != NULL) {
        n = PyNumber_Add(calls, one_obj);
        Py_DECREF(calls);
    }
    if (n == NULL || PyObject_SetAttr(self->group, s_calls, n) < 0 ||
        PyObject_SetAttr(self->b, s_user_op, NAMES[k]) < 0 || PyObject_SetAttr(self->b, s_user_no, n) < 0)
        goto leave;
    /* the observer's record around the operation, as Recorder.call keeps it */
    Running *running = NULL;
    if (record != NULL) {
        long long seq = PyLong_AsLongLong(n);
        if (seq == -1 && PyErr_Occurred())
            goto leave;
        double t0 = wall_now();
        running = (Running *)PyTuple_GET_ITEM(record, 5);
        PyObject *prefix = PyTuple_GET_ITEM(record, 0);
        if (running->prefix != prefix)
            Py_XSETREF(running->prefix, Py_NewRef(prefix));
        if (running->op != NAMES[k])
            Py_XSETREF(running->op, Py_NewRef(NAMES[k]));
        running->seq = seq;
        running->t0 = t0;
        running->on = 1;
        if (record_begin(record, t0, seq) < 0) {
            running->on = 0;
            goto leave;
        }
    }
    result = body(self, k, ctx);
    ok = result != NULL;
    if (record != NULL) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        running->on = 0;
        if (record_end(record, ok) < 0) {
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(tb);
            Py_CLEAR(result);
            ok = 0;
        } else {
            PyErr_Restore(type, value, tb);
        }
    }
    if (!ok)
        map_error(self, k);
leave:
    Py_XDECREF(n);
    Py_DECREF(active);
    Py_XDECREF(record);
    {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        int failed = 0;
        if (self->piped && PyObject_SetAttr(self->moves, s_call_key, Py_None) < 0)
            failed = 1;
        if (!failed) {
            PyObject *leave_args[4] = {ticket_obj, NAMES[k], self->who, ok ? Py_True : Py_False};
            PyObject *r = Guard_leave(self->guard, leave_args, 4);
            if (r == NULL)
                failed = 1;
            else
                Py_DECREF(r);
        }
        Py_DECREF(ticket_obj);
        if (failed) { /* the guard's (or the key's) error replaces the operation's, as a finally does */
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(tb);
            Py_CLEAR(result);
        } else if (type != NULL) {
            PyErr_Restore(type, value, tb);
            Py_CLEAR(result);
        }
    }
    return result;
}

/* run(x, k[, out]): what an all-reduce's lane_call needs of x (and out, or NULL) */
typedef struct {
    PyObject *x, *dtype, *out;
    int ndim, k;
    Py_ssize_t nbytes;
} Reduction;

static PyObject *reduction_body(Lane *self, int k, void *ctx) {
    Reduction *r = (Reduction *)ctx;
    return reduced(self, k, r->x, r->ndim, r->nbytes, r->dtype, r->out);
}

static PyObject *reduction_slow(Lane *self, void *ctx) {
    Reduction *r = (Reduction *)ctx;
    return slow(self, r->k, r->x, r->out);
}

/* Whether ``out`` takes the all-reduce of ``x`` here: a NumPy array of x's very dtype and
 * shape, C-contiguous, writable, apart from x in memory, and a backend that writes into
 * callers' arrays. Anything else (out=x, an overlap, a mismatch: Group._out's errors) is for
 * the Python path. */
static int out_fits(Lane *self, PyArrayObject *x, PyObject *out_obj) {
    if (!self->direct_out || !PyArray_CheckExact(out_obj) || out_obj == (PyObject *)x)
        return 0;
    PyArrayObject *out = (PyArrayObject *)out_obj;
    int nd = PyArray_NDIM(x);
    if (PyArray_DESCR(out) != PyArray_DESCR(x) || PyArray_NDIM(out) != nd || !PyArray_IS_C_CONTIGUOUS(out) ||
        !PyArray_ISWRITEABLE(out) || memcmp(PyArray_DIMS(out), PyArray_DIMS(x), nd * sizeof(npy_intp)) != 0)
        return 0;
    char *a = PyArray_BYTES(x), *b = PyArray_BYTES(out);
    npy_intp n = PyArray_NBYTES(x);
    return b + n <= a || a + n <= b;
}

static PyObject *Lane_run(Lane *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 && nargs != 3) {
        PyErr_Format(PyExc_TypeError, "run(x, k[, out]) takes 2 or 3 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *x = args[0], *out = nargs == 3 && args[2] != Py_None ? args[2] : NULL;
    long k = PyLong_AsLong(args[1]);
    if (k < 0 || k > 2) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "run: k must be 0 (sum), 1 (max) or 2 (min), got %ld", k);
        return NULL;
    }
    if (!PyArray_CheckExact(x))
        return slow(self, (int)k, x, out);
    /* a supported dtype, C-contiguous, not empty, not 0-d: else the Python path */
    PyArrayObject *a = (PyArrayObject *)x;
    PyObject *dtype = (PyObject *)PyArray_DESCR(a); /* borrowed: x holds it */
    int known = PySet_Contains(movable, dtype);
    if (known < 0)
        return NULL;
    if (!known || !PyArray_IS_C_CONTIGUOUS(a) || PyArray_NDIM(a) == 0 || PyArray_SIZE(a) == 0 ||
        (out != NULL && !out_fits(self, a, out)))
        return slow(self, (int)k, x, out);
    Reduction r = {x, dtype, out, PyArray_NDIM(a), (int)k, (Py_ssize_t)PyArray_NBYTES(a)};
    return lane_call(self, (int)k, reduction_body, &r, reduction_slow);
}

/* start(p): one start of the persistent all-reduce p (Group._start_persistent, compiled) */
static PyObject *persistent_body(Lane *self, int k, void *ctx) {
    return PyObject_CallMethodObjArgs(self->group, s_persistent_run, (PyObject *)ctx, NULL);
}

static PyObject *persistent_slow(Lane *self, void *ctx) {
    return PyObject_CallMethodObjArgs(self->group, s_start_persistent, (PyObject *)ctx, NULL);
}

static PyObject *Lane_start(Lane *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 1) {
        PyErr_Format(PyExc_TypeError, "start(p) takes 1 argument (%zd given)", nargs);
        return NULL;
    }
    return lane_call(self, 3, persistent_body, args[0], persistent_slow);
}

/* barrier(): Group._barrier_run, compiled: the call check (which, when it runs apart from the
 * operation, is the barrier), else the backend's barrier */
static PyObject *barrier_body(Lane *self, int k, void *ctx) {
    int ran = piped_key(self, BARRIER, NULL, Py_None, s_barrier);
    if (ran < 0)
        return NULL;
    if (ran)
        Py_RETURN_NONE;
    PyObject *r = PyObject_CallMethodNoArgs(self->moves, s_barrier);
    if (r == NULL)
        return NULL;
    Py_DECREF(r);
    Py_RETURN_NONE;
}

static PyObject *barrier_slow(Lane *self, void *ctx) {
    return PyObject_CallMethodOneArg(self->group, s_submit_barrier, Py_False);
}

static PyObject *Lane_barrier(Lane *self, PyObject *Py_UNUSED(ignored)) {
    return lane_call(self, BARRIER, barrier_body, NULL, barrier_slow);
}

static PyObject *Lane_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *names[] = {"group", "guard", "world", "worker", "backend", "moves", "who", "observers", "plain",
                            "keyed", "piped", NULL};
    PyObject *group, *guard, *world, *worker, *b, *moves, *who, *observers;
    int plain, keyed, piped;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO!OOOOUOppp", names, &group, &GuardType, &guard, &world, &worker,
                                     &b, &moves, &who, &observers, &plain, &keyed, &piped))
        return NULL;
    if (movable == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "meshcomm.api._callpath.setup() was not called");
        return NULL;
    }
    /* the backend's class constants (Backend.EMPTY_MIN_BYTES, direct_out), read once */
    PyObject *least_obj = PyObject_GetAttr(moves, s_min_bytes);
    Py_ssize_t least = least_obj ? PyLong_AsSsize_t(least_obj) : -1;
    Py_XDECREF(least_obj);
    if (least == -1 && PyErr_Occurred())
        return NULL;
    PyObject *direct_obj = PyObject_GetAttr(moves, s_direct_out);
    int direct = direct_obj ? PyObject_IsTrue(direct_obj) : -1;
    Py_XDECREF(direct_obj);
    if (direct < 0)
        return NULL;
    Lane *self = (Lane *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->min_bytes = least;
    self->direct_out = direct;
    self->group = Py_NewRef(group);
    self->guard = (Guard *)Py_NewRef(guard);
    self->world = Py_NewRef(world);
    self->worker = Py_NewRef(worker);
    self->b = Py_NewRef(b);
    self->moves = Py_NewRef(moves);
    self->who = Py_NewRef(who);
    self->observers = Py_NewRef(observers);
    self->plain = plain;
    self->keyed = keyed;
    self->piped = piped;
    return (PyObject *)self;
}

static int Lane_traverse(Lane *self, visitproc visit, void *arg) {
    Py_VISIT(self->group);
    Py_VISIT(self->guard);
    Py_VISIT(self->world);
    Py_VISIT(self->worker);
    Py_VISIT(self->b);
    Py_VISIT(self->moves);
    Py_VISIT(self->who);
    Py_VISIT(self->observers);
    Py_VISIT(self->rec);
    for (int i = 0; i < N_OPS; i++) {
        Py_VISIT(self->records[i]);
        Py_VISIT(self->key_dtype[i]);
        Py_VISIT(self->key_shape[i]);
        Py_VISIT(self->key[i]);
        Py_VISIT(self->in_flight[i]);
    }
    return 0;
}

static int Lane_clear(Lane *self) {
    Py_CLEAR(self->group);
    Py_CLEAR(self->guard);
    Py_CLEAR(self->world);
    Py_CLEAR(self->worker);
    Py_CLEAR(self->b);
    Py_CLEAR(self->moves);
    Py_CLEAR(self->who);
    Py_CLEAR(self->observers);
    Py_CLEAR(self->rec);
    for (int i = 0; i < N_OPS; i++) {
        Py_CLEAR(self->records[i]);
        Py_CLEAR(self->key_dtype[i]);
        Py_CLEAR(self->key_shape[i]);
        Py_CLEAR(self->key[i]);
        Py_CLEAR(self->in_flight[i]);
    }
    return 0;
}

static void Lane_dealloc(Lane *self) {
    PyObject_GC_UnTrack(self);
    Lane_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Lane_methods[] = {
    {"run", (PyCFunction)(void (*)(void))Lane_run, METH_FASTCALL,
     "run(x, k[, out]): the blocking all-reduce of x, op k (0 sum, 1 max, 2 min), into a new result or out."},
    {"start", (PyCFunction)(void (*)(void))Lane_start, METH_FASTCALL,
     "start(p): one start of the persistent all-reduce p (what Group._start_persistent does)."},
    {"barrier", (PyCFunction)Lane_barrier, METH_NOARGS, "barrier(): the blocking barrier (what Group._barrier_run does)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject LaneType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "meshcomm.api._callpath.Lane",
    .tp_basicsize = sizeof(Lane),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A group's blocking all_sum/all_max/all_min, persistent starts and barrier, compiled (see Group._all_reduce).",
    .tp_new = Lane_new,
    .tp_dealloc = (destructor)Lane_dealloc,
    .tp_traverse = (traverseproc)Lane_traverse,
    .tp_clear = (inquiry)Lane_clear,
    .tp_methods = Lane_methods,
};

static PyObject *setup(PyObject *module, PyObject *args) {
    PyObject *mov, *keys, *differ, *kept;
    if (!PyArg_ParseTuple(args, "OOOO:setup", &mov, &keys, &differ, &kept))
        return NULL;
    Py_XSETREF(movable, Py_NewRef(mov));
    Py_XSETREF(shape_keys, Py_NewRef(keys));
    Py_XSETREF(calls_differ, Py_NewRef(differ));
    Py_XSETREF(kept_errors, Py_NewRef(kept));
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"setup", setup, METH_VARARGS,
     "setup(movable, shape_keys, CallsDiffer, kept_errors): what every Lane needs, once."},
    {NULL, NULL, 0, NULL},
};

static int intern_all(void) {
#define INTERN(var, text) \
    if ((var = PyUnicode_InternFromString(text)) == NULL) \
        return -1;
    INTERN(s_closed, "_closed") INTERN(s_world_closed, "closed") INTERN(s_thread, "_thread") INTERN(s_pending, "pending") INTERN(s_calls, "_calls")
    INTERN(s_user_op, "user_op") INTERN(s_user_no, "user_no") INTERN(s_active, "active")
    INTERN(s_lane_record, "lane_record") INTERN(s_check, "_check") INTERN(s_in_flight, "_in_flight")
    INTERN(s_all_reduce, "all_reduce") INTERN(s_shape_key, "shape_key") INTERN(s_empty, "empty")
    INTERN(s_min_bytes, "EMPTY_MIN_BYTES") INTERN(s_reshape, "reshape") INTERN(s_call_key, "call_key")
    INTERN(s_all_reduce_py, "_all_reduce") INTERN(s_sum_now, "sum_now")
    INTERN(s_persistent_run, "_persistent_run") INTERN(s_start_persistent, "_start_persistent") INTERN(s_calls_differ, "_calls_differ") INTERN(s_unexpected, "_unexpected")
    INTERN(s_dtype, "dtype") INTERN(s_shape, "shape")
    INTERN(NAMES[0], "all_sum") INTERN(NAMES[1], "all_max") INTERN(NAMES[2], "all_min")
    INTERN(NAMES[3], "all_reduce_init") INTERN(NAMES[BARRIER], "barrier")
    INTERN(s_barrier, "barrier") INTERN(s_submit_barrier, "_submit_barrier") INTERN(s_direct_out, "direct_out")
    INTERN(OPS[0], "sum") INTERN(OPS[1], "max") INTERN(OPS[2], "min")
#undef INTERN
    if ((minus_one = PyLong_FromLong(-1)) == NULL || (zero_obj = PyLong_FromLong(0)) == NULL ||
        (one_obj = PyLong_FromLong(1)) == NULL || (no_shape = PyTuple_New(0)) == NULL)
        return -1;
    return 0;
}

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "meshcomm.api._callpath", "The compiled parts of meshcomm's call path.", -1, module_methods,
};

PyMODINIT_FUNC PyInit__callpath(void) {
    import_array(); /* NumPy's C API: returns NULL (ImportError) where it does not match */
    if (PyType_Ready(&GuardType) < 0 || PyType_Ready(&LaneType) < 0 || PyType_Ready(&RunningType) < 0 ||
        intern_all() < 0)
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
    Py_INCREF(&LaneType);
    if (PyModule_AddObject(m, "Lane", (PyObject *)&LaneType) < 0) {
        Py_DECREF(&LaneType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&RunningType);
    if (PyModule_AddObject(m, "Running", (PyObject *)&RunningType) < 0) {
        Py_DECREF(&RunningType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
