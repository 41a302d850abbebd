/* A small all_sum of the mpi backend in one C call (optional; the backend's ``sum_now``).
 *
 * meshcomm_mpi.backend keeps every decision: which calls run as persistent operations (its
 * ``_plans``: one MPI_Allreduce_init per dtype, op and count, made in Python), the call
 * check's persistent all-reduce (``_key_req``), errors and the deadline wait. A PlannedSum
 * does what the backend's ``_planned`` does on the commonest path, without Python in
 * between: count the collective, copy the input into the plan's send array, start the call
 * check and the operation, test both for a short spin, compare the check's keys, look for a
 * peer's notice, and copy the result out. Anything else (no plan yet, a plan not made, the
 * spin ran out, keys that differ, a notice, an MPI error) goes back to the backend's Python
 * methods at the point reached, so both paths end the same way.
 *
 * MPI is reached through the functions mpi4py's own extension calls (their addresses, found
 * by ctypes at set-up): the module needs no MPI headers, and runs with any MPI that mpi4py
 * runs with. Only pointers to request handles and one communicator handle cross the calls,
 * so the handles' types (pointers in Open MPI, ints in MPICH) do not matter here.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

typedef int (*start_fn)(void *request);
typedef int (*test_fn)(void *request, int *flag, void *status);
/* MPI_Iprobe's communicator is a pointer (Open MPI, the MPI ABI) or an int (MPICH) */
typedef int (*iprobe_ptr_fn)(int source, int tag, intptr_t comm, int *flag, void *status);
typedef int (*iprobe_int_fn)(int source, int tag, int comm, int *flag, void *status);

/* Tests between looks at the clock; between yields when ranks outnumber cores (the Python
 * wait loop's numbers, meshcomm_mpi.control). */
enum { CLOCK_EVERY = 64, YIELD_EVERY = 4 };

typedef struct {
    PyObject_HEAD
    PyObject *backend, *control, *what, *key_req_obj;
    start_fn start;
    test_fn test;
    void *iprobe;
    intptr_t ctl;
    int ctl_is_int; /* the communicator handle is an int (MPI._sizeof(MPI.Comm) == 4) */
    int any_source, any_tag, oversubscribed;
    double spin;
    Py_ssize_t max_bytes;
    /* the last plan used: (request, send array, receive array) and its key */
    PyObject *plan, *plan_dtype;
    Py_ssize_t plan_count;
    void *req;
    char *in, *out;
    /* the call check's persistent all-reduce: its request and arrays (the backend's) */
    void *key_req;
    int64_t *key, *seen;
    char status[256]; /* an MPI_Status of any MPI (MPI_STATUS_IGNORE differs between them) */
} PlannedSum;

static PyObject *s_broken, *s_call_key, *s_plans, *s_key_req, *s_key, *s_seen, *s_coll_count, *s_tail,
    *s_planned_rest, *s_planned_error, *s_peers_still_here, *s_failed, *s_down, *s_sum, *s_dtype, *s_addressof, *one;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* The data pointer of a C-contiguous array (the buffer is released at once: the caller
 * holds a reference to the array, which keeps the memory). */
static char *data_of(PyObject *array, int writable) {
    Py_buffer view;
    if (PyObject_GetBuffer(array, &view, writable ? (PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) : PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    char *p = view.buf;
    PyBuffer_Release(&view);
    return p;
}

/* The address of an mpi4py object's handle (mpi4py.MPI._addressof). */
static void *handle_address(PyObject *mpi_object) {
    PyObject *r = PyObject_CallOneArg(s_addressof, mpi_object);
    if (r == NULL)
        return NULL;
    void *p = PyLong_AsVoidPtr(r);
    Py_DECREF(r);
    return p;
}

/* The backend holds its PlannedSum's run as ``sum_now``: a cycle the collector must see. */
static int PlannedSum_traverse(PlannedSum *self, visitproc visit, void *arg) {
    Py_VISIT(self->backend);
    Py_VISIT(self->control);
    Py_VISIT(self->key_req_obj);
    Py_VISIT(self->plan);
    return 0;
}

static int PlannedSum_clear(PlannedSum *self) {
    Py_CLEAR(self->backend);
    Py_CLEAR(self->control);
    Py_CLEAR(self->what);
    Py_CLEAR(self->key_req_obj);
    Py_CLEAR(self->plan);
    Py_CLEAR(self->plan_dtype);
    return 0;
}

static void PlannedSum_dealloc(PlannedSum *self) {
    PyObject_GC_UnTrack(self);
    PlannedSum_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int PlannedSum_init(PlannedSum *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"backend", "control", "start", "test", "iprobe", "ctl", "ctl_size", "any_source",
                            "any_tag", "oversubscribed", "spin", "max_bytes", NULL};
    PyObject *backend, *control;
    unsigned long long start, test, iprobe, ctl; /* ctl: a pointer, or an int sign-extended (MPICH) */
    int ctl_size, any_source, any_tag, oversubscribed;
    double spin;
    Py_ssize_t max_bytes;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOKKKKiiipdn", names, &backend, &control, &start, &test, &iprobe,
                                     &ctl, &ctl_size, &any_source, &any_tag, &oversubscribed, &spin, &max_bytes))
        return -1;
    if (ctl_size != 4 && ctl_size != (int)sizeof(void *)) {
        PyErr_Format(PyExc_ValueError, "PlannedSum: a communicator handle of %d bytes", ctl_size);
        return -1;
    }
    if (!start || !test || !iprobe) {
        PyErr_SetString(PyExc_ValueError, "PlannedSum needs the addresses of MPI_Start, MPI_Test and MPI_Iprobe");
        return -1;
    }
    Py_XSETREF(self->backend, Py_NewRef(backend));
    Py_XSETREF(self->control, Py_NewRef(control));
    Py_XSETREF(self->what, Py_BuildValue("(ss)", "coll", "all_sum"));
    if (self->what == NULL)
        return -1;
    self->start = (start_fn)(uintptr_t)start;
    self->test = (test_fn)(uintptr_t)test;
    self->iprobe = (void *)(uintptr_t)iprobe;
    self->ctl_is_int = ctl_size == 4;
    self->ctl = (intptr_t)ctl; /* an int handle is its low 32 bits, as an int argument takes them */
    self->any_source = any_source;
    self->any_tag = any_tag;
    self->oversubscribed = oversubscribed;
    self->spin = spin;
    self->max_bytes = max_bytes;
    return 0;
}

/* Make ``self`` use the backend's plan for (dtype, count): 1, or 0 when it has none (yet), -1 on an error. */
static int find_plan(PlannedSum *self, PyObject *dtype, Py_ssize_t count) {
    if (self->plan != NULL && self->plan_dtype == dtype && self->plan_count == count)
        return 1;
    PyObject *plans = PyObject_GetAttr(self->backend, s_plans);
    if (plans == NULL)
        return -1;
    PyObject *key = Py_BuildValue("(OOn)", dtype, s_sum, count);
    PyObject *plan = key ? PyDict_GetItemWithError(plans, key) : NULL; /* borrowed */
    Py_XDECREF(key);
    if (plan == NULL || plan == Py_None) {
        Py_DECREF(plans);
        return PyErr_Occurred() ? -1 : 0;
    }
    Py_INCREF(plan);
    Py_DECREF(plans);
    void *req = PyTuple_Check(plan) && PyTuple_GET_SIZE(plan) == 3 ? handle_address(PyTuple_GET_ITEM(plan, 0)) : NULL;
    char *in = req ? data_of(PyTuple_GET_ITEM(plan, 1), 1) : NULL;
    char *out = in ? data_of(PyTuple_GET_ITEM(plan, 2), 0) : NULL;
    if (out == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "a plan must be (request, send array, receive array)");
        Py_DECREF(plan);
        return -1;
    }
    Py_XSETREF(self->plan, plan);
    Py_XSETREF(self->plan_dtype, Py_NewRef(dtype));
    self->plan_count = count;
    self->req = req;
    self->in = in;
    self->out = out;
    return 1;
}

/* The backend's call-check request, when the core gave this call a key: 1 (started), 0 (no key),
 * -1 on an error; ``*key`` is the key array (a new reference). Returns 2 when the request is not
 * made yet (the Python path makes it). */
static int key_request(PlannedSum *self, PyObject **key) {
    *key = PyObject_GetAttr(self->backend, s_call_key);
    if (*key == NULL)
        return -1;
    if (*key == Py_None) {
        Py_CLEAR(*key);
        return 0;
    }
    PyObject *req = PyObject_GetAttr(self->backend, s_key_req);
    if (req == NULL)
        goto error;
    if (req == Py_None) {
        Py_DECREF(req);
        Py_CLEAR(*key);
        return 2;
    }
    if (req != self->key_req_obj) {
        PyObject *k = PyObject_GetAttr(self->backend, s_key);
        PyObject *s = k ? PyObject_GetAttr(self->backend, s_seen) : NULL;
        void *addr = s ? handle_address(req) : NULL;
        int64_t *kp = addr ? (int64_t *)data_of(k, 1) : NULL, *sp = kp ? (int64_t *)data_of(s, 0) : NULL;
        Py_XDECREF(k); /* the backend keeps both arrays for its life */
        Py_XDECREF(s);
        if (sp == NULL) {
            Py_DECREF(req);
            goto error;
        }
        Py_XSETREF(self->key_req_obj, Py_NewRef(req));
        self->key_req = addr;
        self->key = kp;
        self->seen = sp;
    }
    Py_DECREF(req);
    return 1;
error:
    Py_CLEAR(*key);
    return -1;
}

/* coll_count += 1; tail = None, as every collective of the backend begins. */
static int count_call(PlannedSum *self) {
    PyObject *n = PyObject_GetAttr(self->backend, s_coll_count);
    if (n == NULL)
        return -1;
    PyObject *m = PyNumber_Add(n, one);
    Py_DECREF(n);
    if (m == NULL)
        return -1;
    int rc = PyObject_SetAttr(self->backend, s_coll_count, m);
    Py_DECREF(m);
    return rc < 0 ? -1 : PyObject_SetAttr(self->backend, s_tail, Py_None);
}

/* Raise the backend's error for MPI error code ``rc`` in a start or (``started``) the wait
 * (its planned_error raises). */
static PyObject *mpi_failed(PlannedSum *self, int rc, PyObject *sendbuf, int started) {
    PyObject *code = PyLong_FromLong(rc);
    if (code == NULL)
        return NULL;
    PyObject *r = PyObject_CallMethodObjArgs(self->backend, s_planned_error, code, sendbuf,
                                             started ? Py_True : Py_False, NULL);
    Py_DECREF(code);
    Py_XDECREF(r);
    if (!PyErr_Occurred())
        PyErr_SetString(PyExc_SystemError, "planned_error returned instead of raising");
    return NULL;
}

/* Whether a peer's notice must be read after the operation completed (Control.check_notices's
 * test: failed or down peers known, or a control message waiting): 1, 0, or -1 on an error. */
static int notices(PlannedSum *self) {
    PyObject *names[2] = {s_failed, s_down};
    for (int i = 0; i < 2; i++) {
        PyObject *v = PyObject_GetAttr(self->control, names[i]);
        int t = v ? PyObject_IsTrue(v) : -1;
        Py_XDECREF(v);
        if (t != 0)
            return t;
    }
    int flag = 0;
    int rc = self->ctl_is_int
                 ? ((iprobe_int_fn)self->iprobe)(self->any_source, self->any_tag, (int)self->ctl, &flag, self->status)
                 : ((iprobe_ptr_fn)self->iprobe)(self->any_source, self->any_tag, self->ctl, &flag, self->status);
    if (rc != 0)
        return 1; /* the Python probe handles the error (MPI's fault tolerance acknowledges it) */
    return flag != 0;
}

/* run(sendbuf, recvbuf) -> bool: the sum of ``sendbuf`` over the ranks into ``recvbuf`` (C-contiguous,
 * same dtype and size, fresh from the core); False when this call is not for this path (nothing
 * happened: too big, not contiguous, no plan yet, the check's request not made yet, a broken
 * communicator). */
static PyObject *PlannedSum_run(PlannedSum *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "run(sendbuf, recvbuf)");
        return NULL;
    }
    if (self->backend == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "PlannedSum: not initialised");
        return NULL;
    }
    PyObject *broken = PyObject_GetAttr(self->backend, s_broken);
    if (broken == NULL)
        return NULL;
    int usable = broken == Py_None;
    Py_DECREF(broken);
    if (!usable)
        Py_RETURN_FALSE;
    Py_buffer src, dst;
    if (PyObject_GetBuffer(args[0], &src, PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear(); /* not contiguous: the backend's all_reduce takes it */
        Py_RETURN_FALSE;
    }
    Py_ssize_t nbytes = src.len, itemsize = src.itemsize, count = itemsize > 0 ? src.len / itemsize : 0;
    char *sp = src.buf;
    PyBuffer_Release(&src); /* args[0] stays referenced by the caller: sp stays valid */
    if (nbytes > self->max_bytes || nbytes == 0 || itemsize <= 0)
        Py_RETURN_FALSE;
    PyObject *dtype = PyObject_GetAttr(args[0], s_dtype);
    if (dtype == NULL)
        return NULL;
    int found = find_plan(self, dtype, count);
    Py_DECREF(dtype);
    if (found <= 0)
        return found < 0 ? NULL : Py_NewRef(Py_False);
    /* this call's plan, held: a Python step below may make self use another */
    PyObject *plan = Py_NewRef(self->plan);
    void *req = self->req;
    char *in = self->in, *out = self->out;
    PyObject *key = NULL, *key_req_obj = NULL, *result = NULL;
    int keyed = key_request(self, &key);
    if (keyed < 0 || keyed == 2) { /* 2: the first checked call makes the check's request, in Python */
        Py_DECREF(plan);
        return keyed < 0 ? NULL : Py_NewRef(Py_False);
    }
    void *key_req = NULL;
    int64_t *key_in = NULL, *seen = NULL, k0 = 0, k1 = 0;
    if (keyed) {
        Py_buffer kv;
        if (PyObject_GetBuffer(key, &kv, PyBUF_C_CONTIGUOUS) < 0)
            goto early;
        int fits = kv.len == 2 * (Py_ssize_t)sizeof(int64_t);
        if (fits) {
            memcpy(&k0, kv.buf, sizeof k0);
            memcpy(&k1, (char *)kv.buf + sizeof k0, sizeof k1);
        }
        PyBuffer_Release(&kv);
        if (!fits) {
            PyErr_SetString(PyExc_ValueError, "run: the call key must be 2 int64");
            goto early;
        }
        key_req_obj = Py_NewRef(self->key_req_obj);
        key_req = self->key_req;
        key_in = self->key;
        seen = self->seen;
    }
    if (PyObject_GetBuffer(args[1], &dst, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
        goto early;
    if (dst.len != nbytes || dst.itemsize != itemsize) {
        PyBuffer_Release(&dst);
        PyErr_SetString(PyExc_ValueError, "run: the receive array differs from the send array in size or item size");
        goto early;
    }
    if ((keyed && PyObject_SetAttr(self->backend, s_call_key, Py_None) < 0) || count_call(self) < 0)
        goto release;
    memcpy(in, sp, nbytes);
    int rc;
    if (keyed) {
        key_in[0] = k0;
        key_in[1] = k1;
        if ((rc = self->start(key_req)) != 0) {
            result = mpi_failed(self, rc, args[0], 0);
            goto release;
        }
    }
    if ((rc = self->start(req)) != 0) {
        result = mpi_failed(self, rc, args[0], 0);
        goto release;
    }
    int data_done = 0, key_done = !keyed;
    double end = 0;
    Py_BEGIN_ALLOW_THREADS /* MPI runs threads' calls at once (mpi4py's calls release the GIL too) */
    for (unsigned i = 1;; i++) {
        int flag = 0;
        if (!key_done) {
            if ((rc = self->test(key_req, &flag, self->status)) != 0)
                break;
            key_done = flag;
        }
        if (!data_done) {
            if ((rc = self->test(req, &flag, self->status)) != 0)
                break;
            data_done = flag;
        }
        if (data_done && key_done)
            break;
        if (i % CLOCK_EVERY == 1) {
            double t = now_s();
            if (end == 0)
                end = t + self->spin;
            else if (t >= end)
                break;
        }
        if (self->oversubscribed && i % YIELD_EVERY == 0)
            sched_yield();
    }
    Py_END_ALLOW_THREADS
    if (rc != 0) {
        result = mpi_failed(self, rc, args[0], 1);
        goto release;
    }
    int agreed = key_done && (!keyed || (seen[0] == k0 && seen[1] == k1));
    if (!(data_done && agreed)) {
        /* the Python rest: the check's answer (a mismatch raises), then the deadline wait */
        PyObject *checked = keyed ? PyTuple_Pack(2, key_req_obj, key) : Py_NewRef(Py_None);
        PyObject *r = checked ? PyObject_CallMethodObjArgs(self->backend, s_planned_rest, PyTuple_GET_ITEM(plan, 0),
                                                           checked, PyTuple_GET_ITEM(self->what, 1),
                                                           PyTuple_GET_ITEM(plan, 1), PyTuple_GET_ITEM(plan, 2), NULL)
                              : NULL;
        Py_XDECREF(checked);
        if (r == NULL)
            goto release;
        Py_DECREF(r);
    } else if (keyed) { /* a peer that gave up on this call, or failed inside it, makes it raise */
        int look = notices(self);
        if (look < 0)
            goto release;
        if (look) {
            PyObject *bufs = PyTuple_Pack(2, PyTuple_GET_ITEM(plan, 1), PyTuple_GET_ITEM(plan, 2));
            PyObject *r = bufs ? PyObject_CallMethodObjArgs(self->backend, s_peers_still_here, self->what,
                                                            PyTuple_GET_ITEM(plan, 0), bufs, NULL)
                               : NULL;
            Py_XDECREF(bufs);
            if (r == NULL)
                goto release;
            Py_DECREF(r);
        }
    }
    memcpy(dst.buf, out, nbytes); /* the plan, held, keeps its receive array */
    result = Py_NewRef(Py_True);
release:
    PyBuffer_Release(&dst);
early:
    Py_DECREF(plan);
    Py_XDECREF(key_req_obj);
    Py_XDECREF(key);
    return result;
}

static PyMethodDef PlannedSum_methods[] = {
    {"run", (PyCFunction)(void (*)(void))PlannedSum_run, METH_FASTCALL,
     "run(sendbuf, recvbuf) -> bool: a small all_sum as a start of its persistent operation"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject PlannedSumType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "meshcomm_mpi._planned.PlannedSum",
    .tp_basicsize = sizeof(PlannedSum),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = (traverseproc)PlannedSum_traverse,
    .tp_clear = (inquiry)PlannedSum_clear,
    .tp_doc = "A small all_sum of one MPIBackend in one C call (its sum_now).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)PlannedSum_init,
    .tp_dealloc = (destructor)PlannedSum_dealloc,
    .tp_methods = PlannedSum_methods,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "meshcomm_mpi._planned",
                                    "A small all_sum of the mpi backend in one C call.", -1, NULL};

#define INTERN(var, text)                              \
    if ((var = PyUnicode_InternFromString(text)) == NULL) \
        return NULL;

PyMODINIT_FUNC PyInit__planned(void) {
    INTERN(s_broken, "broken") INTERN(s_call_key, "call_key") INTERN(s_plans, "_plans")
    INTERN(s_key_req, "_key_req") INTERN(s_key, "_key") INTERN(s_seen, "_seen") INTERN(s_coll_count, "coll_count")
    INTERN(s_tail, "tail") INTERN(s_planned_rest, "planned_rest") INTERN(s_planned_error, "planned_error")
    INTERN(s_peers_still_here, "_peers_still_here") INTERN(s_failed, "failed") INTERN(s_down, "down")
    INTERN(s_sum, "sum") INTERN(s_dtype, "dtype")
    if ((one = PyLong_FromLong(1)) == NULL)
        return NULL;
    PyObject *mpi = PyImport_ImportModule("mpi4py.MPI");
    if (mpi == NULL)
        return NULL;
    s_addressof = PyObject_GetAttrString(mpi, "_addressof");
    Py_DECREF(mpi);
    if (s_addressof == NULL)
        return NULL;
    if (PyType_Ready(&PlannedSumType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "PlannedSum", (PyObject *)&PlannedSumType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
