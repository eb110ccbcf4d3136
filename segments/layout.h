/* The frame and MESSAGE body layouts of docs/formats.md, for the C code that reads or writes
 * them: the storage codec (segments/_codec.c) and the wire codec (qdelay/_wire.c, which
 * turns a SendBatchRequest straight into MESSAGE bodies). Named once here; the Python
 * reference is segments/framing.py and segments/records.py, which check their own layout
 * at import, and tests/test_codec_native.py checks that both languages write the same bytes.
 *
 * Include after <Python.h>. The host must be little-endian (the formats are): both
 * modules refuse to load otherwise.
 */
#ifndef QDELAY_LAYOUT_H
#define QDELAY_LAYOUT_H

#include <stdint.h>
#include <string.h>

#define MAGIC 0x31445151u /* "QQD1" read little-endian */
#define VERSION 1
#define HEADER_SIZE 36
#define CHECKED_FROM 12
/* where the header's fields start (segments/framing.py: the same names) */
#define CHECKSUM_AT 4
#define LENGTH_AT 12
#define KIND_AT 16
#define VERSION_AT 17
#define FLAGS_AT 18
#define SEQUENCE_AT 20
#define TIMESTAMP_AT 28
#define KIND_MESSAGE 1 /* RecordKind */
#define KIND_CANCEL 2
#define KIND_DISPATCH 3
/* MESSAGE body: due i64, subject_len u16, message_id_len u16, headers_len u32, payload_len u32 */
#define MESSAGE_FIXED 20
#define MESSAGE_SUBJECT_LEN_AT 8
#define MESSAGE_ID_LEN_AT 10
#define MESSAGE_HEADERS_LEN_AT 12
#define MESSAGE_PAYLOAD_LEN_AT 16
/* CANCEL body: target due i64, target sequence u64, message_id_len u16, message_id */
#define CANCEL_FIXED 18
#define CANCEL_TARGET_SEQUENCE_AT 8
/* schedule index entry (docs/formats.md, "Schedule index"; segments/schedule_index.py):
 * sequence u64, offset u48 | kind u8 | flags u8, then two 8-byte fields by kind */
#define SIDX_ENTRY 32
/* DISPATCH body: due i64, dispatched_at i64, schedule_offset u64, attempt u32, outcome u8,
 * group_len u8, message_id_len u16 (segments/records.py DISPATCH_FIXED) */
#define DISPATCH_FIXED 32
#define DISPATCH_DISPATCHED_AT 8
#define DISPATCH_SCHEDULE_OFFSET_AT 16
#define DISPATCH_ATTEMPT_AT 24
#define DISPATCH_OUTCOME_AT 28
#define DISPATCH_GROUP_LEN_AT 29
#define DISPATCH_ID_LEN_AT 30

_Static_assert(CHECKED_FROM == LENGTH_AT, "the checksum covers the header from the length on");
_Static_assert(TIMESTAMP_AT + 8 == HEADER_SIZE, "the timestamp is the header's last field");
_Static_assert(MESSAGE_PAYLOAD_LEN_AT + 4 == MESSAGE_FIXED, "the payload length ends MESSAGE's fixed part");
_Static_assert(DISPATCH_ID_LEN_AT + 2 == DISPATCH_FIXED, "the id length ends DISPATCH's fixed part");

static inline uint32_t get_u32(const unsigned char *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint64_t get_u64(const unsigned char *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static inline void put_u16(unsigned char *p, uint16_t v) { memcpy(p, &v, 2); }
static inline void put_u32(unsigned char *p, uint32_t v) { memcpy(p, &v, 4); }
static inline void put_u64(unsigned char *p, uint64_t v) { memcpy(p, &v, 8); }

static inline int little_endian_host(void) {
    const uint16_t one = 1;
    return *(const unsigned char *)&one == 1;
}

/* A MESSAGE body (docs/formats.md, "Record bodies"): fixed part, subject, message id, no
 * headers, payload. A new reference, or NULL with an exception set. */
static inline PyObject *message_body(long long due, const void *subject, Py_ssize_t slen, const void *mid,
                                     Py_ssize_t mlen, const void *payload, Py_ssize_t plen) {
    PyObject *body = PyBytes_FromStringAndSize(NULL, MESSAGE_FIXED + slen + mlen + plen);
    if (!body)
        return NULL;
    unsigned char *b = (unsigned char *)PyBytes_AS_STRING(body);
    put_u64(b, (uint64_t)due);
    put_u16(b + MESSAGE_SUBJECT_LEN_AT, (uint16_t)slen);
    put_u16(b + MESSAGE_ID_LEN_AT, (uint16_t)mlen);
    put_u32(b + MESSAGE_HEADERS_LEN_AT, 0);
    put_u32(b + MESSAGE_PAYLOAD_LEN_AT, (uint32_t)plen);
    memcpy(b + MESSAGE_FIXED, subject, (size_t)slen);
    memcpy(b + MESSAGE_FIXED + slen, mid, (size_t)mlen);
    memcpy(b + MESSAGE_FIXED + slen + mlen, payload, (size_t)plen);
    return body;
}

#endif
