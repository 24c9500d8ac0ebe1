// Pure-read bandwidth: contiguous vs 256-byte runs at a 2 KiB stride (one head of a page
// laid out [token][head][dim]), 8 "heads" handled by different blocks.
#include <cstdio>
#include <cuda_runtime.h>
__global__ void rd_contig(const int4* __restrict__ p, size_t n16, int4* out, int unroll) {
  int4 acc = make_int4(0,0,0,0);
  size_t tid = blockIdx.x * (size_t)blockDim.x + threadIdx.x, nt = (size_t)gridDim.x * blockDim.x;
  for (size_t i = tid; i < n16; i += nt * 4) {
    int4 v[4];
#pragma unroll
    for (int u = 0; u < 4; u++) { size_t j = i + u * nt; v[u] = j < n16 ? __ldg(p + j) : make_int4(0,0,0,0); }
#pragma unroll
    for (int u = 0; u < 4; u++) { acc.x ^= v[u].x; acc.y ^= v[u].y; acc.z ^= v[u].z; acc.w ^= v[u].w; }
  }
  if (acc.x == 0x12345 && acc.y == 7) out[0] = acc;
}
// chunk-contiguous: each block owns a contiguous chunk (like a split of one head, unpaged)
__global__ void rd_chunk(const int4* __restrict__ p, size_t per_block16, int4* out) {
  const int4* b = p + blockIdx.x * per_block16;
  int4 acc = make_int4(0,0,0,0);
  for (size_t i = threadIdx.x; i < per_block16; i += blockDim.x * 4) {
    int4 v[4];
#pragma unroll
    for (int u = 0; u < 4; u++) { size_t j = i + u * blockDim.x; v[u] = j < per_block16 ? __ldg(b + j) : make_int4(0,0,0,0); }
#pragma unroll
    for (int u = 0; u < 4; u++) { acc.x ^= v[u].x; acc.y ^= v[u].y; acc.z ^= v[u].z; acc.w ^= v[u].w; }
  }
  if (acc.x == 0x12345 && acc.y == 7) out[0] = acc;
}
// strided: block (split s, head h) reads 256-byte runs at a 2 KiB stride: rows t of [T][8][128] bf16
__global__ void rd_strided(const int4* __restrict__ p, size_t rows_per_block, int heads, int4* out) {
  int h = blockIdx.x % heads, s = blockIdx.x / heads;
  const int4* b = p + (size_t)s * rows_per_block * heads * 16 + h * 16;  // 16 int4 = 256 B per row
  int4 acc = make_int4(0,0,0,0);
  size_t n = rows_per_block * 16;
  for (size_t i = threadIdx.x; i < n; i += blockDim.x * 4) {
    int4 v[4];
#pragma unroll
    for (int u = 0; u < 4; u++) { size_t j = i + u * blockDim.x; v[u] = j < n ? __ldg(b + (j / 16) * heads * 16 + (j % 16)) : make_int4(0,0,0,0); }
#pragma unroll
    for (int u = 0; u < 4; u++) { acc.x ^= v[u].x; acc.y ^= v[u].y; acc.z ^= v[u].z; acc.w ^= v[u].w; }
  }
  if (acc.x == 0x12345 && acc.y == 7) out[0] = acc;
}
__global__ void cp(const int4* __restrict__ a, int4* __restrict__ b, size_t n16) {
  size_t tid = blockIdx.x * (size_t)blockDim.x + threadIdx.x, nt = (size_t)gridDim.x * blockDim.x;
  for (size_t i = tid; i < n16; i += nt) b[i] = a[i];
}
int main() {
  size_t bytes = 4ull << 30; int4 *p, *q, *o; cudaMalloc(&p, bytes); cudaMalloc(&q, bytes / 2); cudaMalloc(&o, 64);
  cudaMemset(p, 1, bytes); size_t n16 = bytes / 16;
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1); float ms;
  auto time = [&](const char* name, double gb, auto f) {
    f(); cudaDeviceSynchronize(); float best = 1e9;
    for (int r = 0; r < 10; r++) { cudaEventRecord(e0); f(); cudaEventRecord(e1); cudaEventSynchronize(e1); cudaEventElapsedTime(&ms, e0, e1); if (ms < best) best = ms; }
    printf("%-44s %8.1f us  %7.1f GB/s\n", name, best * 1e3, gb / (best * 1e-3)); };
  time("copy 2 GiB (read+write counted)", bytes / 1e9, [&]{ cp<<<132*16, 256>>>(p, q, n16 / 2); });
  for (int bpsm : {2, 4, 8, 16}) { char nm[64]; sprintf(nm, "read contig grid-stride %d blk/SM", bpsm);
    time(nm, bytes / 1e9, [&]{ rd_contig<<<132*bpsm, 256>>>(p, n16, o, 4); }); }
  for (int nb : {128, 256, 512, 1024, 2048}) { char nm[64]; sprintf(nm, "read chunk-contig %d blocks", nb);
    time(nm, bytes / 1e9, [&]{ rd_chunk<<<nb, 256>>>(p, n16 / nb, o); }); }
  for (int nb : {128, 256, 512, 1024, 2048}) { char nm[64]; sprintf(nm, "read strided 256B/2KiB %d blocks", nb);
    size_t rows = bytes / 2048 / (nb / 8);
    time(nm, bytes / 1e9, [&]{ rd_strided<<<nb, 256>>>(p, rows, 8, o); }); }
  return 0;
}
