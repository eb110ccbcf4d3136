/* qdelay.segments._codec: the per-record loops of the ingest and dispatch paths, in C.
 *
 * The formats are those of docs/formats.md and of the Python codecs in segments/framing.py
 * and segments/records.py, which stay the reference: every function here has a Python
 * twin, tests/test_codec_native.py checks both give the same bytes, and the server runs
 * the Python twin when this module is not built (it is an optional extension).
 *
 * Why C: at 100-byte messages, the Python loops over each message (validate and encode a
 * batch, frame it, walk and route it in the iterate service) were most of the server's
 * CPU per message (docs/benchmarks.md, "Where a durable message's server CPU goes").
 *
 * The host must be little-endian (the formats are): the module refuses to load otherwise.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>

/* xxHash from the system (Debian libxxhash-dev, set up by the Makefile), not a copy in the
 * tree. XXH_INLINE_ALL compiles XXH3 into this module from the header (no call into
 * libxxhash per frame, as fast as the copy was); without the header the build fails and
 * the optional extension is skipped, so the Python twins run. */
#define XXH_INLINE_ALL
#include <xxhash.h>

#define MAGIC 0x31445151u /* "QQD1" read little-endian */
#define VERSION 1
#define HEADER_SIZE 36
#define CHECKED_FROM 12
#define MESSAGE_FIXED 20 /* due i64, subject_len u16, message_id_len u16, headers_len u32, payload_len u32 */

/* The protobuf field numbers the hand-written wire codec below reads and writes
 * (proto/qdelay/v1/qdelay.proto). Named once here and exported as WIRE_FIELDS: qdelay/wire.py
 * checks them against the generated descriptors at start-up and in a test, so a .proto
 * change that this code does not follow fails loudly instead of encoding wrong bytes. */
#define F_MESSAGE_SUBJECT 1
#define F_MESSAGE_PAYLOAD 2
#define F_MESSAGE_HEADERS 3
#define F_MESSAGE_ID 4
#define F_MESSAGE_DELIVER_AT 5
#define F_MESSAGE_DELAY 6
#define F_BATCH_MESSAGES 1
#define F_BATCH_COMPACT 2
#define F_RESPONSE_DELIVERIES 1
#define F_DELIVERY_ACK_ID 1
#define F_DELIVERY_MESSAGE_ID 2
#define F_DELIVERY_SUBJECT 3
#define F_DELIVERY_PAYLOAD 4
#define F_DELIVERY_HEADERS 5
#define F_DELIVERY_DELIVER_AT 6
#define F_DELIVERY_DISPATCHED_AT 7
#define F_DELIVERY_ATTEMPT 8
#define F_MAP_KEY 1
#define F_MAP_VALUE 2
#define WIRE_VARINT 0
#define WIRE_LEN 2
#define TAG(field, wire) ((unsigned char)(((field) << 3) | (wire))) /* one byte: fields 1-15 */

static inline uint32_t get_u32(const unsigned char *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint64_t get_u64(const unsigned char *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static inline void put_u16(unsigned char *p, uint16_t v) { memcpy(p, &v, 2); }
static inline void put_u32(unsigned char *p, uint32_t v) { memcpy(p, &v, 4); }
static inline void put_u64(unsigned char *p, uint64_t v) { memcpy(p, &v, 8); }

/* Write one frame header (checksum over [12, 36 + length) computed from the body in place). */
static void write_frame(unsigned char *p, unsigned kind, uint64_t seq, int64_t ts, Py_ssize_t length) {
    put_u32(p, MAGIC);
    put_u32(p + 12, (uint32_t)length);
    p[16] = (unsigned char)kind;
    p[17] = VERSION;
    put_u16(p + 18, 0);
    put_u64(p + 20, seq);
    put_u64(p + 28, (uint64_t)ts);
    put_u64(p + 4, XXH3_64bits(p + CHECKED_FROM, (size_t)(HEADER_SIZE - CHECKED_FROM + length)));
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
        uint32_t length = get_u32(p + 12);
        if (get_u32(p) != MAGIC || p[17] != VERSION || (Py_ssize_t)length > max_body) {
            bad = pos;
            break;
        }
        Py_ssize_t end = pos + HEADER_SIZE + (Py_ssize_t)length;
        if (end > size)
            break;
        if (XXH3_64bits(p + CHECKED_FROM, (size_t)(end - pos - CHECKED_FROM)) != get_u64(p + 4)) {
            bad = pos;
            break;
        }
        put_u64(st + 8 * count, (uint64_t)pos);
        kd[count] = p[16];
        memcpy(sq + 8 * count, p + 20, 8);
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

/* route(data, end, starts, kinds, seqs, dues, scale, near, behind, segment_of)
 *   -> (handed, messages, cancels, duplicates, unknown, copied, added)
 *
 * For each frame (the arrays come from scan()): a MESSAGE or CANCEL goes to its due
 * bucket (UTC minute rounded down to ``scale``) unless that bucket's segment already
 * holds its sequence (a replay); its bytes are appended to ``behind[bucket]`` (a
 * bytearray, created when missing). ``segment_of(bucket)`` gives the segment, whose
 * ``last_sequence`` is read once and written back at the end. ``handed``: (index,
 * bucket, offset in its buffer) of the copied records of buckets <= ``near`` (all when
 * None) and of every CANCEL. ``unknown``: indexes of frames of another kind (skipped).
 * The Python twin is IterateService._route_numpy.
 */
static PyObject *route(PyObject *self, PyObject *args) {
    Py_buffer data, sb, kb, qb, db;
    Py_ssize_t end;
    long long scale;
    PyObject *near_obj, *behind, *segment_of;
    if (!PyArg_ParseTuple(args, "y*ny*y*y*y*LOO!O", &data, &end, &sb, &kb, &qb, &db, &scale, &near_obj,
                          &PyDict_Type, &behind, &segment_of))
        return NULL;
    PyObject *result = NULL, *handed = PyList_New(0), *unknown = PyList_New(0);
    Table t = {NULL, 0, 0};
    long long near = LLONG_MAX, messages = 0, cancels = 0, dups = 0, copied = 0, added = 0;
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
        near = PyLong_AsLongLong(near_obj);
        if (near == -1 && PyErr_Occurred())
            goto done;
    }
    t.cap = 64;
    if (!(t.slots = PyMem_Calloc((size_t)t.cap, sizeof(Slot)))) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned kind = kinds[i];
        if (kind != 1 && kind != 2) {
            PyObject *ix = PyLong_FromSsize_t(i);
            if (!ix || PyList_Append(unknown, ix) < 0) {
                Py_XDECREF(ix);
                goto done;
            }
            Py_DECREF(ix);
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
            PyObject *seg = PyObject_CallFunction(segment_of, "L", bucket);
            if (!seg)
                goto done;
            PyObject *last = PyObject_GetAttrString(seg, "last_sequence");
            long long lastv = last ? PyLong_AsLongLong(last) : -1;
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
        if (!slot->buf) {
            PyObject *key = PyLong_FromLongLong(bucket);
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
            } else if (!(buf = PyByteArray_FromStringAndSize(NULL, 0)) || PyDict_SetItem(behind, key, buf) < 0) {
                Py_XDECREF(buf);
                Py_DECREF(key);
                goto done;
            }
            Py_DECREF(key);
            slot->buf = buf;
        }
        Py_ssize_t at = PyByteArray_GET_SIZE(slot->buf);
        if (PyByteArray_Resize(slot->buf, at + (stop - start)) < 0)
            goto done;
        memcpy(PyByteArray_AS_STRING(slot->buf) + at, bytes + start, (size_t)(stop - start));
        slot->last = seqs[i];
        slot->touched = 1;
        copied++;
        added += stop - start;
        if (kind == 2 || bucket <= near) {
            PyObject *h = Py_BuildValue("(nLn)", i, bucket, at);
            if (!h || PyList_Append(handed, h) < 0) {
                Py_XDECREF(h);
                goto done;
            }
            Py_DECREF(h);
        }
    }
    result = Py_BuildValue("(OLLLOLL)", handed, messages, cancels, dups, unknown, copied, added);
done:
    if (t.slots) {
        for (Py_ssize_t k = 0; k < t.cap; k++) {
            Slot *slot = &t.slots[k];
            if (!slot->used)
                continue;
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
    }
    Py_XDECREF(handed);
    Py_XDECREF(unknown);
    PyBuffer_Release(&data);
    PyBuffer_Release(&sb);
    PyBuffer_Release(&kb);
    PyBuffer_Release(&qb);
    PyBuffer_Release(&db);
    return result;
}

/* A MESSAGE body (docs/formats.md, "Record bodies"): fixed part, subject, message id, no
 * headers, payload. A new reference, or NULL with an exception set. */
static PyObject *message_body(long long due, const void *subject, Py_ssize_t slen, const void *mid, Py_ssize_t mlen,
                              const void *payload, Py_ssize_t plen) {
    PyObject *body = PyBytes_FromStringAndSize(NULL, MESSAGE_FIXED + slen + mlen + plen);
    if (!body)
        return NULL;
    unsigned char *b = (unsigned char *)PyBytes_AS_STRING(body);
    put_u64(b, (uint64_t)due);
    put_u16(b + 8, (uint16_t)slen);
    put_u16(b + 10, (uint16_t)mlen);
    put_u32(b + 12, 0);
    put_u32(b + 16, (uint32_t)plen);
    memcpy(b + MESSAGE_FIXED, subject, (size_t)slen);
    memcpy(b + MESSAGE_FIXED + slen, mid, (size_t)mlen);
    memcpy(b + MESSAGE_FIXED + slen + mlen, payload, (size_t)plen);
    return body;
}

/* ---- encode_messages: validate and encode a batch of qdelay.v1.Message, fast path only ---- */

static PyObject *s_subject, *s_payload, *s_message_id, *s_headers, *s_which, *s_when, *s_deliver_at_ms,
    *s_delay_ms;
static unsigned char subject_ok[256];

/* encode_messages(messages, now_ms, max_subject, max_payload, max_id, max_delay, new_id, ids_required)
 *   -> (bodies, ids, dues, payload_bytes) or None
 *
 * None means "take the Python path" (server/validation.encode_messages): a message with
 * headers, or anything the Python path would refuse, which it does with the precise
 * message. A batch accepted here is exactly what the Python path makes of it.
 */
static PyObject *encode_messages(PyObject *self, PyObject *args) {
    PyObject *messages, *new_id;
    long long now, max_delay;
    Py_ssize_t max_subject, max_payload, max_id;
    int ids_required;
    if (!PyArg_ParseTuple(args, "OLnnnLOp", &messages, &now, &max_subject, &max_payload, &max_id, &max_delay,
                          &new_id, &ids_required))
        return NULL;
    PyObject *seq = PySequence_Fast(messages, "messages must be a sequence");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *bodies = PyList_New(n), *ids = PyList_New(n), *dues = PyList_New(n), *seen = PySet_New(NULL);
    PyObject *result = NULL;
    long long total = 0;
    if (!bodies || !ids || !dues || !seen)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *msg = PySequence_Fast_GET_ITEM(seq, i);
        PyObject *subject = NULL, *payload = NULL, *mid = NULL, *headers = NULL, *which = NULL, *when = NULL;
        int fallback = 1, failed = 1;
        long long due = 0;
        do {
            if (!(subject = PyObject_GetAttr(msg, s_subject)) || !(payload = PyObject_GetAttr(msg, s_payload)) ||
                !(mid = PyObject_GetAttr(msg, s_message_id)) || !(headers = PyObject_GetAttr(msg, s_headers)))
                break;
            if (!PyUnicode_Check(subject) || !PyBytes_Check(payload) || !PyUnicode_Check(mid)) {
                PyErr_SetString(PyExc_TypeError, "messages must be qdelay.v1.Message");
                break;
            }
            Py_ssize_t hn = PyObject_Length(headers);
            if (hn < 0)
                break;
            failed = 0;
            if (hn > 0)
                break; /* headers: the Python path */
            Py_ssize_t slen = PyUnicode_GET_LENGTH(subject);
            if (slen < 1 || slen > max_subject || !PyUnicode_IS_ASCII(subject))
                break;
            const unsigned char *sc = PyUnicode_1BYTE_DATA(subject);
            Py_ssize_t k;
            for (k = 0; k < slen && subject_ok[sc[k]]; k++)
                ;
            if (k < slen)
                break;
            if (PyBytes_GET_SIZE(payload) > max_payload)
                break;
            Py_ssize_t mlen = PyUnicode_GET_LENGTH(mid);
            if (mlen == 0) {
                if (ids_required)
                    break;
                Py_DECREF(mid);
                if (!(mid = PyObject_CallNoArgs(new_id))) {
                    failed = 1;
                    break;
                }
                if (!PyUnicode_Check(mid) || !PyUnicode_IS_ASCII(mid)) {
                    PyErr_SetString(PyExc_TypeError, "new_id() must return an ASCII str");
                    failed = 1;
                    break;
                }
                mlen = PyUnicode_GET_LENGTH(mid);
            } else {
                if (mlen > max_id || !PyUnicode_IS_ASCII(mid))
                    break;
                const unsigned char *mc = PyUnicode_1BYTE_DATA(mid);
                for (k = 0; k < mlen && mc[k] >= 0x20 && mc[k] <= 0x7e; k++)
                    ;
                if (k < mlen)
                    break;
            }
            int added = PySet_Add(seen, mid);
            if (added < 0) {
                failed = 1;
                break;
            }
            if (PySet_GET_SIZE(seen) != i + 1)
                break; /* a repeated id: the Python path names both */
            if (!(which = PyObject_CallMethodOneArg(msg, s_which, s_when))) {
                failed = 1;
                break;
            }
            int is_at = PyUnicode_Check(which) && PyUnicode_Compare(which, s_deliver_at_ms) == 0;
            int is_delay = PyUnicode_Check(which) && PyUnicode_Compare(which, s_delay_ms) == 0;
            if (!is_at && !is_delay)
                break;
            if (!(when = PyObject_GetAttr(msg, is_at ? s_deliver_at_ms : s_delay_ms))) {
                failed = 1;
                break;
            }
            long long v = PyLong_AsLongLong(when);
            if (v == -1 && PyErr_Occurred()) {
                failed = 1;
                break;
            }
            if (is_at) {
                if (v < 0 || v - now > max_delay)
                    break;
                due = v;
            } else {
                if (v < 0 || v > max_delay || v > LLONG_MAX - now)
                    break;
                due = now + v;
            }
            Py_ssize_t plen = PyBytes_GET_SIZE(payload);
            PyObject *body = message_body(due, sc, slen, PyUnicode_1BYTE_DATA(mid), mlen,
                                          PyBytes_AS_STRING(payload), plen);
            if (!body) {
                failed = 1;
                break;
            }
            PyObject *due_obj = PyLong_FromLongLong(due);
            if (!due_obj) {
                Py_DECREF(body);
                failed = 1;
                break;
            }
            PyList_SET_ITEM(bodies, i, body);
            Py_INCREF(mid);
            PyList_SET_ITEM(ids, i, mid);
            PyList_SET_ITEM(dues, i, due_obj);
            total += plen;
            fallback = 0;
        } while (0);
        Py_XDECREF(subject);
        Py_XDECREF(payload);
        Py_XDECREF(mid);
        Py_XDECREF(headers);
        Py_XDECREF(which);
        Py_XDECREF(when);
        if (failed)
            goto done; /* an exception is set */
        if (fallback) {
            result = Py_NewRef(Py_None);
            goto done;
        }
    }
    result = Py_BuildValue("(OOOL)", bodies, ids, dues, total);
done:
    Py_DECREF(seq);
    Py_XDECREF(bodies);
    Py_XDECREF(ids);
    Py_XDECREF(dues);
    Py_XDECREF(seen);
    return result;
}

/* ---- decode_batch: a SendBatchRequest's wire bytes straight to MESSAGE bodies ---- */

/* protobuf varint at *pos (< end); -1 when malformed */
static int read_varint(const unsigned char *buf, Py_ssize_t end, Py_ssize_t *pos, uint64_t *out) {
    uint64_t v = 0;
    for (int shift = 0; shift < 64 && *pos < end; shift += 7) {
        unsigned char b = buf[(*pos)++];
        v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) {
            *out = v;
            return 0;
        }
    }
    return -1;
}

typedef struct {
    Py_ssize_t subject, subject_len, payload, payload_len, id, id_len;
    int when; /* 0 unset, F_MESSAGE_DELIVER_AT or F_MESSAGE_DELAY */
    int64_t when_value;
} Parsed;

/* Parse one qdelay.v1.Message; 1 = ok, 0 = not for the fast path (headers, unknown or
 * malformed fields: the Python path decides), never raises. */
static int parse_message(const unsigned char *buf, Py_ssize_t pos, Py_ssize_t end, Parsed *m) {
    memset(m, 0, sizeof(*m));
    while (pos < end) {
        uint64_t tag, v;
        if (read_varint(buf, end, &pos, &tag) < 0)
            return 0;
        unsigned field = (unsigned)(tag >> 3), wire = (unsigned)(tag & 7);
        if (wire == WIRE_LEN) {
            if (read_varint(buf, end, &pos, &v) < 0 || v > (uint64_t)(end - pos))
                return 0;
            Py_ssize_t at = pos, len = (Py_ssize_t)v;
            pos += len;
            if (field == F_MESSAGE_SUBJECT) { m->subject = at; m->subject_len = len; }
            else if (field == F_MESSAGE_PAYLOAD) { m->payload = at; m->payload_len = len; }
            else if (field == F_MESSAGE_ID) { m->id = at; m->id_len = len; }
            else return 0; /* headers or unknown */
        } else if (wire == WIRE_VARINT) {
            if (read_varint(buf, end, &pos, &v) < 0)
                return 0;
            if (field == F_MESSAGE_DELIVER_AT || field == F_MESSAGE_DELAY) { m->when = (int)field; m->when_value = (int64_t)v; }
            else return 0;
        } else {
            return 0;
        }
    }
    return 1;
}

/* decode_batch(raw, now_ms, max_subject, max_payload, max_id, max_delay, max_batch, new_id)
 *   -> (bodies, ids, dues, payload_bytes, compact_receipts) or None
 *
 * The fast path of SendBatch/SendStream: the request's wire bytes (the server registers
 * these RPCs without a deserializer) are parsed, validated and encoded in one pass, with
 * no protobuf object per message. None: parse with protobuf and take the Python path
 * (headers, unknown fields, anything malformed or refused: it words the error).
 */
static PyObject *decode_batch(PyObject *self, PyObject *args) {
    Py_buffer raw;
    long long now, max_delay;
    Py_ssize_t max_subject, max_payload, max_id, max_batch;
    PyObject *new_id;
    if (!PyArg_ParseTuple(args, "y*LnnnLnO", &raw, &now, &max_subject, &max_payload, &max_id, &max_delay,
                          &max_batch, &new_id))
        return NULL;
    const unsigned char *buf = raw.buf;
    Py_ssize_t end = raw.len, pos = 0, n = 0, cap = 0;
    Parsed *msgs = NULL;
    int compact = 0, fast = 1;
    PyObject *result = NULL, *bodies = NULL, *ids = NULL, *dues = NULL, *seen = NULL;
    long long total = 0;
    /* pass 1: the request's fields; compact_receipts may come after the messages */
    while (pos < end && fast) {
        uint64_t tag, v;
        if (read_varint(buf, end, &pos, &tag) < 0) { fast = 0; break; }
        unsigned field = (unsigned)(tag >> 3), wire = (unsigned)(tag & 7);
        if (field == F_BATCH_MESSAGES && wire == WIRE_LEN) {
            if (read_varint(buf, end, &pos, &v) < 0 || v > (uint64_t)(end - pos)) { fast = 0; break; }
            if (n == cap) {
                Py_ssize_t ncap = cap ? cap * 2 : 128;
                Parsed *more = PyMem_Realloc(msgs, (size_t)ncap * sizeof(Parsed));
                if (!more) { PyErr_NoMemory(); goto done; }
                msgs = more;
                cap = ncap;
            }
            if (!parse_message(buf, pos, pos + (Py_ssize_t)v, &msgs[n])) { fast = 0; break; }
            n++;
            pos += (Py_ssize_t)v;
        } else if (field == F_BATCH_COMPACT && wire == WIRE_VARINT) {
            if (read_varint(buf, end, &pos, &v) < 0) { fast = 0; break; }
            compact = v != 0;
        } else {
            fast = 0;
        }
    }
    if (!fast || n == 0 || n > max_batch)
        goto fallback;
    /* pass 2: validate and encode, exactly as encode_messages does */
    if (!(bodies = PyList_New(n)) || !(ids = PyList_New(n)) || !(dues = PyList_New(n)) || !(seen = PySet_New(NULL)))
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        Parsed *m = &msgs[i];
        const unsigned char *sc = buf + m->subject;
        if (m->subject_len < 1 || m->subject_len > max_subject || m->payload_len > max_payload)
            goto fallback;
        for (Py_ssize_t k = 0; k < m->subject_len; k++)
            if (!subject_ok[sc[k]])
                goto fallback;
        PyObject *mid;
        if (m->id_len == 0) {
            if (compact)
                goto fallback;
            if (!(mid = PyObject_CallNoArgs(new_id)))
                goto done;
            if (!PyUnicode_Check(mid) || !PyUnicode_IS_ASCII(mid)) {
                Py_DECREF(mid);
                PyErr_SetString(PyExc_TypeError, "new_id() must return an ASCII str");
                goto done;
            }
        } else {
            if (m->id_len > max_id)
                goto fallback;
            for (Py_ssize_t k = 0; k < m->id_len; k++)
                if (buf[m->id + k] < 0x20 || buf[m->id + k] > 0x7e)
                    goto fallback;
            if (!(mid = PyUnicode_FromStringAndSize((const char *)buf + m->id, m->id_len)))
                goto done;
        }
        PyList_SET_ITEM(ids, i, mid);
        if (PySet_Add(seen, mid) < 0)
            goto done;
        if (PySet_GET_SIZE(seen) != i + 1)
            goto fallback; /* a repeated id */
        long long due, v = m->when_value;
        if (m->when == F_MESSAGE_DELIVER_AT) {
            if (v < 0 || v - now > max_delay)
                goto fallback;
            due = v;
        } else if (m->when == F_MESSAGE_DELAY) {
            if (v < 0 || v > max_delay || v > LLONG_MAX - now)
                goto fallback;
            due = now + v;
        } else {
            goto fallback;
        }
        PyObject *body = message_body(due, sc, m->subject_len, PyUnicode_1BYTE_DATA(mid), PyUnicode_GET_LENGTH(mid),
                                      buf + m->payload, m->payload_len);
        if (!body)
            goto done;
        PyList_SET_ITEM(bodies, i, body);
        PyObject *due_obj = PyLong_FromLongLong(due);
        if (!due_obj)
            goto done;
        PyList_SET_ITEM(dues, i, due_obj);
        total += m->payload_len;
    }
    result = Py_BuildValue("(OOOLO)", bodies, ids, dues, total, compact ? Py_True : Py_False);
    goto done;
fallback:
    result = Py_NewRef(Py_None);
done:
    PyMem_Free(msgs);
    Py_XDECREF(bodies);
    Py_XDECREF(ids);
    Py_XDECREF(dues);
    Py_XDECREF(seen);
    PyBuffer_Release(&raw);
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
 * Scheduler._check_run_numpy.
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
        uint32_t length = ok ? get_u32(p + 12) : 0;
        ok = ok && get_u32(p) == MAGIC && p[16] == 1 && p[17] == VERSION && (int64_t)get_u64(p + 20) == seqs[i] &&
             off + HEADER_SIZE + (int64_t)length <= size && length >= MESSAGE_FIXED;
        Py_ssize_t slen = 0, mlen = 0, hlen = 0, plen = 0;
        if (ok) {
            const unsigned char *b = p + HEADER_SIZE;
            slen = b[8] | (b[9] << 8);
            mlen = b[10] | (b[11] << 8);
            hlen = (Py_ssize_t)get_u32(b + 12);
            plen = (Py_ssize_t)get_u32(b + 16);
            ok = (int64_t)MESSAGE_FIXED + slen + mlen + hlen + plen == (int64_t)length &&
                 XXH3_64bits(p + CHECKED_FROM, (size_t)(HEADER_SIZE - CHECKED_FROM + length)) == get_u64(p + 4);
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
            PyObject *ix = PyLong_FromSsize_t(i);
            if (!ix || PyList_Append(failed, ix) < 0) {
                Py_XDECREF(ix);
                goto done;
            }
            Py_DECREF(ix);
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

static inline unsigned char *put_varint(unsigned char *p, uint64_t v) {
    while (v >= 0x80) {
        *p++ = (unsigned char)(v | 0x80);
        v >>= 7;
    }
    *p++ = (unsigned char)v;
    return p;
}

static inline Py_ssize_t varint_size(uint64_t v) {
    Py_ssize_t n = 1;
    while (v >= 0x80) {
        v >>= 7;
        n++;
    }
    return n;
}

static inline Py_ssize_t field_size(Py_ssize_t len) { return 1 + varint_size((uint64_t)len) + len; }

/* an ASCII or UTF-8 view of a str or bytes */
static int text_of(PyObject *o, const char **p, Py_ssize_t *n) {
    if (PyBytes_Check(o)) {
        *p = PyBytes_AS_STRING(o);
        *n = PyBytes_GET_SIZE(o);
        return 0;
    }
    if (PyUnicode_Check(o)) {
        *p = PyUnicode_AsUTF8AndSize(o, n);
        return *p ? 0 : -1;
    }
    PyErr_SetString(PyExc_TypeError, "expected str or bytes");
    return -1;
}

/* the wire size of a map<string, string> field's entries (the field's tag included), or -1 */
static Py_ssize_t headers_size(PyObject *hd) {
    Py_ssize_t total = 0, it = 0;
    PyObject *k, *v;
    if (hd == Py_None)
        return 0;
    if (!PyDict_Check(hd)) {
        PyErr_SetString(PyExc_TypeError, "headers must be dicts or None");
        return -1;
    }
    while (PyDict_Next(hd, &it, &k, &v)) {
        const char *kp, *vp;
        Py_ssize_t kn, vn;
        if (text_of(k, &kp, &kn) < 0 || text_of(v, &vp, &vn) < 0)
            return -1;
        total += field_size((kn ? field_size(kn) : 0) + (vn ? field_size(vn) : 0));
    }
    return total;
}

static inline unsigned char *put_bytes(unsigned char *w, unsigned char tag, const void *p, Py_ssize_t n) {
    if (n) {
        *w++ = tag;
        w = put_varint(w, (uint64_t)n);
        memcpy(w, p, (size_t)n);
        w += n;
    }
    return w;
}

/* writes the entries {key = 1, value = 2} of a map<string, string> field ``tag``; the
 * dict was checked by headers_size */
static unsigned char *put_headers(unsigned char *w, unsigned char tag, PyObject *hd) {
    Py_ssize_t it = 0;
    PyObject *k, *v;
    if (hd == Py_None)
        return w;
    while (PyDict_Next(hd, &it, &k, &v)) {
        const char *kp, *vp;
        Py_ssize_t kn, vn;
        text_of(k, &kp, &kn);
        text_of(v, &vp, &vn);
        *w++ = tag;
        w = put_varint(w, (uint64_t)((kn ? field_size(kn) : 0) + (vn ? field_size(vn) : 0)));
        w = put_bytes(w, TAG(F_MAP_KEY, WIRE_LEN), kp, kn);
        w = put_bytes(w, TAG(F_MAP_VALUE, WIRE_LEN), vp, vn);
    }
    return w;
}

/* encode_deliveries(out, subject, ack_ids, message_ids, payloads, headers, deliver_at_ms,
 *                   dispatched_at_ms, attempts) -> count
 *
 * Appends one SubscribeResponse ``deliveries`` entry (field 1, a Delivery message) per
 * delivery to the bytearray ``out``: the wire form protobuf would write (fields in number
 * order, default values left out). ``headers`` entries are dicts or None. The Python twin
 * is consumers.fill_response + SerializeToString.
 */
static PyObject *encode_deliveries(PyObject *self, PyObject *args) {
    PyObject *out, *subject, *acks, *mids, *payloads, *headers, *dues, *attempts;
    long long dispatched;
    if (!PyArg_ParseTuple(args, "O!OO!O!O!O!O!LO!", &PyByteArray_Type, &out, &subject, &PyList_Type, &acks,
                          &PyList_Type, &mids, &PyList_Type, &payloads, &PyList_Type, &headers, &PyList_Type,
                          &dues, &dispatched, &PyList_Type, &attempts))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(acks);
    if (PyList_GET_SIZE(mids) != n || PyList_GET_SIZE(payloads) != n || PyList_GET_SIZE(headers) != n ||
        PyList_GET_SIZE(dues) != n || PyList_GET_SIZE(attempts) != n) {
        PyErr_SetString(PyExc_ValueError, "encode_deliveries: columns differ in length");
        return NULL;
    }
    const char *sp;
    Py_ssize_t sn;
    if (text_of(subject, &sp, &sn) < 0)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        const char *ap, *mp, *pp;
        Py_ssize_t an, mn, pn;
        if (text_of(PyList_GET_ITEM(acks, i), &ap, &an) < 0 || text_of(PyList_GET_ITEM(mids, i), &mp, &mn) < 0)
            return NULL;
        PyObject *payload = PyList_GET_ITEM(payloads, i), *hd = PyList_GET_ITEM(headers, i);
        if (!PyBytes_Check(payload)) {
            PyErr_SetString(PyExc_TypeError, "payloads must be bytes");
            return NULL;
        }
        pp = PyBytes_AS_STRING(payload);
        pn = PyBytes_GET_SIZE(payload);
        long long due = PyLong_AsLongLong(PyList_GET_ITEM(dues, i));
        long long attempt = PyLong_AsLongLong(PyList_GET_ITEM(attempts, i));
        if (PyErr_Occurred())
            return NULL;
        /* size of the Delivery message */
        Py_ssize_t body = 0;
        if (an) body += field_size(an);
        if (mn) body += field_size(mn);
        if (sn) body += field_size(sn);
        if (pn) body += field_size(pn);
        Py_ssize_t hsize = headers_size(hd);
        if (hsize < 0)
            return NULL;
        body += hsize;
        if (due) body += 1 + varint_size((uint64_t)due);
        if (dispatched) body += 1 + varint_size((uint64_t)dispatched);
        if (attempt) body += 1 + varint_size((uint64_t)(uint32_t)attempt);
        Py_ssize_t start = PyByteArray_GET_SIZE(out), total = field_size(body);
        if (PyByteArray_Resize(out, start + total) < 0)
            return NULL;
        unsigned char *w = (unsigned char *)PyByteArray_AS_STRING(out) + start;
        *w++ = TAG(F_RESPONSE_DELIVERIES, WIRE_LEN);
        w = put_varint(w, (uint64_t)body);
        w = put_bytes(w, TAG(F_DELIVERY_ACK_ID, WIRE_LEN), ap, an);
        w = put_bytes(w, TAG(F_DELIVERY_MESSAGE_ID, WIRE_LEN), mp, mn);
        w = put_bytes(w, TAG(F_DELIVERY_SUBJECT, WIRE_LEN), sp, sn);
        w = put_bytes(w, TAG(F_DELIVERY_PAYLOAD, WIRE_LEN), pp, pn);
        w = put_headers(w, TAG(F_DELIVERY_HEADERS, WIRE_LEN), hd);
        if (due) { *w++ = TAG(F_DELIVERY_DELIVER_AT, WIRE_VARINT); w = put_varint(w, (uint64_t)due); }
        if (dispatched) { *w++ = TAG(F_DELIVERY_DISPATCHED_AT, WIRE_VARINT); w = put_varint(w, (uint64_t)dispatched); }
        if (attempt) { *w++ = TAG(F_DELIVERY_ATTEMPT, WIRE_VARINT); w = put_varint(w, (uint64_t)(uint32_t)attempt); }
    }
    return PyLong_FromSsize_t(n);
}

/* dispatch_frames(sequences, deliver_at_ms, dispatched_at_ms, schedule_offsets, attempts,
 *                 message_ids, timestamp, outcome) -> bytes
 *
 * Whole DISPATCH frames back to back, one per position of the (equally long) columns
 * (sequences of ints; message ids bytes). The Python twin is
 * records.encode_dispatch_frames_py. */
static PyObject *dispatch_frames(PyObject *self, PyObject *args) {
    PyObject *cols[6];
    long long ts;
    unsigned int outcome;
    if (!PyArg_ParseTuple(args, "OOOOOOLI", &cols[0], &cols[1], &cols[2], &cols[3], &cols[4], &cols[5], &ts,
                          &outcome))
        return NULL;
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
        total += HEADER_SIZE + 32 + PyBytes_GET_SIZE(mids[i]);
    }
    if (!(result = PyBytes_FromStringAndSize(NULL, total)))
        goto done;
    unsigned char *w = (unsigned char *)PyBytes_AS_STRING(result);
    PyObject **seq = PySequence_Fast_ITEMS(fast[0]), **due = PySequence_Fast_ITEMS(fast[1]),
             **at = PySequence_Fast_ITEMS(fast[2]), **off = PySequence_Fast_ITEMS(fast[3]),
             **att = PySequence_Fast_ITEMS(fast[4]);
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long sq = PyLong_AsUnsignedLongLong(seq[i]), so = PyLong_AsUnsignedLongLong(off[i]);
        long long d = PyLong_AsLongLong(due[i]), a = PyLong_AsLongLong(at[i]);
        unsigned long at_n = PyLong_AsUnsignedLong(att[i]);
        if (PyErr_Occurred()) {
            Py_CLEAR(result);
            goto done;
        }
        Py_ssize_t mlen = PyBytes_GET_SIZE(mids[i]);
        unsigned char *b = w + HEADER_SIZE;
        put_u64(b, (uint64_t)d);
        put_u64(b + 8, (uint64_t)a);
        put_u64(b + 16, (uint64_t)so);
        put_u32(b + 24, (uint32_t)at_n);
        b[28] = (unsigned char)outcome;
        b[29] = 0;
        put_u16(b + 30, (uint16_t)mlen);
        memcpy(b + 32, PyBytes_AS_STRING(mids[i]), (size_t)mlen);
        write_frame(w, 3, (uint64_t)sq, (int64_t)ts, 32 + mlen);
        w += HEADER_SIZE + 32 + mlen;
    }
done:
    for (int c = 0; c < 6; c++)
        Py_XDECREF(fast[c]);
    return result;
}

/* encode_send_batch(out, messages, ids) -> count
 *
 * The client's bulk path: appends one SendBatchRequest ``messages`` entry (field 1, a
 * Message) per item of ``messages`` to the bytearray ``out``, in the wire form protobuf
 * writes (fields in number order, empty strings left out). An item is a sequence
 * (subject, payload, deliver_at_ms, delay_ms, message_id, headers): the first two str /
 * bytes, the times int or None (a time that is not None is written even when 0: it is a
 * oneof member; both set is a ValueError), headers a dict or None. ``ids`` (a list of str, one per item) gives the
 * message ids written; the item's own message_id is not read. Nothing is validated here:
 * the server does that. The Python twin is qdelay.client.client.encode_send_batch_py.
 */
static PyObject *encode_send_batch(PyObject *self, PyObject *args) {
    PyObject *out, *items, *ids;
    if (!PyArg_ParseTuple(args, "O!O!O!", &PyByteArray_Type, &out, &PyList_Type, &items, &PyList_Type, &ids))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(items);
    if (PyList_GET_SIZE(ids) != n) {
        PyErr_SetString(PyExc_ValueError, "encode_send_batch: one id per message");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(items, i);
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 6) {
            PyErr_SetString(PyExc_TypeError,
                            "messages must be 6-tuples (subject, payload, deliver_at_ms, delay_ms, message_id, headers)");
            return NULL;
        }
        const char *sp, *pp, *mp;
        Py_ssize_t sn, pn, mn;
        if (text_of(PyTuple_GET_ITEM(item, 0), &sp, &sn) < 0 || text_of(PyList_GET_ITEM(ids, i), &mp, &mn) < 0)
            return NULL;
        PyObject *payload = PyTuple_GET_ITEM(item, 1), *at = PyTuple_GET_ITEM(item, 2),
                 *delay = PyTuple_GET_ITEM(item, 3), *hd = PyTuple_GET_ITEM(item, 5);
        if (!PyBytes_Check(payload)) {
            PyErr_SetString(PyExc_TypeError, "payload must be bytes");
            return NULL;
        }
        pp = PyBytes_AS_STRING(payload);
        pn = PyBytes_GET_SIZE(payload);
        int has_at = at != Py_None, has_delay = delay != Py_None;
        if (has_at && has_delay) {
            PyErr_SetString(PyExc_ValueError, "give deliver_at_ms or delay_ms, not both");
            return NULL;
        }
        long long at_v = has_at ? PyLong_AsLongLong(at) : 0, delay_v = has_delay ? PyLong_AsLongLong(delay) : 0;
        if (PyErr_Occurred())
            return NULL;
        Py_ssize_t hsize = headers_size(hd);
        if (hsize < 0)
            return NULL;
        Py_ssize_t body = hsize;
        if (sn) body += field_size(sn);
        if (pn) body += field_size(pn);
        if (mn) body += field_size(mn);
        if (has_at) body += 1 + varint_size((uint64_t)at_v);
        if (has_delay) body += 1 + varint_size((uint64_t)delay_v);
        Py_ssize_t start = PyByteArray_GET_SIZE(out);
        if (PyByteArray_Resize(out, start + field_size(body)) < 0)
            return NULL;
        unsigned char *w = (unsigned char *)PyByteArray_AS_STRING(out) + start;
        *w++ = TAG(F_BATCH_MESSAGES, WIRE_LEN);
        w = put_varint(w, (uint64_t)body);
        w = put_bytes(w, TAG(F_MESSAGE_SUBJECT, WIRE_LEN), sp, sn);
        w = put_bytes(w, TAG(F_MESSAGE_PAYLOAD, WIRE_LEN), pp, pn);
        w = put_headers(w, TAG(F_MESSAGE_HEADERS, WIRE_LEN), hd);
        w = put_bytes(w, TAG(F_MESSAGE_ID, WIRE_LEN), mp, mn);
        if (has_at) { *w++ = TAG(F_MESSAGE_DELIVER_AT, WIRE_VARINT); w = put_varint(w, (uint64_t)at_v); }
        if (has_delay) { *w++ = TAG(F_MESSAGE_DELAY, WIRE_VARINT); w = put_varint(w, (uint64_t)delay_v); }
    }
    return PyLong_FromSsize_t(n);
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

static PyMethodDef methods[] = {
    {"frame_bodies", frame_bodies, METH_VARARGS, "Append one frame per body to a bytearray; return the next sequence."},
    {"scan", scan, METH_VARARGS, "Walk and verify the whole frames at the start of a buffer."},
    {"gather", gather, METH_VARARGS, "A fixed-width field at an offset of each frame, as an int64 array."},
    {"route", route, METH_VARARGS, "Copy scanned frames into per-bucket write-behind buffers."},
    {"dispatch_frames", dispatch_frames, METH_VARARGS, "Whole DISPATCH frames from columns."},
    {"read_messages", read_messages, METH_VARARGS, "Check and split MESSAGE records read back for dispatch."},
    {"encode_deliveries", encode_deliveries, METH_VARARGS, "Append Delivery entries of a SubscribeResponse."},
    {"encode_send_batch", encode_send_batch, METH_VARARGS, "Append Message entries of a SendBatchRequest (client)."},
    {"decode_batch", decode_batch, METH_VARARGS,
     "Parse, validate and encode a SendBatchRequest's wire bytes (fast path); None: use protobuf."},
    {"encode_messages", encode_messages, METH_VARARGS,
     "Validate and encode a batch of Messages (fast path); None means: use the Python path."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_codec", NULL, -1, methods};

PyMODINIT_FUNC PyInit__codec(void) {
    const uint16_t one = 1;
    if (*(const unsigned char *)&one != 1) {
        PyErr_SetString(PyExc_ImportError, "qdelay's native codec needs a little-endian host");
        return NULL;
    }
    for (int c = 0; c < 256; c++)
        subject_ok[c] = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' ||
                        c == '_' || c == '-';
    if (!(s_subject = PyUnicode_InternFromString("subject")) || !(s_payload = PyUnicode_InternFromString("payload")) ||
        !(s_message_id = PyUnicode_InternFromString("message_id")) ||
        !(s_headers = PyUnicode_InternFromString("headers")) || !(s_which = PyUnicode_InternFromString("WhichOneof")) ||
        !(s_when = PyUnicode_InternFromString("when")) ||
        !(s_deliver_at_ms = PyUnicode_InternFromString("deliver_at_ms")) ||
        !(s_delay_ms = PyUnicode_InternFromString("delay_ms")))
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    /* WIRE_FIELDS: full field name -> the number this codec uses (checked by qdelay/wire.py) */
    PyObject *fields = Py_BuildValue(
        "{s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i}",
        "qdelay.v1.Message.subject", F_MESSAGE_SUBJECT, "qdelay.v1.Message.payload", F_MESSAGE_PAYLOAD,
        "qdelay.v1.Message.headers", F_MESSAGE_HEADERS, "qdelay.v1.Message.message_id", F_MESSAGE_ID,
        "qdelay.v1.Message.deliver_at_ms", F_MESSAGE_DELIVER_AT, "qdelay.v1.Message.delay_ms", F_MESSAGE_DELAY,
        "qdelay.v1.SendBatchRequest.messages", F_BATCH_MESSAGES,
        "qdelay.v1.SendBatchRequest.compact_receipts", F_BATCH_COMPACT,
        "qdelay.v1.SubscribeResponse.deliveries", F_RESPONSE_DELIVERIES,
        "qdelay.v1.Delivery.ack_id", F_DELIVERY_ACK_ID, "qdelay.v1.Delivery.message_id", F_DELIVERY_MESSAGE_ID,
        "qdelay.v1.Delivery.subject", F_DELIVERY_SUBJECT, "qdelay.v1.Delivery.payload", F_DELIVERY_PAYLOAD,
        "qdelay.v1.Delivery.headers", F_DELIVERY_HEADERS, "qdelay.v1.Delivery.deliver_at_ms", F_DELIVERY_DELIVER_AT,
        "qdelay.v1.Delivery.dispatched_at_ms", F_DELIVERY_DISPATCHED_AT,
        "qdelay.v1.Delivery.attempt", F_DELIVERY_ATTEMPT);
    if (!fields || PyModule_AddObject(m, "WIRE_FIELDS", fields) < 0) {
        Py_XDECREF(fields);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
