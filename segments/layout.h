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
#define MESSAGE_FIXED 20 /* due i64, subject_len u16, message_id_len u16, headers_len u32, payload_len u32 */

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
    put_u16(b + 8, (uint16_t)slen);
    put_u16(b + 10, (uint16_t)mlen);
    put_u32(b + 12, 0);
    put_u32(b + 16, (uint32_t)plen);
    memcpy(b + MESSAGE_FIXED, subject, (size_t)slen);
    memcpy(b + MESSAGE_FIXED + slen, mid, (size_t)mlen);
    memcpy(b + MESSAGE_FIXED + slen + mlen, payload, (size_t)plen);
    return body;
}

#endif
