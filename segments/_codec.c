/* qdelay.segments._codec: the per-record loops of the storage paths, in C: framing bodies,
 * walking and routing frames, reading MESSAGE records back, writing DISPATCH frames, and
 * making and parsing the ack ids of deliveries (the dispatcher's and the ack path's per-delivery loops).
 *
 * The formats are those of docs/formats.md (layouts in segments/layout.h) and of the
 * Python codecs in segments/, which stay the reference: every function here has a Python
 * twin of the same signature in segments/ (the table is ``native.twins()``),
 * tests/test_codec_native.py runs both on the same inputs, and the server runs the twins
 * when this module is not built (it is an optional extension). The protobuf wire codec is
 * not here: it is qdelay/_wire.c.
 *
 * Why C: at 100-byte messages, the Python loops over each message (frame a batch, walk and
 * route it in the iterate service, read it back for dispatch) were most of the server's
 * CPU per message (docs/benchmarks.md, "Where a durable message's server CPU goes").
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>
#include <errno.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
#include <sys/uio.h>

/* xxHash from the system (Debian libxxhash-dev, set up by the Makefile), not a copy in the
 * tree. XXH_INLINE_ALL compiles XXH3 into this module from the header (no call into
 * libxxhash per frame, as fast as the copy was); without the header the build fails and
 * the optional extension is skipped, so the Python twins run. */
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "layout.h"
#include "pyint.h"

/* Append a new reference to ``list`` and give it up (the list keeps its own): -1 if ``item``
 * is NULL (its maker failed) or the append failed, with the exception set. */
static int append_new(PyObject *list, PyObject *item) {
    if (!item)
        return -1;
    int rc = PyList_Append(list, item);
    Py_DECREF(item);
    return rc;
}

/* Write one frame header (checksum over [CHECKED_FROM, HEADER_SIZE + length) computed from
 * the body in place). */
static void write_frame(unsigned char *p, unsigned kind, uint64_t seq, int64_t ts, Py_ssize_t length) {
    put_u32(p, MAGIC);
    put_u32(p + LENGTH_AT, (uint32_t)length);
    p[KIND_AT] = (unsigned char)kind;
    p[VERSION_AT] = VERSION;
    put_u16(p + FLAGS_AT, 0);
    put_u64(p + SEQUENCE_AT, seq);
    put_u64(p + TIMESTAMP_AT, (uint64_t)ts);
    put_u64(p + CHECKSUM_AT, XXH3_64bits(p + CHECKED_FROM, (size_t)(HEADER_SIZE - CHECKED_FROM + length)));
}

/* frame_bodies(out: bytearray, kind, sequence, timestamp, bodies: list[bytes], max_body) -> next sequence */
static PyObject *frame_bodies(PyObject *self, PyObject *args) {
    PyObject *out, *bodies;
    unsigned int kind;
    unsigned long long seq;
    long long ts;
    Py_ssize_t max_body;
    if (!PyArg_ParseTuple(args, "O!IKLO!n", &PyByteArray_Type, &out, &kind, &seq, &ts, &PyList_Type, &bodies,
                          &max_body))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(bodies), total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *b = PyList_GET_ITEM(bodies, i);
        if (!PyBytes_Check(b)) {
            PyErr_Format(PyExc_TypeError, "bodies[%zd] is not bytes", i);
            return NULL;
        }
        if (PyBytes_GET_SIZE(b) > max_body) {
            PyErr_Format(PyExc_ValueError, "bodies[%zd] is %zd bytes, more than %zd", i, PyBytes_GET_SIZE(b), max_body);
            return NULL;
        }
        total += HEADER_SIZE + PyBytes_GET_SIZE(b);
    }
    Py_ssize_t start = PyByteArray_GET_SIZE(out);
    if (PyByteArray_Resize(out, start + total) < 0)
        return NULL;
    unsigned char *p = (unsigned char *)PyByteArray_AS_STRING(out) + start;
    for (Py_ssize_t i = 0; i < n; i++, seq++) {
        PyObject *b = PyList_GET_ITEM(bodies, i);
        Py_ssize_t len = PyBytes_GET_SIZE(b);
        memcpy(p + HEADER_SIZE, PyBytes_AS_STRING(b), (size_t)len);
        write_frame(p, kind, seq, ts, len);
        p += HEADER_SIZE + len;
    }
    return PyLong_FromUnsignedLongLong(seq);
}

/* scan(data, max_body) -> (end, count, starts, kinds, sequences, dues, bad)
 *
 * Walks the whole frames at the start of ``data``, verifying magic, version, length and
 * checksum. ``end``: where the last whole good frame ends. ``starts``/``sequences``/``dues``
 * are int64 arrays (bytes), ``kinds`` a uint8 array; a due is the body's first 8 bytes
 * (MESSAGE and CANCEL bodies start with it; 0 for a shorter body). ``bad``: the offset of a
 * frame failing its checks, or -1. A frame cut by the end of ``data`` just ends the walk.
 */
static PyObject *scan(PyObject *self, PyObject *args) {
    Py_buffer buf;
    Py_ssize_t max_body;
    if (!PyArg_ParseTuple(args, "y*n", &buf, &max_body))
        return NULL;
    const unsigned char *data = buf.buf;
    Py_ssize_t size = buf.len, pos = 0, count = 0, bad = -1;
    /* a frame is at least HEADER_SIZE bytes: this bounds the count */
    Py_ssize_t cap = size / HEADER_SIZE + 1;
    PyObject *starts = PyBytes_FromStringAndSize(NULL, cap * 8);
    PyObject *kinds = PyBytes_FromStringAndSize(NULL, cap);
    PyObject *seqs = PyBytes_FromStringAndSize(NULL, cap * 8);
    PyObject *dues = PyBytes_FromStringAndSize(NULL, cap * 8);
    if (!starts || !kinds || !seqs || !dues)
        goto fail;
    unsigned char *st = (unsigned char *)PyBytes_AS_STRING(starts), *kd = (unsigned char *)PyBytes_AS_STRING(kinds);
    unsigned char *sq = (unsigned char *)PyBytes_AS_STRING(seqs), *du = (unsigned char *)PyBytes_AS_STRING(dues);
    Py_BEGIN_ALLOW_THREADS
    while (pos + HEADER_SIZE <= size) {
        const unsigned char *p = data + pos;
        uint32_t length = get_u32(p + LENGTH_AT);
        if (get_u32(p) != MAGIC || p[VERSION_AT] != VERSION || (Py_ssize_t)length > max_body) {
            bad = pos;
            break;
        }
        Py_ssize_t end = pos + HEADER_SIZE + (Py_ssize_t)length;
        if (end > size)
            break;
        if (XXH3_64bits(p + CHECKED_FROM, (size_t)(end - pos - CHECKED_FROM)) != get_u64(p + CHECKSUM_AT)) {
            bad = pos;
            break;
        }
        put_u64(st + 8 * count, (uint64_t)pos);
        kd[count] = p[KIND_AT];
        memcpy(sq + 8 * count, p + SEQUENCE_AT, 8);
        if (length >= 8)
            memcpy(du + 8 * count, p + HEADER_SIZE, 8);
        else
            put_u64(du + 8 * count, 0);
        count++;
        pos = end;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&buf);
    if (_PyBytes_Resize(&starts, count * 8) < 0 || _PyBytes_Resize(&kinds, count) < 0 ||
        _PyBytes_Resize(&seqs, count * 8) < 0 || _PyBytes_Resize(&dues, count * 8) < 0) {
        Py_XDECREF(starts); Py_XDECREF(kinds); Py_XDECREF(seqs); Py_XDECREF(dues);
        return NULL;
    }
    return Py_BuildValue("(nnNNNNn)", pos, count, starts, kinds, seqs, dues, bad);
fail:
    PyBuffer_Release(&buf);
    Py_XDECREF(starts); Py_XDECREF(kinds); Py_XDECREF(seqs); Py_XDECREF(dues);
    return NULL;
}

/* ---- route: the iterate service's copy of a read into per-bucket buffers ---- */

typedef struct {
    long long bucket;
    PyObject *seg;     /* the bucket's schedule segment (a new reference) */
    PyObject *buf;     /* its write-behind bytearray (a new reference), or NULL until needed */
    long long last;    /* highest sequence it holds, this call's appends included */
    Py_ssize_t bytes;  /* the bytes this call copies into its buffer */
    Py_ssize_t fill;   /* where the next of them goes (the second pass) */
    Py_ssize_t size;   /* the buffer's size before this call, once grown (else -1) */
    int used, touched;
} Slot;

typedef struct {
    Slot *slots;
    Py_ssize_t cap, count;
} Table;

static Slot *table_find(Table *t, long long bucket) {
    size_t mask = (size_t)t->cap - 1, h = ((size_t)bucket * 0x9E3779B97F4A7C15ull) & mask;
    while (t->slots[h].used && t->slots[h].bucket != bucket)
        h = (h + 1) & mask;
    return &t->slots[h];
}

static int table_grow(Table *t) {
    Table bigger = {PyMem_Calloc((size_t)t->cap * 2, sizeof(Slot)), t->cap * 2, 0};
    if (!bigger.slots)
        return -1;
    for (Py_ssize_t i = 0; i < t->cap; i++)
        if (t->slots[i].used) {
            *table_find(&bigger, t->slots[i].bucket) = t->slots[i];
            bigger.count++;
        }
    PyMem_Free(t->slots);
    *t = bigger;
    return 0;
}

static inline long long floor_div(long long a, long long b) { long long q = a / b; return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q; }

/* Make room for ``extra`` more bytes in ``buf`` (a bytearray) and return where they go: its
 * size grows by ``extra``. A bytearray grows by an eighth past its size, or to the exact
 * size for a larger step; a write-behind buffer grows by a few KiB a step up to ~100 KiB,
 * and each realloc copied the whole buffer (route's memcpy and realloc were ~0.2 us a
 * message of the iterate thread's ~1.4). Growing to twice the size needed (and then
 * setting the size, which a bytearray does in place while the size stays above half its
 * allocation) copies each byte about once more in all. */
static Py_ssize_t buffer_grow(PyObject *buf, Py_ssize_t extra) {
    PyByteArrayObject *b = (PyByteArrayObject *)buf;
    Py_ssize_t at = PyByteArray_GET_SIZE(buf), want = at + extra;
    if (b->ob_exports == 0 && b->ob_bytes != NULL && b->ob_start == b->ob_bytes && want < b->ob_alloc) {
        /* room in its allocation: the size set as PyByteArray_Resize's own quick path sets it,
         * which instead gives the allocation back while the size is under half of it (a
         * spare buffer taken over, bytearray_empty_keep, would shrink to its first frames) */
        Py_SET_SIZE(buf, want);
        b->ob_bytes[want] = '\0';
        return at;
    }
    if (want >= ((PyByteArrayObject *)buf)->ob_alloc && want < PY_SSIZE_T_MAX / 2 &&
        PyByteArray_Resize(buf, 2 * want) < 0)
        return -1;
    if (PyByteArray_Resize(buf, want) < 0)
        return -1;
    return at;
}

/* Empty ``buf`` (a bytearray) but keep its allocation: PyByteArray_Resize to 0 gives the
 * memory back, and a write-behind buffer grown again from nothing faults in fresh pages and
 * reallocs its way up each checkpoint. One with buffers exported is emptied the usual way. */
static int bytearray_empty_keep(PyObject *buf) {
    PyByteArrayObject *b = (PyByteArrayObject *)buf;
    if (b->ob_exports > 0 || b->ob_bytes == NULL)
        return PyByteArray_Resize(buf, 0);
    b->ob_start = b->ob_bytes;
    Py_SET_SIZE(buf, 0);
    b->ob_bytes[0] = '\0';
    return 0;
}

/* route(data, end, starts, kinds, seqs, dues, scale, near, behind, segment_of, spares, segments)
 *   -> (handed, messages, cancels, duplicates, unknown, copied, added)
 *
 * For each frame (the arrays come from scan()): a MESSAGE or CANCEL goes to its due
 * bucket (UTC minute rounded down to ``scale``) unless that bucket's segment already
 * holds its sequence (a replay); its bytes are appended to ``behind[bucket]`` (a
 * bytearray: when missing, the last of ``spares``, a list of buffers written out before,
 * emptied with its allocation kept, or a new one). ``segments`` (a dict, bucket -> segment:
 * the schedule log's) gives the segment, or ``segment_of(bucket)`` where it has none (a
 * Python call a bucket and a read was ~1.5 us, 60 of them a step of bench.compare's ingest), whose
 * ``last_sequence`` is read once and written back at the end. ``handed``: (index,
 * bucket, offset in its buffer) of the copied records of buckets <= ``near`` (all when
 * None) and of every CANCEL. ``unknown``: indexes of frames of another kind (skipped).
 * Two passes: the first finds each frame's bucket and whether it is copied, and sums the
 * bytes of each bucket (every segment_of call, every check, before any buffer changes);
 * each buffer then grows once (buffer_grow), and the second copies.
 * The Python twin is segments/reader.py ``route_py``.
 */
static PyObject *route(PyObject *self, PyObject *args) {
    Py_buffer data, sb, kb, qb, db;
    Py_ssize_t end;
    long long scale;
    PyObject *near_obj, *behind, *segment_of, *spares, *segments;
    if (!PyArg_ParseTuple(args, "y*ny*y*y*y*LOO!OO!O!", &data, &end, &sb, &kb, &qb, &db, &scale, &near_obj,
                          &PyDict_Type, &behind, &segment_of, &PyList_Type, &spares, &PyDict_Type, &segments))
        return NULL;
    PyObject *result = NULL, *handed = PyList_New(0), *unknown = PyList_New(0);
    Table t = {NULL, 0, 0};
    long long near = LLONG_MAX, messages = 0, cancels = 0, dups = 0, copied = 0, added = 0;
    long long *bucket_of = NULL; /* each frame's bucket, or LLONG_MIN: not copied */
    Py_ssize_t n = sb.len / 8;
    const int64_t *starts = sb.buf, *seqs = qb.buf, *dues = db.buf;
    const unsigned char *kinds = kb.buf, *bytes = data.buf;
    if (!handed || !unknown)
        goto done;
    if (kb.len != n || qb.len / 8 != n || db.len / 8 != n || end > data.len || scale < 1 ||
        (n > 0 && (starts[0] < 0 || starts[n - 1] >= end))) {
        PyErr_SetString(PyExc_ValueError, "route: arrays do not match the data");
        goto done;
    }
    if (near_obj != Py_None) {
        near = AS_I64(near_obj);
        if (near == -1 && PyErr_Occurred())
            goto done;
    }
    t.cap = 64;
    if (!(t.slots = PyMem_Calloc((size_t)t.cap, sizeof(Slot))) ||
        !(bucket_of = PyMem_Malloc((size_t)(n > 0 ? n : 1) * sizeof(long long)))) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned kind = kinds[i];
        bucket_of[i] = LLONG_MIN;
        if (kind != 1 && kind != 2) {
            if (append_new(unknown, PyLong_FromSsize_t(i)) < 0) {
                goto done;
            }
            continue;
        }
        if (kind == 1)
            messages++;
        else
            cancels++;
        long long minute = floor_div(dues[i], 60000);
        long long bucket = minute - (minute - floor_div(minute, scale) * scale);
        Slot *slot = table_find(&t, bucket);
        if (!slot->used) {
            if (t.count * 2 >= t.cap) {
                if (table_grow(&t) < 0) {
                    PyErr_NoMemory();
                    goto done;
                }
                slot = table_find(&t, bucket);
            }
            PyObject *key = PyLong_FromLongLong(bucket);
            if (!key)
                goto done;
            PyObject *seg = PyDict_GetItemWithError(segments, key);
            Py_DECREF(key);
            if (seg)
                Py_INCREF(seg);
            else if (PyErr_Occurred() || !(seg = PyObject_CallFunction(segment_of, "L", bucket)))
                goto done;
            PyObject *last = PyObject_GetAttrString(seg, "last_sequence");
            long long lastv = last ? AS_I64(last) : -1;
            Py_XDECREF(last);
            if (!last || (lastv == -1 && PyErr_Occurred())) {
                Py_DECREF(seg);
                goto done;
            }
            slot->used = 1;
            slot->bucket = bucket;
            slot->seg = seg;
            slot->last = lastv;
            slot->buf = NULL;
            slot->touched = 0;
            slot->bytes = 0;
            slot->size = -1;
            t.count++;
        }
        if (seqs[i] <= slot->last) {
            dups++;
            continue;
        }
        Py_ssize_t start = (Py_ssize_t)starts[i], stop = i + 1 < n ? (Py_ssize_t)starts[i + 1] : end;
        if (stop < start || stop > end) {
            PyErr_SetString(PyExc_ValueError, "route: frame offsets out of order");
            goto done;
        }
        slot->last = seqs[i];
        slot->touched = 1;
        slot->bytes += stop - start;
        bucket_of[i] = bucket;
        copied++;
        added += stop - start;
    }
    for (Py_ssize_t k = 0; k < t.cap; k++) { /* each buffer found or made, grown once */
        Slot *slot = &t.slots[k];
        if (!slot->used || !slot->touched)
            continue;
        PyObject *key = PyLong_FromLongLong(slot->bucket);
        if (!key)
            goto done;
        PyObject *buf = PyDict_GetItemWithError(behind, key);
        if (!buf && PyErr_Occurred()) {
            Py_DECREF(key);
            goto done;
        }
        if (buf) {
            if (!PyByteArray_Check(buf)) {
                Py_DECREF(key);
                PyErr_SetString(PyExc_TypeError, "route: behind holds a non-bytearray");
                goto done;
            }
            Py_INCREF(buf);
        } else {
            Py_ssize_t ns = PyList_GET_SIZE(spares);
            if (ns > 0) { /* a buffer written out before: its allocation taken over */
                buf = Py_NewRef(PyList_GET_ITEM(spares, ns - 1));
                if (!PyByteArray_Check(buf)) {
                    Py_DECREF(buf);
                    Py_DECREF(key);
                    PyErr_SetString(PyExc_TypeError, "route: spares holds a non-bytearray");
                    goto done;
                }
                if (PyList_SetSlice(spares, ns - 1, ns, NULL) < 0 || bytearray_empty_keep(buf) < 0) {
                    Py_DECREF(buf);
                    Py_DECREF(key);
                    goto done;
                }
            } else if (!(buf = PyByteArray_FromStringAndSize(NULL, 0))) {
                Py_DECREF(key);
                goto done;
            }
            if (PyDict_SetItem(behind, key, buf) < 0) {
                Py_DECREF(buf);
                Py_DECREF(key);
                goto done;
            }
        }
        Py_DECREF(key);
        slot->buf = buf;
        if ((slot->fill = buffer_grow(buf, slot->bytes)) < 0)
            goto done;
        slot->size = slot->fill;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long long bucket = bucket_of[i];
        if (bucket == LLONG_MIN)
            continue;
        Slot *slot = table_find(&t, bucket);
        Py_ssize_t start = (Py_ssize_t)starts[i], stop = i + 1 < n ? (Py_ssize_t)starts[i + 1] : end;
        Py_ssize_t at = slot->fill;
        memcpy(PyByteArray_AS_STRING(slot->buf) + at, bytes + start, (size_t)(stop - start));
        slot->fill = at + (stop - start);
        if (kinds[i] == 2 || bucket <= near) {
            if (append_new(handed, Py_BuildValue("(nLn)", i, bucket, at)) < 0) {
                goto done;
            }
        }
    }
    result = Py_BuildValue("(OLLLOLL)", handed, messages, cancels, dups, unknown, copied, added);
done:
    if (t.slots) {
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        for (Py_ssize_t k = 0; k < t.cap; k++) {
            Slot *slot = &t.slots[k];
            if (!slot->used)
                continue;
            if (!result && slot->size >= 0 && PyByteArray_Resize(slot->buf, slot->size) < 0)
                PyErr_Clear(); /* a failed call leaves every buffer as it found it (only its size) */
            if (slot->touched && result) {  /* write back what the segment now holds */
                PyObject *v = PyLong_FromLongLong(slot->last);
                if (!v || PyObject_SetAttrString(slot->seg, "last_sequence", v) < 0)
                    Py_CLEAR(result);
                Py_XDECREF(v);
            }
            Py_XDECREF(slot->seg);
            Py_XDECREF(slot->buf);
        }
        PyMem_Free(t.slots);
        if (et || ev || tb)
            PyErr_Restore(et, ev, tb);
    }
    PyMem_Free(bucket_of);
    Py_XDECREF(handed);
    Py_XDECREF(unknown);
    PyBuffer_Release(&data);
    PyBuffer_Release(&sb);
    PyBuffer_Release(&kb);
    PyBuffer_Release(&qb);
    PyBuffer_Release(&db);
    return result;
}
/* ---- the dispatch path: read records back, encode deliveries ---- */

/* read_messages(data, offsets, sequences) -> (message_ids, payloads, headers, failed)
 *
 * The MESSAGE records at ``offsets`` (int64 array) of ``data`` (one read of a schedule
 * segment), each expected to carry the sequence in ``sequences``: every check is made
 * before any byte is used (magic, version, kind, sequence, the frame inside the read,
 * the body's lengths adding up, the xxh3 checksum). Returns lists in input order:
 * message id bytes, payload bytes, the raw header block (bytes) or None; ``failed`` holds
 * the positions that failed a check (their entries are None). The Python twin is
 * segments/reader.py ``read_messages_py``.
 */
static PyObject *read_messages(PyObject *self, PyObject *args) {
    Py_buffer data, ob, qb;
    if (!PyArg_ParseTuple(args, "y*y*y*", &data, &ob, &qb))
        return NULL;
    PyObject *result = NULL, *mids = NULL, *payloads = NULL, *headers = NULL, *failed = NULL;
    Py_ssize_t n = ob.len / 8;
    const int64_t *offs = ob.buf, *seqs = qb.buf;
    const unsigned char *buf = data.buf;
    Py_ssize_t size = data.len;
    if (qb.len / 8 != n) {
        PyErr_SetString(PyExc_ValueError, "read_messages: offsets and sequences differ in length");
        goto done;
    }
    if (!(mids = PyList_New(n)) || !(payloads = PyList_New(n)) || !(headers = PyList_New(n)) ||
        !(failed = PyList_New(0)))
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t off = offs[i];
        int ok = off >= 0 && off + HEADER_SIZE + MESSAGE_FIXED <= size;
        const unsigned char *p = buf + (ok ? off : 0);
        uint32_t length = ok ? get_u32(p + LENGTH_AT) : 0;
        ok = ok && get_u32(p) == MAGIC && p[KIND_AT] == KIND_MESSAGE && p[VERSION_AT] == VERSION &&
             (int64_t)get_u64(p + SEQUENCE_AT) == seqs[i] &&
             off + HEADER_SIZE + (int64_t)length <= size && length >= MESSAGE_FIXED;
        Py_ssize_t slen = 0, mlen = 0, hlen = 0, plen = 0;
        if (ok) {
            const unsigned char *b = p + HEADER_SIZE;
            slen = b[MESSAGE_SUBJECT_LEN_AT] | (b[MESSAGE_SUBJECT_LEN_AT + 1] << 8);
            mlen = b[MESSAGE_ID_LEN_AT] | (b[MESSAGE_ID_LEN_AT + 1] << 8);
            hlen = (Py_ssize_t)get_u32(b + MESSAGE_HEADERS_LEN_AT);
            plen = (Py_ssize_t)get_u32(b + MESSAGE_PAYLOAD_LEN_AT);
            ok = (int64_t)MESSAGE_FIXED + slen + mlen + hlen + plen == (int64_t)length &&
                 XXH3_64bits(p + CHECKED_FROM, (size_t)(HEADER_SIZE - CHECKED_FROM + length)) == get_u64(p + CHECKSUM_AT);
        }
        PyObject *mid = NULL, *payload = NULL, *hdr = NULL;
        if (ok) {
            const char *b = (const char *)p + HEADER_SIZE + MESSAGE_FIXED + slen;
            mid = PyBytes_FromStringAndSize(b, mlen);
            hdr = hlen ? PyBytes_FromStringAndSize(b + mlen, hlen) : Py_NewRef(Py_None);
            payload = PyBytes_FromStringAndSize(b + mlen + hlen, plen);
            if (!mid || !hdr || !payload) {
                Py_XDECREF(mid); Py_XDECREF(hdr); Py_XDECREF(payload);
                goto done;
            }
        } else {
            if (append_new(failed, PyLong_FromSsize_t(i)) < 0) {
                goto done;
            }
            mid = Py_NewRef(Py_None);
            payload = Py_NewRef(Py_None);
            hdr = Py_NewRef(Py_None);
        }
        PyList_SET_ITEM(mids, i, mid);
        PyList_SET_ITEM(payloads, i, payload);
        PyList_SET_ITEM(headers, i, hdr);
    }
    result = PyTuple_Pack(4, mids, payloads, headers, failed);
done:
    Py_XDECREF(mids);
    Py_XDECREF(payloads);
    Py_XDECREF(headers);
    Py_XDECREF(failed);
    PyBuffer_Release(&data);
    PyBuffer_Release(&ob);
    PyBuffer_Release(&qb);
    return result;
}
/* dispatch_frames(sequences, deliver_at_ms, dispatched_at_ms, schedule_offsets, attempts,
 *                 message_ids, timestamp, outcome[, group]) -> bytes
 *
 * Whole DISPATCH frames back to back, one per position of the (equally long) columns
 * (sequences of ints; message ids bytes), each closing its message for ``group`` (bytes
 * as records.group_bytes gives them: b"" for the default group, at most 255). The Python
 * twin is records.encode_dispatch_frames_py. */
static PyObject *dispatch_frames(PyObject *self, PyObject *args) {
    PyObject *cols[6];
    long long ts;
    unsigned int outcome;
    const char *group = "";
    Py_ssize_t glen = 0;
    if (!PyArg_ParseTuple(args, "OOOOOOLI|y#", &cols[0], &cols[1], &cols[2], &cols[3], &cols[4], &cols[5], &ts,
                          &outcome, &group, &glen))
        return NULL;
    if (glen > 0xff) {
        PyErr_SetString(PyExc_ValueError, "dispatch_frames: a group name is at most 255 bytes");
        return NULL;
    }
    PyObject *fast[6] = {NULL};
    PyObject *result = NULL;
    for (int c = 0; c < 6; c++)
        if (!(fast[c] = PySequence_Fast(cols[c], "dispatch_frames: columns must be sequences")))
            goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast[0]), total = 0;
    for (int c = 1; c < 6; c++)
        if (PySequence_Fast_GET_SIZE(fast[c]) != n) {
            PyErr_SetString(PyExc_ValueError, "dispatch_frames: columns differ in length");
            goto done;
        }
    PyObject **mids = PySequence_Fast_ITEMS(fast[5]);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyBytes_Check(mids[i]) || PyBytes_GET_SIZE(mids[i]) > 0xffff) {
            PyErr_SetString(PyExc_TypeError, "dispatch_frames: message ids must be bytes of at most 65535");
            goto done;
        }
        total += HEADER_SIZE + DISPATCH_FIXED + PyBytes_GET_SIZE(mids[i]) + glen;
    }
    if (!(result = PyBytes_FromStringAndSize(NULL, total)))
        goto done;
    unsigned char *w = (unsigned char *)PyBytes_AS_STRING(result);
    PyObject **seq = PySequence_Fast_ITEMS(fast[0]), **due = PySequence_Fast_ITEMS(fast[1]),
             **at = PySequence_Fast_ITEMS(fast[2]), **off = PySequence_Fast_ITEMS(fast[3]),
             **att = PySequence_Fast_ITEMS(fast[4]);
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long sq = AS_U64(seq[i]), so = AS_U64(off[i]);
        long long d = AS_I64(due[i]), a = AS_I64(at[i]);
        unsigned long at_n = PyLong_AsUnsignedLong(att[i]);
        if (PyErr_Occurred()) {
            Py_CLEAR(result);
            goto done;
        }
        Py_ssize_t mlen = PyBytes_GET_SIZE(mids[i]);
        unsigned char *b = w + HEADER_SIZE;
        put_u64(b, (uint64_t)d);
        put_u64(b + DISPATCH_DISPATCHED_AT, (uint64_t)a);
        put_u64(b + DISPATCH_SCHEDULE_OFFSET_AT, (uint64_t)so);
        put_u32(b + DISPATCH_ATTEMPT_AT, (uint32_t)at_n);
        b[DISPATCH_OUTCOME_AT] = (unsigned char)outcome;
        b[DISPATCH_GROUP_LEN_AT] = (unsigned char)glen; /* 0: the default group, no name */
        put_u16(b + DISPATCH_ID_LEN_AT, (uint16_t)mlen);
        memcpy(b + DISPATCH_FIXED, PyBytes_AS_STRING(mids[i]), (size_t)mlen);
        memcpy(b + DISPATCH_FIXED + mlen, group, (size_t)glen); /* the group name follows the id */
        write_frame(w, KIND_DISPATCH, (uint64_t)sq, (int64_t)ts, DISPATCH_FIXED + mlen + glen);
        w += HEADER_SIZE + DISPATCH_FIXED + mlen + glen;
    }
done:
    for (int c = 0; c < 6; c++)
        Py_XDECREF(fast[c]);
    return result;
}
/* gather(data, starts, offset, width, signed) -> int64 array (bytes)
 *
 * The little-endian field of ``width`` bytes (1, 2, 4 or 8) at ``starts[i] + offset`` of
 * ``data``, for each int64 start, widened to int64 (sign-extended when ``signed``; a width
 * of 8 is always read as int64). Every field must lie inside ``data`` (ValueError if not).
 * The Spark reader gathers a kind's fixed fields this way, one column per call; the
 * Python twin is segments/reader.py ``gather_py`` (numpy fancy indexing).
 */
static PyObject *gather(PyObject *self, PyObject *args) {
    Py_buffer buf, sb;
    Py_ssize_t offset;
    int width, is_signed;
    if (!PyArg_ParseTuple(args, "y*y*nip", &buf, &sb, &offset, &width, &is_signed))
        return NULL;
    PyObject *out = NULL;
    if (width != 1 && width != 2 && width != 4 && width != 8) {
        PyErr_Format(PyExc_ValueError, "width %d is not 1, 2, 4 or 8", width);
        goto done;
    }
    if (sb.len % 8) {
        PyErr_SetString(PyExc_ValueError, "starts is not an int64 array");
        goto done;
    }
    Py_ssize_t n = sb.len / 8;
    const int64_t *st = sb.buf;
    const unsigned char *data = buf.buf;
    for (Py_ssize_t i = 0; i < n; i++)
        if (st[i] < 0 || st[i] + offset < 0 || st[i] + offset + width > buf.len) {
            PyErr_Format(PyExc_ValueError, "field at %lld + %zd runs past the data (%zd bytes)", (long long)st[i],
                         offset, buf.len);
            goto done;
        }
    out = PyBytes_FromStringAndSize(NULL, n * 8);
    if (!out)
        goto done;
    int64_t *o = (int64_t *)PyBytes_AS_STRING(out);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        const unsigned char *p = data + st[i] + offset;
        switch (width) {
        case 1: o[i] = is_signed ? (int64_t)(int8_t)p[0] : (int64_t)p[0]; break;
        case 2: { uint16_t v; memcpy(&v, p, 2); o[i] = is_signed ? (int64_t)(int16_t)v : (int64_t)v; break; }
        case 4: { uint32_t v; memcpy(&v, p, 4); o[i] = is_signed ? (int64_t)(int32_t)v : (int64_t)v; break; }
        default: { int64_t v; memcpy(&v, p, 8); o[i] = v; }
        }
    }
    Py_END_ALLOW_THREADS
done:
    PyBuffer_Release(&buf);
    PyBuffer_Release(&sb);
    return out;
}

/* ack_ids(seqs, attempts) -> list[str]
 *
 * The ack id of each delivery: "<seq>.<attempt>" (docs/api.md), one str per position of
 * the two equally long sequences of non-negative ints. The dispatcher makes one per
 * delivery per group (hundreds of thousands a second in a burst); the f-string per id was
 * the largest single cost of handing a batch out. Python twin: server/ledger.py
 * ``ack_ids_py``.
 */
static PyObject *ack_ids(PyObject *self, PyObject *args) {
    PyObject *seqs, *attempts;
    if (!PyArg_ParseTuple(args, "OO", &seqs, &attempts))
        return NULL;
    PyObject *fs = NULL, *fa = NULL, *out = NULL;
    if (!(fs = PySequence_Fast(seqs, "ack_ids: seqs must be a sequence")) ||
        !(fa = PySequence_Fast(attempts, "ack_ids: attempts must be a sequence")))
        goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fs);
    if (PySequence_Fast_GET_SIZE(fa) != n) {
        PyErr_SetString(PyExc_ValueError, "ack_ids: columns differ in length");
        goto done;
    }
    if (!(out = PyList_New(n)))
        goto done;
    PyObject **sq = PySequence_Fast_ITEMS(fs), **at = PySequence_Fast_ITEMS(fa);
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long s = AS_U64(sq[i]);
        unsigned long long a = AS_U64(at[i]);
        if (PyErr_Occurred()) {
            Py_CLEAR(out);
            goto done;
        }
        char buf[48], *p = buf + sizeof buf; /* digits written backwards from the end */
        do { *--p = (char)('0' + a % 10); a /= 10; } while (a);
        *--p = '.';
        do { *--p = (char)('0' + s % 10); s /= 10; } while (s);
        Py_ssize_t len = buf + sizeof buf - p;
        PyObject *str = PyUnicode_New(len, 127);
        if (!str) {
            Py_CLEAR(out);
            goto done;
        }
        memcpy(PyUnicode_1BYTE_DATA(str), p, (size_t)len);
        PyList_SET_ITEM(out, i, str);
    }
done:
    Py_XDECREF(fs);
    Py_XDECREF(fa);
    return out;
}

/* The sequence of a well-formed ack id (a str): 1-18 ASCII digits, a dot, 1-9 ASCII digits
 * (at most 18 digits: no int64 overflow). 0 if it is not well formed. */
static int parse_ack_id(PyObject *id, long long *seq) {
    if (PyUnicode_KIND(id) != PyUnicode_1BYTE_KIND)
        return 0;
    const unsigned char *p = PyUnicode_1BYTE_DATA(id);
    Py_ssize_t len = PyUnicode_GET_LENGTH(id), k = 0;
    long long v = 0;
    while (k < len && k < 18 && p[k] >= '0' && p[k] <= '9')
        v = v * 10 + (p[k++] - '0');
    if (k < 1 || k >= len || p[k] != '.')
        return 0;
    Py_ssize_t tail = len - k - 1;
    if (tail < 1 || tail > 9)
        return 0;
    for (Py_ssize_t j = k + 1; j < len; j++)
        if (p[j] < '0' || p[j] > '9')
            return 0;
    *seq = v;
    return 1;
}

/* ack_sequences(ids) -> list[int] | None
 *
 * The sequence of each ack id when every id is well formed: 1-18 ASCII digits, a dot, 1-9
 * ASCII digits (at most 18 digits: no int64 overflow); None if any is not (the caller then
 * takes the ids one by one). Items that are not str raise TypeError. Every ack request of
 * every group passes here. Python twin: server/ledger.py ``ack_sequences_py``.
 */
static PyObject *ack_sequences(PyObject *self, PyObject *args) {
    PyObject *ids;
    if (!PyArg_ParseTuple(args, "O", &ids))
        return NULL;
    PyObject *f = PySequence_Fast(ids, "ack_sequences: ids must be a sequence");
    if (!f)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(f);
    PyObject **it = PySequence_Fast_ITEMS(f);
    PyObject *out = PyList_New(n);
    if (!out)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyUnicode_Check(it[i])) {
            PyErr_Format(PyExc_TypeError, "ack_sequences: ids[%zd] is not a str", i);
            Py_CLEAR(out);
            goto done;
        }
        long long seq;
        if (!parse_ack_id(it[i], &seq)) {
            Py_CLEAR(out);
            Py_XDECREF(f);
            Py_RETURN_NONE;
        }
        PyObject *v = PyLong_FromLongLong(seq);
        if (!v) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, v);
    }
done:
    Py_XDECREF(f);
    return out;
}

/* ack_match(ids, i, keys, p, k) -> bool
 *
 * Whether ack ids ``ids[i:i+k]`` are all well formed (as ack_sequences takes them) and name
 * the sequences ``keys[p:p+k]`` (ints), in order; False if either range runs past its
 * list. Items of the range that are not str raise TypeError. The ack ledger matches an
 * ack request against the flights it has out with this, a stretch at a time, without
 * making an int per id (parsing them into a list and comparing it with the flight's was
 * ~45 ns a delivery per group, the largest part of an ack). Python twin: server/ledger.py
 * ``ack_match_py``.
 */
static PyObject *ack_match(PyObject *self, PyObject *args) {
    PyObject *ids, *keys;
    Py_ssize_t i, p, k;
    if (!PyArg_ParseTuple(args, "OnOnn", &ids, &i, &keys, &p, &k))
        return NULL;
    PyObject *fi = PySequence_Fast(ids, "ack_match: ids must be a sequence");
    if (!fi)
        return NULL;
    PyObject *fk = PySequence_Fast(keys, "ack_match: keys must be a sequence");
    if (!fk) {
        Py_DECREF(fi);
        return NULL;
    }
    PyObject *result = Py_False;
    if (i < 0 || p < 0 || k < 0 || i > PySequence_Fast_GET_SIZE(fi) - k || p > PySequence_Fast_GET_SIZE(fk) - k)
        goto done;
    PyObject **it = PySequence_Fast_ITEMS(fi) + i, **kt = PySequence_Fast_ITEMS(fk) + p;
    for (Py_ssize_t j = 0; j < k; j++) {
        if (!PyUnicode_Check(it[j])) {
            PyErr_Format(PyExc_TypeError, "ack_match: ids[%zd] is not a str", i + j);
            result = NULL;
            goto done;
        }
        long long seq;
        if (!parse_ack_id(it[j], &seq) || !PyLong_Check(kt[j]))
            goto done;
        int overflow;
        long long key = PyLong_AsLongLongAndOverflow(kt[j], &overflow); /* (loops over digits: fast) */
        if (key == -1 && PyErr_Occurred()) {
            result = NULL;
            goto done;
        }
        if (overflow || key != seq)
            goto done;
    }
    result = Py_True;
done:
    Py_DECREF(fi);
    Py_DECREF(fk);
    Py_XINCREF(result);
    return result;
}

/* id_entries(data, starts, dues, seqs) -> (keys: list[bytes], values: list[bytes])
 *
 * The message-id index's entries of the MESSAGE frames starting at ``starts`` (int64) of
 * ``data``: per frame with a non-empty id, the key (the id's bytes) and the value (due i64
 * and sequence i64, little-endian: 16 bytes), in frame order; a frame without an id has
 * nothing to index. Every id must lie inside ``data`` (ValueError if not). The iterate
 * service puts these for every batch it copies (segments/idindex.py), where the same in
 * Python objects cost ~0.5 us a message on the iterate thread. The Python twin is
 * segments/idindex.py ``id_entries_py``.
 */
static PyObject *id_entries(PyObject *self, PyObject *args) {
    Py_buffer buf, sb, db, qb;
    if (!PyArg_ParseTuple(args, "y*y*y*y*", &buf, &sb, &db, &qb))
        return NULL;
    PyObject *keys = NULL, *values = NULL, *out = NULL;
    Py_ssize_t n = sb.len / 8;
    if (sb.len % 8 || db.len != sb.len || qb.len != sb.len) {
        PyErr_SetString(PyExc_ValueError, "id_entries: starts, dues and seqs are not int64 arrays of one length");
        goto done;
    }
    const int64_t *st = sb.buf, *dues = db.buf, *seqs = qb.buf;
    const unsigned char *data = buf.buf;
    if (!(keys = PyList_New(0)) || !(values = PyList_New(0)))
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t s = st[i];
        if (s < 0 || s > buf.len - (HEADER_SIZE + MESSAGE_FIXED)) {
            PyErr_Format(PyExc_ValueError, "id_entries: a frame at %lld runs past the data", (long long)s);
            goto done;
        }
        const unsigned char *body = data + s + HEADER_SIZE;
        Py_ssize_t slen = body[MESSAGE_SUBJECT_LEN_AT] | (body[MESSAGE_SUBJECT_LEN_AT + 1] << 8);
        Py_ssize_t ilen = body[MESSAGE_ID_LEN_AT] | (body[MESSAGE_ID_LEN_AT + 1] << 8);
        Py_ssize_t at = s + HEADER_SIZE + MESSAGE_FIXED + slen;
        if (at + ilen > buf.len) {
            PyErr_Format(PyExc_ValueError, "id_entries: the id of the frame at %lld runs past the data", (long long)s);
            goto done;
        }
        if (ilen == 0)
            continue;
        unsigned char v[16];
        put_u64(v, (uint64_t)dues[i]);
        put_u64(v + 8, (uint64_t)seqs[i]);
        PyObject *k = PyBytes_FromStringAndSize((const char *)data + at, ilen);
        PyObject *val = k ? PyBytes_FromStringAndSize((const char *)v, 16) : NULL;
        int bad = !val || PyList_Append(keys, k) < 0 || PyList_Append(values, val) < 0;
        Py_XDECREF(k);
        Py_XDECREF(val);
        if (bad)
            goto done;
    }
    out = PyTuple_Pack(2, keys, values);
done:
    Py_XDECREF(keys);
    Py_XDECREF(values);
    PyBuffer_Release(&buf);
    PyBuffer_Release(&sb);
    PyBuffer_Release(&db);
    PyBuffer_Release(&qb);
    return out;
}

/* The id filter (segments/idfilter.py): layers of Bloom filters over message ids, each in a buffer
 * whose length is a power of two (at least 8 bytes). An id sets FILTER_PROBES bits:
 * h = XXH3_64(id's UTF-8 bytes), h1 = its low 32 bits, h2 = its high 32 bits | 1, bit i =
 * (h1 + i * h2) mod the number of bits (bit b is bit b % 8 of byte b / 8). */
#define FILTER_PROBES 7

static int filter_bits(Py_buffer *bits, uint64_t *mask) {
    if (bits->len < 8 || (bits->len & (bits->len - 1))) {
        PyErr_SetString(PyExc_ValueError, "id filter: its length is not a power of two of at least 8 bytes");
        return -1;
    }
    *mask = (uint64_t)bits->len * 8 - 1;
    return 0;
}

static inline int filter_test_hash(const unsigned char *b, uint64_t mask, uint64_t h) {
    uint64_t h1 = h & 0xffffffffu, h2 = (h >> 32) | 1;
    for (int i = 0; i < FILTER_PROBES; i++) {
        uint64_t at = (h1 + (uint64_t)i * h2) & mask;
        if (!(b[at >> 3] & (1u << (at & 7))))
            return 0;
    }
    return 1;
}

/* The same probes as filter_test_hash, set instead of tested. */
static inline void filter_set_hash(unsigned char *b, uint64_t mask, uint64_t h) {
    uint64_t h1 = h & 0xffffffffu, h2 = (h >> 32) | 1;
    for (int i = 0; i < FILTER_PROBES; i++) {
        uint64_t at = (h1 + (uint64_t)i * h2) & mask;
        b[at >> 3] |= (unsigned char)(1u << (at & 7));
    }
}

/* How many keys ahead of the one whose bits are set the next one is hashed and its
 * probes' bytes prefetched. */
#define FILTER_ADD_AHEAD 8

/* filter_add(bits: bytearray, keys: list[bytes]) -> None: set each key's bits.
 * Each key is hashed, and every byte its probes touch prefetched, FILTER_ADD_AHEAD keys
 * before its bits are set: a layer of a megabyte or more misses the CPU caches at nearly
 * every probe, and one key after the other waited for its 7 misses in turn (95 % of the
 * call's time on the set; ~7 % of the iterate thread's CPU under bench.iterate).
 * Python twin: segments/idfilter.py ``filter_add_py``. */
static PyObject *filter_add(PyObject *self, PyObject *args) {
    Py_buffer bits;
    PyObject *keys;
    if (!PyArg_ParseTuple(args, "w*O!", &bits, &PyList_Type, &keys))
        return NULL;
    PyObject *out = NULL;
    uint64_t mask;
    if (filter_bits(&bits, &mask) < 0)
        goto done;
    unsigned char *b = bits.buf;
    Py_ssize_t n = PyList_GET_SIZE(keys);
    uint64_t hs[FILTER_ADD_AHEAD];
    for (Py_ssize_t i = 0; i < n + FILTER_ADD_AHEAD; i++) {
        if (i >= FILTER_ADD_AHEAD) /* the key hashed FILTER_ADD_AHEAD keys ago */
            filter_set_hash(b, mask, hs[i % FILTER_ADD_AHEAD]);
        if (i >= n)
            continue;
        PyObject *k = PyList_GET_ITEM(keys, i);
        if (!PyBytes_Check(k)) {
            /* the keys before it are set, as the twin leaves them */
            for (Py_ssize_t j = i >= FILTER_ADD_AHEAD ? i - FILTER_ADD_AHEAD + 1 : 0; j < i; j++)
                filter_set_hash(b, mask, hs[j % FILTER_ADD_AHEAD]);
            PyErr_SetString(PyExc_TypeError, "filter_add: keys must be bytes");
            goto done;
        }
        uint64_t h = hs[i % FILTER_ADD_AHEAD] = XXH3_64bits(PyBytes_AS_STRING(k), (size_t)PyBytes_GET_SIZE(k));
        uint64_t h1 = h & 0xffffffffu, h2 = (h >> 32) | 1;
        for (int p = 0; p < FILTER_PROBES; p++)
            __builtin_prefetch(b + (((h1 + (uint64_t)p * h2) & mask) >> 3), 1);
    }
    out = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&bits);
    return out;
}

/* filter_maybe_layers(layers: list of buffers, ids: list[str]) -> list[int]: the positions of
 * the ids that all of one layer's bits say may be present (each layer a filter as above, of
 * its own size): the layered id filter's lookup in one call. Each id is hashed once for
 * every layer, and for a run of FILTER_RUN ids the first probe of every layer is
 * prefetched before any is tested: a layer of megabytes misses the CPU caches, and the
 * misses of a run overlap instead of following one another.
 * Python twin: segments/idfilter.py ``filter_maybe_layers_py``. */
#define FILTER_RUN 16
#define FILTER_MAX_LAYERS 64

static PyObject *filter_maybe_layers(PyObject *self, PyObject *args) {
    PyObject *layers, *ids;
    if (!PyArg_ParseTuple(args, "O!O!", &PyList_Type, &layers, &PyList_Type, &ids))
        return NULL;
    Py_ssize_t nl = PyList_GET_SIZE(layers), got = 0;
    if (nl < 1 || nl > FILTER_MAX_LAYERS) {
        PyErr_SetString(PyExc_ValueError, "filter_maybe_layers: 1 to 64 layers");
        return NULL;
    }
    Py_buffer bufs[FILTER_MAX_LAYERS];
    uint64_t masks[FILTER_MAX_LAYERS];
    PyObject *out = NULL;
    for (; got < nl; got++) {
        if (PyObject_GetBuffer(PyList_GET_ITEM(layers, got), &bufs[got], PyBUF_SIMPLE) < 0)
            goto done;
        if (filter_bits(&bufs[got], &masks[got]) < 0) {
            PyBuffer_Release(&bufs[got]);
            goto done;
        }
    }
    if (!(out = PyList_New(0)))
        goto done;
    Py_ssize_t n = PyList_GET_SIZE(ids);
    uint64_t hs[FILTER_RUN];
    for (Py_ssize_t start = 0; start < n; start += FILTER_RUN) {
        Py_ssize_t end = start + FILTER_RUN < n ? start + FILTER_RUN : n;
        for (Py_ssize_t i = start; i < end; i++) {
            PyObject *m = PyList_GET_ITEM(ids, i);
            if (!PyUnicode_Check(m)) {
                PyErr_SetString(PyExc_TypeError, "filter_maybe_layers: ids must be str");
                Py_CLEAR(out);
                goto done;
            }
            Py_ssize_t len;
            const char *utf8 = PyUnicode_AsUTF8AndSize(m, &len);
            if (!utf8) {
                Py_CLEAR(out);
                goto done;
            }
            uint64_t h = hs[i - start] = XXH3_64bits(utf8, (size_t)len);
            for (Py_ssize_t k = 0; k < nl; k++)
                __builtin_prefetch((const unsigned char *)bufs[k].buf + (((h & 0xffffffffu) & masks[k]) >> 3));
        }
        for (Py_ssize_t i = start; i < end; i++) {
            for (Py_ssize_t k = 0; k < nl; k++) {
                if (filter_test_hash(bufs[k].buf, masks[k], hs[i - start])) {
                    if (append_new(out, PyLong_FromSsize_t(i)) < 0) {
                        Py_CLEAR(out);
                        goto done;
                    }
                    break;
                }
            }
        }
    }
done:
    for (Py_ssize_t k = 0; k < got; k++)
        PyBuffer_Release(&bufs[k]);
    return out;
}

/* index_entries(data, base) -> bytes
 *
 * The schedule index's entries (docs/formats.md, "Schedule index"; the Python twin is
 * segments/schedule_index.py ``index_entries_py``) of the whole frames at the start of
 * ``data``, which the caller has verified or written itself (walked by their headers'
 * lengths, checksums not checked again), read from file offset ``base``: per frame, 32
 * bytes: sequence u64; offset u48 (``base`` + where the frame starts), kind u8, flags u8
 * (0); then for a MESSAGE its due time i64 and the xxh3-64 of its id's bytes, for a CANCEL
 * its target's sequence u64 and due time i64, for any other kind zeros. Stops at a frame
 * cut by the end of ``data``. A MESSAGE or CANCEL body too short for its fields, or an
 * offset past 48 bits, is a ValueError. The iterate service's appends to the schedule log
 * call this once per bucket append, where numpy gathers cost several calls per append.
 */
#define INDEX_PREFETCH 2048
static PyObject *index_entries(PyObject *self, PyObject *args) {
    Py_buffer buf;
    long long base;
    if (!PyArg_ParseTuple(args, "y*L", &buf, &base))
        return NULL;
    const unsigned char *data = buf.buf;
    Py_ssize_t size = buf.len, pos = 0, n = 0;
    /* count the whole frames first. The walk from header to header is a chain of loads,
     * each waiting for the one before; a write-behind buffer was filled a checkpoint ago
     * and is out of the caches, so nearly every header missed (92 % of the call's time on
     * that load, ~10 % of the iterate thread's CPU under bench.iterate): the buffer is
     * prefetched INDEX_PREFETCH bytes ahead of the walk, line by line (the frames lie back
     * to back), so the misses overlap; the second walk below then reads from the cache. */
    Py_ssize_t fetched = 0;
    while (pos + HEADER_SIZE <= size) {
        for (; fetched < pos + INDEX_PREFETCH && fetched < size; fetched += 64)
            __builtin_prefetch(data + fetched);
        Py_ssize_t end = pos + HEADER_SIZE + (Py_ssize_t)get_u32(data + pos + LENGTH_AT);
        if (end > size)
            break;
        n++;
        pos = end;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * SIDX_ENTRY);
    if (!out) {
        PyBuffer_Release(&buf);
        return NULL;
    }
    unsigned char *e = (unsigned char *)PyBytes_AS_STRING(out);
    const char *err = NULL;
    long long err_at = 0;
    Py_BEGIN_ALLOW_THREADS
    pos = 0;
    for (Py_ssize_t i = 0; i < n; i++, e += SIDX_ENTRY) {
        const unsigned char *p = data + pos;
        Py_ssize_t length = (Py_ssize_t)get_u32(p + LENGTH_AT);
        const unsigned char *body = p + HEADER_SIZE;
        unsigned kind = p[KIND_AT];
        long long at = base + (long long)pos;
        if (base < 0 || at >= (1LL << 48)) {
            err = "an offset does not fit the index's 48 bits";
            err_at = at;
            break;
        }
        memcpy(e, p + SEQUENCE_AT, 8);
        put_u64(e + 8, (uint64_t)at | ((uint64_t)kind << 48));
        memset(e + 16, 0, 16);
        if (kind == KIND_MESSAGE) {
            if (length < MESSAGE_FIXED) {
                err = "a MESSAGE body is shorter than its fixed part";
                err_at = at;
                break;
            }
            Py_ssize_t slen = body[MESSAGE_SUBJECT_LEN_AT] | (body[MESSAGE_SUBJECT_LEN_AT + 1] << 8);
            Py_ssize_t ilen = body[MESSAGE_ID_LEN_AT] | (body[MESSAGE_ID_LEN_AT + 1] << 8);
            if (MESSAGE_FIXED + slen + ilen > length) {
                err = "a MESSAGE's id runs past its body";
                err_at = at;
                break;
            }
            memcpy(e + 16, body, 8);
            put_u64(e + 24, XXH3_64bits(body + MESSAGE_FIXED + slen, (size_t)ilen));
        } else if (kind == KIND_CANCEL) {
            if (length < CANCEL_FIXED) {
                err = "a CANCEL body is shorter than its fixed part";
                err_at = at;
                break;
            }
            memcpy(e + 16, body + CANCEL_TARGET_SEQUENCE_AT, 8);
            memcpy(e + 24, body, 8);
        }
        pos += HEADER_SIZE + length;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&buf);
    if (err) {
        Py_DECREF(out);
        PyErr_Format(PyExc_ValueError, "index_entries: %s (frame at %lld)", err, err_at);
        return NULL;
    }
    return out;
}

/* The position of each of ``q[0..m)`` among ``n`` 32-byte entries ascending by sequence
 * (their first 8 bytes), or -1, into ``pos``: binary searches, shared by index_find and
 * index_gather, SIDX_LOCKSTEP of them at a time in step. A batch of targets (a
 * CancelBatch of 1,000 in a minute of 100,000: a 3.2 MB index) misses the cache at nearly
 * every one of a search's ~17 reads; one search after the other waits for each miss in
 * turn (~0.25 us a search), while searches in step issue their reads together and wait
 * for them at once (~3x fewer waits; measured 250 -> 80 us for 1,000 in such an index).
 * Each step halves every search's range the same way (the lower bound without a branch
 * on the comparison), so the searches of a group stay in step. */
#define SIDX_LOCKSTEP 16
static void sidx_search_many(const unsigned char *e, Py_ssize_t n, const int64_t *q, Py_ssize_t m, int64_t *pos)
{
    if (n <= 0) {
        for (Py_ssize_t i = 0; i < m; i++)
            pos[i] = -1;
        return;
    }
    for (Py_ssize_t i0 = 0; i0 < m; i0 += SIDX_LOCKSTEP) {
        int g = (m - i0) < SIDX_LOCKSTEP ? (int)(m - i0) : SIDX_LOCKSTEP;
        Py_ssize_t base[SIDX_LOCKSTEP];
        for (int j = 0; j < g; j++)
            base[j] = 0;
        /* the first entry not below q: in [base, base + len] throughout */
        for (Py_ssize_t len = n; len > 1;) {
            Py_ssize_t half = len / 2;
            for (int j = 0; j < g; j++)
                base[j] += ((int64_t)get_u64(e + (base[j] + half) * SIDX_ENTRY) < q[i0 + j]) ? half : 0;
            len -= half;
        }
        for (int j = 0; j < g; j++) {
            Py_ssize_t b = base[j] + ((int64_t)get_u64(e + base[j] * SIDX_ENTRY) < q[i0 + j]);
            pos[i0 + j] = (b < n && (int64_t)get_u64(e + b * SIDX_ENTRY) == q[i0 + j]) ? (int64_t)b : -1;
        }
    }
}

/* index_find(entries, seqs) -> bytes
 *
 * Where each sequence of ``seqs`` (int64) is among ``entries`` (a schedule index's entries,
 * 32 bytes each, ascending by their first field: a memory map of the file): the entry's
 * position, or -1, as an int64 array. A binary search each, touching ~log2(n) entries: a
 * lookup in a minute of a million records reads ~20 entries, not the file. The Python
 * twin is segments/schedule_index.py ``index_find_py``.
 */
static PyObject *index_find(PyObject *self, PyObject *args) {
    Py_buffer eb, qb;
    if (!PyArg_ParseTuple(args, "y*y*", &eb, &qb))
        return NULL;
    PyObject *out = NULL;
    if (eb.len % SIDX_ENTRY || qb.len % 8) {
        PyErr_SetString(PyExc_ValueError, "index_find: entries are not whole 32-byte entries or seqs not int64");
        goto done;
    }
    Py_ssize_t n = eb.len / SIDX_ENTRY, m = qb.len / 8;
    if (!(out = PyBytes_FromStringAndSize(NULL, m * 8)))
        goto done;
    const unsigned char *e = eb.buf;
    const int64_t *q = qb.buf;
    int64_t *pos = (int64_t *)PyBytes_AS_STRING(out);
    Py_BEGIN_ALLOW_THREADS
    sidx_search_many(e, n, q, m, pos);
    Py_END_ALLOW_THREADS
done:
    PyBuffer_Release(&eb);
    PyBuffer_Release(&qb);
    return out;
}

/* index_gather(views, seqs, counts) -> (positions, entries)
 *
 * index_find over several schedule indexes in one call (a batch of lookups spread over many
 * minutes: one call rather than a handful of numpy calls a minute). ``seqs`` (int64) come
 * grouped by index: ``counts`` (int64, one per view) says how many in turn belong to each of
 * ``views`` (each whole 32-byte entries, ascending by sequence). Returns the position of
 * each sequence in its index or -1 (int64), and the 32-byte entries of those found, in
 * order. The GIL is kept: a search is ~1 us and each view is a Python buffer. The Python
 * twin is segments/schedule_index.py ``index_gather_py``.
 */
static PyObject *index_gather(PyObject *self, PyObject *args) {
    PyObject *views, *list = NULL, *positions = NULL, *entries = NULL, *result = NULL;
    Py_buffer qb, cb;
    if (!PyArg_ParseTuple(args, "Oy*y*", &views, &qb, &cb))
        return NULL;
    if (qb.len % 8 || cb.len % 8) {
        PyErr_SetString(PyExc_ValueError, "index_gather: seqs and counts are not int64");
        goto done;
    }
    if (!(list = PySequence_Fast(views, "index_gather: views must be a sequence")))
        goto done;
    Py_ssize_t nv = PySequence_Fast_GET_SIZE(list), m = qb.len / 8, total = 0;
    const int64_t *q = qb.buf, *counts = cb.buf;
    if (cb.len / 8 != nv) {
        PyErr_SetString(PyExc_ValueError, "index_gather: not one count per view");
        goto done;
    }
    for (Py_ssize_t v = 0; v < nv; v++) {
        if (counts[v] < 0 || counts[v] > m - total) {
            PyErr_SetString(PyExc_ValueError, "index_gather: the counts do not add up to the sequences");
            goto done;
        }
        total += counts[v];
    }
    if (total != m) {
        PyErr_SetString(PyExc_ValueError, "index_gather: the counts do not add up to the sequences");
        goto done;
    }
    if (!(positions = PyBytes_FromStringAndSize(NULL, m * 8)) ||
        !(entries = PyBytes_FromStringAndSize(NULL, m * SIDX_ENTRY)))
        goto done;
    int64_t *pos = (int64_t *)PyBytes_AS_STRING(positions);
    unsigned char *out = (unsigned char *)PyBytes_AS_STRING(entries);
    Py_ssize_t at = 0, found = 0;
    for (Py_ssize_t v = 0; v < nv; v++) {
        Py_buffer eb;
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(list, v), &eb, PyBUF_SIMPLE) < 0)
            goto done;
        if (eb.len % SIDX_ENTRY) {
            PyBuffer_Release(&eb);
            PyErr_SetString(PyExc_ValueError, "index_gather: a view is not whole 32-byte entries");
            goto done;
        }
        const unsigned char *e = eb.buf;
        Py_ssize_t n = eb.len / SIDX_ENTRY;
        sidx_search_many(e, n, q + at, counts[v], pos + at);
        for (int64_t i = 0; i < counts[v]; i++, at++) {
            if (pos[at] >= 0) {
                memcpy(out + found * SIDX_ENTRY, e + pos[at] * SIDX_ENTRY, SIDX_ENTRY);
                found++;
            }
        }
        PyBuffer_Release(&eb);
    }
    if (_PyBytes_Resize(&entries, found * SIDX_ENTRY) < 0)
        goto done; /* (entries is NULL then) */
    result = PyTuple_Pack(2, positions, entries);
done:
    Py_XDECREF(list);
    Py_XDECREF(positions);
    Py_XDECREF(entries);
    PyBuffer_Release(&qb);
    PyBuffer_Release(&cb);
    return result;
}

/* The recent-id table (server/recent_ids.py): ids written and not yet in the id index, in
 * a bytearray of slots (a power of two of them), RECENT_SLOT bytes each, little-endian:
 * XXH3_64 of the id's UTF-8 bytes with the table's seed u64, its sequence i64 (0: an empty
 * slot), its due time i64, the first sequence of its batch i64. Linear probing from
 * hash mod the number of slots. A slot whose sequence is at most ``floor`` (the index holds
 * it) is dead: a lookup walks past it, a put may take it. */
#define RECENT_SLOT 32

static int recent_slots(Py_buffer *t, uint64_t *mask) {
    Py_ssize_t n = t->len / RECENT_SLOT;
    if (t->len % RECENT_SLOT || n < 1 || (n & (n - 1))) {
        PyErr_SetString(PyExc_ValueError, "recent ids: the table is not a power of two of 32-byte slots");
        return -1;
    }
    *mask = (uint64_t)n - 1;
    return 0;
}

/* Every item of ``ids`` a str (as UTF-8, else a TypeError naming ``what``). */
static int all_str(PyObject *ids, const char *what) {
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(ids); i++)
        if (!PyUnicode_Check(PyList_GET_ITEM(ids, i))) {
            PyErr_Format(PyExc_TypeError, "%s: ids must be str", what);
            return -1;
        }
    return 0;
}

/* recent_put(table: bytearray, seed, floor, ids: list[str], first, dues: list[int]) -> int:
 * ids[i] written with sequence first + i, due at dues[i]; returns how many empty slots were
 * taken (the others reused dead ones). ValueError when no slot is free (the caller grows
 * the table before that). Python twin: server/recent_ids.py ``recent_put_py``. */
static PyObject *recent_put(PyObject *self, PyObject *args) {
    Py_buffer t;
    unsigned long long seed;
    long long floor, first;
    PyObject *ids, *dues;
    if (!PyArg_ParseTuple(args, "w*KLO!LO!", &t, &seed, &floor, &PyList_Type, &ids, &first, &PyList_Type, &dues))
        return NULL;
    PyObject *out = NULL;
    uint64_t mask;
    Py_ssize_t n = PyList_GET_SIZE(ids), filled = 0;
    if (recent_slots(&t, &mask) < 0 || all_str(ids, "recent_put") < 0)
        goto done;
    if (PyList_GET_SIZE(dues) != n || first < 1 || floor < 0 || first > LLONG_MAX - n) {
        PyErr_SetString(PyExc_ValueError, "recent_put: one due time per id, sequences from 1, floor >= 0");
        goto done;
    }
    unsigned char *b = t.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t len;
        const char *utf8 = PyUnicode_AsUTF8AndSize(PyList_GET_ITEM(ids, i), &len);
        if (!utf8)
            goto done;
        long long due = AS_I64(PyList_GET_ITEM(dues, i));
        if (due == -1 && PyErr_Occurred())
            goto done;
        uint64_t h = XXH3_64bits_withSeed(utf8, (size_t)len, (XXH64_hash_t)seed), at = h & mask, probes = 0;
        unsigned char *s = b + at * RECENT_SLOT;
        while ((int64_t)get_u64(s + 8) > floor) {
            if (probes++ == mask) {
                PyErr_SetString(PyExc_ValueError, "recent_put: the table is full");
                goto done;
            }
            at = (at + 1) & mask;
            s = b + at * RECENT_SLOT;
        }
        filled += get_u64(s + 8) == 0;
        put_u64(s, h);
        put_u64(s + 8, (uint64_t)(first + i));
        put_u64(s + 16, (uint64_t)due);
        put_u64(s + 24, (uint64_t)first);
    }
    out = PyLong_FromSsize_t(filled);
done:
    PyBuffer_Release(&t);
    return out;
}

/* recent_find(table, seed, floor, ids: list[str]) -> list[tuple[int, int, int, int]]:
 * (i, sequence, due, first) of every live slot whose hash is that of ids[i], ids in order,
 * each id's slots in probe order (a hash match; the caller confirms the id itself).
 * Python twin: server/recent_ids.py ``recent_find_py``. */
static PyObject *recent_find(PyObject *self, PyObject *args) {
    Py_buffer t;
    unsigned long long seed;
    long long floor;
    PyObject *ids;
    if (!PyArg_ParseTuple(args, "y*KLO!", &t, &seed, &floor, &PyList_Type, &ids))
        return NULL;
    PyObject *out = NULL;
    uint64_t mask;
    if (recent_slots(&t, &mask) < 0 || all_str(ids, "recent_find") < 0 || !(out = PyList_New(0)))
        goto done;
    const unsigned char *b = t.buf;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(ids); i++) {
        Py_ssize_t len;
        const char *utf8 = PyUnicode_AsUTF8AndSize(PyList_GET_ITEM(ids, i), &len);
        if (!utf8) {
            Py_CLEAR(out);
            goto done;
        }
        uint64_t h = XXH3_64bits_withSeed(utf8, (size_t)len, (XXH64_hash_t)seed), at = h & mask;
        for (uint64_t probes = 0; probes <= mask; probes++, at = (at + 1) & mask) {
            const unsigned char *s = b + at * RECENT_SLOT;
            int64_t seq = (int64_t)get_u64(s + 8);
            if (seq == 0)
                break;
            if (seq <= floor || get_u64(s) != h)
                continue;
            if (append_new(out, Py_BuildValue("(nLLL)", i, (long long)seq, (long long)get_u64(s + 16),
                                          (long long)get_u64(s + 24))) < 0) {
                Py_CLEAR(out);
                goto done;
            }
        }
    }
done:
    PyBuffer_Release(&t);
    return out;
}

/* recent_rehash(old, new: bytearray, floor) -> int: copy the live slots of ``old`` into the
 * empty table ``new`` (by their stored hash); returns how many. ValueError if they do not fit.
 * Python twin: server/recent_ids.py ``recent_rehash_py``. */
static PyObject *recent_rehash(PyObject *self, PyObject *args) {
    Py_buffer o, t;
    long long floor;
    if (!PyArg_ParseTuple(args, "y*w*L", &o, &t, &floor))
        return NULL;
    PyObject *out = NULL;
    uint64_t omask, mask;
    Py_ssize_t live = 0;
    if (recent_slots(&o, &omask) < 0 || recent_slots(&t, &mask) < 0)
        goto done;
    if (floor < 0) {
        PyErr_SetString(PyExc_ValueError, "recent_rehash: floor >= 0");
        goto done;
    }
    const unsigned char *ob = o.buf;
    unsigned char *b = t.buf;
    for (uint64_t k = 0; k <= omask; k++) {
        const unsigned char *src = ob + k * RECENT_SLOT;
        if ((int64_t)get_u64(src + 8) <= floor)
            continue;
        uint64_t at = get_u64(src) & mask, probes = 0;
        while (get_u64(b + at * RECENT_SLOT + 8) != 0) {
            if (probes++ == mask) {
                PyErr_SetString(PyExc_ValueError, "recent_rehash: the new table is full");
                goto done;
            }
            at = (at + 1) & mask;
        }
        memcpy(b + at * RECENT_SLOT, src, RECENT_SLOT);
        live++;
    }
    out = PyLong_FromSsize_t(live);
done:
    PyBuffer_Release(&o);
    PyBuffer_Release(&t);
    return out;
}

/* index_confirm(views, counts, seqs, dues, ids) -> list[int]
 *
 * Whether each receipt (sequence, due time, id) names a MESSAGE its minute's schedule
 * index holds, for a few receipts claimed on the event loop (a gathered cancel() batch,
 * server/engine.py ``_claim_few``): the searches of ``index_gather``, then each entry found
 * compared with its receipt (kind MESSAGE, the same due time, a non-empty id whose xxh3-64
 * is the entry's). ``seqs``, ``dues`` and ``ids`` (lists) come grouped by index, ``counts``
 * (a list, one per view) says how many belong to each of ``views`` (whole 32-byte entries,
 * ascending by sequence). Returns the position of each held MESSAGE's entry in its index,
 * -1 for the others, as a list: for 16 targets the arrays and per-entry Python of the
 * search's callers cost ~30 us, this one call ~2. The Python twin is
 * segments/schedule_index.py ``index_confirm_py``.
 */
#define CONFIRM_STACK 64
#define SIDX_KIND_AT 14 /* an entry's kind byte: the second word's seventh */
static PyObject *index_confirm(PyObject *self, PyObject *args) {
    PyObject *views, *counts, *seqs, *dues, *ids, *out = NULL;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!", &PyList_Type, &views, &PyList_Type, &counts, &PyList_Type, &seqs,
                          &PyList_Type, &dues, &PyList_Type, &ids))
        return NULL;
    Py_ssize_t nv = PyList_GET_SIZE(views), m = PyList_GET_SIZE(seqs), total = 0;
    if (PyList_GET_SIZE(counts) != nv) {
        PyErr_SetString(PyExc_ValueError, "index_confirm: not one count per view");
        return NULL;
    }
    if (PyList_GET_SIZE(dues) != m || PyList_GET_SIZE(ids) != m) {
        PyErr_SetString(PyExc_ValueError, "index_confirm: not one due time and one id per sequence");
        return NULL;
    }
    if (all_str(ids, "index_confirm") < 0)
        return NULL;
    for (Py_ssize_t v = 0; v < nv; v++) {
        long long c = AS_I64(PyList_GET_ITEM(counts, v));
        if (c == -1 && PyErr_Occurred())
            return NULL;
        if (c < 0 || c > m - total) {
            PyErr_SetString(PyExc_ValueError, "index_confirm: the counts do not add up to the sequences");
            return NULL;
        }
        total += (Py_ssize_t)c;
    }
    if (total != m) {
        PyErr_SetString(PyExc_ValueError, "index_confirm: the counts do not add up to the sequences");
        return NULL;
    }
    /* sequences, due times and positions: on the stack for the few the event loop claims */
    int64_t stack[3 * CONFIRM_STACK], *q = stack;
    if (m > CONFIRM_STACK && !(q = PyMem_Malloc(3 * (size_t)m * sizeof(int64_t))))
        return PyErr_NoMemory();
    int64_t *due = q + m, *pos = q + 2 * m;
    for (Py_ssize_t i = 0; i < m; i++) {
        q[i] = AS_I64(PyList_GET_ITEM(seqs, i));
        if (q[i] == -1 && PyErr_Occurred())
            goto done;
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        due[i] = AS_I64(PyList_GET_ITEM(dues, i));
        if (due[i] == -1 && PyErr_Occurred())
            goto done;
    }
    Py_ssize_t at = 0;
    for (Py_ssize_t v = 0; v < nv; v++) {
        Py_ssize_t c = (Py_ssize_t)AS_I64(PyList_GET_ITEM(counts, v));
        Py_buffer eb;
        if (PyObject_GetBuffer(PyList_GET_ITEM(views, v), &eb, PyBUF_SIMPLE) < 0)
            goto done;
        if (eb.len % SIDX_ENTRY) {
            PyBuffer_Release(&eb);
            PyErr_SetString(PyExc_ValueError, "index_confirm: a view is not whole 32-byte entries");
            goto done;
        }
        const unsigned char *e = eb.buf;
        sidx_search_many(e, eb.len / SIDX_ENTRY, q + at, c, pos + at);
        for (Py_ssize_t i = at; i < at + c; i++) {
            if (pos[i] < 0)
                continue;
            const unsigned char *p = e + pos[i] * SIDX_ENTRY;
            Py_ssize_t len;
            const char *utf8 = PyUnicode_AsUTF8AndSize(PyList_GET_ITEM(ids, i), &len);
            if (!utf8) {
                PyBuffer_Release(&eb);
                goto done;
            }
            if (p[SIDX_KIND_AT] != KIND_MESSAGE || (int64_t)get_u64(p + 16) != due[i] || len == 0 ||
                XXH3_64bits(utf8, (size_t)len) != get_u64(p + 24))
                pos[i] = -1;
        }
        PyBuffer_Release(&eb);
        at += c;
    }
    if (!(out = PyList_New(m)))
        goto done;
    for (Py_ssize_t i = 0; i < m; i++) {
        PyObject *p = PyLong_FromLongLong(pos[i]);
        if (!p) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, p);
    }
done:
    if (q != stack)
        PyMem_Free(q);
    return out;
}

/* --- the message log's commit: its writes and its fdatasync, the GIL released once ------- */

#define WRITE_PIECE (256 * 1024) /* the most one pwrite(v) writes (segment.py's _WRITE_PIECE) */
#define WRITE_GROUP 1024         /* the most buffers one pwritev takes (segment.py's grouping) */
static const char zero_page[1 << 20];

/* pwritev all of iov[0..cnt) at ``at`` (short writes continued, EINTR retried); 0 or an errno
 * (-1: it wrote nothing). ``iov`` is the caller's scratch copy: it is advanced in place. */
static int pwritev_all(int fd, struct iovec *iov, int cnt, off_t at) {
    for (;;) {
        while (cnt > 0 && iov[0].iov_len == 0) { /* nothing left of it (an empty chunk) */
            iov++;
            cnt--;
        }
        if (cnt == 0)
            return 0;
        ssize_t n = cnt > 1 ? pwritev(fd, iov, cnt, at) : pwrite(fd, iov[0].iov_base, iov[0].iov_len, at);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return errno;
        }
        if (n == 0)
            return -1;
        at += n;
        while (cnt > 0 && (size_t)n >= iov[0].iov_len) {
            n -= (ssize_t)iov[0].iov_len;
            iov++;
            cnt--;
        }
        if (cnt > 0) {
            iov[0].iov_base = (char *)iov[0].iov_base + n;
            iov[0].iov_len -= (size_t)n;
        }
    }
}

/* write_sync(fd, chunks: list of buffers, offset, zero_to, sync) -> (end, allocated, sync_errno, sync_seconds)
 *
 * segment.py's write_sync_py in one call that releases the GIL once: the chunks written back
 * to back from ``offset`` (at most WRITE_GROUP buffers and WRITE_PIECE bytes a pwritev, a
 * larger chunk in pieces), then, if ``zero_to`` is past their end, zeros up to it with one
 * pwrite (best effort: ``allocated`` is where they stop), then, if ``sync``, fdatasync. A
 * failed write raises OSError (nothing synced); a failed fdatasync is returned as its errno,
 * so that the caller tells the two apart (the message log is poisoned only by the second).
 * The message log's writer waited for the GIL after each of its write and its fdatasync
 * (docs/benchmarks.md, "Thread wake-ups a batch under ingest"). */
static PyObject *write_sync(PyObject *self, PyObject *args) {
    int fd, sync;
    PyObject *chunks;
    long long offset, zero_to;
    if (!PyArg_ParseTuple(args, "iO!LLp", &fd, &PyList_Type, &chunks, &offset, &zero_to, &sync))
        return NULL;
    if (offset < 0) {
        PyErr_SetString(PyExc_ValueError, "write_sync: negative offset");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(chunks);
    Py_buffer *views = PyMem_Calloc(n ? (size_t)n : 1, sizeof(Py_buffer));
    struct iovec *iov = PyMem_Malloc((n ? (size_t)n : 1) * sizeof(struct iovec));
    if (!views || !iov) {
        PyMem_Free(views);
        PyMem_Free(iov);
        return PyErr_NoMemory();
    }
    Py_ssize_t got = 0;
    PyObject *result = NULL;
    for (; got < n; got++) {
        if (PyObject_GetBuffer(PyList_GET_ITEM(chunks, got), &views[got], PyBUF_SIMPLE) < 0)
            goto done;
        iov[got].iov_base = views[got].buf;
        iov[got].iov_len = (size_t)views[got].len;
    }
    int werr = 0, serr = 0;
    long long end = offset, allocated;
    double took = 0.0;
    Py_BEGIN_ALLOW_THREADS
    Py_ssize_t i = 0;
    while (i < n && !werr) {
        Py_ssize_t first = i;
        size_t size = iov[i].iov_len;
        i++;
        while (i < n && i - first < WRITE_GROUP && size + iov[i].iov_len <= WRITE_PIECE) {
            size += iov[i].iov_len;
            i++;
        }
        if (size <= WRITE_PIECE) {
            werr = pwritev_all(fd, iov + first, (int)(i - first), (off_t)end);
        } else { /* one chunk larger than a piece */
            const char *p = iov[first].iov_base;
            for (size_t at = 0; at < size && !werr; at += WRITE_PIECE) {
                struct iovec piece = {(void *)(p + at), size - at < WRITE_PIECE ? size - at : WRITE_PIECE};
                werr = pwritev_all(fd, &piece, 1, (off_t)(end + (long long)at));
            }
        }
        end += (long long)size;
    }
    allocated = end;
    if (!werr && zero_to > end) {
        size_t want = (size_t)(zero_to - end);
        const char *zeros = zero_page;
        char *big = NULL;
        if (want > sizeof(zero_page))
            zeros = big = calloc(want, 1);
        if (zeros) {
            ssize_t z;
            do
                z = pwrite(fd, zeros, want, (off_t)end);
            while (z < 0 && errno == EINTR);
            if (z > 0)
                allocated = end + z;
        }
        free(big);
    }
    if (!werr && sync) {
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        int r;
        do
            r = fdatasync(fd);
        while (r < 0 && errno == EINTR);
        serr = r < 0 ? errno : 0;
        clock_gettime(CLOCK_MONOTONIC, &t1);
        took = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
    }
    Py_END_ALLOW_THREADS
    if (werr == -1) {
        PyErr_SetString(PyExc_OSError, "pwrite wrote nothing");
        goto done;
    }
    if (werr) {
        errno = werr;
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    result = Py_BuildValue("(LLid)", end, allocated, serr, took);
done:
    for (Py_ssize_t k = 0; k < got; k++)
        PyBuffer_Release(&views[k]);
    PyMem_Free(views);
    PyMem_Free(iov);
    return result;
}

static PyMethodDef methods[] = {
    {"frame_bodies", frame_bodies, METH_VARARGS, "Append one frame per body to a bytearray; return the next sequence."},
    {"scan", scan, METH_VARARGS, "Walk and verify the whole frames at the start of a buffer."},
    {"gather", gather, METH_VARARGS, "A fixed-width field at an offset of each frame, as an int64 array."},
    {"route", route, METH_VARARGS, "Copy scanned frames into per-bucket write-behind buffers."},
    {"dispatch_frames", dispatch_frames, METH_VARARGS, "Whole DISPATCH frames from columns."},
    {"read_messages", read_messages, METH_VARARGS, "Check and split MESSAGE records read back for dispatch."},
    {"ack_ids", ack_ids, METH_VARARGS, "The ack id \"seq.attempt\" of each delivery."},
    {"ack_sequences", ack_sequences, METH_VARARGS, "The sequences of well-formed ack ids, or None."},
    {"ack_match", ack_match, METH_VARARGS, "Whether a stretch of ack ids names a stretch of sequences."},
    {"id_entries", id_entries, METH_VARARGS, "The id index's keys and values of MESSAGE frames."},
    {"filter_add", filter_add, METH_VARARGS, "Set the id filter's bits of each key."},
    {"filter_maybe_layers", filter_maybe_layers, METH_VARARGS,
     "The positions of the ids one of the id filter's layers may hold."},
    {"recent_put", recent_put, METH_VARARGS, "Put written ids into the recent-id table."},
    {"recent_find", recent_find, METH_VARARGS, "The live slots of the recent-id table whose hash is an id's."},
    {"recent_rehash", recent_rehash, METH_VARARGS, "Copy the live slots of a recent-id table into a new one."},
    {"index_entries", index_entries, METH_VARARGS, "The schedule index's entries of whole frames."},
    {"index_find", index_find, METH_VARARGS, "Binary searches of sequences among a schedule index's entries."},
    {"index_gather", index_gather, METH_VARARGS, "index_find over several indexes, with the entries found."},
    {"index_confirm", index_confirm, METH_VARARGS, "Whether receipts name MESSAGE entries of their indexes."},
    {"write_sync", write_sync, METH_VARARGS, "Write buffers back to back, zeros after them, then fdatasync: the GIL released once."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_codec", NULL, -1, methods};

PyMODINIT_FUNC PyInit__codec(void) {
    if (!little_endian_host()) {
        PyErr_SetString(PyExc_ImportError, "qdelay's native codec needs a little-endian host");
        return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    /* the layout this module was compiled with, checked against segments/framing.py and
     * records.py by segments/native.py at import (and by tests/test_codec_native.py) */
    static const struct { const char *name; long long value; } names[] = {
        {"MAGIC", MAGIC}, {"VERSION", VERSION}, {"HEADER_SIZE", HEADER_SIZE}, {"CHECKED_FROM", CHECKED_FROM},
        {"CHECKSUM_AT", CHECKSUM_AT}, {"LENGTH_AT", LENGTH_AT}, {"KIND_AT", KIND_AT}, {"VERSION_AT", VERSION_AT},
        {"FLAGS_AT", FLAGS_AT}, {"SEQUENCE_AT", SEQUENCE_AT}, {"TIMESTAMP_AT", TIMESTAMP_AT},
        {"KIND_MESSAGE", KIND_MESSAGE}, {"KIND_CANCEL", KIND_CANCEL}, {"KIND_DISPATCH", KIND_DISPATCH},
        {"CANCEL_FIXED", CANCEL_FIXED}, {"CANCEL_TARGET_SEQUENCE_AT", CANCEL_TARGET_SEQUENCE_AT}, {"MESSAGE_FIXED", MESSAGE_FIXED},
        {"MESSAGE_SUBJECT_LEN_AT", MESSAGE_SUBJECT_LEN_AT}, {"MESSAGE_ID_LEN_AT", MESSAGE_ID_LEN_AT},
        {"MESSAGE_HEADERS_LEN_AT", MESSAGE_HEADERS_LEN_AT}, {"MESSAGE_PAYLOAD_LEN_AT", MESSAGE_PAYLOAD_LEN_AT},
        {"DISPATCH_FIXED", DISPATCH_FIXED}, {"DISPATCH_DISPATCHED_AT", DISPATCH_DISPATCHED_AT},
        {"DISPATCH_SCHEDULE_OFFSET_AT", DISPATCH_SCHEDULE_OFFSET_AT}, {"DISPATCH_ATTEMPT_AT", DISPATCH_ATTEMPT_AT},
        {"DISPATCH_OUTCOME_AT", DISPATCH_OUTCOME_AT}, {"DISPATCH_GROUP_LEN_AT", DISPATCH_GROUP_LEN_AT},
        {"DISPATCH_ID_LEN_AT", DISPATCH_ID_LEN_AT},
    };
    PyObject *layout = PyDict_New();
    if (!layout || PyModule_AddObject(m, "LAYOUT", layout) < 0) {
        Py_XDECREF(layout);
        Py_DECREF(m);
        return NULL;
    }
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        PyObject *v = PyLong_FromLongLong(names[i].value);
        if (!v || PyDict_SetItemString(layout, names[i].name, v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(m);
            return NULL;
        }
        Py_DECREF(v);
    }
    return m;
}
