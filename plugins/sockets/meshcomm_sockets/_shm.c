/* The hot loop of the sockets backend's shared-memory path, in C (optional).
 *
 * meshcomm_sockets.shm keeps the protocol and every decision (sequence numbers, sleeping,
 * errors); a Channel only does the steps that cost microseconds in Python on every call:
 * copy this rank's piece into its slot, publish the call descriptor and the sequence
 * number, find the peers asleep on it, spin until every local rank has published (with
 * the GIL released), and compare the peers' descriptors with this rank's; and for the
 * commonest small call, a one-piece all_sum of float32/float64/int32/int64, all of that and
 * the sum in one call (any other case, and every exception to the fast path, is Python's).
 *
 * Layout (shm.py): the segment starts with one control line of LINE int64 words per local
 * rank: word SEQ, word WAIT, then per parity p the descriptor at DESC0 + 5p; the data
 * slots follow the control lines, two of `piece` bytes per rank (rank i, parity p at
 * (2i + p) * piece).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <sched.h>
#include <errno.h>
#include <sys/uio.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
/* No PAUSE instruction in the spin: under KVM a vCPU that keeps executing PAUSE may be
 * taken for a lock waiter whose holder was preempted (pause-loop exiting) and descheduled,
 * the opposite of what a spin that waits for another rank wants (not measured separately:
 * the spin is bounded and checks the clock anyway). A compiler barrier keeps the loads in
 * the loop. */
#define CPU_RELAX() __asm__ __volatile__("" ::: "memory")

enum { SEQ = 0, WAIT = 1, DESC = 5 };

typedef struct {
    PyObject_HEAD
    Py_buffer view;      /* the whole segment; released by release() or on deallocation */
    int held;
    int64_t *words;
    char *data;
    Py_ssize_t n, me, line, piece;
} Channel;

static inline int64_t load(const int64_t *p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }

static int all_published(const Channel *c, int64_t prev)
{
    for (Py_ssize_t i = 0; i < c->n; i++)
        if (i != c->me && load(&c->words[i * c->line + SEQ]) == prev)
            return 0;
    return 1;
}

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static int Channel_init(Channel *self, PyObject *args, PyObject *kw)
{
    static char *names[] = {"segment", "ranks", "me", "line", "piece", NULL};
    PyObject *segment;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "Onnnn", names, &segment, &self->n, &self->me,
                                     &self->line, &self->piece))
        return -1;
    if (self->n < 1 || self->me < 0 || self->me >= self->n || self->line < 2 + 2 * DESC || self->piece < 1) {
        PyErr_Format(PyExc_ValueError, "Channel: bad layout ranks=%zd me=%zd line=%zd piece=%zd",
                     self->n, self->me, self->line, self->piece);
        return -1;
    }
    if (self->held) {
        PyBuffer_Release(&self->view);
        self->held = 0;
    }
    if (PyObject_GetBuffer(segment, &self->view, PyBUF_WRITABLE) < 0)
        return -1;
    self->held = 1;
    Py_ssize_t need = 8 * self->line * self->n + 2 * self->n * self->piece;
    if (self->view.len < need) {
        PyErr_Format(PyExc_ValueError, "Channel: the segment has %zd bytes, the layout needs %zd",
                     self->view.len, need);
        PyBuffer_Release(&self->view);
        self->held = 0;
        return -1;
    }
    self->words = (int64_t *)self->view.buf;
    self->data = (char *)self->view.buf + 8 * self->line * self->n;
    return 0;
}

static void Channel_dealloc(Channel *self)
{
    if (self->held)
        PyBuffer_Release(&self->view);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int alive(Channel *self)
{
    if (!self->held) {
        PyErr_SetString(PyExc_ValueError, "Channel: used after release()");
        return 0;
    }
    return 1;
}

/* Reads n Python ints from args into v; 0 on success, -1 with the error set. */
static int int_args(PyObject *const *args, int n, int64_t *v)
{
    for (int k = 0; k < n; k++) {
        v[k] = PyLong_AsLongLong(args[k]);
        if (v[k] == -1 && PyErr_Occurred())
            return -1;
    }
    return 0;
}

/* Copies len bytes of src (or nothing when src is NULL) into this rank's slot of parity
 * prev & 1, writes the descriptor desc[0..DESC) at word d of this rank's line, then the
 * sequence number seq, with a full barrier before the caller looks for sleeping peers. */
static void put(Channel *self, const void *src, Py_ssize_t len, int64_t d, const int64_t *desc, int64_t seq,
                int64_t prev)
{
    if (src != NULL)
        memcpy(self->data + (2 * self->me + (prev & 1)) * self->piece, src, (size_t)len);
    int64_t *mine = self->words + self->me * self->line;
    for (int k = 0; k < DESC; k++)
        __atomic_store_n(&mine[d + k], desc[k], __ATOMIC_RELAXED);
    /* the slot and the descriptor before the sequence number; then a full barrier before
       reading whether a peer sleeps (it sets WAIT, then reads SEQ: one of us sees the other) */
    __atomic_store_n(&mine[SEQ], seq, __ATOMIC_RELEASE);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
}

/* The peers asleep waiting for seq or prev, as a bit mask; -1 when there are more than 62. */
static long long sleepers(const Channel *self, int64_t seq, int64_t prev)
{
    if (self->n > 62)
        return -1;
    long long mask = 0;
    for (Py_ssize_t i = 0; i < self->n; i++) {
        if (i == self->me)
            continue;
        int64_t waits = load(&self->words[i * self->line + WAIT]);
        if (waits && (waits == seq || waits == prev))
            mask |= 1LL << i;
    }
    return mask;
}

/* Whether every other local rank moved past piece prev within budget ns of spinning; call
 * with the GIL released when budget > 0. */
static int spin_until(const Channel *self, int64_t prev, int64_t budget, int yielding)
{
    int ready = all_published(self, prev);
    if (!ready && budget > 0) {
        int64_t until = now_ns() + budget;
        for (unsigned k = 1;; k++) {
            if (yielding)
                sched_yield();
            else
                CPU_RELAX();
            if ((ready = all_published(self, prev)))
                break;
            /* a yield can take a whole time slice when another process wants the core:
               look at the clock after every one, so the budget holds under load */
            if ((yielding || (k & 63) == 0) && now_ns() >= until)
                break;
        }
    }
    if (ready)
        __atomic_thread_fence(__ATOMIC_ACQUIRE); /* the peers' slots and descriptors after their SEQ */
    return ready;
}

/* spin_until, called with the GIL held: released only when the peers are not there yet. */
static int wait_past(const Channel *self, int64_t prev, int64_t budget, int yielding)
{
    if (all_published(self, prev)) {
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        return 1;
    }
    if (budget <= 0)
        return 0;
    int ready;
    Py_BEGIN_ALLOW_THREADS
    ready = spin_until(self, prev, budget, yielding);
    Py_END_ALLOW_THREADS
    return ready;
}

/* Whether every other local rank's descriptor at word d is desc[0..DESC). */
static int same_call(const Channel *self, int64_t d, const int64_t *desc)
{
    for (Py_ssize_t i = 0; i < self->n; i++) {
        if (i == self->me)
            continue;
        const int64_t *theirs = self->words + i * self->line + d;
        for (int k = 0; k < DESC; k++)
            if (load(&theirs[k]) != desc[k])
                return 0;
    }
    return 1;
}

static int check_word(const Channel *self, const char *what, int64_t d)
{
    if (d < 2 || d + DESC > self->line) {
        PyErr_Format(PyExc_ValueError, "%s: descriptor word %lld is outside the line", what, (long long)d);
        return -1;
    }
    return 0;
}

/* publish(src, d, op, dtype, total, cseq, arg, seq, prev) -> wake mask
 * Publishes piece seq (prev: the piece before it, whose parity names the slot and the
 * descriptor this piece uses): copies src (a C-contiguous buffer of at most one slot, or
 * None) into this rank's slot of parity prev & 1, writes the descriptor at word d of this
 * rank's line, then the sequence number seq; returns a bit mask of the peers asleep waiting
 * for seq or prev, or -1 when there are more than 62 local ranks (the caller looks itself). */
static PyObject *Channel_publish(Channel *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "publish takes 9 arguments");
        return NULL;
    }
    if (!alive(self))
        return NULL;
    int64_t v[8];
    if (int_args(args + 1, 8, v) < 0 || check_word(self, "publish", v[0]) < 0)
        return NULL;
    int64_t seq = v[6], prev = v[7];
    if (args[0] != Py_None) {
        Py_buffer src;
        if (PyObject_GetBuffer(args[0], &src, PyBUF_C_CONTIGUOUS) < 0)
            return NULL;
        if (src.len > self->piece) {
            PyBuffer_Release(&src);
            PyErr_Format(PyExc_ValueError, "publish: %zd bytes do not fit a %zd-byte slot", src.len, self->piece);
            return NULL;
        }
        put(self, src.buf, src.len, v[0], v + 1, seq, prev);
        PyBuffer_Release(&src);
    } else {
        put(self, NULL, 0, v[0], v + 1, seq, prev);
    }
    return PyLong_FromLongLong(sleepers(self, seq, prev));
}

/* spin(prev, budget_ns, yielding) -> bool: whether every other local rank has moved past
 * piece prev within budget_ns nanoseconds of spinning (the GIL is released meanwhile). */
static PyObject *Channel_spin(Channel *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "spin takes 3 arguments");
        return NULL;
    }
    if (!alive(self))
        return NULL;
    int64_t prev = PyLong_AsLongLong(args[0]);
    int64_t budget = PyLong_AsLongLong(args[1]);
    int yielding = PyObject_IsTrue(args[2]);
    if (PyErr_Occurred() || yielding < 0)
        return NULL;
    return PyBool_FromLong(wait_past(self, prev, budget, yielding));
}

/* matches(d, op, dtype, total, cseq, arg) -> bool: every other local rank's descriptor at
 * word d equals this call's. */
static PyObject *Channel_matches(Channel *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "matches takes 6 arguments");
        return NULL;
    }
    if (!alive(self))
        return NULL;
    int64_t v[6];
    if (int_args(args, 6, v) < 0 || check_word(self, "matches", v[0]) < 0)
        return NULL;
    return PyBool_FromLong(same_call(self, v[0], v + 1));
}

/* out = a + b element-wise (out may be a or b): every sum here is a chain of these in rank
 * order, the expression NumPy evaluates on the slow path (IEEE additions of two operands
 * give the same bits in any vectorisation; integers wrap, computed unsigned). */
typedef void (*adder)(void *, const void *, const void *, Py_ssize_t);
#define ADD(T)                                                                        \
    static void add_##T(void *out, const void *a, const void *b, Py_ssize_t count)    \
    {                                                                                 \
        T *o = (T *)out;                                                              \
        const T *x = (const T *)a, *y = (const T *)b;                                 \
        for (Py_ssize_t j = 0; j < count; j++)                                        \
            o[j] = x[j] + y[j];                                                       \
    }
ADD(float)
ADD(double)
ADD(uint32_t)
ADD(uint64_t)

/* out = a + b like add_float/add_double, with stores that bypass the cache (the direct
 * path's block sum of a large array: its result is read back from memory by the peers and
 * copied out much later, so caching it only evicts the inputs, and a normal store first
 * reads the line it overwrites). */
#if defined(__SSE2__)
#define ADD_STREAM(T, V, LOAD, ADDV, STREAM)                                          \
    static void stream_##T(void *out, const void *a, const void *b, Py_ssize_t count) \
    {                                                                                 \
        T *o = (T *)out;                                                              \
        const T *x = (const T *)a, *y = (const T *)b;                                 \
        Py_ssize_t j = 0, lane = 16 / sizeof(T);                                      \
        for (; j < count && ((uintptr_t)(o + j) & 15); j++)                           \
            o[j] = x[j] + y[j];                                                       \
        for (; j + 4 * lane <= count; j += 4 * lane)                                  \
            for (Py_ssize_t k = 0; k < 4 * lane; k += lane)                           \
                STREAM((V *)(o + j + k), ADDV(LOAD((const V *)(x + j + k)), LOAD((const V *)(y + j + k)))); \
        for (; j < count; j++)                                                        \
            o[j] = x[j] + y[j];                                                       \
    }
#define LOADPS(p) _mm_loadu_ps((const float *)(p))
#define STOREPS(p, v) _mm_stream_ps((float *)(p), v)
#define LOADPD(p) _mm_loadu_pd((const double *)(p))
#define STOREPD(p, v) _mm_stream_pd((double *)(p), v)
ADD_STREAM(float, __m128, LOADPS, _mm_add_ps, STOREPS)
ADD_STREAM(double, __m128d, LOADPD, _mm_add_pd, STOREPD)
ADD_STREAM(uint32_t, __m128i, _mm_loadu_si128, _mm_add_epi32, _mm_stream_si128)
ADD_STREAM(uint64_t, __m128i, _mm_loadu_si128, _mm_add_epi64, _mm_stream_si128)
#define STREAMER(T) stream_##T
#define FENCE() _mm_sfence()
#else
#define STREAMER(T) add_##T
#define FENCE() ((void)0)
#endif

/* dst = the n bytes at src (a smaller result stays in cache for whoever reads it next) */
static void plain_copy(char *dst, const char *src, Py_ssize_t n)
{
    memcpy(dst, src, n);
}

/* dst = the n bytes at src, stored past the cache where the CPU can (see above) */
static void stream_copy(char *dst, const char *src, Py_ssize_t n)
{
#if defined(__SSE2__)
    Py_ssize_t head = (Py_ssize_t)((16 - ((uintptr_t)dst & 15)) & 15);
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    dst += head, src += head, n -= head;
    for (; n >= 64; n -= 64, dst += 64, src += 64)
        for (int k = 0; k < 64; k += 16)
            _mm_stream_si128((__m128i *)(dst + k), _mm_loadu_si128((const __m128i *)(src + k)));
#endif
    memcpy(dst, src, n);
}

/* kind -> (element size, add); kind 0 is unused */
static const struct { Py_ssize_t item; adder add, stream; } KINDS[] = {
    {0, NULL, NULL}, {4, add_float, STREAMER(float)}, {8, add_double, STREAMER(double)},
    {4, add_uint32_t, STREAMER(uint32_t)}, {8, add_uint64_t, STREAMER(uint64_t)},
};
enum { NKINDS = sizeof(KINDS) / sizeof(KINDS[0]) };

/* The one-piece all-reduce's sum: out = slot 0 + slot 1 (+ slot 2 ...) of piece parity. */
static void sum_slots(const Channel *c, int64_t parity, void *out, Py_ssize_t count, adder add)
{
    add(out, c->data + parity * c->piece, c->data + (2 + parity) * c->piece, count);
    for (Py_ssize_t i = 2; i < c->n; i++)
        add(out, out, c->data + (2 * i + parity) * c->piece, count);
}

/* from this many bytes of result the direct path's block sum streams its stores */
enum { STREAM_MIN_BYTES = 8 << 20 };

/* above this many bytes the sum runs with the GIL released */
enum { SUM_NOGIL_BYTES = 32 * 1024 };

/* The one-piece all_sum proper (see all_sum below): publish src (len bytes), and unless a
 * peer sleeps, spin, compare the descriptors and sum every local rank's slot into out.
 * Returns the status of all_sum. */
static int sum_piece(Channel *self, const void *src, void *out, Py_ssize_t len, int64_t kind, int64_t d,
                     const int64_t *desc, int64_t seq, int64_t prev, int64_t budget, int yielding)
{
    put(self, src, len, d, desc, seq, prev);
    int status = sleepers(self, seq, prev) != 0 ? 1 : 0;
    if (status == 0) {
        if (!wait_past(self, prev, budget, yielding))
            status = 2;
        else if (!same_call(self, d, desc))
            status = 3;
    }
    if (status == 0) {
        Py_ssize_t count = len / KINDS[kind].item;
        if (len > SUM_NOGIL_BYTES) {
            Py_BEGIN_ALLOW_THREADS
            sum_slots(self, prev & 1, out, count, KINDS[kind].add);
            Py_END_ALLOW_THREADS
        } else {
            sum_slots(self, prev & 1, out, count, KINDS[kind].add);
        }
    }
    return status;
}

/* all_sum(src, out, kind, d, op, dtype, total, cseq, arg, seq, prev, budget_ns, yielding) -> status
 * The one-piece all_sum in one call: publish src as piece seq (as publish does), and unless
 * a peer sleeps, spin (as spin does), compare the descriptors (as matches does) and write
 * the sum of every local rank's slot into out. kind: 1 float32, 2 float64, 3 int32/uint32,
 * 4 int64/uint64 (out and src: that many bytes per element, C-contiguous, the same length).
 * Status: 0 done (out holds the sum); otherwise the piece is published and the caller goes
 * on as after publish: 1 peers may sleep (wake them, then wait), 2 the spin ran out (sleep),
 * 3 a peer's descriptor differs (the mismatch). */
static PyObject *Channel_all_sum(Channel *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 13) {
        PyErr_SetString(PyExc_TypeError, "all_sum takes 13 arguments");
        return NULL;
    }
    if (!alive(self))
        return NULL;
    int64_t v[11];
    if (int_args(args + 2, 11, v) < 0 || check_word(self, "all_sum", v[1]) < 0)
        return NULL;
    int yielding = PyObject_IsTrue(args[12]);
    if (yielding < 0)
        return NULL;
    int64_t kind = v[0], d = v[1], seq = v[7], prev = v[8], budget = v[9];
    if (kind < 1 || kind >= NKINDS) {
        PyErr_Format(PyExc_ValueError, "all_sum: unknown element kind %lld", (long long)kind);
        return NULL;
    }
    Py_buffer src, out;
    if (PyObject_GetBuffer(args[0], &src, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[1], &out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    PyObject *result = NULL;
    if (src.len > self->piece || out.len != src.len || src.len % KINDS[kind].item) {
        PyErr_Format(PyExc_ValueError, "all_sum: %zd bytes in, %zd out, %zd-byte elements, %zd-byte slots",
                     src.len, out.len, KINDS[kind].item, self->piece);
        goto done;
    }
    int status = sum_piece(self, src.buf, out.buf, src.len, kind, d, v + 2, seq, prev, budget, yielding);
    result = PyLong_FromLong(status);
done:
    PyBuffer_Release(&out);
    PyBuffer_Release(&src);
    return result;
}

/* len bytes at address in process pid into `into`; 0, or the errno of the refusal
 * (EFAULT for a read that stops short). */
static int read_peer(int64_t pid, char *into, int64_t address, Py_ssize_t len)
{
    while (len > 0) {
        struct iovec mine = {into, (size_t)len}, theirs = {(void *)(intptr_t)address, (size_t)len};
        ssize_t got = process_vm_readv((pid_t)pid, &mine, 1, &theirs, 1, 0);
        if (got <= 0)
            return got < 0 ? errno : EFAULT;
        into += got;
        address += got;
        len -= got;
    }
    return 0;
}

/* read_sum(out, own, kind, where, chunk[, copies]) -> None, or (local rank, errno) of a failed read
 * The direct path's block sum: out = every local rank's block combined in rank order
 * (as sum_slots does), this rank's from own, every other rank's read from its memory
 * (where: int64 pairs (pid, address of its block), one per local rank, this rank's
 * ignored) chunk bytes at a time into buffers that stay in cache, with the GIL released.
 * out may be own (in place); they must not overlap otherwise. copies: int64 addresses in
 * this process (peers' shared results mapped here) that get the same bytes as out. */
static PyObject *Channel_read_sum(Channel *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5 && nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "read_sum takes 5 or 6 arguments");
        return NULL;
    }
    int64_t v[2];
    if (int_args(args + 2, 1, v) < 0 || int_args(args + 4, 1, v + 1) < 0)
        return NULL;
    int64_t kind = v[0], chunk = v[1];
    if (kind < 1 || kind >= NKINDS) {
        PyErr_Format(PyExc_ValueError, "read_sum: unknown element kind %lld", (long long)kind);
        return NULL;
    }
    Py_ssize_t item = KINDS[kind].item;
    chunk -= chunk % item;
    if (chunk <= 0 || chunk > (64 << 20)) {
        PyErr_Format(PyExc_ValueError, "read_sum: chunk of %lld bytes", (long long)v[1]);
        return NULL;
    }
    Py_buffer out, own, where;
    if (PyObject_GetBuffer(args[0], &out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[1], &own, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&out);
        return NULL;
    }
    if (PyObject_GetBuffer(args[3], &where, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&own);
        PyBuffer_Release(&out);
        return NULL;
    }
    Py_buffer copies = {0};
    if (nargs == 6 && PyObject_GetBuffer(args[5], &copies, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&where);
        PyBuffer_Release(&own);
        PyBuffer_Release(&out);
        return NULL;
    }
    Py_ssize_t ncopies = copies.len / (Py_ssize_t)sizeof(int64_t);
    PyObject *result = NULL;
    char *tmp = NULL;
    const char *o0 = out.buf, *s0 = own.buf;
    int alias = o0 == s0;
    if (copies.len % (Py_ssize_t)sizeof(int64_t)) {
        PyErr_Format(PyExc_ValueError, "read_sum: %zd bytes of copy addresses", copies.len);
        goto done;
    }
    if (out.len != own.len || out.len % item || where.len != (Py_ssize_t)(2 * self->n * sizeof(int64_t)) ||
        (!alias && o0 < s0 + own.len && s0 < o0 + out.len)) {
        PyErr_Format(PyExc_ValueError, "read_sum: %zd bytes out, %zd own, %zd-byte elements, %zd bytes of "
                     "(pid, address) for %zd ranks, %s", out.len, own.len, item, where.len, self->n,
                     alias ? "in place" : "apart or overlapping");
        goto done;
    }
    tmp = PyMem_RawMalloc(4 * chunk);
    if (tmp == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const int64_t *w = where.buf, *to = copies.buf;
    /* with copies, each chunk is summed in cache (acc) and streamed to out and every copy;
     * without, a large out gets streamed stores directly */
    adder add = !ncopies && out.len >= STREAM_MIN_BYTES ? KINDS[kind].stream : KINDS[kind].add;
    void (*copier)(char *, const char *, Py_ssize_t) = out.len >= STREAM_MIN_BYTES ? stream_copy : plain_copy;
    Py_ssize_t n = self->n, me = self->me, failed = -1;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t off = 0; off < out.len && failed < 0; off += chunk) {
        Py_ssize_t m = out.len - off < chunk ? out.len - off : chunk;
        char *o = ncopies ? tmp + 3 * chunk : (char *)out.buf + off;
        const char *mine = (const char *)own.buf + off;
        if (alias && me >= 2) { /* the first add overwrites my chunk before I combine it */
            memcpy(tmp + 2 * chunk, mine, m);
            mine = tmp + 2 * chunk;
        }
        const char *part[2] = {mine, mine};
        for (Py_ssize_t i = 0; i < 2; i++) {
            if (i == me)
                continue;
            if ((err = read_peer(w[2 * i], tmp + i * chunk, w[2 * i + 1] + off, m)) != 0) {
                failed = i;
                break;
            }
            part[i] = tmp + i * chunk;
        }
        if (failed >= 0)
            break;
        add(o, part[0], part[1], m / item);
        for (Py_ssize_t i = 2; i < n; i++) {
            const char *p = mine;
            if (i != me) {
                if ((err = read_peer(w[2 * i], tmp, w[2 * i + 1] + off, m)) != 0) {
                    failed = i;
                    break;
                }
                p = tmp;
            }
            add(o, o, p, m / item);
        }
        if (failed < 0 && ncopies) {
            copier(((char *)out.buf) + off, o, m);
            for (Py_ssize_t c = 0; c < ncopies; c++)
                copier((char *)(intptr_t)to[c] + off, o, m);
        }
    }
    FENCE(); /* the streamed stores are visible before this rank says it is done */
    Py_END_ALLOW_THREADS
    if (failed < 0) {
        Py_INCREF(Py_None);
        result = Py_None;
    } else {
        result = Py_BuildValue("(ni)", failed, err);
    }
done:
    PyMem_RawFree(tmp);
    if (nargs == 6)
        PyBuffer_Release(&copies);
    PyBuffer_Release(&where);
    PyBuffer_Release(&own);
    PyBuffer_Release(&out);
    return result;
}

static PyObject *Channel_release(Channel *self, PyObject *Py_UNUSED(ignored))
{
    if (self->held) {
        PyBuffer_Release(&self->view);
        self->held = 0;
    }
    Py_RETURN_NONE;
}

static PyMethodDef Channel_methods[] = {
    {"publish", (PyCFunction)(void (*)(void))Channel_publish, METH_FASTCALL,
     "publish(src, d, op, dtype, total, cseq, arg, seq, prev) -> mask of the sleeping peers to wake"},
    {"spin", (PyCFunction)(void (*)(void))Channel_spin, METH_FASTCALL,
     "spin(prev, budget_ns, yielding) -> whether every other local rank published past prev"},
    {"matches", (PyCFunction)(void (*)(void))Channel_matches, METH_FASTCALL,
     "matches(d, op, dtype, total, cseq, arg) -> whether every other local rank's descriptor is this one"},
    {"all_sum", (PyCFunction)(void (*)(void))Channel_all_sum, METH_FASTCALL,
     "all_sum(src, out, kind, d, op, dtype, total, cseq, arg, seq, prev, budget_ns, yielding) -> "
     "0 done, 1 wake the sleepers, 2 sleep, 3 mismatch"},
    {"read_sum", (PyCFunction)(void (*)(void))Channel_read_sum, METH_FASTCALL,
     "read_sum(out, own, kind, where, chunk[, copies]) -> None, or (local rank, errno) of the read that failed"},
    {"release", (PyCFunction)Channel_release, METH_NOARGS,
     "release() -> None: let the segment go (the channel is unusable after)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ChannelType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "meshcomm_sockets._shm.Channel",
    .tp_doc = "Channel(segment, ranks, me, line, piece): the shared-memory hot loop of one local rank",
    .tp_basicsize = sizeof(Channel),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Channel_init,
    .tp_dealloc = (destructor)Channel_dealloc,
    .tp_methods = Channel_methods,
};

/* ---------------------------------------------------------------------------------------- */
/* QuickSum: ShmGroup.quick_sum of a plain all_sum of one backend, in C                      */

typedef struct {
    PyObject_HEAD
    Channel *channel;
    PyObject *group;  /* the ShmGroup: seq, prev, and quick_rest for what is left to Python */
    PyObject *owner;  /* the backend: call_seq, shape_key */
    PyObject *fabric; /* check(), spin_ns, yielding */
    PyObject *codes;  /* dtype -> (kind, wire code) of the dtypes the channel sums */
    int64_t split_min, seq_mask, seq_wrap, count_mask, shape_shift, op, desc_at[2];
} QuickSum;

static PyObject *s_dtype, *s_check, *s_call_seq, *s_shape_key, *s_seq, *s_prev, *s_spin_ns, *s_yielding;

static int QuickSum_init(QuickSum *self, PyObject *args, PyObject *kw)
{
    static char *names[] = {"channel", "group", "owner", "fabric", "codes", "split_min", "seq_mask", "seq_wrap",
                            "count_mask", "shape_shift", "op", "desc_at0", "desc_at1", NULL};
    PyObject *channel, *group, *owner, *fabric, *codes;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!OOOO!LLLLLLLL", names, &ChannelType, &channel, &group, &owner,
                                     &fabric, &PyDict_Type, &codes, &self->split_min, &self->seq_mask,
                                     &self->seq_wrap, &self->count_mask, &self->shape_shift, &self->op,
                                     &self->desc_at[0], &self->desc_at[1]))
        return -1;
    if (self->seq_wrap < 1) {
        PyErr_SetString(PyExc_ValueError, "QuickSum: seq_wrap must be positive");
        return -1;
    }
    for (int k = 0; k < 2; k++)
        if (check_word((Channel *)channel, "QuickSum", self->desc_at[k]) < 0)
            return -1;
    Py_XSETREF(self->channel, (Channel *)Py_NewRef(channel));
    Py_XSETREF(self->group, Py_NewRef(group));
    Py_XSETREF(self->owner, Py_NewRef(owner));
    Py_XSETREF(self->fabric, Py_NewRef(fabric));
    Py_XSETREF(self->codes, Py_NewRef(codes));
    return 0;
}

/* An int attribute of obj (-1 with the error set when it is missing or not an int). */
static int get_int(PyObject *obj, PyObject *name, int64_t *v)
{
    PyObject *o = PyObject_GetAttr(obj, name);
    if (o == NULL)
        return -1;
    *v = PyLong_AsLongLong(o);
    Py_DECREF(o);
    return (*v == -1 && PyErr_Occurred()) ? -1 : 0;
}

static int set_int(PyObject *obj, PyObject *name, int64_t v)
{
    PyObject *o = PyLong_FromLongLong(v);
    if (o == NULL)
        return -1;
    int rc = PyObject_SetAttr(obj, name, o);
    Py_DECREF(o);
    return rc;
}

/* run(sendbuf, recvbuf) -> bool: what ShmGroup.quick_sum(owner, sendbuf, recvbuf) does (its
 * docstring is the contract), the steps up to the C call's status here; a status that
 * leaves work to Python goes to ShmGroup.quick_rest. */
static PyObject *QuickSum_run(QuickSum *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "run takes 2 arguments (sendbuf, recvbuf)");
        return NULL;
    }
    Channel *ch = self->channel;
    if (!ch->held) /* released with the segment: not this way */
        Py_RETURN_FALSE;
    PyObject *dtype = PyObject_GetAttr(args[0], s_dtype);
    if (dtype == NULL)
        return NULL;
    PyObject *codes = PyDict_GetItemWithError(self->codes, dtype);
    Py_DECREF(dtype);
    if (codes == NULL) {
        if (PyErr_Occurred())
            return NULL;
        Py_RETURN_FALSE;
    }
    int64_t kind, dcode;
    if (!PyTuple_Check(codes) || PyTuple_GET_SIZE(codes) != 2 ||
        (kind = PyLong_AsLongLong(PyTuple_GET_ITEM(codes, 0))) < 1 || kind >= NKINDS ||
        ((dcode = PyLong_AsLongLong(PyTuple_GET_ITEM(codes, 1))) == -1 && PyErr_Occurred())) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "QuickSum: codes must map a dtype to (kind, wire code)");
        return NULL;
    }
    Py_buffer src, out;
    if (PyObject_GetBuffer(args[0], &src, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (src.len > ch->piece || (src.len >= self->split_min && ch->n > 2)) {
        PyBuffer_Release(&src);
        Py_RETURN_FALSE;
    }
    if (PyObject_GetBuffer(args[1], &out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    PyObject *result = NULL, *r;
    int64_t call_seq, key, prev, budget;
    if (out.len != src.len || src.len % KINDS[kind].item) {
        PyErr_Format(PyExc_ValueError, "QuickSum: %zd bytes in, %zd out, %zd-byte elements", src.len, out.len,
                     KINDS[kind].item);
        goto done;
    }
    r = PyObject_CallMethodNoArgs(self->fabric, s_check); /* raises once the job failed */
    if (r == NULL)
        goto done;
    Py_DECREF(r);
    if (get_int(self->owner, s_call_seq, &call_seq) < 0 || get_int(self->owner, s_shape_key, &key) < 0 ||
        get_int(self->group, s_seq, &prev) < 0 || get_int(self->fabric, s_spin_ns, &budget) < 0)
        goto done;
    PyObject *y = PyObject_GetAttr(self->fabric, s_yielding);
    int yielding = y == NULL ? -1 : PyObject_IsTrue(y);
    Py_XDECREF(y);
    if (yielding < 0)
        goto done;
    int64_t cseq = (call_seq + 1) & self->seq_mask;
    int64_t count = src.len / KINDS[kind].item;
    int64_t total = key && count <= self->count_mask ? (count | (key << self->shape_shift)) : count;
    int64_t seq = prev % self->seq_wrap + 1;
    int64_t desc[DESC] = {self->op, dcode, total, cseq, 0};
    int status = sum_piece(ch, src.buf, out.buf, src.len, kind, self->desc_at[prev & 1], desc, seq, prev, budget,
                           yielding);
    if (set_int(self->group, s_prev, prev) < 0 || set_int(self->group, s_seq, seq) < 0)
        goto done;
    if (status == 0) {
        if (set_int(self->owner, s_call_seq, cseq) == 0)
            result = Py_NewRef(Py_True);
        goto done;
    }
    PyBuffer_Release(&out);
    PyBuffer_Release(&src);
    /* peers to wake, a sleep, a mismatch: as quick_sum goes on after its C call */
    return PyObject_CallMethod(self->group, "quick_rest", "OOOOiLLLL", self->owner, Py_None, args[0], args[1], status,
                               (long long)prev, (long long)cseq, (long long)dcode, (long long)total);
done:
    PyBuffer_Release(&out);
    PyBuffer_Release(&src);
    return result;
}

static int QuickSum_traverse(QuickSum *self, visitproc visit, void *arg)
{
    Py_VISIT(self->channel);
    Py_VISIT(self->group);
    Py_VISIT(self->owner);
    Py_VISIT(self->fabric);
    Py_VISIT(self->codes);
    return 0;
}

static int QuickSum_clear(QuickSum *self)
{
    Py_CLEAR(self->channel);
    Py_CLEAR(self->group);
    Py_CLEAR(self->owner);
    Py_CLEAR(self->fabric);
    Py_CLEAR(self->codes);
    return 0;
}

static void QuickSum_dealloc(QuickSum *self)
{
    PyObject_GC_UnTrack(self);
    QuickSum_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef QuickSum_methods[] = {
    {"run", (PyCFunction)(void (*)(void))QuickSum_run, METH_FASTCALL,
     "run(sendbuf, recvbuf) -> bool: ShmGroup.quick_sum(owner, sendbuf, recvbuf), in C"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject QuickSumType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "meshcomm_sockets._shm.QuickSum",
    .tp_doc = "QuickSum(channel, group, owner, fabric, codes, split_min, seq_mask, seq_wrap, count_mask, "
              "shape_shift, op, desc_at0, desc_at1): a backend's small all_sum through its channel",
    .tp_basicsize = sizeof(QuickSum),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)QuickSum_init,
    .tp_dealloc = (destructor)QuickSum_dealloc,
    .tp_traverse = (traverseproc)QuickSum_traverse,
    .tp_clear = (inquiry)QuickSum_clear,
    .tp_methods = QuickSum_methods,
};

static struct PyModuleDef module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "_shm",
    .m_doc = "The sockets backend's shared-memory hot loop in C.",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__shm(void)
{
    if (PyType_Ready(&ChannelType) < 0 || PyType_Ready(&QuickSumType) < 0)
        return NULL;
#define INTERN(var, text)                                 \
    if ((var = PyUnicode_InternFromString(text)) == NULL) \
        return NULL;
    INTERN(s_dtype, "dtype") INTERN(s_check, "check") INTERN(s_call_seq, "call_seq") INTERN(s_shape_key, "shape_key")
    INTERN(s_seq, "seq") INTERN(s_prev, "prev") INTERN(s_spin_ns, "spin_ns") INTERN(s_yielding, "yielding")
#undef INTERN
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&ChannelType);
    if (PyModule_AddObject(m, "Channel", (PyObject *)&ChannelType) < 0) {
        Py_DECREF(&ChannelType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&QuickSumType);
    if (PyModule_AddObject(m, "QuickSum", (PyObject *)&QuickSumType) < 0) {
        Py_DECREF(&QuickSumType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
