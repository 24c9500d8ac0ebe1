// Embedding lookup: rows of a bf16 / fp16 / fp32 / Q8_0 table picked by token ids, widened to
// fp32 or rounded once to the output type, with each row's sum of squares in the norm's units:
// the CUDA twin of `kiln_core::ops::embedding`, equal to it bit for bit.
//
// Memory floor: one read of each picked table row and one write of each output row (plus 4 bytes
// per row of sums). Each lane moves 8 elements per unit with 16-byte accesses (2-byte ones for
// Q8_0, whose 34-byte blocks are only 2-byte aligned).
//
// Layout: `ids[r]` (u32) picks table row `ids[r]`; the table is `vocab` rows of `row_bytes` bytes
// (Q8_0: `hidden / 32` blocks of an fp16 scale and 32 int8 codes; a value is `f32(d) * q`); `out`
// is `rows x hidden` of OUT_T; `sum_squares[r]` (fp32) is the fixed-order unit sum of the squares
// of output row r. Unit u of a row (elements 256u .. 256u + 256) belongs to warp u % WARPS_PER_ROW
// of the row's warps, lane l holding its elements 8l .. 8l + 8; unit sums combine left to right
// (in a register with one warp per row, through dynamic shared memory, `units` floats per row,
// otherwise).
//
// An id at or past `vocab` gives a zero row (and a zero sum) and sets `*flag` to 1; the kernel never
// clears the flag.
//
// Compile-time constants: TABLE_T (KILN_F32 / KILN_F16 / KILN_BF16, or 3 for Q8_0), OUT_T
// (KILN_F32 / KILN_F16 / KILN_BF16), SUM_SQUARES (0 / 1), WARPS_PER_ROW, ROWS_PER_BLOCK.

#define KILN_TABLE_Q8_0 3

// Elements col .. col + 8 of a table row, widened to fp32.
__device__ __forceinline__ void kiln_embedding_load8(const unsigned char* row, int col, float v[8]) {
    if (TABLE_T == KILN_TABLE_Q8_0) {
        const unsigned char* block = row + (long long)(col >> 5) * 34;
        const float d = kiln_f16_to_f32(*reinterpret_cast<const unsigned short*>(block));
        const unsigned short* codes = reinterpret_cast<const unsigned short*>(block + 2 + (col & 31));
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const unsigned short pair = codes[e];
            v[2 * e] = d * (float)(signed char)(pair & 0xFF);
            v[2 * e + 1] = d * (float)(signed char)(pair >> 8);
        }
    } else {
        kiln_load8<(TABLE_T == KILN_TABLE_Q8_0 ? KILN_F32 : TABLE_T)>(row, col, v);
    }
}

extern "C" __global__ void __launch_bounds__(32 * WARPS_PER_ROW * ROWS_PER_BLOCK)
kiln_embedding(const unsigned int* __restrict__ ids, const unsigned char* __restrict__ table,
               void* __restrict__ out, float* __restrict__ sum_squares, unsigned int* flag, long long rows,
               int hidden, unsigned int vocab, long long row_bytes) {
    kiln_wait_prior();
    extern __shared__ float unit_sums[];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warp_in_row = warp % WARPS_PER_ROW;
    const int row_in_block = warp / WARPS_PER_ROW;
    const long long row = (long long)blockIdx.x * ROWS_PER_BLOCK + row_in_block;
    const bool active = row < rows;
    const unsigned int id = active ? ids[row] : 0u;
    const bool known = id < vocab;
    if (active && !known && warp_in_row == 0 && lane == 0) *flag = 1u;
    const unsigned char* source = table + (known ? (long long)id * row_bytes : 0);
    const int units = (hidden + 255) >> 8;
    float* row_sums = unit_sums + row_in_block * units;

    float total = 0.0f;
    for (int unit = warp_in_row; unit < units; unit += WARPS_PER_ROW) {
        const int col = unit * 256 + lane * 8;
        const bool valid = active && col < hidden;
        float v[8];
        if (valid && known) {
            kiln_embedding_load8(source, col, v);
#pragma unroll
            for (int e = 0; e < 8; ++e) v[e] = kiln_round<OUT_T>(v[e]);
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) v[e] = 0.0f;
        }
        if (valid) kiln_store8<OUT_T>(out, row * hidden + col, v);
        if (SUM_SQUARES) {
            float sq[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) sq[e] = v[e] * v[e];
            const float s = kiln_unit_reduce(kiln_lane_sum8(sq));
            if (WARPS_PER_ROW == 1) {
                total += s;
            } else if (lane == 0) {
                row_sums[unit] = s;
            }
        }
    }
    if (SUM_SQUARES) {
        if (WARPS_PER_ROW > 1) {
            __syncthreads();
            if (warp_in_row == 0 && lane == 0) {
                for (int i = 0; i < units; ++i) total += row_sums[i];
            }
        }
        if (active && warp_in_row == 0 && lane == 0) sum_squares[row] = total;
    }
}
