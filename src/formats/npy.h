/* formats/npy.h: NumPy .npy files of integers (token ids), read as uint32.
 *
 * Token files are produced by Python tooling (np.save); ctitan only needs the
 * element values, so the reader returns the flattened C-order elements
 * converted to uint32 and refuses anything it cannot read exactly: float or
 * big-endian dtypes, Fortran order, values outside uint32. The header is
 * untrusted input and is parsed, not evaluated. */
#ifndef CT_FORMATS_NPY_H
#define CT_FORMATS_NPY_H

#include <stddef.h>
#include <stdint.h>

#include "core/err.h"

/* Reads PATH (format 1.0, 2.0 or 3.0; dtype i1/u1/i2/u2/i4/u4/i8/u8,
 * little-endian or native) into a malloc'ed array *out of *n elements
 * (the product of the shape; 1 for a 0-d array). The caller frees *out.
 * On error *out is NULL, *n is 0 and the message names the file (and the
 * element index for a value outside uint32). */
int npy_read_u32(const char *path, uint32_t **out, size_t *n, ct_err *e);

#endif
