/* A Python int as a C integer, for the per-record loops of both native codecs (the storage
 * codec, segments/_codec.c, and the wire codec, qdelay/_wire.c). Include after <Python.h>.
 *
 * CPython 3.11's PyLong_AsLongLong and PyLong_AsUnsignedLongLong take a slow general path
 * (_PyLong_AsByteArray) for any value of more than one 30-bit digit, which every due time in
 * milliseconds is: ~12 ns each, half of what a DISPATCH frame cost to encode. PyLong_AsLong
 * and PyLong_AsUnsignedLong loop over the digits; where long is 64 bits (LP64) they give the
 * same results and errors. */
#ifndef QDELAY_PYINT_H
#define QDELAY_PYINT_H

#include <limits.h>

#if LONG_MAX == LLONG_MAX
#define AS_I64(o) ((long long)PyLong_AsLong(o))
#define AS_U64(o) ((unsigned long long)PyLong_AsUnsignedLong(o))
#else
#define AS_I64(o) PyLong_AsLongLong(o)
#define AS_U64(o) PyLong_AsUnsignedLongLong(o)
#endif

#endif /* QDELAY_PYINT_H */
