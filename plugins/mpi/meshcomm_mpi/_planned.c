/* A small all_sum or a barrier of the mpi backend in one C call (optional; the backend's
 * ``sum_now`` and ``barrier_now``).
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
 * Where every rank has this module, the call check's operation is a carried sum (below): a
 * small all_sum's data rides in the check's own record, and the call is one start of the
 * check's persistent operation, with no plan and no second operation (``carried``). A
 * barrier is the same start with no data: the check, which no rank leaves before every rank
 * entered it (``barrier``).
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
    PyObject *backend, *control, *what, *barrier_what, *key_req_obj;
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
    PyObject *key_arr, *seen_arr;
    /* the carried sum: the data bytes a record holds (0: not used), dtype -> code, the last found */
    Py_ssize_t carried_data;
    PyObject *codes, *code_dtype;
    long code;
    char status[256]; /* an MPI_Status of any MPI (MPI_STATUS_IGNORE differs between them) */
} PlannedSum;

static PyObject *s_broken, *s_call_key, *s_plans, *s_key_req, *s_key, *s_seen, *s_coll_count, *s_tail,
    *s_planned_rest, *s_carried_rest, *s_planned_error, *s_peers_still_here, *s_failed, *s_down, *s_sum, *s_dtype, *s_addressof, *one;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* -- the carried sum: the call check's key and a small all_sum's data in one record --------- */
/* A record: CARRIED_HEAD int64 (the key h and -h, the data's bytes, the data's code), then
 * CARRIED_DATA bytes of data (zeros past the data). Every record has this one size, the call
 * check of every other collective too (no data, code 0): whatever two ranks call, their first
 * operations have the same length, so MPI never truncates one (Open MPI's non-blocking
 * collectives then wait for ever instead of failing) and the keys always meet. */
enum { CARRIED_HEAD = 4, CARRIED_DATA = 64, CARRIED_RECORD = CARRIED_HEAD * 8 + CARRIED_DATA };
/* the data's code: how its elements add (complex: as their float parts; signed integers: as
 * the unsigned ones of their width, whose wrapping sum is the same bits) */
enum { CODE_NONE = 0, CODE_F4, CODE_F8, CODE_U1, CODE_U2, CODE_U4, CODE_U8 };

#define ADD(T)                                                    \
    do {                                                          \
        const T *a = (const T *)(hi + CARRIED_HEAD);              \
        T *b = (T *)(ho + CARRIED_HEAD);                          \
        for (int64_t i = 0, m = n / (int64_t)sizeof(T); i < m; i++) \
            b[i] = a[i] + b[i];                                   \
    } while (0)

/* inout = in (+) inout for ``len`` records: keys by max, data by its code's sum; records of
 * another length or code (another call) make the keys INT64_MAX, which no rank's key is. */
static void carried_sum(void *in, void *inout, int *len, void *datatype) {
    (void)datatype;
    for (int r = 0; r < *len; r++) {
        int64_t *hi = (int64_t *)((char *)in + (size_t)r * CARRIED_RECORD);
        int64_t *ho = (int64_t *)((char *)inout + (size_t)r * CARRIED_RECORD);
        int64_t n = ho[2], code = ho[3];
        if (hi[2] != n || hi[3] != code || n < 0 || n > CARRIED_DATA || code < CODE_NONE || code > CODE_U8) {
            ho[0] = ho[1] = INT64_MAX;
            continue;
        }
        if (hi[0] > ho[0])
            ho[0] = hi[0];
        if (hi[1] > ho[1])
            ho[1] = hi[1];
        switch (code) {
        case CODE_F4: ADD(float); break;
        case CODE_F8: ADD(double); break;
        case CODE_U1: ADD(uint8_t); break;
        case CODE_U2: ADD(uint16_t); break;
        case CODE_U4: ADD(uint32_t); break;
        case CODE_U8: ADD(uint64_t); break;
        default: break;
        }
    }
}

typedef void (*user_fn)(void *, void *, int *, void *);
typedef int (*op_create_fn)(user_fn fn, int commute, void *op);

/* carried_op(op_create, op_size) -> the carried sum's MPI op handle (made once per process by
 * meshcomm_mpi.compiled; MPI frees it at MPI_Finalize). */
static PyObject *carried_op(PyObject *module, PyObject *args) {
    unsigned long long op_create;
    int op_size;
    if (!PyArg_ParseTuple(args, "Ki", &op_create, &op_size))
        return NULL;
    if (!op_create || (op_size != 4 && op_size != (int)sizeof(void *))) {
        PyErr_SetString(PyExc_ValueError, "carried_op: the address of MPI_Op_create and an op handle of 4 or 8 bytes");
        return NULL;
    }
    union {
        int i;
        void *p;
    } op;
    op.p = NULL;
    int rc = ((op_create_fn)(uintptr_t)op_create)(carried_sum, 1, &op);
    if (rc != 0)
        return PyErr_Format(PyExc_RuntimeError, "MPI_Op_create failed with MPI error %d", rc);
    /* an int handle as mpi4py takes it: its 32 bits unsigned (MPICH's have the top bit set) */
    return op_size == 4 ? PyLong_FromUnsignedLong((unsigned int)op.i) : PyLong_FromVoidPtr(op.p);
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
    Py_VISIT(self->key_arr);
    Py_VISIT(self->seen_arr);
    Py_VISIT(self->codes);
    return 0;
}

static int PlannedSum_clear(PlannedSum *self) {
    Py_CLEAR(self->backend);
    Py_CLEAR(self->control);
    Py_CLEAR(self->what);
    Py_CLEAR(self->barrier_what);
    Py_CLEAR(self->key_req_obj);
    Py_CLEAR(self->plan);
    Py_CLEAR(self->plan_dtype);
    Py_CLEAR(self->key_arr);
    Py_CLEAR(self->seen_arr);
    Py_CLEAR(self->codes);
    Py_CLEAR(self->code_dtype);
    return 0;
}

static void PlannedSum_dealloc(PlannedSum *self) {
    PyObject_GC_UnTrack(self);
    PlannedSum_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int PlannedSum_init(PlannedSum *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"backend", "control", "start", "test", "iprobe", "ctl", "ctl_size", "any_source",
                            "any_tag", "oversubscribed", "spin", "max_bytes", "carried_data", "codes", NULL};
    PyObject *backend, *control, *codes = Py_None;
    unsigned long long start, test, iprobe, ctl; /* ctl: a pointer, or an int sign-extended (MPICH) */
    int ctl_size, any_source, any_tag, oversubscribed;
    double spin;
    Py_ssize_t max_bytes, carried_data = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOKKKKiiipdn|nO", names, &backend, &control, &start, &test, &iprobe,
                                     &ctl, &ctl_size, &any_source, &any_tag, &oversubscribed, &spin, &max_bytes,
                                     &carried_data, &codes))
        return -1;
    if (carried_data > 0 && !PyDict_Check(codes)) {
        PyErr_SetString(PyExc_TypeError, "PlannedSum: carried_data needs codes, a dict of dtype -> code");
        return -1;
    }
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
    Py_XSETREF(self->barrier_what, Py_BuildValue("(ss)", "coll", "barrier"));
    if (self->what == NULL || self->barrier_what == NULL)
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
    self->carried_data = carried_data > 0 ? carried_data : 0;
    Py_XSETREF(self->codes, carried_data > 0 ? Py_NewRef(codes) : NULL);
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

/* Point ``self`` at the backend's call-check request and its arrays: 1, 0 when the request is
 * not made yet (the Python path makes it at the first check), -1 on an error. */
static int bind_key_req(PlannedSum *self) {
    PyObject *req = PyObject_GetAttr(self->backend, s_key_req);
    if (req == NULL)
        return -1;
    if (req == Py_None) {
        Py_DECREF(req);
        return 0;
    }
    if (req != self->key_req_obj) {
        PyObject *k = PyObject_GetAttr(self->backend, s_key);
        PyObject *s = k ? PyObject_GetAttr(self->backend, s_seen) : NULL;
        void *addr = s ? handle_address(req) : NULL;
        int64_t *kp = addr ? (int64_t *)data_of(k, 1) : NULL, *sp = kp ? (int64_t *)data_of(s, 0) : NULL;
        if (sp == NULL) {
            Py_XDECREF(k);
            Py_XDECREF(s);
            Py_DECREF(req);
            return -1;
        }
        Py_XSETREF(self->key_arr, k); /* the backend keeps both arrays for its life; so do we */
        Py_XSETREF(self->seen_arr, s);
        Py_XSETREF(self->key_req_obj, Py_NewRef(req));
        self->key_req = addr;
        self->key = kp;
        self->seen = sp;
    }
    Py_DECREF(req);
    return 1;
}

/* The core's call key for this call (``*key``, a new reference, or NULL when it gave none):
 * 1 with a key, 0 without, -1 on an error. */
static int call_key(PlannedSum *self, PyObject **key, int64_t *k0, int64_t *k1) {
    *key = PyObject_GetAttr(self->backend, s_call_key);
    if (*key == NULL)
        return -1;
    if (*key == Py_None) {
        Py_CLEAR(*key);
        *k0 = *k1 = 0;
        return 0;
    }
    Py_buffer kv;
    if (PyObject_GetBuffer(*key, &kv, PyBUF_C_CONTIGUOUS) < 0)
        goto error;
    int fits = kv.len == 2 * (Py_ssize_t)sizeof(int64_t);
    if (fits) {
        memcpy(k0, kv.buf, sizeof *k0);
        memcpy(k1, (char *)kv.buf + sizeof *k0, sizeof *k1);
    }
    PyBuffer_Release(&kv);
    if (fits)
        return 1;
    PyErr_SetString(PyExc_ValueError, "run: the call key must be 2 int64");
error:
    Py_CLEAR(*key);
    return -1;
}

/* Test ``a`` and ``b`` (NULL: none) until both completed or the spin ran out: MPI's return
 * code (0: went well); ``*a_done`` and ``*b_done`` say which completed. */
static int spin_on(PlannedSum *self, void *a, int *a_done, void *b, int *b_done) {
    int rc = 0;
    double end = 0;
    *a_done = a == NULL;
    *b_done = b == NULL;
    Py_BEGIN_ALLOW_THREADS /* MPI runs threads' calls at once (mpi4py's calls release the GIL too) */
    for (unsigned i = 1;; i++) {
        int flag = 0;
        if (!*a_done) {
            if ((rc = self->test(a, &flag, self->status)) != 0)
                break;
            *a_done = flag;
        }
        if (!*b_done) {
            if ((rc = self->test(b, &flag, self->status)) != 0)
                break;
            *b_done = flag;
        }
        if (*a_done && *b_done)
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
    return rc;
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
 * of the all_sum of ``sendbuf`` (None: the barrier); its planned_error raises. */
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

/* The receive array ``recvbuf`` as ``dst``, which must match the send array's size and item size. */
static int receive_array(PyObject *recvbuf, Py_buffer *dst, Py_ssize_t nbytes, Py_ssize_t itemsize) {
    if (PyObject_GetBuffer(recvbuf, dst, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
        return -1;
    if (dst->len != nbytes || dst->itemsize != itemsize) {
        PyBuffer_Release(dst);
        PyErr_SetString(PyExc_ValueError, "run: the receive array differs from the send array in size or item size");
        return -1;
    }
    return 0;
}

/* After a keyed call completed agreed: a peer that gave up on this call, or failed inside it,
 * makes it raise (the backend's _peers_still_here, abandoning ``op`` and its ``bufs``). */
static int still_here(PlannedSum *self, PyObject *what, PyObject *op, PyObject *in, PyObject *out) {
    int look = notices(self);
    if (look <= 0)
        return look;
    PyObject *bufs = PyTuple_Pack(2, in, out);
    PyObject *r = bufs ? PyObject_CallMethodObjArgs(self->backend, s_peers_still_here, what, op, bufs, NULL)
                       : NULL;
    Py_XDECREF(bufs);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

/* A small all_sum of ``sendbuf`` into ``recvbuf`` as one start of the call check's persistent
 * operation, its data in the check's record under ``code`` (the backend's _carried_sum, in
 * C); with no arrays (NULL) and no data, the barrier. */
static PyObject *carried_run(PlannedSum *self, PyObject *sendbuf, PyObject *recvbuf, const char *sp,
                             Py_ssize_t nbytes, Py_ssize_t itemsize, long code) {
    int bound = bind_key_req(self);
    if (bound <= 0)
        return bound < 0 ? NULL : Py_NewRef(Py_False);
    PyObject *key = NULL, *result = NULL;
    int64_t k0, k1;
    int keyed = call_key(self, &key, &k0, &k1);
    if (keyed < 0)
        return NULL;
    /* held: a Python step below may make the backend use other ones */
    PyObject *req_obj = Py_NewRef(self->key_req_obj), *rec_obj = Py_NewRef(self->key_arr),
             *seen_obj = Py_NewRef(self->seen_arr);
    void *req = self->key_req;
    int64_t *rec = self->key, *seen = self->seen;
    PyObject *what = recvbuf == NULL ? self->barrier_what : self->what, *failed_on = sendbuf ? sendbuf : Py_None;
    Py_buffer dst = {0};
    if (recvbuf != NULL && receive_array(recvbuf, &dst, nbytes, itemsize) < 0)
        goto early;
    if ((keyed && PyObject_SetAttr(self->backend, s_call_key, Py_None) < 0) || count_call(self) < 0)
        goto release;
    rec[0] = k0; /* 0, 0 without a key: the same on every rank */
    rec[1] = k1;
    rec[2] = nbytes;
    rec[3] = code;
    if (nbytes)
        memcpy(rec + CARRIED_HEAD, sp, nbytes);
    int rc = self->start(req), done = 0, none = 1;
    if (rc != 0) {
        result = mpi_failed(self, rc, failed_on, 0);
        goto release;
    }
    if ((rc = spin_on(self, req, &done, NULL, &none)) != 0) {
        result = mpi_failed(self, rc, failed_on, 1);
        goto release;
    }
    if (!(done && seen[0] == k0 && seen[1] == k1)) {
        /* the Python rest: the deadline wait, the keys' answer (a mismatch raises) */
        PyObject *r = PyObject_CallMethodObjArgs(self->backend, s_carried_rest, done ? Py_True : Py_False,
                                                 keyed ? Py_True : Py_False, what, NULL);
        if (r == NULL)
            goto release;
        Py_DECREF(r);
    } else if (keyed && still_here(self, what, req_obj, rec_obj, seen_obj) < 0)
        goto release;
    if (recvbuf != NULL)
        memcpy(dst.buf, seen + CARRIED_HEAD, nbytes);
    result = Py_NewRef(Py_True);
release:
    if (recvbuf != NULL)
        PyBuffer_Release(&dst);
early:
    Py_DECREF(req_obj);
    Py_DECREF(rec_obj);
    Py_DECREF(seen_obj);
    Py_XDECREF(key);
    return result;
}

/* A small all_sum as a start of its plan, the call check's operation (if keyed) beside it. */
static PyObject *planned_run(PlannedSum *self, PyObject *const *args, const char *sp, Py_ssize_t nbytes,
                             Py_ssize_t itemsize, PyObject *dtype) {
    int found = find_plan(self, dtype, nbytes / itemsize);
    if (found <= 0)
        return found < 0 ? NULL : Py_NewRef(Py_False);
    PyObject *key = NULL, *result = NULL;
    int64_t k0, k1;
    int keyed = call_key(self, &key, &k0, &k1);
    if (keyed < 0)
        return NULL;
    if (keyed) {
        int bound = bind_key_req(self);
        if (bound <= 0) { /* 0: the first checked call makes the check's request, in Python */
            Py_DECREF(key);
            return bound < 0 ? NULL : Py_NewRef(Py_False);
        }
    }
    /* this call's plan and the check's request, held: a Python step below may make self use others */
    PyObject *plan = Py_NewRef(self->plan), *key_req_obj = keyed ? Py_NewRef(self->key_req_obj) : NULL;
    void *req = self->req, *key_req = keyed ? self->key_req : NULL;
    char *in = self->in, *out = self->out;
    int64_t *key_in = self->key, *seen = self->seen;
    Py_buffer dst;
    if (receive_array(args[1], &dst, nbytes, itemsize) < 0)
        goto early;
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
    int key_done, data_done;
    if ((rc = spin_on(self, key_req, &key_done, req, &data_done)) != 0) {
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
    } else if (keyed && still_here(self, self->what, PyTuple_GET_ITEM(plan, 0), PyTuple_GET_ITEM(plan, 1),
                                   PyTuple_GET_ITEM(plan, 2)) < 0)
        goto release;
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

/* The carried sum's code of ``dtype`` (0: none), -1 on an error; the last one found is kept
 * (a program's calls repeat one dtype, whose object NumPy keeps). */
static long carried_code(PlannedSum *self, PyObject *dtype) {
    if (dtype == self->code_dtype)
        return self->code;
    PyObject *c = PyDict_GetItemWithError(self->codes, dtype); /* borrowed */
    if (c == NULL)
        return PyErr_Occurred() ? -1 : 0;
    long code = PyLong_AsLong(c);
    if (code == -1 && PyErr_Occurred())
        return -1;
    Py_XSETREF(self->code_dtype, Py_NewRef(dtype));
    self->code = code;
    return code;
}

/* 1 when the backend's communicator is usable (not broken), 0 when not, -1 on an error. */
static int ready(PlannedSum *self) {
    if (self->backend == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "PlannedSum: not initialised");
        return -1;
    }
    PyObject *broken = PyObject_GetAttr(self->backend, s_broken);
    if (broken == NULL)
        return -1;
    int usable = broken == Py_None;
    Py_DECREF(broken);
    return usable;
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
    int usable = ready(self);
    if (usable <= 0)
        return usable < 0 ? NULL : Py_NewRef(Py_False);
    Py_buffer src;
    if (PyObject_GetBuffer(args[0], &src, PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear(); /* not contiguous: the backend's all_reduce takes it */
        Py_RETURN_FALSE;
    }
    Py_ssize_t nbytes = src.len, itemsize = src.itemsize;
    char *sp = src.buf;
    PyBuffer_Release(&src); /* args[0] stays referenced by the caller: sp stays valid */
    if (nbytes > self->max_bytes || nbytes == 0 || itemsize <= 0)
        Py_RETURN_FALSE;
    PyObject *dtype = PyObject_GetAttr(args[0], s_dtype);
    if (dtype == NULL)
        return NULL;
    PyObject *result;
    long code = nbytes <= self->carried_data ? carried_code(self, dtype) : 0;
    if (code < 0)
        result = NULL;
    else if (code > 0)
        result = carried_run(self, args[0], args[1], sp, nbytes, itemsize, code);
    else
        result = planned_run(self, args, sp, nbytes, itemsize, dtype);
    Py_DECREF(dtype);
    return result;
}

/* barrier() -> bool: the barrier as one start of the call check's operation with no data;
 * False when it is not for this path (nothing happened: no carried check, a broken
 * communicator). */
static PyObject *PlannedSum_barrier(PlannedSum *self, PyObject *Py_UNUSED(ignored)) {
    int usable = self->carried_data == 0 ? 0 : ready(self);
    if (usable <= 0)
        return usable < 0 ? NULL : Py_NewRef(Py_False);
    return carried_run(self, NULL, NULL, NULL, 0, 0, 0);
}

static PyMethodDef module_methods[] = {
    {"carried_op", carried_op, METH_VARARGS, "carried_op(op_create, op_size) -> the carried sum's MPI op handle"},
    {NULL, NULL, 0, NULL},
};

static PyMethodDef PlannedSum_methods[] = {
    {"run", (PyCFunction)(void (*)(void))PlannedSum_run, METH_FASTCALL,
     "run(sendbuf, recvbuf) -> bool: a small all_sum as a start of its persistent operation"},
    {"barrier", (PyCFunction)PlannedSum_barrier, METH_NOARGS,
     "barrier() -> bool: the barrier as a start of the call check's operation with no data"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject PlannedSumType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "meshcomm_mpi._planned.PlannedSum",
    .tp_basicsize = sizeof(PlannedSum),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = (traverseproc)PlannedSum_traverse,
    .tp_clear = (inquiry)PlannedSum_clear,
    .tp_doc = "A small all_sum or a barrier of one MPIBackend in one C call (its sum_now and barrier_now).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)PlannedSum_init,
    .tp_dealloc = (destructor)PlannedSum_dealloc,
    .tp_methods = PlannedSum_methods,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "meshcomm_mpi._planned",
                                    "A small all_sum of the mpi backend in one C call.", -1, module_methods};

#define INTERN(var, text)                              \
    if ((var = PyUnicode_InternFromString(text)) == NULL) \
        return NULL;

PyMODINIT_FUNC PyInit__planned(void) {
    INTERN(s_broken, "broken") INTERN(s_call_key, "call_key") INTERN(s_plans, "_plans")
    INTERN(s_key_req, "_key_req") INTERN(s_key, "_key") INTERN(s_seen, "_seen") INTERN(s_coll_count, "coll_count")
    INTERN(s_tail, "tail") INTERN(s_planned_rest, "planned_rest") INTERN(s_carried_rest, "carried_rest") INTERN(s_planned_error, "planned_error")
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
    if (PyModule_AddIntConstant(m, "CARRIED_HEAD", CARRIED_HEAD) < 0 ||
        PyModule_AddIntConstant(m, "CARRIED_DATA", CARRIED_DATA) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    PyObject *codes = Py_BuildValue("{sisisisisisi}", "f4", CODE_F4, "f8", CODE_F8, "u1", CODE_U1, "u2", CODE_U2,
                                    "u4", CODE_U4, "u8", CODE_U8);
    int added = codes != NULL && PyModule_AddObjectRef(m, "CARRIED_CODES", codes) == 0;
    Py_XDECREF(codes);
    if (!added) {
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddObjectRef(m, "PlannedSum", (PyObject *)&PlannedSumType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
