/*
 * asyncsync._native: the publisher's fused diff kernel and the receiver's fused patch kernel.
 *
 * Only Python.h and the buffer protocol (no NumPy headers): every argument is any object that
 * exports a C-contiguous buffer (a NumPy array, a bytearray, a memoryview, ...). Elements are
 * opaque `width`-byte words (1, 2, 4 or 8) compared bytewise, so float payloads are never
 * interpreted. The loops run with the GIL released.
 *
 * diff_extract(old, new, width, start, pos_out, new_out, xor_out) -> (count, next_start)
 *     Scans elements from `start`; for each element whose bytes differ writes its index (int64)
 *     to pos_out, the new element to new_out and old ^ new to xor_out, until the outputs are
 *     full (capacity: len(pos_out) // 8 elements) or the end. Returns how many it wrote and
 *     the element to resume from (== number of elements when done). new_out and xor_out may
 *     both be None (positions only). Slots past `count` in the outputs may be overwritten.
 *     Fast path: compare 8-byte words of old and new and skip equal ones; a differing word is
 *     emitted branch-free, one slot per lane, advancing `count` only for lanes that differ.
 *
 * xor_patch(flat, width, positions, values, old_out) / set_patch(...same...)
 *     For k in range(len(positions)): if old_out is not None: old_out[k] = flat[pos[k]];
 *     then flat[pos[k]] ^= values[k] (xor_patch) or flat[pos[k]] = values[k] (set_patch).
 *     Positions are int64 and all are bounds-checked before the first write (IndexError,
 *     flat unchanged). Repeated positions are applied in order.
 *
 * All byte buffers are accessed with memcpy, so no alignment is required of any of them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

/* ------------------------------------------------------------------------ buffer helpers */

typedef struct {
    Py_buffer views[5];
    int held;
} Buffers;

static void release_all(Buffers *b) {
    while (b->held > 0) {
        PyBuffer_Release(&b->views[--b->held]);
    }
}

/* Acquire a C-contiguous buffer of `obj` (writable if asked); NULL with an exception set. */
static Py_buffer *acquire(Buffers *b, PyObject *obj, const char *name, int writable) {
    if (!PyObject_CheckBuffer(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must support the buffer protocol, not %.100s", name,
                     Py_TYPE(obj)->tp_name);
        return NULL;
    }
    Py_buffer *v = &b->views[b->held];
    if (PyObject_GetBuffer(obj, v, PyBUF_FULL_RO) < 0) {
        return NULL;
    }
    b->held++;
    if (!PyBuffer_IsContiguous(v, 'C')) {
        PyErr_Format(PyExc_ValueError, "%s must be a C-contiguous buffer", name);
        return NULL;
    }
    if (writable && v->readonly) {
        PyErr_Format(PyExc_TypeError, "%s must be a writable buffer", name);
        return NULL;
    }
    return v;
}

static int check_width(Py_ssize_t width) {
    if (width != 1 && width != 2 && width != 4 && width != 8) {
        PyErr_Format(PyExc_ValueError, "width must be 1, 2, 4 or 8, not %zd", width);
        return -1;
    }
    return 0;
}

/* Number of `width`-byte elements in `v`, or -1 with ValueError when it is not whole. */
static Py_ssize_t elements(Py_buffer *v, Py_ssize_t width, const char *name) {
    if (v->len % width) {
        PyErr_Format(PyExc_ValueError, "%s is %zd bytes, not a whole number of %zd-byte elements",
                     name, v->len, width);
        return -1;
    }
    return v->len / width;
}

/* ------------------------------------------------------------------------------ diff kernel */

/* Emit element i unconditionally into slot c (the caller advances c only if it differs). */
#define DIFF_SLOT(T, W, i, c)                                                                 \
    do {                                                                                      \
        T ea_, eb_, ex_;                                                                      \
        int64_t p_ = (int64_t)(i);                                                            \
        memcpy(&ea_, o + (i) * (W), (W));                                                     \
        memcpy(&eb_, nw + (i) * (W), (W));                                                    \
        ex_ = (T)(ea_ ^ eb_);                                                                 \
        memcpy(pos + (c) * 8, &p_, 8);                                                        \
        if (nv) {                                                                             \
            memcpy(nv + (c) * (W), &eb_, (W));                                                \
            memcpy(xv + (c) * (W), &ex_, (W));                                                \
        }                                                                                     \
        (c) += (ex_ != 0);                                                                    \
    } while (0)

/* One element with a capacity check: jumps to `full` (resume at i) when no slot is left. */
#define DIFF_ONE(T, W, i, c)                                                                  \
    do {                                                                                      \
        T ea_, eb_;                                                                           \
        memcpy(&ea_, o + (i) * (W), (W));                                                     \
        memcpy(&eb_, nw + (i) * (W), (W));                                                    \
        if (ea_ != eb_) {                                                                     \
            if ((c) == cap) {                                                                 \
                *resume = (i);                                                                \
                return (c);                                                                   \
            }                                                                                 \
            DIFF_SLOT(T, W, i, c);                                                            \
        }                                                                                     \
    } while (0)

#define DEFINE_DIFF(T, W)                                                                     \
    static Py_ssize_t diff_##W(const char *o, const char *nw, Py_ssize_t n, Py_ssize_t i,      \
                               char *pos, char *nv, char *xv, Py_ssize_t cap,                 \
                               Py_ssize_t *resume) {                                          \
        const Py_ssize_t lanes = 8 / (W);                                                     \
        const Py_ssize_t body_end = n - n % lanes;                                            \
        Py_ssize_t c = 0;                                                                     \
        for (; i < n && i % lanes; i++) {                                                     \
            DIFF_ONE(T, W, i, c);                                                             \
        }                                                                                     \
        for (; i < body_end; i += lanes) {                                                    \
            uint64_t a, b;                                                                    \
            memcpy(&a, o + i * (W), 8);                                                       \
            memcpy(&b, nw + i * (W), 8);                                                      \
            if (a == b) {                                                                     \
                continue;                                                                     \
            }                                                                                 \
            if (cap - c >= lanes) {                                                           \
                for (Py_ssize_t k = 0; k < lanes; k++) {                                      \
                    DIFF_SLOT(T, W, i + k, c);                                                \
                }                                                                             \
            } else {                                                                          \
                for (Py_ssize_t k = 0; k < lanes; k++) {                                      \
                    DIFF_ONE(T, W, i + k, c);                                                 \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        for (; i < n; i++) {                                                                  \
            DIFF_ONE(T, W, i, c);                                                             \
        }                                                                                     \
        *resume = n;                                                                          \
        return c;                                                                             \
    }

DEFINE_DIFF(uint8_t, 1)
DEFINE_DIFF(uint16_t, 2)
DEFINE_DIFF(uint32_t, 4)
DEFINE_DIFF(uint64_t, 8)

static PyObject *diff_extract(PyObject *self, PyObject *args) {
    PyObject *old_o, *new_o, *pos_o, *nv_o, *xv_o;
    Py_ssize_t width, start;
    if (!PyArg_ParseTuple(args, "OOnnOOO:diff_extract", &old_o, &new_o, &width, &start, &pos_o,
                          &nv_o, &xv_o)) {
        return NULL;
    }
    if (check_width(width) < 0) {
        return NULL;
    }
    if ((nv_o == Py_None) != (xv_o == Py_None)) {
        PyErr_SetString(PyExc_TypeError, "new_out and xor_out must both be buffers or both None");
        return NULL;
    }
    Buffers b = {.held = 0};
    Py_buffer *old, *new, *pos, *nv = NULL, *xv = NULL;
    Py_ssize_t n, cap, count = 0, resume = 0;
    if (!(old = acquire(&b, old_o, "old", 0)) || !(new = acquire(&b, new_o, "new", 0)) ||
        !(pos = acquire(&b, pos_o, "pos_out", 1))) {
        goto fail;
    }
    if (nv_o != Py_None &&
        (!(nv = acquire(&b, nv_o, "new_out", 1)) || !(xv = acquire(&b, xv_o, "xor_out", 1)))) {
        goto fail;
    }
    if (old->len != new->len) {
        PyErr_Format(PyExc_ValueError, "old is %zd bytes but new is %zd", old->len, new->len);
        goto fail;
    }
    if ((n = elements(old, width, "old")) < 0) {
        goto fail;
    }
    if (start < 0 || start > n) {
        PyErr_Format(PyExc_ValueError, "start %zd outside [0, %zd]", start, n);
        goto fail;
    }
    if (pos->len % 8) {
        PyErr_Format(PyExc_ValueError, "pos_out is %zd bytes, not a whole number of int64",
                     pos->len);
        goto fail;
    }
    cap = pos->len / 8;
    if (nv && (nv->len / width < cap || xv->len / width < cap)) {
        PyErr_Format(PyExc_ValueError,
                     "new_out/xor_out (%zd/%zd bytes) must hold %zd elements of %zd bytes",
                     nv->len, xv->len, cap, width);
        goto fail;
    }
    if (cap == 0 && start < n) {
        PyErr_SetString(PyExc_ValueError, "pos_out has no room (capacity 0)");
        goto fail;
    }
    {
        const char *po = old->buf, *pn = new->buf;
        char *pp = pos->buf, *pv = nv ? nv->buf : NULL, *px = xv ? xv->buf : NULL;
        Py_BEGIN_ALLOW_THREADS;
        switch (width) {
        case 1: count = diff_1(po, pn, n, start, pp, pv, px, cap, &resume); break;
        case 2: count = diff_2(po, pn, n, start, pp, pv, px, cap, &resume); break;
        case 4: count = diff_4(po, pn, n, start, pp, pv, px, cap, &resume); break;
        default: count = diff_8(po, pn, n, start, pp, pv, px, cap, &resume); break;
        }
        Py_END_ALLOW_THREADS;
    }
    release_all(&b);
    return Py_BuildValue("nn", count, resume);
fail:
    release_all(&b);
    return NULL;
}

/* ----------------------------------------------------------------------------- patch kernel */

#define DEFINE_PATCH(T, W)                                                                    \
    static void patch_##W(char *flat, const char *pos, const char *vals, char *old,           \
                          Py_ssize_t k, int is_xor) {                                         \
        for (Py_ssize_t j = 0; j < k; j++) {                                                  \
            int64_t p;                                                                        \
            T cur, v;                                                                         \
            memcpy(&p, pos + j * 8, 8);                                                       \
            memcpy(&cur, flat + p * (W), (W));                                                \
            memcpy(&v, vals + j * (W), (W));                                                  \
            if (old) {                                                                        \
                memcpy(old + j * (W), &cur, (W));                                             \
            }                                                                                 \
            cur = is_xor ? (T)(cur ^ v) : v;                                                  \
            memcpy(flat + p * (W), &cur, (W));                                                \
        }                                                                                     \
    }

DEFINE_PATCH(uint8_t, 1)
DEFINE_PATCH(uint16_t, 2)
DEFINE_PATCH(uint32_t, 4)
DEFINE_PATCH(uint64_t, 8)

/* Index of the first position outside [0, n), or -1 when all are inside. */
static Py_ssize_t first_out_of_bounds(const char *pos, Py_ssize_t k, Py_ssize_t n,
                                      int64_t *bad) {
    for (Py_ssize_t j = 0; j < k; j++) {
        int64_t p;
        memcpy(&p, pos + j * 8, 8);
        if ((uint64_t)p >= (uint64_t)n) {
            *bad = p;
            return j;
        }
    }
    return -1;
}

static PyObject *patch(PyObject *args, int is_xor) {
    PyObject *flat_o, *pos_o, *val_o, *old_o;
    Py_ssize_t width;
    if (!PyArg_ParseTuple(args, is_xor ? "OnOOO:xor_patch" : "OnOOO:set_patch", &flat_o, &width,
                          &pos_o, &val_o, &old_o)) {
        return NULL;
    }
    if (check_width(width) < 0) {
        return NULL;
    }
    Buffers b = {.held = 0};
    Py_buffer *flat, *pos, *vals, *old = NULL;
    Py_ssize_t n, k, bad_at = -1;
    int64_t bad = 0;
    if (!(flat = acquire(&b, flat_o, "flat", 1)) || !(pos = acquire(&b, pos_o, "positions", 0)) ||
        !(vals = acquire(&b, val_o, "values", 0))) {
        goto fail;
    }
    if (old_o != Py_None && !(old = acquire(&b, old_o, "old_out", 1))) {
        goto fail;
    }
    if ((n = elements(flat, width, "flat")) < 0) {
        goto fail;
    }
    if (pos->len % 8) {
        PyErr_Format(PyExc_ValueError, "positions is %zd bytes, not a whole number of int64",
                     pos->len);
        goto fail;
    }
    k = pos->len / 8;
    if (vals->len != k * width) {
        PyErr_Format(PyExc_ValueError, "values is %zd bytes, want %zd (%zd positions of %zd)",
                     vals->len, k * width, k, width);
        goto fail;
    }
    if (old && old->len < k * width) {
        PyErr_Format(PyExc_ValueError, "old_out is %zd bytes, want at least %zd", old->len,
                     k * width);
        goto fail;
    }
    {
        char *pf = flat->buf, *pold = old ? old->buf : NULL;
        const char *pp = pos->buf, *pv = vals->buf;
        Py_BEGIN_ALLOW_THREADS;
        bad_at = first_out_of_bounds(pp, k, n, &bad);
        if (bad_at < 0) {
            switch (width) {
            case 1: patch_1(pf, pp, pv, pold, k, is_xor); break;
            case 2: patch_2(pf, pp, pv, pold, k, is_xor); break;
            case 4: patch_4(pf, pp, pv, pold, k, is_xor); break;
            default: patch_8(pf, pp, pv, pold, k, is_xor); break;
            }
        }
        Py_END_ALLOW_THREADS;
    }
    if (bad_at >= 0) {
        PyErr_Format(PyExc_IndexError, "positions[%zd] = %lld is outside a tensor of %zd elements",
                     bad_at, (long long)bad, n);
        goto fail;
    }
    release_all(&b);
    Py_RETURN_NONE;
fail:
    release_all(&b);
    return NULL;
}

static PyObject *xor_patch(PyObject *self, PyObject *args) { return patch(args, 1); }

static PyObject *set_patch(PyObject *self, PyObject *args) { return patch(args, 0); }

/* --------------------------------------------------------------------------------- module */

static PyMethodDef methods[] = {
    {"diff_extract", diff_extract, METH_VARARGS,
     "diff_extract(old, new, width, start, pos_out, new_out, xor_out) -> (count, next_start)\n\n"
     "Write the int64 index, new element and old^new of each differing element from `start`\n"
     "until the outputs (capacity len(pos_out) // 8) are full or the end is reached."},
    {"xor_patch", xor_patch, METH_VARARGS,
     "xor_patch(flat, width, positions, values, old_out) -> None\n\n"
     "old_out[k] = flat[pos[k]] (unless None); flat[pos[k]] ^= values[k]. Bounds-checked first."},
    {"set_patch", set_patch, METH_VARARGS,
     "set_patch(flat, width, positions, values, old_out) -> None\n\n"
     "old_out[k] = flat[pos[k]] (unless None); flat[pos[k]] = values[k]. Bounds-checked first."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "asyncsync._native",
    .m_doc = "Fused diff and patch kernels over the buffer protocol (see asyncsync.codec).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
