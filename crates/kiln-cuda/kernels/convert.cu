// Element type conversions between f32 and bf16, fp16, fp8 (e4m3, e5m2), one element per thread
// in a grid-stride loop.
//
// Memory floor: read n source elements and write n destination elements once. The conversions are
// the prelude's, which round to nearest even exactly like the CPU reference, so the outputs are
// bit-identical to `Tensor::to_dtype` on the host.
#include "kiln_prelude.cuh"

#define KILN_CONVERT(NAME, IN, OUT, EXPR)                                                       \
    extern "C" __global__ void NAME(const IN* __restrict__ in, OUT* __restrict__ out, kiln_u64 n) { \
        kiln_wait_prior();                                                                      \
        for (kiln_u64 i = kiln_global_index(); i < n; i += kiln_grid_stride()) {                \
            IN x = in[i];                                                                        \
            out[i] = EXPR;                                                                       \
        }                                                                                        \
    }

KILN_CONVERT(convert_f32_to_bf16, float, kiln_u16, kiln_f32_to_bf16(x))
KILN_CONVERT(convert_bf16_to_f32, kiln_u16, float, kiln_bf16_to_f32(x))
KILN_CONVERT(convert_f32_to_f16, float, kiln_u16, kiln_f32_to_f16(x))
KILN_CONVERT(convert_f16_to_f32, kiln_u16, float, kiln_f16_to_f32(x))
KILN_CONVERT(convert_f32_to_e4m3, float, kiln_u8, kiln_f32_to_e4m3(x))
KILN_CONVERT(convert_e4m3_to_f32, kiln_u8, float, kiln_e4m3_to_f32(x))
KILN_CONVERT(convert_f32_to_e5m2, float, kiln_u8, kiln_f32_to_e5m2(x))
KILN_CONVERT(convert_e5m2_to_f32, kiln_u8, float, kiln_e5m2_to_f32(x))
