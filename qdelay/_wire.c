/* qdelay._wire: the hand-written protobuf wire codec of qdelay's gRPC messages, in C.
 *
 * The hot messages are read and written here without a protobuf object per message:
 * SendBatchRequest (parsed, validated and turned into MESSAGE bodies by the server;
 * written from ``Outgoing`` tuples by the client), SendBatchResponse with full or compact
 * receipts, and SubscribeResponse. Every function has a Python twin of the same signature
 * in qdelay/wire.py (the table is ``wire.twins()``); tests/test_codec_native.py runs both on
 * the same inputs, and the twins run when this optional extension is not built.
 *
 * This module needs no library beyond Python's headers (no xxHash: it frames nothing), so
 * the client distribution (packaging/client, qdelay-client) builds it too; the MESSAGE body
 * layout comes from segments/layout.h, shared with the storage codec.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

#include "layout.h"
#include "pyint.h"

/* The protobuf field numbers this codec reads and writes (proto/qdelay/v1/qdelay.proto).
 * Named once here and exported as WIRE_FIELDS: qdelay/wire.py checks them against the
 * generated descriptors at import (server and client start-up) and in a test, so a .proto
 * change that this code does not follow fails loudly instead of encoding wrong bytes. */
#define F_MESSAGE_SUBJECT 1
#define F_MESSAGE_PAYLOAD 2
#define F_MESSAGE_HEADERS 3
#define F_MESSAGE_ID 4
#define F_MESSAGE_DELIVER_AT 5
#define F_MESSAGE_DELAY 6
#define F_BATCH_MESSAGES 1
#define F_BATCH_COMPACT 2
#define F_RECEIPT_MESSAGE_ID 1
#define F_RECEIPT_DELIVER_AT 2
#define F_RECEIPT_SEQUENCE 3
#define F_RECEIPT_DUPLICATE 4
#define F_RECEIPT_SHARD 5
#define F_BATCH_RESPONSE_RECEIPTS 1
#define F_BATCH_RESPONSE_FIRST_SEQUENCE 2
#define F_BATCH_RESPONSE_DELIVER_AT 3
#define F_BATCH_RESPONSE_SHARD 4
#define F_RESPONSE_DELIVERIES 1
#define F_DELIVERY_ACK_ID 1
#define F_DELIVERY_MESSAGE_ID 2
#define F_DELIVERY_SUBJECT 3
#define F_DELIVERY_PAYLOAD 4
#define F_DELIVERY_HEADERS 5
#define F_DELIVERY_DELIVER_AT 6
#define F_DELIVERY_DISPATCHED_AT 7
#define F_DELIVERY_ATTEMPT 8
#define F_CANCEL_BATCH_REQUESTS 1
#define F_CANCEL_RECEIPT 1
#define F_CANCEL_MESSAGE_ID 2
#define F_MAP_KEY 1
#define F_MAP_VALUE 2
#define WIRE_VARINT 0
#define WIRE_LEN 2
#define TAG(field, wire) ((unsigned char)(((field) << 3) | (wire))) /* one byte: fields 1-15 */

/* ---- encode_messages: validate and encode a batch of qdelay.v1.Message, fast path only ---- */

static PyObject *s_subject, *s_payload, *s_message_id, *s_headers, *s_which, *s_when, *s_deliver_at_ms,
    *s_delay_ms;
static unsigned char subject_ok[256];

/* encode_messages(messages, now_ms, max_subject, max_payload, max_id, max_delay, new_id, ids_required)
 *   -> (bodies, ids, dues, payload_bytes) or None
 *
 * None means "take the Python path" (server/validation.encode_messages_py, the reference):
 * a message with headers, or anything the Python path would refuse, which it does with the
 * precise message. A batch accepted here is exactly what the Python path makes of it. The
 * Python twin is qdelay/wire.py ``encode_messages_py``.
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
            long long v = AS_I64(when);
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
    Py_hash_t hash; /* its id's (str) hash, for the repeated-id check */
} Parsed;

/* decode_batch's repeated-id check: an open-addressing table of message indexes + 1 (0
 * empty), at most half full, on the stack up to this many slots. A set of the ids (the
 * check before) cost ~400 instructions a message: its growth by resizes, each zeroed. */
#define SEEN_STACK_SLOTS 1024

/* Whether ``mid`` (message i's id, an ASCII str; its hash in msgs[i].hash) is the id of a
 * message before it, and else enter it. */
static int seen_before(Py_ssize_t *slots, size_t mask, const Parsed *msgs, PyObject *ids, Py_ssize_t i,
                       PyObject *mid) {
    Py_hash_t h = msgs[i].hash;
    size_t at = (size_t)h & mask;
    Py_ssize_t len = PyUnicode_GET_LENGTH(mid);
    while (slots[at]) {
        Py_ssize_t j = slots[at] - 1;
        if (msgs[j].hash == h) {
            PyObject *other = PyList_GET_ITEM(ids, j);
            if (PyUnicode_GET_LENGTH(other) == len &&
                memcmp(PyUnicode_1BYTE_DATA(other), PyUnicode_1BYTE_DATA(mid), (size_t)len) == 0)
                return 1;
        }
        at = (at + 1) & mask;
    }
    slots[at] = i + 1;
    return 0;
}

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
 * (headers, unknown fields, anything malformed or refused: it words the error). The
 * Python twin is qdelay/wire.py ``decode_batch_py``.
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
    PyObject *result = NULL, *bodies = NULL, *ids = NULL, *dues = NULL;
    Py_ssize_t seen_stack[SEEN_STACK_SLOTS], *seen = NULL;
    size_t seen_mask = 0;
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
    if (!(bodies = PyList_New(n)) || !(ids = PyList_New(n)) || !(dues = PyList_New(n)))
        goto done;
    {
        size_t slots = 16;
        while (slots < 2 * (size_t)n)
            slots *= 2;
        if (slots <= SEEN_STACK_SLOTS) {
            seen = seen_stack;
            memset(seen, 0, slots * sizeof(Py_ssize_t));
        } else if (!(seen = PyMem_Calloc(slots, sizeof(Py_ssize_t)))) {
            PyErr_NoMemory();
            goto done;
        }
        seen_mask = slots - 1;
    }
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
        /* (str's own hash, kept in the str: the deduper's sets of these ids reuse it) */
        if ((m->hash = PyObject_Hash(mid)) == -1)
            goto done;
        if (seen_before(seen, seen_mask, msgs, ids, i, mid))
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
    if (seen != seen_stack)
        PyMem_Free(seen);
    Py_XDECREF(bodies);
    Py_XDECREF(ids);
    Py_XDECREF(dues);
    PyBuffer_Release(&raw);
    return result;
}
/* ---- decode_cancel_batch: a CancelBatchRequest of plain receipts straight to targets ---- */

typedef struct {
    Py_ssize_t id, id_len;
    uint64_t due, seq;
    int has_receipt;
} Target;

/* Parse one qdelay.v1.Receipt into ``t`` (fields present overwrite: protobuf's merge of a
 * repeated submessage); 0 when malformed or carrying an unknown field. */
static int parse_receipt(const unsigned char *buf, Py_ssize_t pos, Py_ssize_t end, Target *t) {
    while (pos < end) {
        uint64_t tag, v;
        if (read_varint(buf, end, &pos, &tag) < 0)
            return 0;
        unsigned field = (unsigned)(tag >> 3), wire = (unsigned)(tag & 7);
        if (wire == WIRE_LEN && (field == F_RECEIPT_MESSAGE_ID || field == F_RECEIPT_SHARD)) {
            if (read_varint(buf, end, &pos, &v) < 0 || v > (uint64_t)(end - pos))
                return 0;
            if (field == F_RECEIPT_MESSAGE_ID) { t->id = pos; t->id_len = (Py_ssize_t)v; }
            pos += (Py_ssize_t)v;
        } else if (wire == WIRE_VARINT &&
                   (field == F_RECEIPT_DELIVER_AT || field == F_RECEIPT_SEQUENCE || field == F_RECEIPT_DUPLICATE)) {
            if (read_varint(buf, end, &pos, &v) < 0)
                return 0;
            if (field == F_RECEIPT_DELIVER_AT) t->due = v;
            else if (field == F_RECEIPT_SEQUENCE) t->seq = v;
        } else {
            return 0;
        }
    }
    return 1;
}

/* decode_cancel_batch(raw, max_id, max_batch) -> [(message_id, deliver_at_ms, sequence)] or None
 *
 * The fast path of CancelBatch/CancelStream (registered without a deserializer): 1 to
 * max_batch CancelRequests, each a receipt alone (no message_id beside it) whose id is 1 to
 * max_id printable-ASCII bytes and whose due time is not negative: the targets, as
 * validation.validate_cancel_batch returns them, with no protobuf object per target. None:
 * anything else (by id, unknown fields, malformed, refused): the caller parses with
 * protobuf and validates, which words the error. The Python twin is qdelay/wire.py
 * ``decode_cancel_batch_py``.
 */
static PyObject *decode_cancel_batch(PyObject *self, PyObject *args) {
    Py_buffer raw;
    Py_ssize_t max_id, max_batch;
    if (!PyArg_ParseTuple(args, "y*nn", &raw, &max_id, &max_batch))
        return NULL;
    const unsigned char *buf = raw.buf;
    Py_ssize_t end = raw.len, pos = 0, n = 0, cap = 0;
    Target *ts = NULL;
    PyObject *result = NULL, *out = NULL;
    int fast = 1;
    while (pos < end && fast) {
        uint64_t tag, v;
        if (read_varint(buf, end, &pos, &tag) < 0 || tag != TAG(F_CANCEL_BATCH_REQUESTS, WIRE_LEN) ||
            read_varint(buf, end, &pos, &v) < 0 || v > (uint64_t)(end - pos)) {
            fast = 0;
            break;
        }
        if (n == cap) {
            Py_ssize_t ncap = cap ? cap * 2 : 256;
            Target *more = PyMem_Realloc(ts, (size_t)ncap * sizeof(Target));
            if (!more) { PyErr_NoMemory(); goto done; }
            ts = more;
            cap = ncap;
        }
        Target *t = &ts[n++];
        memset(t, 0, sizeof(*t));
        Py_ssize_t rend = pos + (Py_ssize_t)v;
        while (pos < rend && fast) { /* one CancelRequest */
            uint64_t rtag, len;
            if (read_varint(buf, rend, &pos, &rtag) < 0 || (rtag & 7) != WIRE_LEN ||
                read_varint(buf, rend, &pos, &len) < 0 || len > (uint64_t)(rend - pos)) {
                fast = 0;
                break;
            }
            unsigned field = (unsigned)(rtag >> 3);
            if (field == F_CANCEL_RECEIPT) {
                t->has_receipt = 1;
                if (!parse_receipt(buf, pos, pos + (Py_ssize_t)len, t))
                    fast = 0;
            } else if (field != F_CANCEL_MESSAGE_ID || len != 0) {
                fast = 0; /* by id, or a receipt with an id beside it: the Python path */
            }
            pos += (Py_ssize_t)len;
        }
    }
    if (!fast || n == 0 || n > max_batch)
        goto fallback;
    if (!(out = PyList_New(n)))
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        Target *t = &ts[i];
        if (!t->has_receipt || t->id_len < 1 || t->id_len > max_id || (int64_t)t->due < 0)
            goto fallback;
        for (Py_ssize_t k = 0; k < t->id_len; k++)
            if (buf[t->id + k] < 0x20 || buf[t->id + k] > 0x7e)
                goto fallback;
        PyObject *item = Py_BuildValue("(s#LK)", (const char *)buf + t->id, t->id_len, (long long)(int64_t)t->due,
                                       (unsigned long long)t->seq);
        if (!item)
            goto done;
        PyList_SET_ITEM(out, i, item);
    }
    result = Py_NewRef(out);
    goto done;
fallback:
    result = Py_NewRef(Py_None);
done:
    PyMem_Free(ts);
    Py_XDECREF(out);
    PyBuffer_Release(&raw);
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
 * is qdelay/wire.py ``encode_deliveries_py`` (protobuf's own serializer).
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
        long long due = AS_I64(PyList_GET_ITEM(dues, i));
        long long attempt = AS_I64(PyList_GET_ITEM(attempts, i));
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
/* encode_send_batch(out, messages, ids) -> count
 *
 * The client's bulk path: appends one SendBatchRequest ``messages`` entry (field 1, a
 * Message) per item of ``messages`` to the bytearray ``out``, in the wire form protobuf
 * writes (fields in number order, empty strings left out). An item is a sequence
 * (subject, payload, deliver_at_ms, delay_ms, message_id, headers): the first two str /
 * bytes, the times int or None (a time that is not None is written even when 0: it is a
 * oneof member; both set is a ValueError), headers a dict or None. ``ids`` (a list of str,
 * one per item) gives the message ids written; the item's own message_id is not read.
 * Nothing is validated here: the server does that. The Python twin is qdelay/wire.py
 * ``encode_send_batch_py``.
 */
/* One Outgoing item's Message, with ``id`` as its message id: its fields read (and
 * checked as encode_send_batch says) into ``m``, its size without the entry's tag and
 * length in ``m->body``. 0, or -1 with an exception set. */
typedef struct {
    const char *sp, *pp, *mp;
    Py_ssize_t sn, pn, mn, hsize, body;
    long long at_v, delay_v;
    int has_at, has_delay;
    PyObject *hd;
} OutgoingOut;

static int outgoing_of(OutgoingOut *m, PyObject *item, PyObject *id) {
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 6) {
        PyErr_SetString(PyExc_TypeError,
                        "messages must be 6-tuples (subject, payload, deliver_at_ms, delay_ms, message_id, headers)");
        return -1;
    }
    if (text_of(PyTuple_GET_ITEM(item, 0), &m->sp, &m->sn) < 0 || text_of(id, &m->mp, &m->mn) < 0)
        return -1;
    PyObject *payload = PyTuple_GET_ITEM(item, 1), *at = PyTuple_GET_ITEM(item, 2), *delay = PyTuple_GET_ITEM(item, 3);
    m->hd = PyTuple_GET_ITEM(item, 5);
    if (!PyBytes_Check(payload)) {
        PyErr_SetString(PyExc_TypeError, "payload must be bytes");
        return -1;
    }
    m->pp = PyBytes_AS_STRING(payload);
    m->pn = PyBytes_GET_SIZE(payload);
    m->has_at = at != Py_None;
    m->has_delay = delay != Py_None;
    if (m->has_at && m->has_delay) {
        PyErr_SetString(PyExc_ValueError, "give deliver_at_ms or delay_ms, not both");
        return -1;
    }
    m->at_v = m->has_at ? AS_I64(at) : 0;
    m->delay_v = m->has_delay ? AS_I64(delay) : 0;
    if (PyErr_Occurred())
        return -1;
    Py_ssize_t hsize = m->hsize = headers_size(m->hd);
    if (hsize < 0)
        return -1;
    Py_ssize_t body = hsize;
    if (m->sn) body += field_size(m->sn);
    if (m->pn) body += field_size(m->pn);
    if (m->mn) body += field_size(m->mn);
    if (m->has_at) body += 1 + varint_size((uint64_t)m->at_v);
    if (m->has_delay) body += 1 + varint_size((uint64_t)m->delay_v);
    m->body = body;
    return 0;
}

/* writes the SendBatchRequest ``messages`` entry of ``m`` (room: field_size(m->body)) */
static unsigned char *put_outgoing(unsigned char *w, const OutgoingOut *m) {
    *w++ = TAG(F_BATCH_MESSAGES, WIRE_LEN);
    w = put_varint(w, (uint64_t)m->body);
    w = put_bytes(w, TAG(F_MESSAGE_SUBJECT, WIRE_LEN), m->sp, m->sn);
    w = put_bytes(w, TAG(F_MESSAGE_PAYLOAD, WIRE_LEN), m->pp, m->pn);
    w = put_headers(w, TAG(F_MESSAGE_HEADERS, WIRE_LEN), m->hd);
    w = put_bytes(w, TAG(F_MESSAGE_ID, WIRE_LEN), m->mp, m->mn);
    if (m->has_at) { *w++ = TAG(F_MESSAGE_DELIVER_AT, WIRE_VARINT); w = put_varint(w, (uint64_t)m->at_v); }
    if (m->has_delay) { *w++ = TAG(F_MESSAGE_DELAY, WIRE_VARINT); w = put_varint(w, (uint64_t)m->delay_v); }
    return w;
}

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
        OutgoingOut m;
        if (outgoing_of(&m, PyList_GET_ITEM(items, i), PyList_GET_ITEM(ids, i)) < 0)
            return NULL;
        Py_ssize_t start = PyByteArray_GET_SIZE(out);
        if (PyByteArray_Resize(out, start + field_size(m.body)) < 0)
            return NULL;
        put_outgoing((unsigned char *)PyByteArray_AS_STRING(out) + start, &m);
    }
    return PyLong_FromSsize_t(n);
}

/* encode_outgoing_request(messages, make_id) -> (request, ids)
 *
 * send_many's request of a batch of Outgoing items (a list, as encode_send_batch takes
 * them): a whole SendBatchRequest with compact receipts as bytes, and the list of the
 * message ids it carries: an item's own message_id when it is not empty, else
 * ``make_id()``'s (called once per such item, in order). The ids made first (one pass),
 * the sizes with them, then the bytes in one piece (a second): no list comprehension for
 * the ids, no bytearray grown per message and copied to bytes at the end (7.4 -> ~4 us a
 * batch of 100). Nothing is validated beyond what encode_send_batch checks. The Python
 * twin is qdelay/wire.py ``encode_outgoing_request_py``.
 */
static PyObject *encode_outgoing_request(PyObject *self, PyObject *args) {
    PyObject *given_items, *make_id;
    if (!PyArg_ParseTuple(args, "O!O", &PyList_Type, &given_items, &make_id))
        return NULL;
    /* a copy: make_id and an int's __index__ may run Python code, which must not take an
     * item away from under the views read from it */
    PyObject *items = PyList_GetSlice(given_items, 0, PyList_GET_SIZE(given_items));
    if (!items)
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(items);
    PyObject *ids = PyList_New(n), *request = NULL, *result = NULL;
    OutgoingOut *ms = PyMem_Malloc(sizeof(OutgoingOut) * (size_t)(n ? n : 1));
    if (!ids || !ms) {
        if (!ms)
            PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t total = 2; /* compact_receipts = true */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(items, i), *id;
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 6) {
            PyErr_SetString(PyExc_TypeError,
                            "messages must be 6-tuples (subject, payload, deliver_at_ms, delay_ms, message_id, headers)");
            goto done;
        }
        id = PyTuple_GET_ITEM(item, 4);
        int given = PyObject_IsTrue(id);
        if (given < 0)
            goto done;
        id = given ? Py_NewRef(id) : PyObject_CallNoArgs(make_id);
        if (!id)
            goto done;
        PyList_SET_ITEM(ids, i, id);
        if (outgoing_of(&ms[i], item, id) < 0)
            goto done;
        total += field_size(ms[i].body);
    }
    if (!(request = PyBytes_FromStringAndSize(NULL, total)))
        goto done;
    unsigned char *w = (unsigned char *)PyBytes_AS_STRING(request);
    for (Py_ssize_t i = 0; i < n; i++) {
        /* a headers dict changed by Python code run after it was sized (make_id, an
         * __index__) would overrun the request: sized again (no Python code runs here) */
        if (ms[i].hd != Py_None && headers_size(ms[i].hd) != ms[i].hsize) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_RuntimeError, "encode_outgoing_request: a headers dict changed while encoding");
            goto done;
        }
        w = put_outgoing(w, &ms[i]);
    }
    *w++ = TAG(F_BATCH_COMPACT, WIRE_VARINT);
    *w++ = 1;
    result = PyTuple_Pack(2, request, ids);
done:
    PyMem_Free(ms);
    Py_XDECREF(request);
    Py_XDECREF(ids);
    Py_DECREF(items);
    return result;
}

/* the UTF-8 bytes of a str (ASCII ids and shards: the str's own buffer, no copy) */
static inline int utf8_of(PyObject *o, const char **p, Py_ssize_t *n) {
    if (!PyUnicode_Check(o)) {
        PyErr_SetString(PyExc_TypeError, "expected str");
        return -1;
    }
    *p = PyUnicode_AsUTF8AndSize(o, n);
    return *p ? 0 : -1;
}

typedef struct {
    const char *id, *shard;
    Py_ssize_t id_len, shard_len;
    long long due;
    unsigned long long sequence;
    int duplicate;
} ReceiptOut;

static inline Py_ssize_t receipt_size(const ReceiptOut *r) {
    Py_ssize_t n = 0;
    if (r->id_len) n += field_size(r->id_len);
    if (r->due) n += 1 + varint_size((uint64_t)r->due);
    if (r->sequence) n += 1 + varint_size(r->sequence);
    if (r->duplicate) n += 2;
    if (r->shard_len) n += field_size(r->shard_len);
    return n;
}

static unsigned char *put_receipt(unsigned char *w, const ReceiptOut *r, Py_ssize_t size) {
    *w++ = TAG(F_BATCH_RESPONSE_RECEIPTS, WIRE_LEN);
    w = put_varint(w, (uint64_t)size);
    w = put_bytes(w, TAG(F_RECEIPT_MESSAGE_ID, WIRE_LEN), r->id, r->id_len);
    if (r->due) { *w++ = TAG(F_RECEIPT_DELIVER_AT, WIRE_VARINT); w = put_varint(w, (uint64_t)r->due); }
    if (r->sequence) { *w++ = TAG(F_RECEIPT_SEQUENCE, WIRE_VARINT); w = put_varint(w, r->sequence); }
    if (r->duplicate) { *w++ = TAG(F_RECEIPT_DUPLICATE, WIRE_VARINT); *w++ = 1; }
    return put_bytes(w, TAG(F_RECEIPT_SHARD, WIRE_LEN), r->shard, r->shard_len);
}

/* One receipt of a full SendBatchResponse: message k's own (its id and due time, the next
 * sequence) or, when ``dups`` names k, the original receipt of a duplicate
 * (message_id, deliver_at_ms, sequence). 0, or -1 with an exception set. */
static int receipt_of(ReceiptOut *r, PyObject *ids, PyObject *dues, PyObject *dups, Py_ssize_t k,
                      unsigned long long *next) {
    PyObject *dup = NULL;
    if (dups != Py_None && PyDict_GET_SIZE(dups)) {
        PyObject *key = PyLong_FromSsize_t(k);
        if (!key)
            return -1;
        dup = PyDict_GetItemWithError(dups, key);
        Py_DECREF(key);
        if (!dup && PyErr_Occurred())
            return -1;
    }
    if (dup) {
        if (!PyTuple_Check(dup) || PyTuple_GET_SIZE(dup) != 3) {
            PyErr_SetString(PyExc_TypeError, "dups values must be (message_id, deliver_at_ms, sequence)");
            return -1;
        }
        if (utf8_of(PyTuple_GET_ITEM(dup, 0), &r->id, &r->id_len) < 0)
            return -1;
        r->due = AS_I64(PyTuple_GET_ITEM(dup, 1));
        r->sequence = AS_U64(PyTuple_GET_ITEM(dup, 2));
        r->duplicate = 1;
    } else {
        if (utf8_of(PyList_GET_ITEM(ids, k), &r->id, &r->id_len) < 0)
            return -1;
        r->due = AS_I64(PyList_GET_ITEM(dues, k));
        r->sequence = (*next)++;
        r->duplicate = 0;
    }
    return PyErr_Occurred() ? -1 : 0;
}

/* encode_send_batch_response(ids, dues, first_sequence, compact, dups, shard) -> bytes
 *
 * A whole SendBatchResponse, as protobuf writes it, for a batch written from
 * ``first_sequence`` on: ``ids`` (str) and ``dues`` (int) one per message. Compact
 * (``compact`` and no duplicates): first_sequence, the packed due times and the shard.
 * Full: one Receipt per message, its shard on each; ``dups`` (a dict, or None) maps a
 * message's index to the original receipt of a duplicate, (message_id, deliver_at_ms,
 * sequence), answered with duplicate = true; the other messages take the sequences from
 * ``first_sequence`` on, in order. SendBatch and SendStream are registered without a
 * response serializer, so a plain generated client's full receipts cost no protobuf
 * object per receipt on the server. The Python twin is qdelay/wire.py
 * ``encode_send_batch_response_py``.
 */
static PyObject *encode_send_batch_response(PyObject *self, PyObject *args) {
    PyObject *ids, *dues, *dups, *shard;
    unsigned long long first;
    int compact;
    if (!PyArg_ParseTuple(args, "O!O!KpOU", &PyList_Type, &ids, &PyList_Type, &dues, &first, &compact, &dups,
                          &shard))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(ids);
    if (PyList_GET_SIZE(dues) != n) {
        PyErr_SetString(PyExc_ValueError, "encode_send_batch_response: one due time per id");
        return NULL;
    }
    if (dups != Py_None && !PyDict_Check(dups)) {
        PyErr_SetString(PyExc_TypeError, "dups must be a dict or None");
        return NULL;
    }
    const char *sp;
    Py_ssize_t sn;
    if (utf8_of(shard, &sp, &sn) < 0)
        return NULL;
    PyObject *result;
    if (compact && (dups == Py_None || PyDict_GET_SIZE(dups) == 0)) {
        Py_ssize_t packed = 0;
        for (Py_ssize_t k = 0; k < n; k++) {
            long long due = AS_I64(PyList_GET_ITEM(dues, k));
            if (due == -1 && PyErr_Occurred())
                return NULL;
            packed += varint_size((uint64_t)due);
        }
        Py_ssize_t total = (first ? 1 + varint_size(first) : 0) + (n ? field_size(packed) : 0) + (sn ? field_size(sn) : 0);
        if (!(result = PyBytes_FromStringAndSize(NULL, total)))
            return NULL;
        unsigned char *w = (unsigned char *)PyBytes_AS_STRING(result);
        if (first) { *w++ = TAG(F_BATCH_RESPONSE_FIRST_SEQUENCE, WIRE_VARINT); w = put_varint(w, first); }
        if (n) {
            *w++ = TAG(F_BATCH_RESPONSE_DELIVER_AT, WIRE_LEN);
            w = put_varint(w, (uint64_t)packed);
            for (Py_ssize_t k = 0; k < n; k++)
                w = put_varint(w, (uint64_t)AS_I64(PyList_GET_ITEM(dues, k)));
        }
        put_bytes(w, TAG(F_BATCH_RESPONSE_SHARD, WIRE_LEN), sp, sn);
        return result;
    }
    /* full receipts: sizes first (one pass), then the bytes (a second) */
    Py_ssize_t total = 0;
    unsigned long long next = first;
    for (Py_ssize_t k = 0; k < n; k++) {
        ReceiptOut r = {.shard = sp, .shard_len = sn};
        if (receipt_of(&r, ids, dues, dups, k, &next) < 0)
            return NULL;
        total += field_size(receipt_size(&r));
    }
    if (!(result = PyBytes_FromStringAndSize(NULL, total)))
        return NULL;
    unsigned char *w = (unsigned char *)PyBytes_AS_STRING(result);
    next = first;
    for (Py_ssize_t k = 0; k < n; k++) {
        ReceiptOut r = {.shard = sp, .shard_len = sn};
        if (receipt_of(&r, ids, dues, dups, k, &next) < 0) {
            Py_DECREF(result);
            return NULL;
        }
        w = put_receipt(w, &r, receipt_size(&r));
    }
    return result;
}

/* ---- decode_deliveries: a SubscribeResponse's wire bytes straight to the client's Delivery ---- */

/* a str from UTF-8 bytes, or NULL with no exception set when they are not valid UTF-8 */
static PyObject *utf8_str(const unsigned char *buf, Py_ssize_t at, Py_ssize_t len) {
    PyObject *s = PyUnicode_DecodeUTF8((const char *)buf + at, len, NULL);
    if (!s && PyErr_ExceptionMatches(PyExc_UnicodeDecodeError))
        PyErr_Clear();
    return s;
}

/* One map<string, string> entry into ``headers``: 1 = ok, 0 = not for the fast path, -1 =
 * an exception is set (out of memory). */
static int parse_header(const unsigned char *buf, Py_ssize_t pos, Py_ssize_t end, PyObject *headers) {
    Py_ssize_t key = 0, key_len = 0, value = 0, value_len = 0;
    while (pos < end) {
        uint64_t tag, v;
        if (read_varint(buf, end, &pos, &tag) < 0 || (tag & 7) != WIRE_LEN)
            return 0;
        if (read_varint(buf, end, &pos, &v) < 0 || v > (uint64_t)(end - pos))
            return 0;
        if ((tag >> 3) == F_MAP_KEY) { key = pos; key_len = (Py_ssize_t)v; }
        else if ((tag >> 3) == F_MAP_VALUE) { value = pos; value_len = (Py_ssize_t)v; }
        else return 0;
        pos += (Py_ssize_t)v;
    }
    PyObject *k = utf8_str(buf, key, key_len), *val = k ? utf8_str(buf, value, value_len) : NULL;
    int ok = k && val ? (PyDict_SetItem(headers, k, val) < 0 ? -1 : 1) : (PyErr_Occurred() ? -1 : 0);
    Py_XDECREF(k);
    Py_XDECREF(val);
    return ok;
}

/* The client's Delivery is a slots class whose __init__ only stores its nine arguments
 * (a slots dataclass). Calling it costs about as much as decoding the delivery, so when
 * ``cls`` has a writable object slot for each field the object is made with tp_alloc and
 * its slots are filled directly, as its __init__ would (what the member descriptors
 * do); any other ``cls`` is called. */
#define DELIVERY_NFIELDS 9
static const char *delivery_fields[DELIVERY_NFIELDS] = {
    "message_id", "subject", "payload", "headers", "deliver_at_ms", "dispatched_at_ms", "attempt", "ack_id", "group"};

/* 1 with the slots' offsets in ``offsets`` when ``cls`` is such a class, 0 if not, -1 on error */
static int delivery_slots(PyObject *cls, Py_ssize_t offsets[DELIVERY_NFIELDS]) {
    if (!PyType_Check(cls) || ((PyTypeObject *)cls)->tp_itemsize != 0)
        return 0;
    for (int k = 0; k < DELIVERY_NFIELDS; k++) {
        PyObject *d = PyObject_GetAttrString(cls, delivery_fields[k]);
        if (!d) {
            if (!PyErr_ExceptionMatches(PyExc_AttributeError))
                return -1;
            PyErr_Clear();
            return 0;
        }
        int ok = Py_IS_TYPE(d, &PyMemberDescr_Type);
        if (ok) {
            PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
            ok = m->type == T_OBJECT_EX && !(m->flags & READONLY) &&
                 PyType_IsSubtype((PyTypeObject *)cls, PyDescr_TYPE(d));
            offsets[k] = m->offset;
        }
        Py_DECREF(d);
        if (!ok)
            return 0;
    }
    return 1;
}

/* One qdelay.v1.Delivery as cls(message_id, subject, payload, headers, deliver_at_ms,
 * dispatched_at_ms, attempt, ack_id, group); Py_None = not for the fast path, NULL = an
 * exception is set. A field seen twice keeps its last value, as protobuf does. */
static PyObject *parse_delivery(const unsigned char *buf, Py_ssize_t pos, Py_ssize_t end, PyObject *cls,
                                const Py_ssize_t *slots, PyObject *group) {
    Py_ssize_t at[F_DELIVERY_PAYLOAD + 1] = {0}, len[F_DELIVERY_PAYLOAD + 1] = {0};
    uint64_t ints[F_DELIVERY_ATTEMPT + 1] = {0};
    PyObject *headers = PyDict_New(), *result = NULL;
    if (!headers)
        return NULL;
    while (pos < end) {
        uint64_t tag, v;
        if (read_varint(buf, end, &pos, &tag) < 0)
            goto fallback;
        unsigned field = (unsigned)(tag >> 3), wire = (unsigned)(tag & 7);
        if (wire == WIRE_LEN && field >= F_DELIVERY_ACK_ID && field <= F_DELIVERY_HEADERS) {
            if (read_varint(buf, end, &pos, &v) < 0 || v > (uint64_t)(end - pos))
                goto fallback;
            if (field == F_DELIVERY_HEADERS) {
                int ok = parse_header(buf, pos, pos + (Py_ssize_t)v, headers);
                if (ok < 0)
                    goto done;
                if (ok == 0)
                    goto fallback;
            } else {
                at[field] = pos;
                len[field] = (Py_ssize_t)v;
            }
            pos += (Py_ssize_t)v;
        } else if (wire == WIRE_VARINT && field >= F_DELIVERY_DELIVER_AT && field <= F_DELIVERY_ATTEMPT) {
            Py_ssize_t start = pos;
            if (read_varint(buf, end, &pos, &v) < 0 || (pos - start == 10 && buf[pos - 1] > 1))
                goto fallback; /* malformed, or bits beyond 64: protobuf decides */
            if (field == F_DELIVERY_ATTEMPT && v > UINT32_MAX)
                goto fallback; /* protobuf truncates it: leave that to protobuf */
            ints[field] = v;
        } else {
            goto fallback; /* unknown field or wire type: protobuf decides */
        }
    }
    PyObject *args[DELIVERY_NFIELDS] = {NULL};
    args[0] = utf8_str(buf, at[F_DELIVERY_MESSAGE_ID], len[F_DELIVERY_MESSAGE_ID]);
    args[1] = args[0] ? utf8_str(buf, at[F_DELIVERY_SUBJECT], len[F_DELIVERY_SUBJECT]) : NULL;
    args[2] = args[1] ? PyBytes_FromStringAndSize((const char *)buf + at[F_DELIVERY_PAYLOAD], len[F_DELIVERY_PAYLOAD])
                      : NULL;
    args[3] = Py_NewRef(headers);
    args[4] = args[2] ? PyLong_FromLongLong((int64_t)ints[F_DELIVERY_DELIVER_AT]) : NULL;
    args[5] = args[4] ? PyLong_FromLongLong((int64_t)ints[F_DELIVERY_DISPATCHED_AT]) : NULL;
    args[6] = args[5] ? PyLong_FromUnsignedLongLong(ints[F_DELIVERY_ATTEMPT]) : NULL;
    args[7] = args[6] ? utf8_str(buf, at[F_DELIVERY_ACK_ID], len[F_DELIVERY_ACK_ID]) : NULL;
    args[8] = Py_NewRef(group);
    if (args[7] && slots) {
        if ((result = ((PyTypeObject *)cls)->tp_alloc((PyTypeObject *)cls, 0))) {
            for (int k = 0; k < DELIVERY_NFIELDS; k++) { /* the slots take the references */
                *(PyObject **)((char *)result + slots[k]) = args[k];
                args[k] = NULL;
            }
        }
    } else if (args[7]) {
        result = PyObject_Vectorcall(cls, args, DELIVERY_NFIELDS, NULL);
    } else if (!PyErr_Occurred()) {
        result = Py_NewRef(Py_None); /* a string that is not UTF-8: protobuf words the error */
    }
    for (int k = 0; k < DELIVERY_NFIELDS; k++)
        Py_XDECREF(args[k]);
    goto done;
fallback:
    result = Py_NewRef(Py_None);
done:
    Py_DECREF(headers);
    return result;
}

/* decode_deliveries(raw, cls, group) -> [cls(...), ...] or None
 *
 * The client's deserializer of Subscribe: a SubscribeResponse's wire bytes to a list of
 * ``cls`` (qdelay.client.types.Delivery, called with its fields in order and ``group``),
 * with no protobuf object per delivery. None: parse with protobuf (unknown fields, wire
 * types this code does not expect, strings that are not UTF-8, anything malformed). The
 * Python twin is qdelay/wire.py ``decode_deliveries_py``.
 */
static PyObject *decode_deliveries(PyObject *self, PyObject *args) {
    Py_buffer raw;
    PyObject *cls, *group;
    if (!PyArg_ParseTuple(args, "y*OU", &raw, &cls, &group))
        return NULL;
    const unsigned char *buf = raw.buf;
    Py_ssize_t end = raw.len, pos = 0, offsets[DELIVERY_NFIELDS];
    PyObject *out = NULL;
    int direct = delivery_slots(cls, offsets);
    if (direct < 0 || !(out = PyList_New(0)))
        goto done;
    while (pos < end) {
        uint64_t tag, v;
        if (read_varint(buf, end, &pos, &tag) < 0 || tag != TAG(F_RESPONSE_DELIVERIES, WIRE_LEN) ||
            read_varint(buf, end, &pos, &v) < 0 || v > (uint64_t)(end - pos))
            goto fallback;
        PyObject *d = parse_delivery(buf, pos, pos + (Py_ssize_t)v, cls, direct ? offsets : NULL, group);
        if (!d)
            goto fail;
        if (d == Py_None) {
            Py_DECREF(d);
            goto fallback;
        }
        int added = PyList_Append(out, d);
        Py_DECREF(d);
        if (added < 0)
            goto fail;
        pos += (Py_ssize_t)v;
    }
    goto done;
fallback:
    Py_SETREF(out, Py_NewRef(Py_None));
    goto done;
fail:
    Py_CLEAR(out);
done:
    PyBuffer_Release(&raw);
    return out;
}

/* new_outgoing(cls, subject, payload, deliver_at_ms=None, delay_ms=None, message_id="", headers=None)
 *
 * ``Outgoing.__new__`` (client/client.py): the NamedTuple's generated ``__new__`` is a Python
 * function that builds a tuple and has ``tuple.__new__`` copy it into the instance, ~0.3 us a
 * message on the producer's thread, as much as encoding and sending it; this fills the
 * instance directly. ``cls`` must be a tuple subclass without fields of its own (a
 * NamedTuple); nothing else is checked, as by the generated one. The Python twin is
 * qdelay/wire.py ``new_outgoing_py``.
 */
#define OUTGOING_NFIELDS 6
static const char *outgoing_fields[OUTGOING_NFIELDS] = {"subject", "payload", "deliver_at_ms",
                                                         "delay_ms", "message_id", "headers"};
static PyObject *s_empty;

static PyObject *new_outgoing(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    PyObject *v[OUTGOING_NFIELDS] = {NULL, NULL, Py_None, Py_None, s_empty, Py_None};
    int given[OUTGOING_NFIELDS] = {0};
    if (nargs < 1 || nargs > 1 + OUTGOING_NFIELDS) {
        PyErr_Format(PyExc_TypeError, "__new__() takes from 3 to %d positional arguments but %zd were given",
                     1 + OUTGOING_NFIELDS, nargs);
        return NULL;
    }
    PyObject *cls = args[0];
    if (!PyType_Check(cls) || !PyType_IsSubtype((PyTypeObject *)cls, &PyTuple_Type) ||
        ((PyTypeObject *)cls)->tp_basicsize != PyTuple_Type.tp_basicsize) {
        PyErr_SetString(PyExc_TypeError, "new_outgoing: cls must be a tuple subclass without fields of its own");
        return NULL;
    }
    for (Py_ssize_t i = 1; i < nargs; i++) {
        v[i - 1] = args[i];
        given[i - 1] = 1;
    }
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t k = 0; k < nkw; k++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, k);
        int f = 0;
        while (f < OUTGOING_NFIELDS && PyUnicode_CompareWithASCIIString(name, outgoing_fields[f]) != 0)
            f++;
        if (f == OUTGOING_NFIELDS) {
            PyErr_Format(PyExc_TypeError, "__new__() got an unexpected keyword argument '%U'", name);
            return NULL;
        }
        if (given[f]) {
            PyErr_Format(PyExc_TypeError, "__new__() got multiple values for argument '%s'", outgoing_fields[f]);
            return NULL;
        }
        v[f] = args[nargs + k];
        given[f] = 1;
    }
    for (int f = 0; f < 2; f++)
        if (!given[f]) {
            PyErr_Format(PyExc_TypeError, "__new__() missing required argument: '%s'", outgoing_fields[f]);
            return NULL;
        }
    PyObject *out = ((PyTypeObject *)cls)->tp_alloc((PyTypeObject *)cls, OUTGOING_NFIELDS);
    if (!out)
        return NULL;
    for (int f = 0; f < OUTGOING_NFIELDS; f++)
        PyTuple_SET_ITEM(out, f, Py_NewRef(v[f]));
    return out;
}

static PyMethodDef methods[] = {
    {"encode_send_batch", encode_send_batch, METH_VARARGS, "Append Message entries of a SendBatchRequest (client)."},
    {"encode_outgoing_request", encode_outgoing_request, METH_VARARGS,
     "send_many's SendBatchRequest (compact receipts) of Outgoing items as bytes, and its message ids."},
    {"new_outgoing", (PyCFunction)(void (*)(void))new_outgoing, METH_FASTCALL | METH_KEYWORDS,
     "new_outgoing($module, cls, subject, payload, deliver_at_ms=None, delay_ms=None, message_id='', headers=None)\n"
     "--\n\n"
     "Outgoing.__new__ (client): the tuple's fields filled in directly."},
    {"decode_batch", decode_batch, METH_VARARGS,
     "Parse, validate and encode a SendBatchRequest's wire bytes (fast path); None: use protobuf."},
    {"decode_cancel_batch", decode_cancel_batch, METH_VARARGS,
     "A CancelBatchRequest of plain receipts to its targets (fast path); None: use protobuf."},
    {"encode_messages", encode_messages, METH_VARARGS,
     "Validate and encode a batch of Messages (fast path); None means: use the Python path."},
    {"encode_send_batch_response", encode_send_batch_response, METH_VARARGS,
     "A whole SendBatchResponse, full or compact receipts."},
    {"encode_deliveries", encode_deliveries, METH_VARARGS, "Append Delivery entries of a SubscribeResponse."},
    {"decode_deliveries", decode_deliveries, METH_VARARGS,
     "A SubscribeResponse's wire bytes to a list of Delivery (client); None: use protobuf."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_wire", NULL, -1, methods};

PyMODINIT_FUNC PyInit__wire(void) {
    if (!little_endian_host()) {
        PyErr_SetString(PyExc_ImportError, "qdelay's native wire codec needs a little-endian host");
        return NULL;
    }
    for (int c = 0; c < 256; c++)
        subject_ok[c] = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' ||
                        c == '_' || c == '-';
    if (!(s_empty = PyUnicode_InternFromString("")) || !(s_subject = PyUnicode_InternFromString("subject")) || !(s_payload = PyUnicode_InternFromString("payload")) ||
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
        "{s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,"
        "s:i,s:i,s:i}",
        "qdelay.v1.Message.subject", F_MESSAGE_SUBJECT, "qdelay.v1.Message.payload", F_MESSAGE_PAYLOAD,
        "qdelay.v1.Message.headers", F_MESSAGE_HEADERS, "qdelay.v1.Message.message_id", F_MESSAGE_ID,
        "qdelay.v1.Message.deliver_at_ms", F_MESSAGE_DELIVER_AT, "qdelay.v1.Message.delay_ms", F_MESSAGE_DELAY,
        "qdelay.v1.SendBatchRequest.messages", F_BATCH_MESSAGES,
        "qdelay.v1.SendBatchRequest.compact_receipts", F_BATCH_COMPACT,
        "qdelay.v1.Receipt.message_id", F_RECEIPT_MESSAGE_ID, "qdelay.v1.Receipt.deliver_at_ms", F_RECEIPT_DELIVER_AT,
        "qdelay.v1.Receipt.sequence", F_RECEIPT_SEQUENCE, "qdelay.v1.Receipt.duplicate", F_RECEIPT_DUPLICATE,
        "qdelay.v1.Receipt.shard", F_RECEIPT_SHARD, "qdelay.v1.SendBatchResponse.receipts", F_BATCH_RESPONSE_RECEIPTS,
        "qdelay.v1.SendBatchResponse.first_sequence", F_BATCH_RESPONSE_FIRST_SEQUENCE,
        "qdelay.v1.SendBatchResponse.deliver_at_ms", F_BATCH_RESPONSE_DELIVER_AT,
        "qdelay.v1.SendBatchResponse.shard", F_BATCH_RESPONSE_SHARD,
        "qdelay.v1.SubscribeResponse.deliveries", F_RESPONSE_DELIVERIES,
        "qdelay.v1.Delivery.ack_id", F_DELIVERY_ACK_ID, "qdelay.v1.Delivery.message_id", F_DELIVERY_MESSAGE_ID,
        "qdelay.v1.Delivery.subject", F_DELIVERY_SUBJECT, "qdelay.v1.Delivery.payload", F_DELIVERY_PAYLOAD,
        "qdelay.v1.Delivery.headers", F_DELIVERY_HEADERS, "qdelay.v1.Delivery.deliver_at_ms", F_DELIVERY_DELIVER_AT,
        "qdelay.v1.Delivery.dispatched_at_ms", F_DELIVERY_DISPATCHED_AT,
        "qdelay.v1.Delivery.attempt", F_DELIVERY_ATTEMPT, "qdelay.v1.CancelBatchRequest.requests",
        F_CANCEL_BATCH_REQUESTS, "qdelay.v1.CancelRequest.receipt", F_CANCEL_RECEIPT,
        "qdelay.v1.CancelRequest.message_id", F_CANCEL_MESSAGE_ID);
    if (!fields || PyModule_AddObject(m, "WIRE_FIELDS", fields) < 0) {
        Py_XDECREF(fields);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
