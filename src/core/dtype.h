/* core/dtype.h: element types that appear in files and buffers.
 *
 * Compute is fp32; bf16/f16 exist for reading and writing checkpoints (and,
 * later, bf16 matmul inputs). Conversions round to nearest even, as torch. */
#ifndef CT_CORE_DTYPE_H
#define CT_CORE_DTYPE_H

#include <stddef.h>
#include <stdint.h>

#include "core/err.h"

typedef enum {
    CT_F32 = 0,
    CT_BF16,
    CT_F16,
    CT_F64,
    CT_I64,
    CT_I32,
    CT_I16,
    CT_I8,
    CT_U8,
    CT_U16,
    CT_U32,
    CT_U64,
    CT_BOOL,
    CT_DTYPE_COUNT
} ct_dtype;

size_t ct_dtype_size(ct_dtype t);
/* safetensors spelling: "F32", "BF16", ... */
const char *ct_dtype_name(ct_dtype t);
/* Returns -1 if the name is unknown. */
int ct_dtype_from_name(const char *name);

float ct_bf16_to_f32(uint16_t h);
uint16_t ct_f32_to_bf16(float f);
/* x[i] = ct_bf16_to_f32(ct_f32_to_bf16(x[i])) for i < n, vectorised: fp32 values
 * made bf16 values in place (the attention's operands under bf16 products). */
void ct_round_bf16(float *x, size_t n);
float ct_f16_to_f32(uint16_t h);
uint16_t ct_f32_to_f16(float f);

/* Converts n floating elements of type `src_t` (F32, BF16, F16 or F64) to fp32.
 * Returns 0, or -1 if src_t is not a floating type. */
int ct_convert_to_f32(float *dst, const void *src, ct_dtype src_t, size_t n);
/* Converts n fp32 values to dst_t (F32, BF16 or F16). Returns 0 or -1. */
int ct_convert_from_f32(void *dst, ct_dtype dst_t, const float *src, size_t n);

/* Index of the first inf or NaN of x[0, n), or n when every value is finite:
 * the check before weights are saved or after they are loaded. */
size_t ct_first_nonfinite(const float *x, size_t n);
/* 0, or a CT_ERR_FORMAT naming FILE, tensor NAME and the element (x[0] being
 * element `first` of the tensor) when x[0, n) holds an inf or NaN: the one
 * message for weights read from a file (HF, checkpoint, adapter). */
int ct_check_finite(const float *x, size_t n, size_t first, const char *file, const char *name, ct_err *e);

#endif
