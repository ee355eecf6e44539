/*
 * asyncsync.codec._native: the publisher's fused diff kernel, the receiver's fused patch kernel and
 * Elias-Fano position coding for both.
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
 *     For 2-byte elements on a CPU with AVX2 (see simd() below), 32 bytes are compared at a
 *     time instead and only the differing lanes are written.
 *     Two optional arguments fold two more passes over the same bytes into this one:
 *     `hasher` (an Xxh3, below) is fed the new bytes of every element scanned, in order, block
 *     by block right after the block is diffed (so it has hashed exactly elements [0,
 *     next_start) once a tensor is scanned from 0), and `advance` (old must be writable) copies
 *     each differing element's new bytes into old, so old becomes new as the scan passes (the
 *     publisher's snapshot; undone from the XORs if the publish fails). The hasher is fed
 *     the bytes the outputs make, never a second read of new: with `advance` old's, after
 *     the copy; else (with new_out) old's block with the new values emitted put in. Each
 *     element of new is read once, so a new that another thread writes meanwhile (a
 *     trainer's optimizer step) is hashed as the outputs carry it.
 *
 * xor_patch(flat, width, positions, values, old_out) / set_patch(...same...)
 *     For k in range(len(positions)): if old_out is not None: old_out[k] = flat[pos[k]];
 *     then flat[pos[k]] ^= values[k] (xor_patch) or flat[pos[k]] = values[k] (set_patch).
 *     Positions are int64 and all are bounds-checked before the first write (IndexError,
 *     flat unchanged). Repeated positions are applied in order.
 *
 * gather(flat, width, positions, out) -> None
 *     out[k] = flat[pos[k]] for every k; out must hold exactly len(positions) elements. All
 *     positions are bounds-checked before the first read (IndexError, out unchanged).
 *
 * ef_encode(positions, numel, low_bits) -> bytes
 *     The uncompressed Elias-Fano payload of docs/FORMAT.md section 4.2 ("xef") for int64
 *     positions, which must be strictly increasing within [0, numel) (ValueError naming the
 *     first bad index otherwise): the low parts `p & (2**L - 1)` as an L-bit LSB-first field
 *     array (ceil(n*L/8) bytes), then the high bitvector of n + (numel >> L) + 1 bits with bit
 *     (p[i] >> L) + i set (LSB-first, ceil(bits/8) bytes). 0 <= low_bits <= 63. With
 *     header (0..255), the payload follows that one byte (an xef positions blob's header) in
 *     the bytes returned: no copy of the payload to prepend it.
 *
 * ef_decode(payload, n, numel, low_bits, out_positions) -> None
 *     The inverse, into a writable buffer of exactly n int64. ValueError unless the payload has
 *     exactly the size above, no bit is set past the n*L bits of the low part or past the end of
 *     the high bitvector, the high bitvector has exactly n set bits, and the decoded positions
 *     are strictly increasing within [0, numel). Messages match asyncsync.codec.ef's NumPy decoder.
 *
 * xef_decode_many(positions, values, counts, numels, width, pos_out, val_out) -> None
 *     The receiver's decode of many small sparse xef deltas in one call: piece j's positions
 *     blob (its header byte L, then the uncompressed payload) as ef_decode, its values (the
 *     decompressed byte planes of counts[j] elements) as unplanes, each into pos_out / val_out
 *     after the pieces before it; every value must be non-zero (a listed position changed).
 *     ValueError naming the first piece that is not valid: the caller then decodes the pieces
 *     one by one, whose errors say what is wrong.
 *
 * patch_hash(flat, width, positions, values, is_xor, lo, hi, hasher) -> None
 *     Patch the element range [lo, hi) of flat (positions: int64, strictly increasing within
 *     [lo, hi), or None for every element of the range, `values` then holding hi - lo
 *     elements) in blocks of PATCH_BLOCK bytes, each block fed to `hasher` (an Xxh3, or None)
 *     right after it is patched, while in cache: the digest is that of the patched range.
 *     Every position is checked before the first write (ValueError, flat unchanged).
 *
 * journal_patch_hash(flat, width, positions, values, is_xor, lo, hi, hasher, fd, values_at,
 *                    progress_at, done) -> None
 *     patch_hash() for a receiver's progressive undo journal: per chunk of JOURNAL_CHUNK_BYTES,
 *     the old values of the chunk's positions (elements, positions None) are pwritten to fd
 *     (index j of positions, or of [lo, hi), at values_at + (done + j) * width), then the
 *     count saved so far (done + j + 1 of the chunk's last) as an int64 LE at progress_at, and
 *     only then is the chunk patched and hashed: a process killed at any instant leaves in the
 *     file (the page cache) the old value of every element it changed. OSError if a write
 *     fails, ValueError at a position not strictly increasing within [lo, hi): each chunk's
 *     positions are checked as its old values are saved (one pass), so either stops the
 *     kernel before that chunk writes anything, with every chunk before it saved, counted and
 *     patched (the caller undoes them from the file). JOURNAL_CHUNK_BYTES (a module constant,
 *     256 KiB): the bytes of the tensor per chunk, the chunks aligned to multiples of it.
 *
 * planes(src, width, out) / unplanes(src, width, out) -> None
 *     The byte planes of the xef values (all byte 0s of the width-byte elements, then all byte
 *     1s, ...) and back; out has src's size.
 *
 * Xxh3(bits=128): a streaming XXH3 hasher (xxhash.h, vendored from xxHash 0.8.2, BSD-2, see
 *     LICENSE.xxhash), 64- or 128-bit, with update(buffer) (the GIL released) and hexdigest(),
 *     whose digests equal python-xxhash's xxh3_64 / xxh3_128 hexdigest().
 *
 * All byte buffers are accessed with memcpy, so no alignment is required of any of them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* x86-64 with GCC/Clang: AVX2 variants of the diff and of XXH3's accumulate loop are compiled
 * with target attributes and used where the CPU has AVX2 (simd_enabled, decided at import; the
 * build itself stays baseline x86-64). XXH3's digest does not depend on the variant. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_SIMD 1
#define XXH_DISPATCH_AVX2 1
#define XXH_TARGET_AVX2 __attribute__((target("avx2")))
#include <immintrin.h>
#endif
static int simd_enabled = 0; /* set at import: the CPU has AVX2 and BMI1, ASYNCSYNC_SIMD != 0 */
static int ef_bmi2 = 0;      /* set at import: the CPU has BMI1 and BMI2 (the Elias-Fano encode, decode) */

#define XXH_INLINE_ALL
#define XXH_STATIC_LINKING_ONLY
#include "xxhash.h"

#ifdef HAVE_SIMD
/* XXH3_64bits_update / XXH3_128bits_update (the same routine) with the AVX2 accumulate loop. */
__attribute__((target("avx2"))) static void xxh3_update_avx2(XXH3_state_t *s, const void *p,
                                                             size_t len) {
    (void)XXH3_update(s, (const xxh_u8 *)p, len, XXH3_accumulate_avx2, XXH3_scrambleAcc_avx2);
}
#endif

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

/* The number of int64 positions in v, or -1 with a ValueError. */
static Py_ssize_t int64s(Py_buffer *v, const char *name) {
    if (v->len % 8) {
        PyErr_Format(PyExc_ValueError, "%s is %zd bytes, not a whole number of int64", name,
                     v->len);
        return -1;
    }
    return v->len / 8;
}

/* Two sequences of as many buffer objects (diff_many's olds and news, xef_decode_many's
 * positions and values): their views taken in order, item j of seq[0] then of seq[1] at
 * views[2 j] and views[2 j + 1], and released all at once by pairs_close. */
typedef struct {
    PyObject *seq[2];
    const char *name[2];
    Py_buffer *views;
    Py_ssize_t k, held;
} Pairs;

/* -1 with an exception when either is not a sequence or their lengths differ. */
static int pairs_open(Pairs *p, PyObject *first, PyObject *second, const char *names[2]) {
    *p = (Pairs){.name = {names[0], names[1]}};
    if (!(p->seq[0] = PySequence_Fast(first, "expected a sequence of buffers")) ||
        !(p->seq[1] = PySequence_Fast(second, "expected a sequence of buffers"))) {
        return -1;
    }
    p->k = PySequence_Fast_GET_SIZE(p->seq[0]);
    if (PySequence_Fast_GET_SIZE(p->seq[1]) != p->k) {
        PyErr_Format(PyExc_ValueError, "%zd %s but %zd %s", p->k, names[0],
                     PySequence_Fast_GET_SIZE(p->seq[1]), names[1]);
        return -1;
    }
    if (p->k && !(p->views = PyMem_Calloc((size_t)(2 * p->k), sizeof(Py_buffer)))) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

/* The next view: item j of seq[side], C-contiguous (and writable if asked); NULL with an
 * exception. */
static Py_buffer *pairs_take(Pairs *p, Py_ssize_t j, int side, int writable) {
    Py_buffer *v = &p->views[p->held];
    if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(p->seq[side], j), v, PyBUF_FULL_RO) < 0) {
        return NULL;
    }
    p->held++;
    if (!PyBuffer_IsContiguous(v, 'C')) {
        PyErr_Format(PyExc_ValueError, "%s[%zd] must be a C-contiguous buffer", p->name[side], j);
        return NULL;
    }
    if (writable && v->readonly) {
        PyErr_Format(PyExc_TypeError, "%s[%zd] must be a writable buffer", p->name[side], j);
        return NULL;
    }
    return v;
}

static void pairs_close(Pairs *p) {
    while (p->held > 0) {
        PyBuffer_Release(&p->views[--p->held]);
    }
    PyMem_Free(p->views);
    Py_XDECREF(p->seq[0]);
    Py_XDECREF(p->seq[1]);
}

/* The IndexError of a position outside the tensor (found by first_out_of_bounds). */
static void out_of_bounds(Py_ssize_t at, int64_t value, Py_ssize_t n) {
    PyErr_Format(PyExc_IndexError, "positions[%zd] = %lld is outside a tensor of %zd elements", at,
                 (long long)value, n);
}

/* ------------------------------------------------------------------------------ Xxh3 hasher */

typedef struct {
    PyObject_HEAD XXH3_state_t *state;
    int bits; /* 64 or 128 */
} Xxh3Object;

static PyTypeObject Xxh3Type;

/* Buffers at least this large are hashed with the GIL released. */
/* The kernels release the GIL only for work of NOGIL_MIN_BYTES or more. Releasing it costs
 * little alone, but with other threads waiting each release hands the GIL over (a futex wake
 * and a context switch) and the call then waits to get it back: for the small tensors of a
 * model of thousands (MoE experts, norms, biases) that handover cost more than the kernel's
 * work, and two pool threads ran a version of 2000 small tensors ~2.5x slower than one. */
#define NOGIL_MIN_BYTES 65536
#define NOGIL_BEGIN(nbytes)                                                                   \
    {                                                                                         \
        PyThreadState *nogil_save_ =                                                          \
            (Py_ssize_t)(nbytes) >= NOGIL_MIN_BYTES ? PyEval_SaveThread() : NULL
#define NOGIL_END                                                                             \
    if (nogil_save_) {                                                                        \
        PyEval_RestoreThread(nogil_save_);                                                    \
    }                                                                                         \
    }

#define XXH3_NOGIL_BYTES NOGIL_MIN_BYTES

static void state_feed(XXH3_state_t *state, int bits, const void *p, size_t len) {
#ifdef HAVE_SIMD
    if (simd_enabled) {
        xxh3_update_avx2(state, p, len);
        return;
    }
#endif
    if (bits == 64) {
        XXH3_64bits_update(state, p, len);
    } else {
        XXH3_128bits_update(state, p, len);
    }
}

static void xxh3_feed(Xxh3Object *h, const void *p, size_t len) {
    state_feed(h->state, h->bits, p, len);
}

static void state_reset(XXH3_state_t *state, int bits) {
    if (bits == 64) {
        XXH3_64bits_reset(state);
    } else {
        XXH3_128bits_reset(state);
    }
}

/* The canonical (big-endian) digest of `state` into raw[0..len), len = bits / 8. */
static int state_digest(XXH3_state_t *state, int bits, unsigned char *raw) {
    if (bits == 64) {
        XXH64_canonical_t c;
        XXH64_canonicalFromHash(&c, XXH3_64bits_digest(state));
        memcpy(raw, c.digest, 8);
        return 8;
    }
    XXH128_canonical_t c;
    XXH128_canonicalFromHash(&c, XXH3_128bits_digest(state));
    memcpy(raw, c.digest, 16);
    return 16;
}

static int xxh3_init(Xxh3Object *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"bits", NULL};
    int bits = 128;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|i:Xxh3", names, &bits)) {
        return -1;
    }
    if (bits != 64 && bits != 128) {
        PyErr_Format(PyExc_ValueError, "bits must be 64 or 128, not %d", bits);
        return -1;
    }
    if (!self->state && !(self->state = XXH3_createState())) {
        PyErr_NoMemory();
        return -1;
    }
    self->bits = bits;
    state_reset(self->state, bits);
    return 0;
}

static void xxh3_dealloc(Xxh3Object *self) {
    if (self->state) {
        XXH3_freeState(self->state);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *xxh3_update(Xxh3Object *self, PyObject *arg) {
    Py_buffer v;
    if (PyObject_GetBuffer(arg, &v, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    if (v.len >= XXH3_NOGIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS;
        xxh3_feed(self, v.buf, (size_t)v.len);
        Py_END_ALLOW_THREADS;
    } else {
        xxh3_feed(self, v.buf, (size_t)v.len);
    }
    PyBuffer_Release(&v);
    Py_RETURN_NONE;
}

static PyObject *xxh3_hexdigest(Xxh3Object *self, PyObject *unused) {
    char hex[33];
    static const char digits[] = "0123456789abcdef";
    unsigned char raw[16];
    int len = state_digest(self->state, self->bits, raw);
    for (int k = 0; k < len; k++) {
        hex[2 * k] = digits[raw[k] >> 4];
        hex[2 * k + 1] = digits[raw[k] & 15];
    }
    return PyUnicode_FromStringAndSize(hex, 2 * len);
}

static PyMethodDef xxh3_methods[] = {
    {"update", (PyCFunction)xxh3_update, METH_O, "update(buffer): hash these bytes next."},
    {"hexdigest", (PyCFunction)xxh3_hexdigest, METH_NOARGS,
     "The digest of the bytes so far, as python-xxhash's hexdigest() prints it."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject Xxh3Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "asyncsync.codec._native.Xxh3",
    .tp_basicsize = sizeof(Xxh3Object),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Xxh3(bits=128): streaming XXH3 (64 or 128 bits) over buffers.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)xxh3_init,
    .tp_dealloc = (destructor)xxh3_dealloc,
    .tp_methods = xxh3_methods,
};

/* The Xxh3 in `obj` (NULL for None, with *ok = 1), or NULL with *ok = 0 and a TypeError. */
static Xxh3Object *as_hasher(PyObject *obj, int *ok) {
    *ok = 1;
    if (obj == NULL || obj == Py_None) {
        return NULL;
    }
    if (!PyObject_TypeCheck(obj, &Xxh3Type) || !((Xxh3Object *)obj)->state) {
        PyErr_Format(PyExc_TypeError, "hasher must be an initialised Xxh3 or None, not %.100s",
                     Py_TYPE(obj)->tp_name);
        *ok = 0;
    }
    return (Xxh3Object *)obj;
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
        if (adv) {                                                                            \
            memcpy(adv + (i) * (W), &eb_, (W));                                               \
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
                               Py_ssize_t *resume, char *adv) {                               \
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

/* The 2-byte diff (bf16, fp16: what trainers ship) with AVX2 where the CPU has it, chosen at run
 * time so the build stays portable. Two passes over each run of 32768 elements (64 KiB, in
 * cache for the second): the first compares 16 elements per step and keeps one bit per
 * element, without a branch; the second writes each differing element found by those bits
 * (where the CPU has AVX-512 VBMI2 and the run has 1 change in 256 elements or more, from a
 * list of their offsets that list_lanes compresses out of the bits, again without a branch:
 * 3 % of 1 GiB of bf16 in 175 ms against 196, BENCHMARKS.md, 28th session). The word loop
 * above instead branches on every 8 bytes, which at a few % density is a mispredicted branch
 * every ~10 words, and writes all 4 lanes of a differing word. Its outputs are the word
 * loop's, byte for byte (tests/test_native.py runs every diff test both ways). */
#ifdef HAVE_SIMD
#define HAVE_DIFF_AVX2 1

/* Lanes whose changed-bit words are built before any is emitted: one diff block. */
#define AVX2_RUN 32768
/* The offsets in a run of the changed lanes listed before their elements are written. */
#define AVX2_LIST 4096

/* Set at import when the CPU has AVX-512 VBMI2 (and BW): the AVX2 diff's runs (simd_enabled)
 * list their changed lanes by list_lanes before they write them. */
static int list_enabled = 0;

/* The offsets from a run's start of the set bits of bits[0 .. words) (<= 64 words, the first
 * at offset base), in order, into list (room for words * 64 + 32: each step stores 32). No
 * branch on the bits: a loop over each word's bits mispredicts its exit about once a word. */
__attribute__((target("avx512f,avx512bw,avx512vbmi2,popcnt"))) static Py_ssize_t
list_lanes(const uint64_t *bits, Py_ssize_t words, Py_ssize_t base, uint16_t *list) {
    static const uint16_t iota[32] = {0,  1,  2,  3,  4,  5,  6,  7,  8,  9,  10,
                                      11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21,
                                      22, 23, 24, 25, 26, 27, 28, 29, 30, 31};
    const __m512i step = _mm512_set1_epi16(32);
    __m512i at = _mm512_add_epi16(_mm512_loadu_si512(iota), _mm512_set1_epi16((short)base));
    Py_ssize_t k = 0;
    for (Py_ssize_t w = 0; w < words; w++) {
        const __mmask32 lo = (__mmask32)bits[w], hi = (__mmask32)(bits[w] >> 32);
        _mm512_storeu_si512(list + k, _mm512_maskz_compress_epi16(lo, at));
        k += __builtin_popcount(lo);
        at = _mm512_add_epi16(at, step);
        _mm512_storeu_si512(list + k, _mm512_maskz_compress_epi16(hi, at));
        k += __builtin_popcount(hi);
        at = _mm512_add_epi16(at, step);
    }
    return k;
}

/* One changed lane (offset e from the run's start i) into slot c of the outputs. */
#define EMIT_2(e_, c_)                                                                        \
    do {                                                                                      \
        const int64_t p_ = (int64_t)(e_);                                                     \
        uint16_t ea_, eb_, ex_;                                                               \
        memcpy(&ea_, o + (e_) * 2, 2);                                                        \
        memcpy(&eb_, nw + (e_) * 2, 2);                                                       \
        ex_ = (uint16_t)(ea_ ^ eb_);                                                          \
        memcpy(pos + (c_) * 8, &p_, 8);                                                       \
        if (nv) {                                                                             \
            memcpy(nv + (c_) * 2, &eb_, 2);                                                   \
            memcpy(xv + (c_) * 2, &ex_, 2);                                                   \
        }                                                                                     \
        if (adv) {                                                                            \
            memcpy(adv + (e_) * 2, &eb_, 2);                                                  \
        }                                                                                     \
    } while (0)

__attribute__((target("avx2,bmi,popcnt"))) static Py_ssize_t
diff_2_avx2(const char *o, const char *nw, Py_ssize_t n, Py_ssize_t i, char *pos, char *nv,
            char *xv, Py_ssize_t cap, Py_ssize_t *resume, char *adv) {
    Py_ssize_t c = 0;
    uint64_t bits[AVX2_RUN / 64];
    while (n - i >= 64) {
        /* 1. one bit per lane that differs, 64 lanes a word: branch-free, streaming */
        const Py_ssize_t words = ((n - i < AVX2_RUN) ? n - i : AVX2_RUN) / 64;
        Py_ssize_t total = 0;
        for (Py_ssize_t w = 0; w < words; w++) {
            uint64_t m = 0;
            for (int q = 0; q < 4; q++) {
                const Py_ssize_t at = (i + w * 64 + q * 16) * 2;
                const __m256i a = _mm256_loadu_si256((const __m256i *)(o + at));
                const __m256i b = _mm256_loadu_si256((const __m256i *)(nw + at));
                const __m256i eq = _mm256_cmpeq_epi16(a, b);
                const __m128i p8 = _mm_packs_epi16(_mm256_castsi256_si128(eq),
                                                   _mm256_extracti128_si256(eq, 1));
                m |= (uint64_t)(~(unsigned)_mm_movemask_epi8(p8) & 0xFFFFu) << (16 * q);
            }
            bits[w] = m;
            total += __builtin_popcountll(m);
        }
        if (cap - c < total) {
            break; /* the word loop below fills the outputs exactly */
        }
        /* 2. each differing lane, in order: the run's bytes are still in cache */
        if (!list_enabled || total * 4 < words) { /* a loop over each word's bits */
            for (Py_ssize_t w = 0; w < words; w++) {
                for (uint64_t m = bits[w]; m; m &= m - 1) {
                    EMIT_2(i + w * 64 + __builtin_ctzll(m), c);
                    c++;
                }
            }
        } else { /* listed first, 64 words at a time: that loop's exit, taken after a
                  * different count in each word, mispredicted about once a word (~1 in 40
                  * elements at 3 %) */
            uint16_t list[AVX2_LIST + 32];
            for (Py_ssize_t w = 0; w < words; w += AVX2_LIST / 64) {
                const Py_ssize_t k = list_lanes(bits + w, (words - w < AVX2_LIST / 64)
                                                              ? words - w : AVX2_LIST / 64,
                                                w * 64, list);
                for (Py_ssize_t q = 0; q < k; q++, c++) {
                    EMIT_2(i + list[q], c);
                }
            }
        }
        i += words * 64;
    }
    /* the tail, or a run the outputs cannot hold: the word loop, which stops at the exact
     * element where the output fills */
    return c + diff_2(o, nw, n, i, pos + c * 8, nv ? nv + c * 2 : NULL, xv ? xv + c * 2 : NULL,
                      cap - c, resume, adv);
}

static void simd_init(void) {
    const char *env = getenv("ASYNCSYNC_SIMD");
    __builtin_cpu_init();
    simd_enabled = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi") &&
                   !(env && strcmp(env, "0") == 0);
    ef_bmi2 = __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2");
    list_enabled = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                   __builtin_cpu_supports("avx512vbmi2");
}
#else
static void simd_init(void) {}
#endif

/* Elements diffed (and hashed, and advanced) per block: hashed while still in cache. */
#define DIFF_BLOCK_BYTES 65536

static Py_ssize_t diff_any(Py_ssize_t width, const char *o, const char *nw, Py_ssize_t end,
                           Py_ssize_t i, char *pos, char *nv, char *xv, Py_ssize_t cap,
                           Py_ssize_t *resume, char *adv) {
    switch (width) {
    case 1: return diff_1(o, nw, end, i, pos, nv, xv, cap, resume, adv);
    case 2:
#ifdef HAVE_DIFF_AVX2
        if (simd_enabled) {
            return diff_2_avx2(o, nw, end, i, pos, nv, xv, cap, resume, adv);
        }
#endif
        return diff_2(o, nw, end, i, pos, nv, xv, cap, resume, adv);
    case 4: return diff_4(o, nw, end, i, pos, nv, xv, cap, resume, adv);
    default: return diff_8(o, nw, end, i, pos, nv, xv, cap, resume, adv);
    }
}

/* The bytes the outputs make of elements [i, resume) (what the hasher is fed when old is not
 * advanced): old's, with the `got` values emitted from slot `count` on put in, in `made`. */
static const char *made_block(char *made, const char *po, Py_ssize_t width, Py_ssize_t i,
                              Py_ssize_t resume, const char *pp, const char *pv, Py_ssize_t count,
                              Py_ssize_t got) {
    memcpy(made, po + i * width, (size_t)((resume - i) * width));
    for (Py_ssize_t k = count; k < count + got; k++) {
        int64_t p;
        memcpy(&p, pp + k * 8, 8);
        memcpy(made + (p - i) * width, pv + k * width, (size_t)width);
    }
    return made;
}

static PyObject *diff_extract(PyObject *self, PyObject *args) {
    PyObject *old_o, *new_o, *pos_o, *nv_o, *xv_o, *hasher_o = Py_None;
    Py_ssize_t width, start;
    int advance = 0, ok;
    if (!PyArg_ParseTuple(args, "OOnnOOO|Op:diff_extract", &old_o, &new_o, &width, &start,
                          &pos_o, &nv_o, &xv_o, &hasher_o, &advance)) {
        return NULL;
    }
    if (check_width(width) < 0) {
        return NULL;
    }
    if ((nv_o == Py_None) != (xv_o == Py_None)) {
        PyErr_SetString(PyExc_TypeError, "new_out and xor_out must both be buffers or both None");
        return NULL;
    }
    Xxh3Object *hasher = as_hasher(hasher_o, &ok);
    if (!ok) {
        return NULL;
    }
    Buffers b = {.held = 0};
    Py_buffer *old, *new, *pos, *nv = NULL, *xv = NULL;
    Py_ssize_t n, cap, count = 0, resume = 0;
    if (!(old = acquire(&b, old_o, "old", advance)) || !(new = acquire(&b, new_o, "new", 0)) ||
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
    if ((cap = int64s(pos, "pos_out")) < 0) {
        goto fail;
    }
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
    /* not advanced: each block is hashed as old's bytes with the values emitted put in (the
     * bytes the outputs make), built here, never from a second read of new */
    char *made = (hasher && !advance && nv) ? PyMem_RawMalloc(DIFF_BLOCK_BYTES) : NULL;
    if (hasher && !advance && nv && !made) {
        PyErr_NoMemory();
        goto fail;
    }
    {
        const char *po = old->buf, *pn = new->buf;
        char *pp = pos->buf, *pv = nv ? nv->buf : NULL, *px = xv ? xv->buf : NULL;
        char *adv = advance ? (char *)old->buf : NULL;
        const Py_ssize_t block = DIFF_BLOCK_BYTES / width;
        Py_ssize_t i = start;
        resume = start;
        NOGIL_BEGIN(old->len);
        if (!hasher && !adv) {
            count = diff_any(width, po, pn, n, start, pp, pv, px, cap, &resume, NULL);
        } else {
            while (i < n) {
                Py_ssize_t end = (i / block + 1) * block; /* block-aligned: lanes stay aligned */
                end = end < n ? end : n;
                Py_ssize_t got = diff_any(width, po, pn, end, i, pp + count * 8,
                                          pv ? pv + count * width : NULL,
                                          px ? px + count * width : NULL, cap - count, &resume,
                                          adv);
                if (hasher && resume > i) { /* old once advanced: the bytes the outputs carry */
                    const char *src = adv ? adv + i * width : pn + i * width;
                    if (made) { /* (resume - i <= block elements: one block at most) */
                        src = made_block(made, po, width, i, resume, pp, pv, count, got);
                    }
                    xxh3_feed(hasher, src, (size_t)((resume - i) * width));
                }
                count += got;
                i = resume;
                if (resume < end) {
                    break; /* the outputs are full */
                }
            }
            resume = i;
        }
        NOGIL_END;
    }
    PyMem_RawFree(made);
    release_all(&b);
    return Py_BuildValue("nn", count, resume);
fail:
    release_all(&b);
    return NULL;
}

/* ------------------------------------------------------------------- batched diff kernel */

/* diff_many(olds, news, width, pos_out, new_out, xor_out, counts_out, digests_out, bits,
 * advance): diff_extract over many small pairs in one call (a MoE's thousands of expert
 * tensors: the per-call glue cost ~8x the kernel at 4 KiB). The outputs of pair j follow
 * those of pair j-1 (positions relative to its own start); counts_out[j] is its count. The
 * outputs must hold every element of all pairs, so no pair stops short. bits (64/128):
 * each pair's XXH3 digest (canonical, big-endian bytes) goes to digests_out[16 j ...], of
 * the bytes the outputs make, as diff_extract's hasher is fed. Every argument is checked
 * before any pair is diffed: an error leaves the olds as they were. */
static PyObject *diff_many(PyObject *self, PyObject *args) {
    PyObject *olds_o, *news_o, *pos_o, *nv_o, *xv_o, *counts_o, *dig_o;
    Py_ssize_t width;
    int bits = 0, advance = 0;
    if (!PyArg_ParseTuple(args, "OOnOOOOO|ip:diff_many", &olds_o, &news_o, &width, &pos_o,
                          &nv_o, &xv_o, &counts_o, &dig_o, &bits, &advance)) {
        return NULL;
    }
    if (check_width(width) < 0) {
        return NULL;
    }
    if (bits != 0 && bits != 64 && bits != 128) {
        PyErr_Format(PyExc_ValueError, "bits must be 0, 64 or 128, not %d", bits);
        return NULL;
    }
    static const char *names[2] = {"olds", "news"};
    PyObject *result = NULL;
    Pairs pairs;
    Py_ssize_t k = 0, total = 0, count = 0;
    XXH3_state_t *state = NULL;
    char *made = NULL;
    Buffers b = {.held = 0};
    if (pairs_open(&pairs, olds_o, news_o, names) < 0) {
        goto done;
    }
    k = pairs.k;
    Py_buffer *views = pairs.views;
    for (Py_ssize_t j = 0; j < k; j++) {
        if (!pairs_take(&pairs, j, 0, advance) || !pairs_take(&pairs, j, 1, 0)) {
            goto done;
        }
        Py_buffer *ov = &views[2 * j], *nw = &views[2 * j + 1];
        if (ov->len != nw->len) {
            PyErr_Format(PyExc_ValueError, "olds[%zd] is %zd bytes but news[%zd] is %zd", j,
                         ov->len, j, nw->len);
            goto done;
        }
        if (ov->len % width) {
            PyErr_Format(PyExc_ValueError,
                         "olds[%zd] is %zd bytes, not a whole number of %zd-byte elements", j,
                         ov->len, width);
            goto done;
        }
        total += ov->len / width;
    }
    Py_buffer *pos, *nv, *xv, *cnt, *dig;
    if (!(pos = acquire(&b, pos_o, "pos_out", 1)) || !(nv = acquire(&b, nv_o, "new_out", 1)) ||
        !(xv = acquire(&b, xv_o, "xor_out", 1)) || !(cnt = acquire(&b, counts_o, "counts_out", 1)) ||
        !(dig = acquire(&b, dig_o, "digests_out", 1))) {
        goto done;
    }
    if (pos->len / 8 < total || nv->len / width < total || xv->len / width < total) {
        PyErr_Format(PyExc_ValueError,
                     "pos_out/new_out/xor_out (%zd/%zd/%zd bytes) must hold all %zd elements",
                     pos->len, nv->len, xv->len, total);
        goto done;
    }
    if (cnt->len / 8 < k || (bits && dig->len / 16 < k)) {
        PyErr_Format(PyExc_ValueError,
                     "counts_out/digests_out (%zd/%zd bytes) must hold %zd pairs (8/16 bytes each)",
                     cnt->len, dig->len, k);
        goto done;
    }
    if (bits && !(state = XXH3_createState())) {
        PyErr_NoMemory();
        goto done;
    }
    if (bits && !advance && !(made = PyMem_RawMalloc(DIFF_BLOCK_BYTES))) {
        PyErr_NoMemory();
        goto done;
    }
    {
        char *pp = pos->buf, *pv = nv->buf, *px = xv->buf;
        unsigned char *pd = dig->buf;
        const Py_ssize_t block = DIFF_BLOCK_BYTES / width;
        NOGIL_BEGIN(total * width);
        for (Py_ssize_t j = 0; j < k; j++) {
            const Py_ssize_t n = views[2 * j].len / width, first = count;
            const char *po = views[2 * j].buf, *pn = views[2 * j + 1].buf;
            char *adv = advance ? (char *)views[2 * j].buf : NULL;
            Py_ssize_t resume = 0;
            if (!state && !adv) {
                count += diff_any(width, po, pn, n, 0, pp + count * 8, pv + count * width,
                                  px + count * width, total - count, &resume, NULL);
            } else {
                if (state) {
                    state_reset(state, bits);
                }
                for (Py_ssize_t i = 0; i < n; i = resume) {
                    Py_ssize_t end = (i / block + 1) * block;
                    end = end < n ? end : n;
                    Py_ssize_t got = diff_any(width, po, pn, end, i, pp + count * 8,
                                              pv + count * width, px + count * width,
                                              total - count, &resume, adv);
                    if (state) {
                        const char *src = adv ? adv + i * width : pn + i * width;
                        if (made) {
                            src = made_block(made, po, width, i, resume, pp, pv, count, got);
                        }
                        state_feed(state, bits, src, (size_t)((resume - i) * width));
                    }
                    count += got;
                }
                if (state) {
                    state_digest(state, bits, pd + 16 * j);
                }
            }
            int64_t c = (int64_t)(count - first);
            memcpy((char *)cnt->buf + 8 * j, &c, 8);
        }
        NOGIL_END;
    }
    result = PyLong_FromSsize_t(count);
done:
    if (state) {
        XXH3_freeState(state);
    }
    PyMem_RawFree(made);
    release_all(&b);
    pairs_close(&pairs);
    return result;
}

/* ----------------------------------------------------------------------------- patch kernel */

/* Patch k positions (old values saved first into old, if any). Each position is read once
 * and checked to lie in [0, n) right before its write, whatever was checked before: positions
 * that alias flat, or that another thread writes while the GIL is released, can change after
 * a check pass. Returns k, or the index of the first position outside (nothing written at
 * it or after it). */
#define DEFINE_PATCH(T, W)                                                                    \
    static Py_ssize_t patch_##W(char *flat, Py_ssize_t n, const char *pos, const char *vals,  \
                                char *old, Py_ssize_t k, int is_xor) {                        \
        for (Py_ssize_t j = 0; j < k; j++) {                                                  \
            int64_t p;                                                                        \
            T cur, v;                                                                         \
            memcpy(&p, pos + j * 8, 8);                                                       \
            if ((uint64_t)p >= (uint64_t)n) {                                                 \
                return j;                                                                     \
            }                                                                                 \
            memcpy(&cur, flat + p * (W), (W));                                                \
            memcpy(&v, vals + j * (W), (W));                                                  \
            if (old) {                                                                        \
                memcpy(old + j * (W), &cur, (W));                                             \
            }                                                                                 \
            cur = is_xor ? (T)(cur ^ v) : v;                                                  \
            memcpy(flat + p * (W), &cur, (W));                                                \
        }                                                                                     \
        return k;                                                                             \
    }

DEFINE_PATCH(uint8_t, 1)
DEFINE_PATCH(uint16_t, 2)
DEFINE_PATCH(uint32_t, 4)
DEFINE_PATCH(uint64_t, 8)

static Py_ssize_t patch_any(Py_ssize_t width, char *flat, Py_ssize_t n, const char *pos,
                            const char *vals, char *old, Py_ssize_t k, int is_xor) {
    switch (width) {
    case 1: return patch_1(flat, n, pos, vals, old, k, is_xor);
    case 2: return patch_2(flat, n, pos, vals, old, k, is_xor);
    case 4: return patch_4(flat, n, pos, vals, old, k, is_xor);
    default: return patch_8(flat, n, pos, vals, old, k, is_xor);
    }
}

/* The error of a position found outside the tensor while patching, after the check before
 * passed: the positions changed meanwhile. */
static void moved_positions(Py_ssize_t at) {
    PyErr_Format(PyExc_ValueError,
                 "positions[%zd] changed while the patch ran (it lies outside the tensor now): "
                 "the positions alias the tensor or another thread wrote them; patch stopped",
                 at);
}


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
    Py_ssize_t n, k, bad_at = -1, changed = 0;
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
    if ((k = int64s(pos, "positions")) < 0) {
        goto fail;
    }
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
        NOGIL_BEGIN(pos->len);
        bad_at = first_out_of_bounds(pp, k, n, &bad);
        if (bad_at < 0) {
            changed = patch_any(width, pf, n, pp, pv, pold, k, is_xor);
        }
        NOGIL_END;
    }
    if (bad_at >= 0) {
        out_of_bounds(bad_at, bad, n);
        goto fail;
    }
    if (changed < k) {
        moved_positions(changed);
        goto fail;
    }
    release_all(&b);
    Py_RETURN_NONE;
fail:
    release_all(&b);
    return NULL;
}

static PyObject *xor_patch(PyObject *self, PyObject *args) { return patch(args, 1); }

/* ------------------------------------------------ shifted XOR and the increasing check */

static int check_pos_width(Py_ssize_t pw) {
    if (pw != 4 && pw != 8) {
        PyErr_Format(PyExc_ValueError, "positions width must be 4 or 8, not %zd", pw);
        return -1;
    }
    return 0;
}

/* Position j of an int32 or int64 array. */
static inline int64_t pos_at(const char *pos, Py_ssize_t pw, Py_ssize_t j) {
    if (pw == 4) {
        int32_t p;
        memcpy(&p, pos + j * 4, 4);
        return p;
    }
    int64_t p;
    memcpy(&p, pos + j * 8, 8);
    return p;
}

/* Whether p + shift lies outside [0, n) (|shift| < 2^62, checked; p is bounded first, so
 * the sum cannot overflow). */
static inline int shifted_out(int64_t p, int64_t shift, Py_ssize_t n) {
    return p < 0 || p >= ((int64_t)1 << 62) || p + shift < 0 || p + shift >= (int64_t)n;
}

/* Each position is checked again as it is used (the pass before may be stale: see
 * DEFINE_PATCH): k, or the index of the first found outside [0, n). */
#define DEFINE_XOR_SHIFTED(T, W)                                                              \
    static Py_ssize_t xor_shifted_##W(char *flat, Py_ssize_t n, const char *pos,             \
                                      Py_ssize_t pw, int64_t shift, const char *vals,         \
                                      Py_ssize_t k) {                                         \
        for (Py_ssize_t j = 0; j < k; j++) {                                                  \
            int64_t p = pos_at(pos, pw, j);                                                   \
            T cur, v;                                                                         \
            if (shifted_out(p, shift, n)) {                                                   \
                return j;                                                                     \
            }                                                                                 \
            p += shift;                                                                       \
            memcpy(&cur, flat + p * (W), (W));                                                \
            memcpy(&v, vals + j * (W), (W));                                                  \
            cur = (T)(cur ^ v);                                                               \
            memcpy(flat + p * (W), &cur, (W));                                                \
        }                                                                                     \
        return k;                                                                             \
    }

DEFINE_XOR_SHIFTED(uint8_t, 1)
DEFINE_XOR_SHIFTED(uint16_t, 2)
DEFINE_XOR_SHIFTED(uint32_t, 4)
DEFINE_XOR_SHIFTED(uint64_t, 8)

/* Index of the first position with p + shift outside [0, n), or -1. */
static Py_ssize_t first_shifted_out(const char *pos, Py_ssize_t pw, Py_ssize_t k, int64_t shift,
                                    Py_ssize_t n, int64_t *bad) {
    for (Py_ssize_t j = 0; j < k; j++) {
        int64_t p = pos_at(pos, pw, j);
        if (shifted_out(p, shift, n)) {
            *bad = p;
            return j;
        }
    }
    return -1;
}

static PyObject *xor_shifted(PyObject *self, PyObject *args) {
    PyObject *flat_o, *pos_o, *val_o;
    Py_ssize_t width, pw;
    long long shift;
    if (!PyArg_ParseTuple(args, "OnOnLO:xor_shifted", &flat_o, &width, &pos_o, &pw, &shift,
                          &val_o)) {
        return NULL;
    }
    if (check_width(width) < 0) {
        return NULL;
    }
    if (check_pos_width(pw) < 0) {
        return NULL;
    }
    if (shift <= -((long long)1 << 62) || shift >= ((long long)1 << 62)) {
        PyErr_Format(PyExc_ValueError, "shift %lld is out of range", shift);
        return NULL;
    }
    Buffers b = {.held = 0};
    Py_buffer *flat, *pos, *vals;
    Py_ssize_t n, k, bad_at = -1, changed = 0;
    int64_t bad = 0;
    if (!(flat = acquire(&b, flat_o, "flat", 1)) || !(pos = acquire(&b, pos_o, "positions", 0)) ||
        !(vals = acquire(&b, val_o, "values", 0))) {
        goto fail;
    }
    if ((n = elements(flat, width, "flat")) < 0 || (k = elements(pos, pw, "positions")) < 0) {
        goto fail;
    }
    if (vals->len != k * width) {
        PyErr_Format(PyExc_ValueError, "values is %zd bytes, want %zd (%zd positions of %zd)",
                     vals->len, k * width, k, width);
        goto fail;
    }
    {
        char *pf = flat->buf;
        const char *pp = pos->buf, *pv = vals->buf;
        NOGIL_BEGIN(pos->len);
        bad_at = first_shifted_out(pp, pw, k, (int64_t)shift, n, &bad);
        if (bad_at < 0) {
            const int64_t sh = (int64_t)shift;
            switch (width) {
            case 1: changed = xor_shifted_1(pf, n, pp, pw, sh, pv, k); break;
            case 2: changed = xor_shifted_2(pf, n, pp, pw, sh, pv, k); break;
            case 4: changed = xor_shifted_4(pf, n, pp, pw, sh, pv, k); break;
            default: changed = xor_shifted_8(pf, n, pp, pw, sh, pv, k); break;
            }
        }
        NOGIL_END;
    }
    if (bad_at < 0 && changed < k) {
        moved_positions(changed);
        goto fail;
    }
    if (bad_at >= 0) {
        PyErr_Format(PyExc_IndexError,
                     "positions[%zd] = %lld shifted by %lld is outside a tensor of %zd elements",
                     bad_at, (long long)bad, shift, n);
        goto fail;
    }
    release_all(&b);
    Py_RETURN_NONE;
fail:
    release_all(&b);
    return NULL;
}

static PyObject *increasing(PyObject *self, PyObject *args) {
    PyObject *pos_o;
    Py_ssize_t pw;
    long long limit;
    if (!PyArg_ParseTuple(args, "OnL:increasing", &pos_o, &pw, &limit)) {
        return NULL;
    }
    if (check_pos_width(pw) < 0) {
        return NULL;
    }
    Buffers b = {.held = 0};
    Py_buffer *pos;
    Py_ssize_t k;
    int ok = 1;
    if (!(pos = acquire(&b, pos_o, "positions", 0)) || (k = elements(pos, pw, "positions")) < 0) {
        release_all(&b);
        return NULL;
    }
    {
        const char *pp = pos->buf;
        NOGIL_BEGIN(pos->len);
        int64_t prev = -1;
        for (Py_ssize_t j = 0; j < k; j++) {
            int64_t p = pos_at(pp, pw, j);
            if (p <= prev) {
                ok = 0;
                break;
            }
            prev = p;
        }
        if (ok && k && prev >= (int64_t)limit) {
            ok = 0;
        }
        NOGIL_END;
    }
    release_all(&b);
    return PyBool_FromLong(ok);
}

/* Patched and hashed per block: the block is hashed right after it is patched, in cache. */
#define PATCH_BLOCK_BYTES 65536

/* Read one byte of every 64-byte line of [p, p + len): a sequential stream of independent
 * loads that the core and its prefetchers overlap, so the scattered writes of a patch that
 * follows hit the cache. Without it each write to a line not yet cached waits for it in the
 * store buffer, which fills: patch + hash of 1 GiB at 3 % went from ~185 to ~150 ms here. Used
 * only where the hash reads every line of the range right after anyway (no extra traffic). */
static void touch_lines(const char *p, Py_ssize_t len) {
    unsigned char acc = 0;
    for (Py_ssize_t o = 0; o < len; o += 64) {
        acc ^= (unsigned char)p[o];
    }
    volatile unsigned char sink = acc; /* keeps the loads */
    (void)sink;
}


/* Bytewise XOR of len bytes of src into dst (XOR needs no element width). */
static void xor_bytes(char *dst, const char *src, Py_ssize_t len) {
    Py_ssize_t j = 0;
    for (; j + 8 <= len; j += 8) {
        uint64_t a, v;
        memcpy(&a, dst + j, 8);
        memcpy(&v, src + j, 8);
        a ^= v;
        memcpy(dst + j, &a, 8);
    }
    for (; j < len; j++) {
        dst[j] ^= src[j];
    }
}

/* The arguments patch_hash and journal_patch_hash share: flat (writable), positions (None: a
 * dense range) and values, checked against width and [lo, hi). 0, or -1 with an error set. */
static int patch_buffers(Buffers *b, PyObject *flat_o, PyObject *pos_o, PyObject *val_o,
                         Py_ssize_t width, Py_ssize_t lo, Py_ssize_t hi, Py_buffer **flat,
                         Py_buffer **pos, Py_buffer **vals, Py_ssize_t *k) {
    Py_ssize_t n;
    *pos = NULL;
    *k = 0;
    if (!(*flat = acquire(b, flat_o, "flat", 1)) || !(*vals = acquire(b, val_o, "values", 0))) {
        return -1;
    }
    if (pos_o != Py_None && !(*pos = acquire(b, pos_o, "positions", 0))) {
        return -1;
    }
    if ((n = elements(*flat, width, "flat")) < 0) {
        return -1;
    }
    if (lo < 0 || lo > hi || hi > n) {
        PyErr_Format(PyExc_ValueError, "range [%zd, %zd) outside a tensor of %zd elements", lo,
                     hi, n);
        return -1;
    }
    if (*pos && (*k = int64s(*pos, "positions")) < 0) {
        return -1;
    }
    if ((*vals)->len != (*pos ? *k : hi - lo) * width) {
        PyErr_Format(PyExc_ValueError, "values is %zd bytes, want %zd elements of %zd",
                     (*vals)->len, *pos ? *k : hi - lo, width);
        return -1;
    }
    return 0;
}

/* Index of the first of k positions not strictly increasing within [lo, hi) (its value in
 * *bad), or -1: every position is checked before any write. */
static Py_ssize_t first_unordered(const char *pp, Py_ssize_t k, Py_ssize_t lo, Py_ssize_t hi,
                                  int64_t *bad) {
    int64_t prev = (int64_t)lo - 1;
    for (Py_ssize_t j = 0; j < k; j++) {
        int64_t p;
        memcpy(&p, pp + j * 8, 8);
        if (p <= prev || p >= (int64_t)hi) {
            *bad = p;
            return j;
        }
        prev = p;
    }
    return -1;
}

static PyObject *unordered_error(Py_ssize_t bad_at, int64_t bad, Py_ssize_t lo, Py_ssize_t hi) {
    return PyErr_Format(PyExc_ValueError,
                        "positions[%zd] = %lld: positions must be strictly increasing within "
                        "[%zd, %zd)",
                        bad_at, (long long)bad, lo, hi);
}

/* The index of the first of positions [from, to) that is >= end (they are increasing). */
static Py_ssize_t positions_below(const char *pp, Py_ssize_t from, Py_ssize_t to, int64_t end) {
    while (from < to) {
        Py_ssize_t mid = from + (to - from) / 2;
        int64_t p;
        memcpy(&p, pp + mid * 8, 8);
        if (p < end) {
            from = mid + 1;
        } else {
            to = mid;
        }
    }
    return from;
}

/* Patch [i, end) of flat (n elements) block by block, each block fed to hasher (if any) right
 * after it is patched: positions [at, stop) (checked, increasing, inside [i, end)) with their
 * values (and old values saved) at the same index, or, without positions, every element, its
 * value and old value at its index less lo. touch: bring each hashed block's lines in first
 * (0 where the caller just did, for the whole range). -1, or the index of a position found
 * outside the tensor as it was written (changed since its check: see DEFINE_PATCH). */
static Py_ssize_t patch_blocks(Py_ssize_t width, char *pf, Py_ssize_t n, const char *pp,
                               const char *pv, char *po, Py_ssize_t lo, Py_ssize_t i,
                               Py_ssize_t end, Py_ssize_t at, Py_ssize_t stop, int is_xor,
                               Xxh3Object *hasher, int touch) {
    const Py_ssize_t block = PATCH_BLOCK_BYTES / width;
    while (i < end) {
        Py_ssize_t bend = (i / block + 1) * block;
        bend = bend < end ? bend : end;
        if (pp) {
            Py_ssize_t s = positions_below(pp, at, stop, (int64_t)bend);
            if (touch && hasher && s > at) {
                touch_lines(pf + i * width, (bend - i) * width);
            }
            Py_ssize_t done = patch_any(width, pf, n, pp + at * 8, pv + at * width,
                                        po ? po + at * width : NULL, s - at, is_xor);
            if (done < s - at) {
                return at + done;
            }
            at = s;
        } else {
            if (po) { /* dense: the block's old bytes first */
                memcpy(po + (i - lo) * width, pf + i * width, (size_t)((bend - i) * width));
            }
            if (is_xor) {
                xor_bytes(pf + i * width, pv + (i - lo) * width, (bend - i) * width);
            } else {
                memcpy(pf + i * width, pv + (i - lo) * width, (size_t)((bend - i) * width));
            }
        }
        if (hasher) {
            xxh3_feed(hasher, pf + i * width, (size_t)((bend - i) * width));
        }
        i = bend;
    }
    return -1;
}

static PyObject *patch_hash(PyObject *self, PyObject *args) {
    PyObject *flat_o, *pos_o, *val_o, *hasher_o, *old_o = Py_None;
    Py_ssize_t width, lo, hi;
    int is_xor, ok;
    if (!PyArg_ParseTuple(args, "OnOOpnnO|O:patch_hash", &flat_o, &width, &pos_o, &val_o,
                          &is_xor, &lo, &hi, &hasher_o, &old_o)) {
        return NULL;
    }
    if (check_width(width) < 0) {
        return NULL;
    }
    Xxh3Object *hasher = as_hasher(hasher_o, &ok);
    if (!ok) {
        return NULL;
    }
    Buffers b = {.held = 0};
    Py_buffer *flat, *pos, *vals, *old = NULL;
    Py_ssize_t k, bad_at = -1, moved = -1;
    int64_t bad = 0;
    if (patch_buffers(&b, flat_o, pos_o, val_o, width, lo, hi, &flat, &pos, &vals, &k) < 0) {
        goto fail;
    }
    if (old_o != Py_None && !(old = acquire(&b, old_o, "old_out", 1))) {
        goto fail;
    }
    if (old && old->len != vals->len) {
        PyErr_Format(PyExc_ValueError, "old_out is %zd bytes, want %zd (as values)", old->len,
                     vals->len);
        goto fail;
    }
    {
        char *pf = flat->buf, *po = old ? old->buf : NULL;
        const char *pp = pos ? pos->buf : NULL, *pv = vals->buf;
        NOGIL_BEGIN((hi - lo) * width);
        bad_at = first_unordered(pp, k, lo, hi, &bad);
        if (bad_at < 0) {
            moved = patch_blocks(width, pf, flat->len / width, pp, pv, po, lo, lo, hi, 0, k,
                                 is_xor, hasher, 1);
        }
        NOGIL_END;
    }
    if (bad_at >= 0) {
        unordered_error(bad_at, bad, lo, hi);
        goto fail;
    }
    if (moved >= 0) {
        moved_positions(moved);
        goto fail;
    }
    release_all(&b);
    Py_RETURN_NONE;
fail:
    release_all(&b);
    return NULL;
}

/* flat[p] of k positions into out, each position checked again to lie in [0, n) as it is read
 * (out may alias the positions): k, or the index of the first outside. */
#define DEFINE_GATHER(T, W)                                                                   \
    static Py_ssize_t gather_##W(const char *flat, Py_ssize_t n, const char *pos, char *out,  \
                                 Py_ssize_t k, int64_t *bad) {                                \
        for (Py_ssize_t j = 0; j < k; j++) {                                                  \
            int64_t p;                                                                        \
            T v;                                                                              \
            memcpy(&p, pos + j * 8, 8);                                                       \
            if ((uint64_t)p >= (uint64_t)n) {                                                 \
                *bad = p;                                                                     \
                return j;                                                                     \
            }                                                                                 \
            memcpy(&v, flat + p * (W), (W));                                                  \
            memcpy(out + j * (W), &v, (W));                                                   \
        }                                                                                     \
        return k;                                                                             \
    }

DEFINE_GATHER(uint8_t, 1)
DEFINE_GATHER(uint16_t, 2)
DEFINE_GATHER(uint32_t, 4)
DEFINE_GATHER(uint64_t, 8)

static PyObject *gather(PyObject *self, PyObject *args) {
    PyObject *flat_o, *pos_o, *out_o;
    Py_ssize_t width;
    if (!PyArg_ParseTuple(args, "OnOO:gather", &flat_o, &width, &pos_o, &out_o)) {
        return NULL;
    }
    if (check_width(width) < 0) {
        return NULL;
    }
    Buffers b = {.held = 0};
    Py_buffer *flat, *pos, *out;
    Py_ssize_t n, k, bad_at = -1;
    int64_t bad = 0;
    if (!(flat = acquire(&b, flat_o, "flat", 0)) || !(pos = acquire(&b, pos_o, "positions", 0)) ||
        !(out = acquire(&b, out_o, "out", 1))) {
        goto fail;
    }
    if ((n = elements(flat, width, "flat")) < 0) {
        goto fail;
    }
    if ((k = int64s(pos, "positions")) < 0) {
        goto fail;
    }
    if (out->len != k * width) {
        PyErr_Format(PyExc_ValueError, "out is %zd bytes, want %zd (%zd positions of %zd)",
                     out->len, k * width, k, width);
        goto fail;
    }
    {
        const char *pf = flat->buf, *pp = pos->buf;
        char *po = out->buf;
        NOGIL_BEGIN(pos->len);
        bad_at = first_out_of_bounds(pp, k, n, &bad); /* out untouched if any is outside */
        if (bad_at < 0) {
            Py_ssize_t got;
            switch (width) {
            case 1: got = gather_1(pf, n, pp, po, k, &bad); break;
            case 2: got = gather_2(pf, n, pp, po, k, &bad); break;
            case 4: got = gather_4(pf, n, pp, po, k, &bad); break;
            default: got = gather_8(pf, n, pp, po, k, &bad); break;
            }
            bad_at = got < k ? got : -1; /* changed since the pass before: see DEFINE_PATCH */
        }
        NOGIL_END;
    }
    if (bad_at >= 0) {
        out_of_bounds(bad_at, bad, n);
        goto fail;
    }
    release_all(&b);
    Py_RETURN_NONE;
fail:
    release_all(&b);
    return NULL;
}

/* ------------------------------------------------------------- journalled patch kernel */

/* Bytes of the tensor whose old values are saved to the journal and then patched at a time:
 * a few blocks, brought into the cache once (touch_lines) for the save, the patch and the
 * hash. 256 KiB rather than 1 MiB: on the Xeon of BENCHMARKS.md (2 MiB of L2 per core), the
 * journal of 1 GiB of bf16 at 3 % cost 41-50 ms of thread CPU over patch + hash alone with
 * 1 MiB chunks (each block's lines brought in a second time) and 9-16 ms with 256 KiB ones
 * (touched once), nearly all of it the record's pwrites: 4x as many cost less than the cache
 * misses of the bigger chunk. */
#define JOURNAL_CHUNK_BYTES (4 * PATCH_BLOCK_BYTES)

/* Save flat[p] into out for the positions from pos on that are below end (at most k), each
 * checked first to be above the one before (*prev, updated): the count saved, or -1 - the
 * index of the first that is not (nothing is read at it). */
#define DEFINE_SAVE(T, W)                                                                     \
    static Py_ssize_t save_##W(const char *flat, const char *pos, Py_ssize_t k, int64_t end,  \
                               int64_t *prev, char *out) {                                    \
        int64_t before = *prev;                                                               \
        Py_ssize_t j = 0;                                                                     \
        for (; j < k; j++) {                                                                  \
            int64_t p;                                                                        \
            T v;                                                                              \
            memcpy(&p, pos + j * 8, 8);                                                       \
            if (p >= end) {                                                                   \
                break;                                                                        \
            }                                                                                 \
            if (p <= before) {                                                                \
                return -1 - j;                                                                \
            }                                                                                 \
            memcpy(&v, flat + p * (W), (W));                                                  \
            memcpy(out + j * (W), &v, (W));                                                   \
            before = p;                                                                       \
        }                                                                                     \
        *prev = before;                                                                       \
        return j;                                                                             \
    }

DEFINE_SAVE(uint8_t, 1)
DEFINE_SAVE(uint16_t, 2)
DEFINE_SAVE(uint32_t, 4)
DEFINE_SAVE(uint64_t, 8)

static Py_ssize_t save_any(Py_ssize_t width, const char *flat, const char *pos, Py_ssize_t k,
                           int64_t end, int64_t *prev, char *out) {
    switch (width) {
    case 1: return save_1(flat, pos, k, end, prev, out);
    case 2: return save_2(flat, pos, k, end, prev, out);
    case 4: return save_4(flat, pos, k, end, prev, out);
    default: return save_8(flat, pos, k, end, prev, out);
    }
}

/* pwrite all of buf at off; 0, or the errno of the failure. */
static int pwrite_all(int fd, const char *buf, size_t len, int64_t off) {
    while (len > 0) {
        ssize_t w = pwrite(fd, buf, len, (off_t)off);
        if (w < 0) {
            if (errno == EINTR) {
                continue;
            }
            return errno;
        }
        if (w == 0) {
            return EIO;
        }
        buf += w;
        len -= (size_t)w;
        off += w;
    }
    return 0;
}

static PyObject *journal_patch_hash(PyObject *self, PyObject *args) {
    PyObject *flat_o, *pos_o, *val_o, *hasher_o;
    Py_ssize_t width, lo, hi, done;
    long long values_at, progress_at;
    int is_xor, ok, fd;
    if (!PyArg_ParseTuple(args, "OnOOpnnOiLLn:journal_patch_hash", &flat_o, &width, &pos_o,
                          &val_o, &is_xor, &lo, &hi, &hasher_o, &fd, &values_at, &progress_at,
                          &done)) {
        return NULL;
    }
    if (check_width(width) < 0) {
        return NULL;
    }
    Xxh3Object *hasher = as_hasher(hasher_o, &ok);
    if (!ok) {
        return NULL;
    }
    if (fd < 0 || values_at < 0 || progress_at < 0 || done < 0) {
        PyErr_SetString(PyExc_ValueError, "fd, values_at, progress_at and done must be >= 0");
        return NULL;
    }
    Buffers b = {.held = 0};
    Py_buffer *flat, *pos, *vals;
    Py_ssize_t k, bad_at = -1, moved = -1;
    int64_t bad = 0;
    int err = 0;
    if (patch_buffers(&b, flat_o, pos_o, val_o, width, lo, hi, &flat, &pos, &vals, &k) < 0) {
        goto fail;
    }
    { /* every offset written, values_at + (done + count) * width and progress_at + 8, fits */
        const int64_t count = pos ? k : hi - lo;
        if (progress_at > INT64_MAX - 8 || done > INT64_MAX - count ||
            done + count > (INT64_MAX - values_at) / width) {
            PyErr_SetString(PyExc_ValueError, "values_at, progress_at or done is too large");
            goto fail;
        }
    }
    {
        char *pf = flat->buf;
        const char *pp = pos ? pos->buf : NULL, *pv = vals->buf;
        const Py_ssize_t chunk = JOURNAL_CHUNK_BYTES / width;
        Py_ssize_t room = pp ? (k < chunk ? k : chunk) : (hi - lo < chunk ? hi - lo : chunk);
        char *saved = PyMem_RawMalloc((size_t)(room > 0 ? room : 1) * (size_t)width);
        if (saved == NULL) {
            release_all(&b);
            return PyErr_NoMemory();
        }
        NOGIL_BEGIN(NOGIL_MIN_BYTES); /* always: it writes the journal file, which can block */
        /* Each position is checked as its chunk saves it, before the chunk writes anything: a
         * bad one stops the kernel with every chunk before it saved (and counted) and patched,
         * as a failed write does; the caller undoes them from the record. */
        int64_t prev = (int64_t)lo - 1;
        Py_ssize_t i = lo, at = 0;
        while (i < hi) {
            Py_ssize_t cend = (i / chunk + 1) * chunk;
            cend = cend < hi ? cend : hi;
            /* 1. the old values of everything this chunk writes, then how many are saved: in
             *    the journal file (the page cache) before the first byte of the chunk changes */
            Py_ssize_t stop = at, first = at, count;
            if (pp) {
                if (hasher && at < k) { /* the chunk is hashed next: bring it in for the save */
                    touch_lines(pf + i * width, (cend - i) * width);
                }
                count = save_any(width, pf, pp + at * 8, k - at, (int64_t)cend, &prev, saved);
                if (count < 0) {
                    bad_at = at - 1 - count;
                    memcpy(&bad, pp + bad_at * 8, 8);
                    break;
                }
                stop = at + count;
            } else {
                first = i - lo;
                count = cend - i;
                memcpy(saved, pf + i * width, (size_t)(count * width));
            }
            if (count > 0) {
                int64_t progress = (int64_t)(done + first + count);
                unsigned char le[8];
                for (int q = 0; q < 8; q++) {
                    le[q] = (unsigned char)((uint64_t)progress >> (8 * q));
                }
                err = pwrite_all(fd, saved, (size_t)(count * width),
                                 (int64_t)values_at + (int64_t)(done + first) * width);
                if (!err) {
                    err = pwrite_all(fd, (const char *)le, 8, (int64_t)progress_at);
                }
                if (err) {
                    break;
                }
            }
            /* 2. patch, then hash, block by block (the chunk's lines are still cached) */
            moved = patch_blocks(width, pf, flat->len / width, pp, pv, NULL, lo, i, cend, at,
                                 stop, is_xor, hasher, 0); /* its lines brought in above */
            if (moved >= 0) {
                break;
            }
            at = stop;
            i = cend;
        }
        if (pp && !err && bad_at < 0 && moved < 0 && at < k) { /* left over: at or past hi */
            bad_at = at;
            memcpy(&bad, pp + at * 8, 8);
        }
        NOGIL_END;
        PyMem_RawFree(saved);
    }
    if (bad_at >= 0) {
        unordered_error(bad_at, bad, lo, hi);
        goto fail;
    }
    if (moved >= 0) {
        moved_positions(moved);
        goto fail;
    }
    if (err) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        goto fail;
    }
    release_all(&b);
    Py_RETURN_NONE;
fail:
    release_all(&b);
    return NULL;
}

static PyObject *set_patch(PyObject *self, PyObject *args) { return patch(args, 0); }

/* ---------------------------------------------------------------------------- byte planes */

/* planes: n elements of `width` bytes -> byte k of every element, for k = 0 .. width-1 (and back). */
static PyObject *planes_impl(PyObject *args, int split) {
    PyObject *src_o, *out_o;
    Py_ssize_t width;
    if (!PyArg_ParseTuple(args, split ? "OnO:planes" : "OnO:unplanes", &src_o, &width, &out_o)) {
        return NULL;
    }
    if (check_width(width) < 0) {
        return NULL;
    }
    Buffers b = {.held = 0};
    Py_buffer *src, *out;
    Py_ssize_t n;
    if (!(src = acquire(&b, src_o, "src", 0)) || !(out = acquire(&b, out_o, "out", 1))) {
        goto fail;
    }
    if ((n = elements(src, width, "src")) < 0) {
        goto fail;
    }
    if (out->len != src->len) {
        PyErr_Format(PyExc_ValueError, "out is %zd bytes, src %zd", out->len, src->len);
        goto fail;
    }
    Py_ssize_t zeros = 0; /* unplanes: elements of out whose bytes are all zero */
    {
        const unsigned char *ps = src->buf;
        unsigned char *po = out->buf;
        NOGIL_BEGIN(src->len);
        if (width == 1) {
            memcpy(po, ps, (size_t)n);
        } else if (width == 2) { /* the bf16 / fp16 case, unrolled */
            unsigned char *p0 = split ? po : (unsigned char *)ps, *p1 = p0 + n;
            if (split) {
                for (Py_ssize_t i = 0; i < n; i++) {
                    p0[i] = ps[2 * i];
                    p1[i] = ps[2 * i + 1];
                }
            } else {
                for (Py_ssize_t i = 0; i < n; i++) {
                    const unsigned char lo = p0[i], hi = p1[i];
                    po[2 * i] = lo;
                    po[2 * i + 1] = hi;
                    zeros += (lo | hi) == 0;
                }
            }
        } else {
            for (Py_ssize_t k = 0; k < width; k++) { /* one plane at a time: sequential writes */
                if (split) {
                    unsigned char *dst = po + k * n;
                    for (Py_ssize_t i = 0; i < n; i++) {
                        dst[i] = ps[i * width + k];
                    }
                } else {
                    const unsigned char *from = ps + k * n;
                    for (Py_ssize_t i = 0; i < n; i++) {
                        po[i * width + k] = from[i];
                    }
                }
            }
        }
        if (!split && width != 2) { /* 1, 4, 8: a pass of its own */
            for (Py_ssize_t i = 0; i < n; i++) {
                unsigned char any = 0;
                for (Py_ssize_t k = 0; k < width; k++) {
                    any |= po[i * width + k];
                }
                zeros += any == 0;
            }
        }
        NOGIL_END;
    }
    release_all(&b);
    if (split) {
        Py_RETURN_NONE;
    }
    return PyLong_FromSsize_t(zeros);
fail:
    release_all(&b);
    return NULL;
}

static PyObject *planes(PyObject *self, PyObject *args) { return planes_impl(args, 1); }
static PyObject *unplanes(PyObject *self, PyObject *args) { return planes_impl(args, 0); }

/* ---------------------------------------------------------------------------- Elias-Fano */

#if defined(__GNUC__) || defined(__clang__)
#define POPCOUNT64(x) ((Py_ssize_t)__builtin_popcountll(x))
#define CTZ64(x) ((unsigned)__builtin_ctzll(x))
#else
static Py_ssize_t POPCOUNT64(uint64_t x) {
    x = x - ((x >> 1) & 0x5555555555555555ULL);
    x = (x & 0x3333333333333333ULL) + ((x >> 2) & 0x3333333333333333ULL);
    x = (x + (x >> 4)) & 0x0F0F0F0F0F0F0F0FULL;
    return (Py_ssize_t)((x * 0x0101010101010101ULL) >> 56);
}
static unsigned CTZ64(uint64_t x) { /* x != 0 */
    unsigned c = 0;
    while (!(x & 1)) {
        x >>= 1;
        c++;
    }
    return c;
}
#endif

/* The payload is a little-endian bit stream whatever the host's byte order. */
static uint64_t load_le64(const unsigned char *p) {
#if PY_LITTLE_ENDIAN
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
#else
    uint64_t v = 0;
    for (int k = 7; k >= 0; k--) {
        v = (v << 8) | p[k];
    }
    return v;
#endif
}

/* The `len` (< 8) bytes at p as the low bytes of a word, the rest zero. */
static uint64_t load_le_tail(const unsigned char *p, Py_ssize_t len) {
    uint64_t v = 0;
    for (Py_ssize_t k = 0; k < len; k++) {
        v |= (uint64_t)p[k] << (8 * k);
    }
    return v;
}

static void store_le64(unsigned char *p, uint64_t v) {
#if PY_LITTLE_ENDIAN
    memcpy(p, &v, 8);
#else
    for (int k = 0; k < 8; k++) {
        p[k] = (unsigned char)(v >> (8 * k));
    }
#endif
}

typedef struct {
    Py_ssize_t low_len, high_len; /* bytes of the low part and of the high bitvector */
    uint64_t low_bits, high_bits; /* bits of each */
} EfLayout;

/* The payload layout for n positions in [0, numel) with L low bits; -1 with an exception when
 * an argument is out of range or the payload could not be addressed. */
static int ef_layout(Py_ssize_t n, Py_ssize_t numel, int L, EfLayout *lay) {
    if (n < 0 || numel < 0) {
        PyErr_Format(PyExc_ValueError, "n (%zd) and numel (%zd) must be >= 0", n, numel);
        return -1;
    }
    if (L < 0 || L > 63) {
        PyErr_Format(PyExc_ValueError, "low_bits must be in [0, 63], not %d", L);
        return -1;
    }
    if (L && (uint64_t)n > UINT64_MAX / (uint64_t)L) {
        PyErr_SetString(PyExc_OverflowError, "Elias-Fano low part too large");
        return -1;
    }
    lay->low_bits = (uint64_t)n * (uint64_t)L;
    lay->high_bits = (uint64_t)n + ((uint64_t)numel >> L) + 1; /* both < 2**63: no wrap */
    uint64_t low_len = lay->low_bits / 8 + (lay->low_bits % 8 != 0);
    uint64_t high_len = lay->high_bits / 8 + (lay->high_bits % 8 != 0);
    if (low_len > (uint64_t)PY_SSIZE_T_MAX || high_len > (uint64_t)PY_SSIZE_T_MAX - low_len) {
        PyErr_SetString(PyExc_OverflowError, "Elias-Fano payload too large");
        return -1;
    }
    lay->low_len = (Py_ssize_t)low_len;
    lay->high_len = (Py_ssize_t)high_len;
    return 0;
}

/* The Elias-Fano loops stream tens of MB (the int64 positions, the payload) and on the 2-core
 * Xeon of BENCHMARKS.md the hardware prefetcher alone left them waiting on memory: half of
 * the encode's ~65 ms for 16M positions (1 GiB of bf16 at 3 %), gone with a hint EF_AHEAD
 * bytes ahead of each stream. A hint never faults; its address is formed as an integer, so
 * no pointer runs past its buffer. */
#if defined(__GNUC__) || defined(__clang__)
#define EF_PREFETCH(p, rw) __builtin_prefetch((const void *)((uintptr_t)(p) + EF_AHEAD), rw)
#else
#define EF_PREFETCH(p, rw) ((void)0)
#endif
#define EF_AHEAD 2048

/* Encode n int64 positions into low (lay->low_len bytes) and high (lay->high_len bytes).
 * Returns -1, or the index of the first position that is not strictly increasing within
 * [0, numel) (its value in *bad; the output is then incomplete). */
#if defined(__GNUC__) || defined(__clang__)
#define EF_INLINE static inline __attribute__((always_inline))
#else
#define EF_INLINE static inline
#endif
EF_INLINE Py_ssize_t ef_pack_body(const char *pos, Py_ssize_t n, uint64_t numel, int L,
                                  const EfLayout *lay, unsigned char *low, unsigned char *high,
                                  int64_t *bad) {
    const uint64_t mask = ((uint64_t)1 << L) - 1; /* L <= 63 */
    const uint64_t words = (uint64_t)lay->high_len / 8; /* whole 64-bit words of high */
    uint64_t acc = 0;                              /* low bits not yet stored */
    unsigned fill = 0;                             /* how many (< 64) */
    int64_t prev = -1;
    /* The high part's current 64-bit word hword (word hat; its bits come in increasing order),
     * stored after every position while it is a whole word of high: no branch on the word
     * changing, which mispredicted once per ~30 positions. The words skipped stay zero; the
     * last, partial word is stored byte by byte at the end. */
    uint64_t hword = 0, hat = 0;
    memset(high, 0, (size_t)lay->high_len);
    for (Py_ssize_t j = 0; j < n; j++) {
        int64_t p;
        EF_PREFETCH(pos + j * 8, 0);
        memcpy(&p, pos + j * 8, 8);
        if (p <= prev || (uint64_t)p >= numel) {
            *bad = p;
            return j;
        }
        prev = p;
        const uint64_t v = (uint64_t)p & mask;
        acc |= v << fill;
        fill += (unsigned)L;
        if (fill >= 64) { /* the word is full: store it, keep v's bits that did not fit */
            store_le64(low, acc);
            low += 8;
            fill -= 64;
            acc = v >> (L - fill); /* L - fill = 64 - old fill, in [1, 63] as L <= 63 */
        }
        const uint64_t bit = ((uint64_t)p >> L) + (uint64_t)j; /* < lay->high_bits */
        const uint64_t w = bit >> 6;
        hword = (w == hat ? hword : 0) | (uint64_t)1 << (bit & 63);
        hat = w;
        if (w < words) {
            store_le64(high + w * 8, hword);
        }
    }
    for (; fill > 0; fill = fill > 8 ? fill - 8 : 0) {
        *low++ = (unsigned char)acc;
        acc >>= 8;
    }
    if (hat >= words) { /* the partial last word: its bytes in high */
        for (uint64_t q = hat * 8; hword; q++, hword >>= 8) {
            high[q] = (unsigned char)hword;
        }
    }
    return -1;
}

/* The loop above compiled for BMI1/BMI2 too (shlx/shrx for the shifts by L and fill, bzhi for
 * the mask), used where the CPU has them and the SIMD kernels are on, as the decode's
 * (ef_unpack_fast): the same bytes and the same refusals. */
#ifdef HAVE_SIMD
__attribute__((target("bmi,bmi2"))) static Py_ssize_t
ef_pack_bmi2(const char *pos, Py_ssize_t n, uint64_t numel, int L, const EfLayout *lay,
             unsigned char *low, unsigned char *high, int64_t *bad) {
    return ef_pack_body(pos, n, numel, L, lay, low, high, bad);
}
#endif

/* The baseline build of the loop, kept out of line: inlined into the dispatch below, GCC
 * compiled it ~30 % slower (1 GiB of bf16 at 3 %: 28.6 -> 37.6 ms). */
#if defined(__GNUC__) || defined(__clang__)
__attribute__((noinline))
#endif
static Py_ssize_t
ef_pack_base(const char *pos, Py_ssize_t n, uint64_t numel, int L, const EfLayout *lay,
             unsigned char *low, unsigned char *high, int64_t *bad) {
    return ef_pack_body(pos, n, numel, L, lay, low, high, bad);
}

static Py_ssize_t ef_pack(const char *pos, Py_ssize_t n, uint64_t numel, int L,
                          const EfLayout *lay, unsigned char *low, unsigned char *high,
                          int64_t *bad) {
#ifdef HAVE_SIMD
    if (simd_enabled && ef_bmi2) {
        return ef_pack_bmi2(pos, n, numel, L, lay, low, high, bad);
    }
#endif
    return ef_pack_base(pos, n, numel, L, lay, low, high, bad);
}

enum { EF_OK, EF_LOW_TAIL, EF_HIGH_TAIL, EF_COUNT, EF_ORDER };

/* Where a decode stands: the high part's word w (its bits not yet decoded in word), i
 * positions decoded, the last one prev and its high part hi. */
typedef struct {
    Py_ssize_t w, i;
    uint64_t word, prev, hi;
} EfCursor;

/* The first positions of a payload whose high bits are counted, fast: each low part read with
 * one 8-byte load at its bit offset i*L (L <= 56), for the positions whose load stays inside
 * the low part (i < safe <= n), and the order checked by a flag. Stops at i == safe or at the
 * end of the high part, leaving *c there. Returns nonzero if any position is not above the one
 * before; the caller also checks c->hi and c->prev against numel (both only grow). */
EF_INLINE uint64_t ef_unpack_fast_body(const unsigned char *low, const unsigned char *high,
                                       Py_ssize_t words, Py_ssize_t tail, Py_ssize_t safe,
                                       int L, char *out, EfCursor *c) {
    const uint64_t mask = ((uint64_t)1 << L) - 1;
    uint64_t word = 0, at = 0, hi = 0, p = 0, next = 0, bad = 0; /* at: i * L */
    Py_ssize_t w = 0, i = 0;
    for (; w <= words; w++) {
        word = w < words ? load_le64(high + w * 8) : load_le_tail(high + w * 8, tail);
        EF_PREFETCH(high + w * 8, 0);
        EF_PREFETCH(low + at / 8, 0);
        while (word) {
            if (i >= safe) {
                goto stop;
            }
            EF_PREFETCH(out + i * 8, 1);
            hi = (uint64_t)w * 64 + CTZ64(word) - (uint64_t)i;
            word &= word - 1;
            p = hi << L | (load_le64(low + at / 8) >> (at % 8) & mask); /* at % 8 + L <= 63 */
            at += (unsigned)L;
            bad |= p < next;
            next = p + 1;
            memcpy(out + i * 8, &p, 8);
            i++;
        }
    }
stop:
    c->w = w;
    c->word = word;
    c->i = i;
    c->prev = p;
    c->hi = hi;
    return bad;
}

/* The loop above compiled for BMI1/BMI2 too (shlx/shrx take the shift counts without the
 * flags' dependency, tzcnt and blsr the high part's bits), used where the CPU has them and
 * the SIMD kernels are on (ef_bmi2, simd_enabled): on the Xeon of BENCHMARKS.md the decode of
 * one version's positions at 1 GiB of bf16 (16M positions, 3 %) took 30.4 -> 26.7 ms. The
 * build stays baseline x86-64; the positions and every check are the same. */
#ifdef HAVE_SIMD
__attribute__((target("bmi,bmi2"))) static uint64_t
ef_unpack_fast_bmi2(const unsigned char *low, const unsigned char *high, Py_ssize_t words,
                    Py_ssize_t tail, Py_ssize_t safe, int L, char *out, EfCursor *c) {
    return ef_unpack_fast_body(low, high, words, tail, safe, L, out, c);
}
#endif

static uint64_t ef_unpack_fast(const unsigned char *low, const unsigned char *high,
                               Py_ssize_t words, Py_ssize_t tail, Py_ssize_t safe, int L,
                               char *out, EfCursor *c) {
#ifdef HAVE_SIMD
    if (simd_enabled && ef_bmi2) {
        return ef_unpack_fast_bmi2(low, high, words, tail, safe, L, out, c);
    }
#endif
    return ef_unpack_fast_body(low, high, words, tail, safe, L, out, c);
}

/* Decode into out (n int64). Never reads or writes outside the given lengths, whatever the
 * bytes (even if they change meanwhile). *count: set bits of the high part (for EF_COUNT).
 * The positions up to the last 8 bytes of the low part go through ef_unpack_fast; if its
 * checks fail, all are decoded again here one by one, whose first failed check is the error. */
static int ef_unpack(const unsigned char *low, const unsigned char *high, const EfLayout *lay,
                     Py_ssize_t n, uint64_t numel, int L, char *out, Py_ssize_t *count) {
    const unsigned low_tail = (unsigned)(lay->low_bits % 8);
    const unsigned high_tail = (unsigned)(lay->high_bits % 8);
    if (low_tail && low[lay->low_len - 1] >> low_tail) {
        return EF_LOW_TAIL;
    }
    if (high_tail && high[lay->high_len - 1] >> high_tail) {
        return EF_HIGH_TAIL;
    }
    const Py_ssize_t words = lay->high_len / 8, tail = lay->high_len % 8;
    Py_ssize_t c = 0;
    for (Py_ssize_t w = 0; w < words; w++) {
        EF_PREFETCH(high + w * 8, 0);
        c += POPCOUNT64(load_le64(high + w * 8));
    }
    c += POPCOUNT64(load_le_tail(high + words * 8, tail));
    *count = c;
    if (c != n) {
        return EF_COUNT;
    }
    const uint64_t mask = ((uint64_t)1 << L) - 1, top = numel >> L;
    EfCursor cur = {.w = 0, .i = 0, .prev = 0, .hi = 0};
    cur.word = words ? load_le64(high) : load_le_tail(high, tail);
    if (L >= 1 && L <= 56 && lay->low_len >= 8) {
        /* the loads at bit i*L <= (low_len - 8) * 8 stay inside; low_bits < 2**64: no wrap */
        const uint64_t fit = (uint64_t)(lay->low_len - 8) * 8 / (uint64_t)L + 1;
        const Py_ssize_t safe = fit < (uint64_t)n ? (Py_ssize_t)fit : n;
        EfCursor fast;
        /* fit < n (L <= 56): the last position is always decoded below, which would catch
         * a high part past top or a position past numel too; checked here all the same */
        if (!ef_unpack_fast(low, high, words, tail, safe, L, out, &fast) && fast.hi <= top &&
            fast.prev < numel) { /* then no shift overflowed and every position is in range */
            cur = fast;
        }
    }
    /* the rest one by one, from cur */
    const uint64_t at = (uint64_t)cur.i * (uint64_t)L; /* < low_bits */
    const unsigned char *src = low + at / 8, *src_end = low + lay->low_len;
    uint64_t acc = 0, prev = cur.prev; /* acc: the next `have` low bits, already loaded */
    unsigned have = 0;
    if (at % 8) {
        acc = (uint64_t)(*src++ >> (at % 8));
        have = 8 - (unsigned)(at % 8);
    }
    Py_ssize_t i = cur.i, w = cur.w;
    uint64_t word = cur.word;
    for (;;) {
        EF_PREFETCH(src, 0);
        while (word) {
            const uint64_t hi = (uint64_t)w * 64 + CTZ64(word) - (uint64_t)i;
            word &= word - 1;
            if (i >= n) {
                return EF_COUNT; /* the buffer changed since it was counted */
            }
            EF_PREFETCH(out + i * 8, 1);
            uint64_t lo = 0;
            if (have >= (unsigned)L) {
                lo = acc & mask;
                acc = L ? acc >> L : acc; /* have >= L; L <= 63 */
                have -= (unsigned)L;
            } else { /* have < L: take the rest from the next (zero-padded) word */
                uint64_t next;
                if (src_end - src >= 8) {
                    next = load_le64(src);
                    src += 8;
                } else {
                    next = load_le_tail(src, src_end - src);
                    src = src_end;
                }
                const unsigned need = (unsigned)L - have; /* in [1, 63] */
                lo = (acc | next << have) & mask;
                acc = next >> need;
                have = 64 - need;
            }
            if (hi > top) { /* then (hi << L) >= numel, and the shift could overflow */
                return EF_ORDER;
            }
            const uint64_t p = hi << L | lo;
            if (p >= numel || (i > 0 && p <= prev)) {
                return EF_ORDER;
            }
            const int64_t sp = (int64_t)p;
            memcpy(out + i * 8, &sp, 8);
            prev = p;
            i++;
        }
        if (++w > words) {
            break;
        }
        word = w < words ? load_le64(high + w * 8) : load_le_tail(high + w * 8, tail);
    }
    return i == n ? EF_OK : EF_COUNT;
}

static PyObject *ef_encode(PyObject *self, PyObject *args) {
    PyObject *pos_o, *out = NULL;
    Py_ssize_t numel, n, bad_at = -1;
    int L, header = -1;
    int64_t bad = 0;
    EfLayout lay;
    if (!PyArg_ParseTuple(args, "Oni|i:ef_encode", &pos_o, &numel, &L, &header)) {
        return NULL;
    }
    if (header < -1 || header > 255) {
        PyErr_Format(PyExc_ValueError, "header must be a byte (0..255) or -1, not %d", header);
        return NULL;
    }
    const Py_ssize_t head = header >= 0; /* bytes before the payload */
    Buffers b = {.held = 0};
    Py_buffer *pos;
    if (!(pos = acquire(&b, pos_o, "positions", 0))) {
        goto fail;
    }
    if ((n = int64s(pos, "positions")) < 0) {
        goto fail;
    }
    if (ef_layout(n, numel, L, &lay) < 0) {
        goto fail;
    }
    if (lay.low_len + lay.high_len > PY_SSIZE_T_MAX - head) {
        PyErr_SetString(PyExc_OverflowError, "Elias-Fano payload too large");
        goto fail;
    }
    if (!(out = PyBytes_FromStringAndSize(NULL, head + lay.low_len + lay.high_len))) {
        goto fail;
    }
    {
        unsigned char *dst = (unsigned char *)PyBytes_AS_STRING(out) + head;
        if (head) {
            dst[-1] = (unsigned char)header;
        }
        const char *pp = pos->buf;
        NOGIL_BEGIN(pos->len);
        bad_at = ef_pack(pp, n, (uint64_t)numel, L, &lay, dst, dst + lay.low_len, &bad);
        NOGIL_END;
    }
    if (bad_at >= 0) {
        PyErr_Format(PyExc_ValueError,
                     "positions[%zd] = %lld: positions must be strictly increasing within "
                     "[0, %zd)",
                     bad_at, (long long)bad, numel);
        goto fail;
    }
    release_all(&b);
    return out;
fail:
    Py_XDECREF(out);
    release_all(&b);
    return NULL;
}

static PyObject *ef_decode(PyObject *self, PyObject *args) {
    PyObject *pay_o, *out_o;
    Py_ssize_t n, numel, count = 0;
    int L, err;
    EfLayout lay;
    if (!PyArg_ParseTuple(args, "OnniO:ef_decode", &pay_o, &n, &numel, &L, &out_o)) {
        return NULL;
    }
    if (ef_layout(n, numel, L, &lay) < 0) {
        return NULL;
    }
    Buffers b = {.held = 0};
    Py_buffer *pay, *out;
    if (!(pay = acquire(&b, pay_o, "payload", 0)) ||
        !(out = acquire(&b, out_o, "out_positions", 1))) {
        goto fail;
    }
    if (pay->len != lay.low_len + lay.high_len) {
        PyErr_Format(PyExc_ValueError, "positions blob is %zd bytes, want %zd", pay->len,
                     lay.low_len + lay.high_len);
        goto fail;
    }
    if (out->len / 8 != n || out->len % 8) {
        PyErr_Format(PyExc_ValueError, "out_positions is %zd bytes, want %zd int64", out->len, n);
        goto fail;
    }
    {
        const unsigned char *pl = pay->buf;
        char *po = out->buf;
        NOGIL_BEGIN(out->len);
        err = ef_unpack(pl, pl + lay.low_len, &lay, n, (uint64_t)numel, L, po, &count);
        NOGIL_END;
    }
    switch (err) {
    case EF_OK: release_all(&b); Py_RETURN_NONE;
    case EF_LOW_TAIL:
        PyErr_Format(PyExc_ValueError, "Elias-Fano low part has bits set past its %llu bits",
                     (unsigned long long)lay.low_bits);
        break;
    case EF_HIGH_TAIL:
        PyErr_Format(PyExc_ValueError, "Elias-Fano high part has bits set past its %llu bits",
                     (unsigned long long)lay.high_bits);
        break;
    case EF_COUNT:
        PyErr_Format(PyExc_ValueError, "Elias-Fano high bits hold %zd positions, want %zd",
                     count, n);
        break;
    default:
        PyErr_Format(PyExc_ValueError, "positions not strictly increasing within [0, %zd)",
                     numel);
        break;
    }
fail:
    release_all(&b);
    return NULL;
}

/* The values of one sparse xef patch from their byte planes (n elements of width bytes, src
 * n * width bytes) into out; returns how many elements are zero (all bytes). unplanes' loops,
 * for the batched decode. */
static Py_ssize_t unplane_count(const unsigned char *src, Py_ssize_t n, Py_ssize_t width,
                                unsigned char *out) {
    Py_ssize_t zeros = 0;
    for (Py_ssize_t k = 0; k < width; k++) {
        const unsigned char *from = src + k * n;
        for (Py_ssize_t i = 0; i < n; i++) {
            out[i * width + k] = from[i];
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned char any = 0;
        for (Py_ssize_t k = 0; k < width; k++) {
            any |= out[i * width + k];
        }
        zeros += any == 0;
    }
    return zeros;
}

/* The low bits L of n positions in [0, numel): floor(log2(numel // n)), 1 <= n <= numel. */
static int ef_low_bits(Py_ssize_t n, Py_ssize_t numel) {
    uint64_t q = (uint64_t)(numel / n);
    int L = -1;
    while (q) {
        q >>= 1;
        L++;
    }
    return L;
}

/* xef_decode_many: see the method table. The pieces are checked in order; the first one that
 * is not valid stops the call (ValueError naming it): the caller then decodes them one by one,
 * whose errors say what is wrong. */
static PyObject *xef_decode_many(PyObject *self, PyObject *args) {
    PyObject *pos_o, *val_o, *counts_o, *numels_o, *pout_o, *vout_o;
    Py_ssize_t width;
    if (!PyArg_ParseTuple(args, "OOOOnOO:xef_decode_many", &pos_o, &val_o, &counts_o,
                          &numels_o, &width, &pout_o, &vout_o)) {
        return NULL;
    }
    if (check_width(width) < 0) {
        return NULL;
    }
    static const char *names[2] = {"positions", "values"};
    PyObject *result = NULL;
    Pairs pairs;
    Py_ssize_t k = 0, total = 0, bad = -1;
    const char *why = NULL;
    Buffers b = {.held = 0};
    if (pairs_open(&pairs, pos_o, val_o, names) < 0) {
        goto done;
    }
    k = pairs.k;
    Py_buffer *views = pairs.views;
    Py_buffer *counts, *numels, *pout, *vout;
    if (!(counts = acquire(&b, counts_o, "counts", 0)) ||
        !(numels = acquire(&b, numels_o, "numels", 0)) ||
        !(pout = acquire(&b, pout_o, "pos_out", 1)) || !(vout = acquire(&b, vout_o, "val_out", 1))) {
        goto done;
    }
    if (counts->len != 8 * k || numels->len != 8 * k) {
        PyErr_Format(PyExc_ValueError, "counts/numels (%zd/%zd bytes) must hold %zd int64",
                     counts->len, numels->len, k);
        goto done;
    }
    for (Py_ssize_t j = 0; j < k; j++) {
        if (!pairs_take(&pairs, j, 0, 0) || !pairs_take(&pairs, j, 1, 0)) {
            goto done;
        }
        int64_t n;
        memcpy(&n, (const char *)counts->buf + 8 * j, 8);
        if (n < 1 || n > PY_SSIZE_T_MAX / 8 - total) {
            PyErr_Format(PyExc_ValueError, "piece %zd: %lld positions", j, (long long)n);
            goto done;
        }
        total += (Py_ssize_t)n;
    }
    if (pout->len != 8 * total || vout->len / width != total || vout->len % width) {
        PyErr_Format(PyExc_ValueError,
                     "pos_out/val_out (%zd/%zd bytes) must hold exactly %zd elements", pout->len,
                     vout->len, total);
        goto done;
    }
    {
        char *pp = pout->buf;
        unsigned char *pv = vout->buf;
        NOGIL_BEGIN(total * (8 + width));
        Py_ssize_t at = 0;
        for (Py_ssize_t j = 0; j < k && !why; j++) {
            const Py_buffer *pb = &views[2 * j], *vb = &views[2 * j + 1];
            const unsigned char *blob = pb->buf;
            int64_t n, numel;
            memcpy(&n, (const char *)counts->buf + 8 * j, 8);
            memcpy(&numel, (const char *)numels->buf + 8 * j, 8);
            EfLayout lay;
            Py_ssize_t count = 0;
            int L;
            bad = j;
            if (numel < n || numel > PY_SSIZE_T_MAX) {
                why = "changed exceeds numel";
            } else if (pb->len < 1 || blob[0] != (L = ef_low_bits((Py_ssize_t)n, (Py_ssize_t)numel))) {
                why = "Elias-Fano header (compressed payloads come uncompressed)";
            } else if (vb->len != n * width) {
                why = "values are not changed * width bytes";
            } else {
                /* ef_layout cannot fail here (1 <= n <= numel, L <= 62): both sizes fit */
                lay.low_bits = (uint64_t)n * (uint64_t)L;
                lay.high_bits = (uint64_t)n + ((uint64_t)numel >> L) + 1;
                lay.low_len = (Py_ssize_t)(lay.low_bits / 8 + (lay.low_bits % 8 != 0));
                lay.high_len = (Py_ssize_t)(lay.high_bits / 8 + (lay.high_bits % 8 != 0));
                if (pb->len - 1 != lay.low_len + lay.high_len) {
                    why = "positions blob size";
                } else if (ef_unpack(blob + 1, blob + 1 + lay.low_len, &lay, (Py_ssize_t)n,
                                     (uint64_t)numel, L, pp + 8 * at, &count) != EF_OK) {
                    why = "Elias-Fano payload";
                } else if (unplane_count(vb->buf, (Py_ssize_t)n, width, pv + width * at)) {
                    why = "a zero XOR";
                }
            }
            at += (Py_ssize_t)n;
        }
        NOGIL_END;
    }
    if (why) {
        PyErr_Format(PyExc_ValueError, "piece %zd: %s", bad, why);
        goto done;
    }
    result = Py_None;
    Py_INCREF(result);
done:
    release_all(&b);
    pairs_close(&pairs);
    return result;
}

/* simd(enabled=None) -> bool: whether the AVX2 diff is used; True/False switch it (True only
 * where the CPU has it: else ValueError). */
static PyObject *simd(PyObject *self, PyObject *args) {
    PyObject *want = Py_None;
    if (!PyArg_ParseTuple(args, "|O:simd", &want)) {
        return NULL;
    }
#ifdef HAVE_DIFF_AVX2
    if (want != Py_None) {
        int on = PyObject_IsTrue(want);
        if (on < 0) {
            return NULL;
        }
        if (on && !(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi"))) {
            PyErr_SetString(PyExc_ValueError, "this CPU has no AVX2/BMI1");
            return NULL;
        }
        simd_enabled = on;
    }
    return PyBool_FromLong(simd_enabled);
#else
    if (want != Py_None && PyObject_IsTrue(want)) {
        PyErr_SetString(PyExc_ValueError, "built without the AVX2 diff (not x86-64 GCC/Clang)");
        return NULL;
    }
    Py_RETURN_FALSE;
#endif
}

/* ------------------------------------------------------------------------ page population */

#ifdef __linux__
#include <sys/mman.h>
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux >= 5.14; older headers do not name it */
#endif
#endif

/* madvise(MADV_POPULATE_WRITE) over [start, start + length) of a writable buffer (an mmap):
 * every page faulted in writable, with the GIL released (Python's mmap.madvise holds it for
 * the whole call, tens of ms per GiB of a file mapping, stalling every other thread). */
static PyObject *populate_write(PyObject *self, PyObject *args) {
    PyObject *obj;
    Py_ssize_t start, length;
    (void)self;
    if (!PyArg_ParseTuple(args, "Onn:populate_write", &obj, &start, &length)) {
        return NULL;
    }
    Buffers b = {.held = 0};
    Py_buffer *v = acquire(&b, obj, "buffer", 1);
    if (v == NULL) {
        release_all(&b);
        return NULL;
    }
    if (start < 0 || length < 0 || start > v->len || length > v->len - start) {
        PyErr_Format(PyExc_ValueError, "range [%zd, %zd + %zd) is outside a buffer of %zd bytes",
                     start, start, length, v->len);
        release_all(&b);
        return NULL;
    }
#ifdef __linux__
    char *at = (char *)v->buf + start;
    const long page = sysconf(_SC_PAGESIZE);
    if (page <= 0 || (uintptr_t)at % (uintptr_t)page != 0) {
        PyErr_Format(PyExc_ValueError, "start %zd is not at a page boundary of the buffer", start);
        release_all(&b);
        return NULL;
    }
    int rc, err = 0;
    Py_BEGIN_ALLOW_THREADS
    rc = madvise(at, (size_t)length, MADV_POPULATE_WRITE);
    if (rc != 0) {
        err = errno;
    }
    Py_END_ALLOW_THREADS
    release_all(&b);
    if (rc != 0) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
#else
    release_all(&b);
    errno = ENOSYS;
    return PyErr_SetFromErrno(PyExc_OSError);
#endif
}

/* --------------------------------------------------------------------------------- module */

static PyMethodDef methods[] = {
    {"diff_many", diff_many, METH_VARARGS,
     "diff_many(olds, news, width, pos_out, new_out, xor_out, counts_out, digests_out, bits=0, "
     "advance=False) -> count: diff_extract of many pairs in one call, outputs one after "
     "another, counts_out[j] each pair's; bits 64/128: each pair's XXH3 digest in "
     "digests_out[16 j:]."},
    {"diff_extract", diff_extract, METH_VARARGS,
     "diff_extract(old, new, width, start, pos_out, new_out, xor_out, hasher=None, "
     "advance=False) -> (count, next_start)\n\n"
     "Write the int64 index, new element and old^new of each differing element from `start`\n"
     "until the outputs (capacity len(pos_out) // 8) are full or the end is reached; feed the\n"
     "new bytes scanned to `hasher`; with `advance`, copy each differing element into old."},
    {"patch_hash", patch_hash, METH_VARARGS,
     "patch_hash(flat, width, positions, values, is_xor, lo, hi, hasher, old_out=None) -> "
     "None\n\n"
     "Patch flat[lo:hi) (positions strictly increasing there, or None: every element) block by\n"
     "block, feeding each patched block to `hasher` (an Xxh3 or None); `old_out` (as long as\n"
     "values) gets the elements each write replaces, in the same pass."},
    {"journal_patch_hash", journal_patch_hash, METH_VARARGS,
     "journal_patch_hash(flat, width, positions, values, is_xor, lo, hi, hasher, fd, values_at, "
     "progress_at, done) -> None\n\n"
     "patch_hash() that saves what it overwrites first: chunk by chunk, the old values of the\n"
     "chunk's positions (or elements, positions None) are pwritten to fd at values_at +\n"
     "(done + j) * width (j: their index in positions / from lo), then done + the count saved\n"
     "so far as an int64 LE at progress_at, then the chunk is patched and hashed. OSError if\n"
     "a write fails, ValueError at a position not strictly increasing within [lo, hi): the\n"
     "chunk is not patched, the chunks before it are (saved and counted)."},
    {"xor_patch", xor_patch, METH_VARARGS,
     "xor_patch(flat, width, positions, values, old_out) -> None\n\n"
     "old_out[k] = flat[pos[k]] (unless None); flat[pos[k]] ^= values[k]. Bounds-checked first."},
    {"xor_shifted", xor_shifted, METH_VARARGS,
     "xor_shifted(flat, width, positions, pos_width, shift, values) -> None\n\n"
     "flat[pos[k] + shift] ^= values[k]; positions int32 (pos_width 4) or int64 (8).\n"
     "Bounds-checked first (nothing is written when one is outside)."},
    {"increasing", increasing, METH_VARARGS,
     "increasing(positions, pos_width, limit) -> bool\n\n"
     "Whether the int32 (4) / int64 (8) positions are >= 0, strictly increasing and < limit."},
    {"set_patch", set_patch, METH_VARARGS,
     "set_patch(flat, width, positions, values, old_out) -> None\n\n"
     "old_out[k] = flat[pos[k]] (unless None); flat[pos[k]] = values[k]. Bounds-checked first."},
    {"gather", gather, METH_VARARGS,
     "gather(flat, width, positions, out) -> None\n\n"
     "out[k] = flat[pos[k]] for every k (out holds exactly len(positions)). Bounds-checked first."},
    {"planes", planes, METH_VARARGS,
     "planes(src, width, out) -> None\n\n"
     "out = the bytes of src's width-byte elements as byte planes (all byte 0s, then 1s, ...)."},
    {"unplanes", unplanes, METH_VARARGS,
     "unplanes(src, width, out) -> int\n\n"
     "The inverse of planes(); returns how many elements of out are zero (all bytes)."},
    {"simd", simd, METH_VARARGS,
     "simd(enabled=None) -> bool\n\n"
     "Whether the AVX2 kernels are used: diff_extract's runs for 2-byte elements and XXH3's\n"
     "accumulate loop (chosen at import: the CPU has AVX2 and BMI1 and ASYNCSYNC_SIMD is not\n"
     "0), with their AVX-512 VBMI2 listing of a run's changed lanes where the CPU has it,\n"
     "and the Elias-Fano encode's and decode's BMI2 loops where the CPU has BMI2; True/False\n"
     "switch them. Results never depend on it."},
    {"ef_encode", ef_encode, METH_VARARGS,
     "ef_encode(positions, numel, low_bits, header=-1) -> bytes\n\n"
     "The uncompressed Elias-Fano payload of strictly increasing int64 positions in [0, numel)\n"
     "(after the one byte header, when 0 <= header <= 255)."},
    {"populate_write", populate_write, METH_VARARGS,
     "populate_write(buffer, start, length) -> None\n\n"
     "madvise(MADV_POPULATE_WRITE) over that byte range of a writable buffer (an mmap; start at\n"
     "a page boundary), the GIL released; OSError where the kernel refuses it."},
    {"xef_decode_many", xef_decode_many, METH_VARARGS,
     "xef_decode_many(positions, values, counts, numels, width, pos_out, val_out) -> None\n\n"
     "Decode many small sparse xef patches in one call: piece j's positions blob (its header\n"
     "byte, uncompressed Elias-Fano) and values (its byte planes, decompressed) into pos_out and\n"
     "val_out after the pieces before it, counts[j] (int64) elements of a tensor of numels[j];\n"
     "each checked as ef_decode and unplanes are (every value not zero). ValueError naming the\n"
     "first piece that is not valid."},
    {"ef_decode", ef_decode, METH_VARARGS,
     "ef_decode(payload, n, numel, low_bits, out_positions) -> None\n\n"
     "Decode an Elias-Fano payload into n int64 positions; ValueError if it is not valid."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "asyncsync.codec._native",
    .m_doc = "Fused diff, patch and gather kernels and Elias-Fano coding over the buffer "
             "protocol.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    simd_init();
    if (PyType_Ready(&Xxh3Type) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    Py_INCREF(&Xxh3Type);
    if (PyModule_AddObject(m, "Xxh3", (PyObject *)&Xxh3Type) < 0) {
        Py_DECREF(&Xxh3Type);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "JOURNAL_CHUNK_BYTES", JOURNAL_CHUNK_BYTES) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
