// Routed-MoE kernels for Hopper (sm_90), compiled through CuPy/NVRTC or nvcc: routing permutation,
// a grouped "swap-AB" GEMM for every weight format (mma.sync on tensor cores, weights streamed from
// HBM straight into registers, dequantized there), fused activations, FP8 activation quantization and
// the weighted combine.
//
// No CUDA headers are included (NVRTC finds none without extra include paths): bf16/fp8 conversions
// are inline PTX or bit arithmetic. The GEMM is a template; extern "C" entry points are stamped out
// by MOE_GEMM_INSTANCE lines that runtime/kernels/__init__.py appends for the variants it needs.
//
// Design of the GEMM (docs/runtime.md, CUPY; measurements in BENCHMARKS.md):
//  * "swap AB": the weight rows (output features) are the MMA's M dimension (16 rows per m-tile) and
//    the tokens routed to one expert its N dimension (8 per n-fragment). Decode batches route a few
//    tokens to each expert, so N is small and the kernel is a grouped GEMV that streams each active
//    expert's weights once.
//  * K is walked in chunks of 64; lane t (= lane % 4) of a quad owns 16 consecutive K elements of the
//    chunk for both operands. Because K is a reduction, any permutation of K shared by A and B is
//    exact, so each lane loads its weights and activations with 16-byte (8 for fp4) vector loads and
//    feeds them to the MMA without shuffles or shared memory.
//  * gate and up rows are interleaved in blocks of 8 at load time, so one m-tile holds gate rows
//    (g) and the matching up rows (g + 8) and the activation is computed in registers.
//  * FP4 weights and their block scales are stored in tiles of 16 rows x 64 K elements at load time, so an
//    m-tile's chunk is one contiguous 512-byte read (WTraits::STEP) and a run of its chunks one span.
//  * the staged variant (W4A16 decode tiles, moe_gemm_staged_impl) moves the weight stream off the warps
//    that compute: a producer warp bulk-copies those spans and the token rows into shared memory ahead of
//    four consumer warps, which run the same chunk math (mma_chunk_bf16) and epilogue (store_tile).
//  * a persistent grid walks (token tile, n-block) items; the item count comes from the device, so
//    nothing is read back to the host and the whole op is CUDA-graph capturable.
//  * pair tiles (the `_pairs` entry points) skip the sort for one-token calls, whose top-k experts
//    are distinct, and for calls whose shared experts are cheap to read again: tile p is routing pair
//    p (its expert read from the ids, one row), so neither GEMM needs moe_align's arrays, and the
//    GEMM2 also runs the combine (combine_tile, by its token's last pair per 16 channels): two launches fewer.
//  * every kernel is launched with programmatic dependent launch and waits (griddepcontrol.wait) before
//    it reads an earlier kernel's output, with coherent loads only; GEMM2 issues its first weight loads
//    before its wait, overlapping GEMM1's end.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define WF_BF16 0
#define WF_FP8B 1
#define WF_MXFP4 2
#define WF_NVFP4 3

#define AQ_NONE 0       // bf16 activations
#define AQ_GROUP128 1   // FP8 E4M3 codes, fp32 scale per token per 128 channels (fp8_block_scales)
#define AQ_TOKEN 2      // FP8 E4M3 codes, fp32 scale per token (w4a8_mxfp4_fp8), K permuted per 64-chunk

#define EPI_GATED 0     // GEMM1 of silu_glu / swiglu_oai: gate/up interleaved, writes bf16 h
#define EPI_RELU2 1     // GEMM1 of relu2 (no gate), writes bf16 h
#define EPI_DOWN 2      // GEMM2, writes fp32 y (combine adds bias and routing weight)

#define ACT_SILU 0
#define ACT_SWIGLU_OAI 1

#define THREADS 128     // 4 warps per CTA; each warp owns MT m-tiles of the CTA's n-block

// ------------------------------------------------------------------------------------------------
// small helpers
// ------------------------------------------------------------------------------------------------
__device__ __forceinline__ float bf16_to_f32(u16 h) { return __uint_as_float(((u32)h) << 16); }

__device__ __forceinline__ u16 f32_to_bf16(float f) {
  u16 r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
  return r;
}

// Four fp32 rounded to bf16 and stored as one 8-byte word at dst.
__device__ __forceinline__ void store_bf16x4(u16* dst, const float (&v)[4]) {
  uint2 o;
  o.x = (u32)f32_to_bf16(v[0]) | ((u32)f32_to_bf16(v[1]) << 16);
  o.y = (u32)f32_to_bf16(v[2]) | ((u32)f32_to_bf16(v[3]) << 16);
  *reinterpret_cast<uint2*>(dst) = o;
}

// v[i] += b[i] for four channels, b read as one float4.
__device__ __forceinline__ void add4(float (&v)[4], const float* b) {
  const float4 x = *reinterpret_cast<const float4*>(b);
  v[0] += x.x; v[1] += x.y; v[2] += x.z; v[3] += x.w;
}

// Two fp32 -> E4M3 (round to nearest even, saturating at +-448); lo in the low byte.
__device__ __forceinline__ u16 f32x2_to_e4m3x2(float lo, float hi) {
  u16 r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}

// E4M3 byte -> fp32, exact (integer decode: no conversion instruction needed).
__device__ __forceinline__ float e4m3_to_f32(u32 b) {
  u32 e = (b >> 3) & 15u, m = b & 7u;
  float v = e ? __uint_as_float(((e + 120u) << 23) | (m << 20)) : (float)m * 0.001953125f;  // 2^-9
  return (b & 0x80u) ? -v : v;
}

__device__ __forceinline__ uint4 ldg_stream16(const void* p) {   // weights: read once, skip L1
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ uint2 ldg_stream8(const void* p) {
  uint2 v;
  asm("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}
// Activations, the token rows an earlier kernel of the op wrote (shared by the warps, cached in L1): a
// coherent load, never ld.global.nc. ptxas takes .nc data for read-only over the kernel's whole life and
// moves such loads above griddepcontrol.wait (seen in the SASS of GEMM2), where the previous kernel may
// still be writing them. For the same reason no pointer to an earlier kernel's output is __restrict__
// (which would let the compiler pick .nc loads itself); weights, scales and biases stay read-only.
__device__ __forceinline__ uint4 ldg16(const void* p) {
  uint4 v;
  asm volatile("ld.global.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// Programmatic dependent launch (runtime/kernels/driver.py launches every kernel of this module with
// it): a kernel may start while the previous kernel of the stream finishes, so each one waits for its
// predecessor's completion (and memory) before touching anything that kernel, or one before it, writes,
// and then lets its own successor start. Both are no-ops for a launch without the attribute.
__device__ __forceinline__ void grid_dependency_wait() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_then_release() {
  grid_dependency_wait();
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma_e4m3(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Sum and max over the 32 lanes of a warp (butterfly: every lane gets the result, in the same order).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

// bf16x2 multiply (subnormal inputs are supported by the half-precision FMA path).
__device__ __forceinline__ u32 bf16x2_mul(u32 a, u32 b) {
  u32 d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
  return d;
}

// FP4 E2M1 word (8 elements, bit layout of runtime/kernels/layouts.py: BF16_WORD) -> 4 bf16x2 pairs
// holding value * 2^-126; the caller multiplies by the block scale * 2^126. 13 integer ops per 8
// elements: the magnitude fields of pair j sit 3*j bits apart and the signs in the leftover bits.
__device__ __forceinline__ void fp4_to_bf16x8(u32 x, u32 (&p)[4]) {
  const u32 MAG = 0x01C001C0u, SGN = 0x80008000u;
  p[0] = x & (MAG | SGN);
  p[1] = ((x >> 3) & MAG) | ((x << 15) & SGN);
  p[2] = ((x >> 6) & MAG) | ((x << 14) & SGN);
  p[3] = ((x << 3) & MAG) | ((x << 13) & SGN);
}

// FP4 E2M1 word (layout E4M3_WORD) -> 8 E4M3 bytes holding value * 2^-6 (exact, subnormals too).
__device__ __forceinline__ void fp4_to_e4m3x8(u32 x, u32& lo, u32& hi) {
  const u32 MAG = 0x1C1C1C1Cu, SGN = 0x80808080u;
  lo = (x & MAG) | ((x << 7) & SGN);
  hi = ((x >> 3) & MAG) | ((x << 6) & SGN);
}

__device__ __forceinline__ float act_gated(int kind, float g, float u, float alpha, float limit) {
  if (kind == ACT_SWIGLU_OAI) {
    g = fminf(g, limit);
    u = fminf(fmaxf(u, -limit), limit);
    return (u + 1.0f) * (g / (1.0f + expf(-alpha * g)));
  }
  return g / (1.0f + expf(-g)) * u;
}

// ------------------------------------------------------------------------------------------------
// routing: counting sort of (token, slot) pairs by local expert, and the GEMM tile list
// ------------------------------------------------------------------------------------------------
// Pair p's local expert: its global id through this rank's map, or -1 (a dropped slot or another rank's expert).
__device__ __forceinline__ int local_expert(const long long* ids, const int* __restrict__ local_map,
                                            int num_experts, int p) {
  const long long g = ids[p];
  return (g >= 0 && g < num_experts) ? local_map[g] : -1;
}

// The sort's two passes over pairs first, first + blockDim.x, ... below `end` (first: p0 + the thread's
// index): count each local expert's pairs into `hist`, then place each pair at the next row `cursor`
// hands out for its expert.
__device__ __forceinline__ void align_count(const long long* ids, const int* __restrict__ local_map,
                                            int num_experts, int first, int end, int* hist) {
  for (int p = first; p < end; p += blockDim.x) {
    const int e = local_expert(ids, local_map, num_experts, p);
    if (e >= 0) atomicAdd(&hist[e], 1);
  }
}

__device__ __forceinline__ void align_place(const long long* ids, const int* __restrict__ local_map,
                                            int num_experts, int first, int end, int* cursor,
                                            int* __restrict__ sorted_pair, int* __restrict__ sorted_expert,
                                            int* __restrict__ pair_pos) {
  for (int p = first; p < end; p += blockDim.x) {
    const int e = local_expert(ids, local_map, num_experts, p);
    int pos = -1;
    if (e >= 0) {
      pos = atomicAdd(&cursor[e], 1);
      sorted_pair[pos] = p;
      sorted_expert[pos] = e;
    }
    pair_pos[p] = pos;
  }
}

// One CTA of 1024 threads. ids [P] int64 global expert ids; local_map [E] global -> local or -1.
// Writes offs [El + 1], sorted_pair [P] (pair index by sorted row), sorted_expert [P], pair_pos [P]
// (sorted row of each pair or -1), tiles (expert, first row) of at most `bt` rows, num_tiles.
__device__ __forceinline__ int block_exclusive_scan(int v, int* warp_sums, int& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    int y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int w = lane < (int)(blockDim.x >> 5) ? warp_sums[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      int y = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += y;
    }
    warp_sums[lane] = w;   // inclusive
  }
  __syncthreads();
  int base = warp ? warp_sums[warp - 1] : 0;
  total = warp_sums[(blockDim.x >> 5) - 1];
  __syncthreads();
  return base + x - v;
}

// From each local expert's count `cnt` (thread e holds expert e's; every thread of the CTA calls it, for its
// two block scans): offs, the tiles of at most `bt` rows and num_tiles. `first_row(start)` runs for each
// expert's thread with the expert's first sorted row, before its tiles are written.
template <typename F>
__device__ __forceinline__ void align_offsets(int cnt, int El, int bt, int* warp_sums, int* __restrict__ offs,
                                              int* __restrict__ tile_expert, int* __restrict__ tile_row,
                                              int* __restrict__ num_tiles, F first_row) {
  const int tid = threadIdx.x;
  int total;
  const int start = block_exclusive_scan(cnt, warp_sums, total);
  const int ntile = (cnt + bt - 1) / bt;
  int ntotal;
  const int tstart = block_exclusive_scan(ntile, warp_sums, ntotal);
  if (tid < El) {
    offs[tid] = start;
    first_row(start);
    for (int j = 0; j < ntile; ++j) {
      tile_expert[tstart + j] = tid;
      tile_row[tstart + j] = start + j * bt;
    }
  }
  if (tid == 0) {
    offs[El] = total;
    num_tiles[0] = ntotal;
  }
}

extern "C" __global__ void __launch_bounds__(1024) moe_align(
    const long long* ids, const int* __restrict__ local_map, int num_experts, int P, int El,
    int bt, int* __restrict__ offs, int* __restrict__ sorted_pair, int* __restrict__ sorted_expert,
    int* __restrict__ pair_pos, int* __restrict__ tile_expert, int* __restrict__ tile_row,
    int* __restrict__ num_tiles) {
  wait_then_release();
  __shared__ int hist[1024];
  __shared__ int cursor[1024];
  __shared__ int warp_sums[32];
  const int tid = threadIdx.x;
  for (int e = tid; e < El; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  align_count(ids, local_map, num_experts, tid, P, hist);
  __syncthreads();
  // El <= 1024 (checked on the host): one expert per thread
  align_offsets(tid < El ? hist[tid] : 0, El, bt, warp_sums, offs, tile_expert, tile_row, num_tiles,
                [&](int start) { cursor[tid] = start; });
  __syncthreads();
  align_place(ids, local_map, num_experts, tid, P, cursor, sorted_pair, sorted_expert, pair_pos);
}

// Prefill-sized calls: the same counting sort over many CTAs of `cta_pairs` pairs each, as one CTA
// stores its P scattered rows through one SM (142 us at 65k pairs on an H200). CTA b of
// moe_align_count counts its pairs per local expert into counts[b][El]; the last CTA to
// finish (a ticket the module keeps at zero between calls) turns the counts into each CTA's first
// sorted row per expert and writes offs, the tiles and num_tiles as moe_align does. moe_align_scatter
// then places each CTA's pairs from its rows. Same outputs as moe_align, up to the order of the pairs
// of one expert (which no consumer depends on).
extern "C" __global__ void __launch_bounds__(1024) moe_align_count(
    const long long* ids, const int* __restrict__ local_map, int num_experts, int P, int El,
    int bt, int cta_pairs, int* __restrict__ counts, unsigned int* __restrict__ ticket, int* __restrict__ offs,
    int* __restrict__ tile_expert, int* __restrict__ tile_row, int* __restrict__ num_tiles) {
  wait_then_release();
  __shared__ int hist[1024];
  __shared__ int warp_sums[32];
  __shared__ bool last;
  const int tid = threadIdx.x, cta = blockIdx.x;
  for (int e = tid; e < El; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  align_count(ids, local_map, num_experts, cta * cta_pairs + tid, min(P, (cta + 1) * cta_pairs), hist);
  __syncthreads();
  for (int e = tid; e < El; e += blockDim.x) counts[(size_t)cta * El + e] = hist[e];
  __threadfence();
  __syncthreads();
  if (tid == 0) last = atomicAdd(ticket, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  // the last CTA: one expert per thread (El <= 1024), its count summed over the CTAs, each CTA's
  // share turned into its first row (relative to the expert's first, then absolute)
  int cnt = 0;
  if (tid < El)
    for (int b = 0; b < (int)gridDim.x; ++b) {
      const int c = __ldcg(&counts[(size_t)b * El + tid]);
      counts[(size_t)b * El + tid] = cnt;
      cnt += c;
    }
  align_offsets(cnt, El, bt, warp_sums, offs, tile_expert, tile_row, num_tiles, [&](int start) {
    for (int b = 0; b < (int)gridDim.x; ++b) counts[(size_t)b * El + tid] += start;
  });
  if (tid == 0) *ticket = 0u;   // for the next call (stream order: no other CTA of this launch reads it again)
}

extern "C" __global__ void __launch_bounds__(1024) moe_align_scatter(
    const long long* ids, const int* __restrict__ local_map, int num_experts, int P, int El,
    int cta_pairs, const int* counts, int* __restrict__ sorted_pair,
    int* __restrict__ sorted_expert, int* __restrict__ pair_pos) {
  wait_then_release();
  __shared__ int cursor[1024];
  const int tid = threadIdx.x, cta = blockIdx.x;
  for (int e = tid; e < El; e += blockDim.x) cursor[e] = counts[(size_t)cta * El + e];
  __syncthreads();
  align_place(ids, local_map, num_experts, cta * cta_pairs + tid, min(P, (cta + 1) * cta_pairs), cursor,
              sorted_pair, sorted_expert, pair_pos);
}

// ------------------------------------------------------------------------------------------------
// FP8 activation quantization (dynamic scales, the formulas of runtime/formats/fp8.py)
// ------------------------------------------------------------------------------------------------
// One CTA (128 threads) per row of x [R, K] bf16; rows >= *valid_rows (if given) are skipped.
// mode 1: scale per 128 channels -> s [R, K/128]; codes in the canonical order.
// mode 2: one scale per row -> s [R]; codes permuted inside each 64-chunk so that chunk element
//         32*s + 8*t + i lands at byte 16*t + 8*s + i (the k32 steps of the w4a8 GEMM).
// Each thread issues its 16-byte loads of up to QUANT_PASSES passes (of 1024 elements) before it uses any:
// a loop of load, quantize, store waited one L2 round trip per pass, seven in a row for a 7168-wide row.
#define QUANT_PASSES 8
__device__ __forceinline__ void quant_load(const u16* row, int K, int base, uint4 (&v)[QUANT_PASSES]) {
#pragma unroll
  for (int p = 0; p < QUANT_PASSES; ++p) {
    const int i = base + p * 1024 + threadIdx.x * 8;
    if (i < K) v[p] = ldg16(row + i);
  }
}

extern "C" __global__ void __launch_bounds__(128) quant_fp8_rows(
    const u16* x, const int* valid_rows, u8* __restrict__ q, float* __restrict__ s,
    int K, int mode) {
  wait_then_release();
  const int r = blockIdx.x;
  if (valid_rows && r >= valid_rows[0]) return;
  const u16* row = x + (size_t)r * K;
  u8* qrow = q + (size_t)r * K;
  __shared__ float red[4];
  float row_scale = 0.f;
  uint4 v[QUANT_PASSES];
  if (mode == 2) {
    float amax = 0.f;
    for (int base = 0; base < K; base += 1024 * QUANT_PASSES) {
      quant_load(row, K, base, v);
#pragma unroll
      for (int p = 0; p < QUANT_PASSES; ++p) {
        if (base + p * 1024 + threadIdx.x * 8 >= K) break;
        const u32 w[4] = {v[p].x, v[p].y, v[p].z, v[p].w};
#pragma unroll
        for (int j = 0; j < 4; ++j)
          amax = fmaxf(amax, fmaxf(fabsf(bf16_to_f32(w[j] & 0xffff)), fabsf(bf16_to_f32(w[j] >> 16))));
      }
    }
    amax = warp_max(amax);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = amax;
    __syncthreads();
    amax = fmaxf(fmaxf(red[0], red[1]), fmaxf(red[2], red[3]));
    row_scale = fmaxf(amax, 1e-4f) / 448.0f;
    if (threadIdx.x == 0) s[r] = row_scale;
  }
  for (int base = 0; base < K; base += 1024 * QUANT_PASSES) {
    quant_load(row, K, base, v);
#pragma unroll
    for (int p = 0; p < QUANT_PASSES; ++p) {
      if (base + p * 1024 >= K) break;   // the same for every thread: the shuffles below see whole warps
      const int i = base + p * 1024 + threadIdx.x * 8;
      const bool in = i < K;
      float f[8];
      if (in) {
        const u32 w[4] = {v[p].x, v[p].y, v[p].z, v[p].w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          f[2 * j] = bf16_to_f32(w[j] & 0xffff);
          f[2 * j + 1] = bf16_to_f32(w[j] >> 16);
        }
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) f[j] = 0.f;
      }
      float scale = row_scale;
      if (mode == 1) {   // 16 lanes (a half warp) hold one 128-group; K % 128 == 0 keeps groups whole
        float amax = 0.f;
#pragma unroll
        for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fabsf(f[j]));
#pragma unroll
        for (int o = 8; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        scale = fmaxf(amax, 1e-4f) / 448.0f;
        if (in && (threadIdx.x & 15) == 0) s[(size_t)r * (K / 128) + i / 128] = scale;
      }
      if (!in) continue;
      u32 out0 = (u32)f32x2_to_e4m3x2(f[0] / scale, f[1] / scale) | ((u32)f32x2_to_e4m3x2(f[2] / scale, f[3] / scale) << 16);
      u32 out1 = (u32)f32x2_to_e4m3x2(f[4] / scale, f[5] / scale) | ((u32)f32x2_to_e4m3x2(f[6] / scale, f[7] / scale) << 16);
      int dst = i;
      if (mode == 2) {
        const int c = i & 63;
        dst = (i - c) + 16 * ((c & 31) >> 3) + 8 * (c >> 5);
      }
      uint2 packed;
      packed.x = out0;
      packed.y = out1;
      *reinterpret_cast<uint2*>(qrow + dst) = packed;
    }
  }
}

// ------------------------------------------------------------------------------------------------
// prefill helpers around torch._grouped_mm (bf16): gather, activation, both on sorted rows
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(128) gather_rows(
    const u16* x, const int* sorted_pair, const int* offs_total,
    u16* __restrict__ out, int K, int topk) {
  wait_then_release();
  const int s = blockIdx.x;
  if (s >= offs_total[0]) return;
  const int tok = sorted_pair[s] / topk;
  const uint4* src = reinterpret_cast<const uint4*>(x + (size_t)tok * K);
  uint4* dst = reinterpret_cast<uint4*>(out + (size_t)s * K);
  for (int i = threadIdx.x; i < K / 8; i += blockDim.x) dst[i] = src[i];
}

// gu [R, N1] bf16 GEMM1 output (gated: gate/up interleaved per 8 channels), bias [El, N1] fp32 or
// null -> h [R, I] bf16. One thread per 8 output channels.
extern "C" __global__ void __launch_bounds__(128) act_rows(
    const u16* gu, const float* __restrict__ bias, const int* sorted_expert,
    const int* offs_total, u16* __restrict__ h, int I, int gated, int kind, float alpha,
    float limit) {
  wait_then_release();
  const int s = blockIdx.x;
  if (s >= offs_total[0]) return;
  const int N1 = gated ? 2 * I : I;
  const int e = sorted_expert[s];
  for (int c = threadIdx.x; c < I / 8; c += blockDim.x) {
    float out[8];
    if (gated) {
      uint4 gv = ldg16(gu + (size_t)s * N1 + 16 * c);
      uint4 uv = ldg16(gu + (size_t)s * N1 + 16 * c + 8);
      u32 gw[4] = {gv.x, gv.y, gv.z, gv.w}, uw[4] = {uv.x, uv.y, uv.z, uv.w};
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        float g = bf16_to_f32(j & 1 ? gw[j / 2] >> 16 : gw[j / 2] & 0xffff);
        float u = bf16_to_f32(j & 1 ? uw[j / 2] >> 16 : uw[j / 2] & 0xffff);
        if (bias) {
          g += bias[(size_t)e * N1 + 16 * c + j];
          u += bias[(size_t)e * N1 + 16 * c + 8 + j];
        }
        out[j] = act_gated(kind, g, u, alpha, limit);
      }
    } else {
      uint4 uv = ldg16(gu + (size_t)s * N1 + 8 * c);
      u32 uw[4] = {uv.x, uv.y, uv.z, uv.w};
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        float u = bf16_to_f32(j & 1 ? uw[j / 2] >> 16 : uw[j / 2] & 0xffff);
        if (bias) u += bias[(size_t)e * N1 + 8 * c + j];
        u = fmaxf(u, 0.f);
        out[j] = u * u;
      }
    }
    uint4 o;
    o.x = (u32)f32_to_bf16(out[0]) | ((u32)f32_to_bf16(out[1]) << 16);
    o.y = (u32)f32_to_bf16(out[2]) | ((u32)f32_to_bf16(out[3]) << 16);
    o.z = (u32)f32_to_bf16(out[4]) | ((u32)f32_to_bf16(out[5]) << 16);
    o.w = (u32)f32_to_bf16(out[6]) | ((u32)f32_to_bf16(out[7]) << 16);
    *reinterpret_cast<uint4*>(h + (size_t)s * I + 8 * c) = o;
  }
}

// ------------------------------------------------------------------------------------------------
// weighted combine: out[t] = sum_j w[t, j] * (y[pos(t, j)] + bias[e(t, j)]) in fp32, then bf16
// ------------------------------------------------------------------------------------------------
// y is fp32 (ybf16 = 0) or bf16 (ybf16 = 1), rows in sorted order. One thread per 4 channels. (Pair
// tiles combine in their GEMM2: combine_tile.) The pairs are taken COMBINE_BATCH at a time, each
// stage's loads issued before any of its values is tested (rows, then experts, then y and biases): one
// pair after another cost two dependent L2 round trips each. The sum still runs in pair order.
#define COMBINE_BATCH 8
extern "C" __global__ void __launch_bounds__(256) moe_combine(
    const void* y, int ybf16, const int* pair_pos, const int* sorted_expert,
    const float* topk_w, const float* __restrict__ bias, u16* __restrict__ out, int H, int topk) {
  wait_then_release();
  const int t = blockIdx.y;
  const int c = (blockIdx.x * blockDim.x + threadIdx.x) * 4;
  if (c >= H) return;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int j0 = 0; j0 < topk; j0 += COMBINE_BATCH) {
    const int n = topk - j0 < COMBINE_BATCH ? topk - j0 : COMBINE_BATCH;
    const int p0 = t * topk + j0;
    int pos[COMBINE_BATCH], le[COMBINE_BATCH];
    float w[COMBINE_BATCH];
#pragma unroll
    for (int q = 0; q < COMBINE_BATCH; ++q) {
      pos[q] = -1; w[q] = 0.f;
      if (q < n) {
        w[q] = topk_w[p0 + q];
        pos[q] = pair_pos[p0 + q];
      }
    }
#pragma unroll
    for (int q = 0; q < COMBINE_BATCH; ++q) le[q] = (bias && pos[q] >= 0) ? sorted_expert[pos[q]] : 0;
    float v[COMBINE_BATCH][4];
#pragma unroll
    for (int q = 0; q < COMBINE_BATCH; ++q) {
      v[q][0] = v[q][1] = v[q][2] = v[q][3] = 0.f;
      if (pos[q] >= 0) {
        if (ybf16) {
          const uint2 raw = *reinterpret_cast<const uint2*>(reinterpret_cast<const u16*>(y) + (size_t)pos[q] * H + c);
          v[q][0] = bf16_to_f32(raw.x & 0xffff); v[q][1] = bf16_to_f32(raw.x >> 16);
          v[q][2] = bf16_to_f32(raw.y & 0xffff); v[q][3] = bf16_to_f32(raw.y >> 16);
        } else {
          const float4 raw = *reinterpret_cast<const float4*>(reinterpret_cast<const float*>(y) + (size_t)pos[q] * H + c);
          v[q][0] = raw.x; v[q][1] = raw.y; v[q][2] = raw.z; v[q][3] = raw.w;
        }
        if (bias) add4(v[q], bias + (size_t)le[q] * H + c);
      }
    }
#pragma unroll
    for (int q = 0; q < COMBINE_BATCH; ++q)
      if (pos[q] >= 0) {
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[i] += v[q][i] * w[q];
      }
  }
  store_bf16x4(out + (size_t)t * H + c, acc);
}

// The pair GEMM2's fused combine (`combined` given: the call then launches no moe_combine). The warp that stored
// m-tile mt of pair p into y (or skipped it: another rank's expert, a dropped slot) counts it on counters[t][mt]
// (t = p / topk); true for the last of token t's topk pairs, which then sees the others' rows (fenced as the
// router's last CTA is, moe_route, here for one warp), combines that m-tile's 16 channels and resets the counter
// for the next launch or graph replay.
__device__ __forceinline__ bool last_pair_tile(unsigned int* __restrict__ counters, int p, int mt, int N, int topk) {
  unsigned int* counter = counters + (size_t)(p / topk) * (N / 16) + mt;
  asm volatile("fence.acq_rel.gpu;" ::: "memory");
  __syncwarp();
  int last = 0;
  if ((threadIdx.x & 31) == 0) last = atomicAdd(counter, 1u) == (unsigned int)topk - 1u;
  last = __shfl_sync(0xffffffffu, last, 0);
  __syncwarp();
  if (!last) return false;
  asm volatile("fence.acq_rel.gpu;" ::: "memory");
  if ((threadIdx.x & 31) == 0) *counter = 0u;
  return true;
}

// Lane 4q + i's pair in combine_tile's batch j0 (pair j0 + q of token t, if below topk): its local expert (-1: none
// here) and weight. Inputs of the op, not GEMM output: the pair GEMM2 loads batch 0's at the start of its item, so
// that the last warp's chain after its count is one read of y, not ids, then local_map, then y.
struct CombineLane {
  int le;
  float w;
};
__device__ __forceinline__ CombineLane combine_lane(const long long* ids, const int* __restrict__ local_map,
                                                    int num_experts, const float* topk_w, int t, int j0, int topk) {
  const int q = (threadIdx.x & 31) >> 2;
  if (j0 + q >= topk) return {-1, 0.f};
  const int pq = t * topk + j0 + q;
  return {local_expert(ids, local_map, num_experts, pq), topk_w[pq]};
}

// Channels 16 mt .. 16 mt + 15 of token t, summed as moe_combine does (the same sums in the same order: the same
// bits). Lane 4q + i loads pair j0 + q's channels 4i..4i+3, eight pairs' loads in flight at once; lanes 0-3 then sum
// them in pair order through shuffles. Few registers: moe_combine's thread, inlined here, took the bf16 GEMM2 from
// 128 registers to 162 (not inlined, the call's ABI cost more). `first`: batch 0's combine_lane.
__device__ __forceinline__ void combine_tile(
    const float* y, const float* topk_w, const float* __restrict__ bias, u16* __restrict__ combined, int t, int mt,
    int N, int topk, const long long* ids, const int* __restrict__ local_map, int num_experts, CombineLane first) {
  const int lane = threadIdx.x & 31, q = lane >> 2, c = mt * 16 + 4 * (lane & 3);
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 1
  for (int j0 = 0; j0 < topk; j0 += COMBINE_BATCH) {
    const CombineLane mine = j0 == 0 ? first : combine_lane(ids, local_map, num_experts, topk_w, t, j0, topk);
    float v[4] = {0.f, 0.f, 0.f, 0.f};
    if (mine.le >= 0) {
      const int pq = t * topk + j0 + q;
      const float4 raw = __ldcg(reinterpret_cast<const float4*>(y + (size_t)pq * N + c));   // not a stale L1 line
      v[0] = raw.x; v[1] = raw.y; v[2] = raw.z; v[3] = raw.w;
      if (bias) add4(v, bias + (size_t)mine.le * N + c);
    }
#pragma unroll 1
    for (int s = 0; s < COMBINE_BATCH && j0 + s < topk; ++s) {
      const int src = 4 * s + (lane & 3);
      const int ps = __shfl_sync(0xffffffffu, mine.le >= 0, src);
      const float ws = __shfl_sync(0xffffffffu, mine.w, src);
      float vs[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) vs[i] = __shfl_sync(0xffffffffu, v[i], src);
      if (ps) {
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[i] += vs[i] * ws;
      }
    }
  }
  if (lane < 4) store_bf16x4(combined + (size_t)t * N + c, acc);
}

// ------------------------------------------------------------------------------------------------
// the router: logits, scores and top-k of one token per CTA, in one launch
// ------------------------------------------------------------------------------------------------
// Decode batches route a handful of tokens: torch spends a dozen small kernels on it (GEMV, sigmoid,
// bias, group top-2, mask, top-k, gather, normalise, scale), which costs more than the GEMV's bytes.
// One CTA per token reads the token, streams the router weight once and keeps everything else in
// shared memory. Modes (the three rules of runtime/routing.py):
//   ROUTE_SOFTMAX   softmax over all experts, top-k, optional renormalisation (Qwen3-MoE, Mixtral)
//   ROUTE_SIGMOID   sigmoid; bias + group top-2 sums choose (topk_group of n_group groups kept, others
//                   -inf), unbiased scores weigh, optional normalisation, times a scale (DeepSeek-V3)
//   ROUTE_LOGITS    top-k on the (biased) logits, softmax over the k (gpt-oss)
// round_logits rounds each logit to bf16 as torch's bf16 GEMM does; ties pick the lower expert index.
#define ROUTE_SOFTMAX 0
#define ROUTE_SIGMOID 1
#define ROUTE_LOGITS 2
#define ROUTE_MAX_K 32
#define ROUTE_MAX_GROUPS 64   // router.py MAX_GROUPS
#define ROUTE_NEG_INF __int_as_float(0xff800000)   // NVRTC has no math headers: no INFINITY

// The router's one order: score o of expert (or group) j beats score c of e if higher, or equal at a lower
// index. Every selection below (arg-max rounds, ranks, kept groups) picks by it.
__device__ __forceinline__ bool route_beats(float o, int j, float c, int e) { return (o > c) | ((o == c) & (j < e)); }

__device__ __forceinline__ void route_argmax(float& v, int& i) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, off);
    const int oi = __shfl_xor_sync(0xffffffffu, i, off);
    if (route_beats(ov, oi, v, i)) { v = ov; i = oi; }
  }
}

// One launch per call: the logits by many CTAs (one warp per expert, 16-byte loads of the weight row, fp32
// products and sums, so the weight streams through every SM), then the last CTA of each token to finish
// (a per-token counter, which that CTA resets for the next launch or graph replay) takes the scores and
// the top-k. Two launches before: the second one's launch latency was most of the router's time at decode.
#define ROUTE_EPB 4   // experts (warps) per CTA
#define ROUTE_LOADS 8 // 16-byte loads of the weight row in flight per lane

// A logit as route_topk reads it: written by another CTA of the launch or by an earlier kernel, so from L2, never a
// stale L1 line. fp32 (moe_route's scratch, an fp32 GEMM's output) or bf16 (a bf16 GEMM's output, read as it is).
__device__ __forceinline__ float load_logit(const float* p) { return __ldcg(p); }
__device__ __forceinline__ float load_logit(const u16* p) { return bf16_to_f32(__ldcg(p)); }

template <int NT, typename L>
__device__ void route_topk(
    const L* __restrict__ logits_in, const float* __restrict__ choice_bias, long long* __restrict__ ids,
    float* __restrict__ weights, int t, int E, int k, int mode, int n_group, int topk_group, int renormalize,
    float scale) {
  extern __shared__ float smem[];
  float* logit = smem;         // [E]
  float* choice = logit + E;   // [E]
  __shared__ float red_v[NT / 32];
  __shared__ int red_i[NT / 32];
  __shared__ int picked[ROUTE_MAX_K];
  __shared__ float stat[2];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int warps = NT / 32;
  static_assert(NT >= ROUTE_MAX_GROUPS && ROUTE_MAX_K <= 32, "a thread per group; a lane per pick, a thread per candidate");
  for (int e = tid; e < E; e += NT) logit[e] = load_logit(logits_in + (size_t)t * E + e);
  // A softmax renormalised over its picks is the LOGITS rule: the sum over every expert cancels, and exp
  // keeps the order. That skips the block-wide max and sum (five barriers).
  if (mode == ROUTE_SOFTMAX && renormalize) mode = ROUTE_LOGITS;
  __syncthreads();

  if (mode == ROUTE_SOFTMAX) {
    // Block max and sum of exp: the probabilities, which both choose and weigh.
    float m = ROUTE_NEG_INF;
    for (int e = tid; e < E; e += NT) m = fmaxf(m, logit[e]);
    m = warp_max(m);
    if (lane == 0) red_v[warp] = m;
    __syncthreads();
    if (tid == 0) { float mm = red_v[0]; for (int i = 1; i < warps; ++i) mm = fmaxf(mm, red_v[i]); stat[0] = mm; }
    __syncthreads();
    float sum = 0.f;
    for (int e = tid; e < E; e += NT) { const float p = __expf(logit[e] - stat[0]); choice[e] = p; sum += p; }
    sum = warp_sum(sum);
    __syncthreads();
    if (lane == 0) red_v[warp] = sum;
    __syncthreads();
    if (tid == 0) { float ss = 0.f; for (int i = 0; i < warps; ++i) ss += red_v[i]; stat[1] = ss; }
    __syncthreads();
    for (int e = tid; e < E; e += NT) { choice[e] /= stat[1]; logit[e] = choice[e]; }
  } else if (mode == ROUTE_SIGMOID) {
    for (int e = tid; e < E; e += NT) {
      const float s = 1.f / (1.f + __expf(-logit[e]));
      logit[e] = s;                                  // the weights
      choice[e] = s + (choice_bias ? choice_bias[e] : 0.f);
    }
    __syncthreads();
    if (topk_group < n_group) {
      // Few groups (<= 64), each scored by its best two: warp w takes groups w, w + warps, ...; each lane keeps
      // the top two of its share as a sequential scan does (duplicates counted), and the warp merges the
      // pairs (the top two of a union of two pairs). Then thread g keeps group g if fewer than topk_group
      // groups beat it (ties to the lower group), and all threads take the other groups' experts out.
      __shared__ float gscore[ROUTE_MAX_GROUPS];
      __shared__ int keep[ROUTE_MAX_GROUPS];
      const int per = E / n_group;
      for (int g = warp; g < n_group; g += warps) {
        float b1 = ROUTE_NEG_INF, b2 = ROUTE_NEG_INF;
        for (int e = g * per + lane; e < (g + 1) * per; e += 32) {
          const float c = choice[e];
          if (c > b1) { b2 = b1; b1 = c; } else if (c > b2) b2 = c;
        }
        for (int off = 16; off > 0; off >>= 1) {
          const float o1 = __shfl_xor_sync(0xffffffffu, b1, off), o2 = __shfl_xor_sync(0xffffffffu, b2, off);
          b2 = fmaxf(fminf(b1, o1), fmaxf(b2, o2));
          b1 = fmaxf(b1, o1);
        }
        if (lane == 0) gscore[g] = b1 + b2;
      }
      __syncthreads();
      if (tid < n_group) {
        const float s = gscore[tid];
        int rank = 0;
        for (int g = 0; g < n_group; ++g) rank += route_beats(gscore[g], g, s, tid);
        keep[tid] = rank < topk_group;
      }
      __syncthreads();
      for (int e = tid; e < E; e += NT) {
        const int g = e / per;
        if (g < n_group && !keep[g]) choice[e] = ROUTE_NEG_INF;
      }
    }
  } else {
    for (int e = tid; e < E; e += NT) choice[e] = logit[e];
  }
  __syncthreads();

  if (E <= 4 * NT) {
    // Top-k by rank in two levels. An expert's rank is how many others beat it (higher, or equal at a lower
    // index: the order the arg-max rounds below pick in). Each warp ranks the experts of its contiguous
    // share among that share; its k best are candidates, and ranks among the candidates below k are the
    // picks, in order (the k best of all are among the k best of their shares). At E = 256 that is 160
    // comparisons a thread where one level took 512. A slot no expert fills (a short share) stays -1;
    // `picked` starts at 0 so that non-finite scores (which rank nothing consistently) still name a valid
    // expert.
    __shared__ int cand[(NT / 32) * ROUTE_MAX_K];
    const int share = (E + warps - 1) / warps, lo = warp * share, hi = lo + share < E ? lo + share : E;
    const int kw = k < share ? k : share;   // candidate slots of each warp
    if (tid < warps * kw) cand[tid] = -1;
    if (tid < k) picked[tid] = 0;
    __syncthreads();
    for (int e = lo + lane; e < hi; e += 32) {
      const float c = choice[e];
      int rank = 0;
#pragma unroll 8
      for (int j = lo; j < hi; ++j) rank += route_beats(choice[j], j, c, e);
      if (rank < kw) cand[warp * kw + rank] = e;
    }
    __syncthreads();
    const int e = tid < warps * kw ? cand[tid] : -1;
    if (e >= 0) {
      const float c = choice[e];
      int rank = 0;
      for (int i = 0; i < warps * kw; ++i) {
        const int j = cand[i];
        if (j >= 0) rank += route_beats(choice[j], j, c, e);
      }
      if (rank < k) picked[rank] = e;
    }
    __syncthreads();
  } else
  // Top-k: k block-wide arg-max rounds over `choice`, each taking its winner out.
  for (int r = 0; r < k; ++r) {
    float v = ROUTE_NEG_INF;
    int i = 0x7fffffff;
    for (int e = tid; e < E; e += NT) {
      const float c = choice[e];
      if (route_beats(c, e, v, i)) { v = c; i = e; }
    }
    route_argmax(v, i);
    if (lane == 0) { red_v[warp] = v; red_i[warp] = i; }
    __syncthreads();
    if (warp == 0) {
      v = lane < warps ? red_v[lane] : ROUTE_NEG_INF;
      i = lane < warps ? red_i[lane] : 0x7fffffff;
      route_argmax(v, i);
      if (lane == 0) { picked[r] = i; choice[i] = ROUTE_NEG_INF; }
    }
    __syncthreads();
  }

  // The weights: lane r of warp 0 takes pick r (k <= 32), the sum and max over the picks by shuffles.
  if (warp == 0) {
    const bool mine = lane < k;
    const int e = mine ? picked[lane] : 0;
    const float v = mine ? logit[e] : 0.f;
    float out = v;   // SOFTMAX here is never renormalised (that runs as LOGITS)
    // mode and renormalize are the same for every lane: each reduction below runs on the whole warp
    if (mode == ROUTE_LOGITS) {
      const float wmax = warp_max(mine ? v : ROUTE_NEG_INF);
      const float x = mine ? __expf(v - wmax) : 0.f;
      out = x / warp_sum(x);
    } else if (mode == ROUTE_SIGMOID) {
      out = (renormalize ? v / (warp_sum(v) + 1e-20f) : v) * scale;
    }
    if (mine) {
      ids[(size_t)t * k + lane] = e;
      weights[(size_t)t * k + lane] = out;
    }
  }
}

extern "C" __global__ void __launch_bounds__(ROUTE_EPB * 32) moe_route(
    const u16* x,                         // [T, H] bf16
    const void* __restrict__ w,           // [E, H] bf16 (w_fp32 = 0) or fp32
    const float* __restrict__ logit_bias, // [E] or null (gpt-oss router bias, added before rounding)
    const float* __restrict__ choice_bias,// [E] or null (sigmoid correction bias)
    float* __restrict__ logits,           // [T, E] scratch
    unsigned int* __restrict__ counters,  // [T], zero before and after the launch
    long long* __restrict__ ids,          // [T, k]
    float* __restrict__ weights,          // [T, k]
    int H, int E, int w_fp32, int round_logits, int k, int mode, int n_group, int topk_group, int renormalize,
    float scale) {
  const int lane = threadIdx.x & 31;
  const int e = blockIdx.x * ROUTE_EPB + (threadIdx.x >> 5);
  const int t = blockIdx.y;
  wait_then_release();
  if (e < E) {
    const u16* xr = x + (size_t)t * H;
    float acc = 0.f;
    if (w_fp32) {
      const float* row = reinterpret_cast<const float*>(w) + (size_t)e * H;
#pragma unroll 8
      for (int h = lane; h < H; h += 32) acc += bf16_to_f32(xr[h]) * row[h];
    } else {
      const u16* row = reinterpret_cast<const u16*>(w) + (size_t)e * H;
      if ((H & 7) == 0) {
        // ROUTE_LOADS 16-byte loads of the row and as many of the token issued per lane before any is used
        // (the row is only H / 256 of them). A plain unrolled loop was scheduled load, use, load: one or two
        // in flight, a DRAM round trip per one or two chunks.
        for (int h0 = lane * 8; h0 < H; h0 += 256 * ROUTE_LOADS) {
          uint4 wv[ROUTE_LOADS], xv[ROUTE_LOADS];
#pragma unroll
          for (int q = 0; q < ROUTE_LOADS; ++q)
            if (h0 + 256 * q < H) {
              wv[q] = *reinterpret_cast<const uint4*>(row + h0 + 256 * q);
              xv[q] = *reinterpret_cast<const uint4*>(xr + h0 + 256 * q);
            }
#pragma unroll
          for (int q = 0; q < ROUTE_LOADS; ++q)
            if (h0 + 256 * q < H) {
              const u32 ws[4] = {wv[q].x, wv[q].y, wv[q].z, wv[q].w}, xs[4] = {xv[q].x, xv[q].y, xv[q].z, xv[q].w};
#pragma unroll
              for (int j = 0; j < 4; ++j)
                acc += bf16_to_f32((u16)(xs[j] & 0xffffu)) * bf16_to_f32((u16)(ws[j] & 0xffffu)) +
                       bf16_to_f32((u16)(xs[j] >> 16)) * bf16_to_f32((u16)(ws[j] >> 16));
            }
        }
      } else {
        for (int h = lane; h < H; h += 32) acc += bf16_to_f32(xr[h]) * bf16_to_f32(row[h]);
      }
    }
    acc = warp_sum(acc);
    if (lane == 0) {
      if (logit_bias) acc += logit_bias[e];
      logits[(size_t)t * E + e] = round_logits ? bf16_to_f32(f32_to_bf16(acc)) : acc;
    }
  }
  // Publish this CTA's logits, then count it; the token's last CTA sees every other CTA's logits.
  // Release/acquire fences at GPU scope (what the pattern needs; __threadfence is a sequentially
  // consistent one, MEMBAR.SC, which is slower).
  __shared__ int last;
  asm volatile("fence.acq_rel.gpu;" ::: "memory");
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(counters + t, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!last) return;
  asm volatile("fence.acq_rel.gpu;" ::: "memory");
  if (threadIdx.x == 0) counters[t] = 0u;
  route_topk<ROUTE_EPB * 32>(logits, choice_bias, ids, weights, t, E, k, mode, n_group, topk_group, renormalize, scale);
}

// The router of larger batches (runtime/kernels/router.py: topk): torch's GEMM gives the logits, whose weight reads
// it shares across tokens, and this kernel takes the rest, one CTA a token, by moe_route's own top-k stage: one
// launch where torch's rules take 6 (softmax) to ~15 (grouped sigmoid) small kernels.
extern "C" __global__ void __launch_bounds__(ROUTE_EPB * 32) moe_topk(
    const void* logits,                   // [T, E] bf16 (logits_bf16) or fp32
    const float* __restrict__ choice_bias,// [E] or null
    long long* __restrict__ ids,          // [T, k]
    float* __restrict__ weights,          // [T, k]
    int logits_bf16, int E, int k, int mode, int n_group, int topk_group, int renormalize, float scale) {
  wait_then_release();
  if (logits_bf16)
    route_topk<ROUTE_EPB * 32>(static_cast<const u16*>(logits), choice_bias, ids, weights, blockIdx.x, E, k, mode,
                               n_group, topk_group, renormalize, scale);
  else
    route_topk<ROUTE_EPB * 32>(static_cast<const float*>(logits), choice_bias, ids, weights, blockIdx.x, E, k, mode,
                               n_group, topk_group, renormalize, scale);
}

// ------------------------------------------------------------------------------------------------
// the grouped GEMM
// ------------------------------------------------------------------------------------------------
template <int WF> struct WTraits;
// bytes of one weight row per 64-chunk (whole quad), per lane, the lane's register words, and the bytes
// from one row's chunk to its next: rows stored whole (STEP = CHUNK), or FP4 rows tiled by 16 x 64
// (runtime/kernels/layouts.tile_fp4_rows: an m-tile's chunk is 512 contiguous bytes, which its warp reads
// in two coalesced 256-byte loads; 16 separate 32-byte row pieces streamed 4-22 % slower, BENCHMARKS.md)
template <> struct WTraits<WF_BF16> { static constexpr int CHUNK = 128, LANE = 32, WORDS = 8, STEP = 128; };
template <> struct WTraits<WF_FP8B> { static constexpr int CHUNK = 64, LANE = 16, WORDS = 4, STEP = 64; };
template <> struct WTraits<WF_MXFP4> { static constexpr int CHUNK = 32, LANE = 8, WORDS = 2, STEP = 512; };
template <> struct WTraits<WF_NVFP4> { static constexpr int CHUNK = 32, LANE = 8, WORDS = 2, STEP = 512; };

template <int AQ> struct ATraits;
template <> struct ATraits<AQ_NONE> { static constexpr int CHUNK = 128, LANE = 32, WORDS = 8; };
template <> struct ATraits<AQ_GROUP128> { static constexpr int CHUNK = 64, LANE = 16, WORDS = 4; };
template <> struct ATraits<AQ_TOKEN> { static constexpr int CHUNK = 64, LANE = 16, WORDS = 4; };

template <int WF, int MT> __device__ __forceinline__ void load_w(const u8* const (&wp)[MT][2], int c, u32 (&w)[MT][2][WTraits<WF>::WORDS]) {
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const u8* p = wp[m][h] + (size_t)c * WTraits<WF>::STEP;
      if constexpr (WF == WF_BF16) {
        uint4 a = ldg_stream16(p), b = ldg_stream16(p + 16);
        w[m][h][0] = a.x; w[m][h][1] = a.y; w[m][h][2] = a.z; w[m][h][3] = a.w;
        w[m][h][4] = b.x; w[m][h][5] = b.y; w[m][h][6] = b.z; w[m][h][7] = b.w;
      } else if constexpr (WF == WF_FP8B) {
        uint4 a = ldg_stream16(p);
        w[m][h][0] = a.x; w[m][h][1] = a.y; w[m][h][2] = a.z; w[m][h][3] = a.w;
      } else {
        uint2 a = ldg_stream8(p);
        w[m][h][0] = a.x; w[m][h][1] = a.y;
      }
    }
}

template <int AQ, int NT> __device__ __forceinline__ void load_a(const u8* const (&ap)[NT], int c, u32 (&a)[NT][ATraits<AQ>::WORDS]) {
#pragma unroll
  for (int f = 0; f < NT; ++f) {
    const u8* p = ap[f] + (size_t)c * ATraits<AQ>::CHUNK;
    uint4 x = ldg16(p);
    a[f][0] = x.x; a[f][1] = x.y; a[f][2] = x.z; a[f][3] = x.w;
    if constexpr (AQ == AQ_NONE) {
      uint4 y = ldg16(p + 16);
      a[f][4] = y.x; a[f][5] = y.y; a[f][6] = y.z; a[f][7] = y.w;
    }
  }
}

// Chunks per load group (two groups are in flight): decode tiles keep 128-256 weight bytes per lane
// in flight, which a bandwidth-bound GEMV needs; large tiles have no registers to spare. The bf16 pair GEMM2
// (PAIR_DOWN) keeps one chunk a group: with the fused combine's state two took it past its 128 registers
// (14-30 bytes of spill stores); with one it holds 90-100 registers and no spill, and the layer at one and two
// tokens ran 0.7 to 6 microseconds faster (BENCHMARKS.md, twenty-ninth session).
template <int WF, int MT, int NT, bool PAIR_DOWN> struct Unroll {
  static constexpr int W = WTraits<WF>::LANE * 2 * MT;          // weight bytes per lane per chunk
  static constexpr int V = ((PAIR_DOWN && WF == WF_BF16) || MT * NT >= 8) ? 1 : (MT * NT >= 2 ? 2 : (W >= 64 ? 2 : 4));
};

// Block-scale bytes of one weight row per 64-chunk (FP4 formats: NVFP4 one E4M3 per 16 elements, MXFP4 one
// E8M0 per 32), stored in tiles of 16 rows per chunk like the weights (layouts.tile_rows).
template <int WF> struct ScaleBytes { static constexpr int V = WF == WF_NVFP4 ? 4 : 2; };

// The scale word lane t needs for row `row` (0..15) of an m-tile from the chunk's scale tile `st`: W4A16 the
// block of its 16 K elements (NVFP4: one of four, MXFP4: one of two), W4A8 both MX blocks of the chunk.
template <int WF, int AQ> __device__ __forceinline__ u32 load_scale(const u8* st, int row, int t) {
  if constexpr (WF == WF_NVFP4) return st[row * 4 + t];
  else if constexpr (AQ == AQ_NONE) return st[row * 2 + (t >> 1)];
  else return *reinterpret_cast<const u16*>(st + row * 2);
}

// One 64-chunk of one m-tile on bf16 tensor cores: four k16 steps, step s on the lane's elements 4s..4s+3
// (pairs 2s, 2s+1). w[h]: rows g (h = 0) and g + 8 (h = 1) of the tile, bf16, or FP4 dequantized here with
// their block scales sc[h]; a[f]: the lane's activations of n-fragment f.
template <int WF, int NT>
__device__ __forceinline__ void mma_chunk_bf16(float (&acc)[NT][4], const u32 (&w)[2][WTraits<WF>::WORDS],
                                               const u32 (&sc)[2], const u32 (&a)[NT][8]) {
  u32 pg[8], ph[8];
  if constexpr (WF == WF_BF16) {
#pragma unroll
    for (int i = 0; i < 8; ++i) { pg[i] = w[0][i]; ph[i] = w[1][i]; }
  } else {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      u32 mul, mul2 = 0;
      if constexpr (WF == WF_MXFP4) {
        // bf16x2 2^(e-1) = 2^(e-127) * 2^126 (exponent field e + 126); scales above 2^1
        // (bytes > 128) need a second factor, 2^(e-128), as bf16 stops at 2^127
        const u32 e = sc[h];
        mul = (((e > 128u ? 128u : e) + 126u) << 7) * 0x10001u;
        if (e > 128u) mul2 = ((e - 1u) << 7) * 0x10001u;
      } else {
        // NVFP4 block scale * 2^110 (exact in bf16); 2^16 is folded into the epilogue
        const u16 b = f32_to_bf16(e4m3_to_f32(sc[h]) * 1.2980742146337069e33f);
        mul = (u32)b * 0x10001u;
      }
      u32* dst = h ? ph : pg;
#pragma unroll
      for (int wd = 0; wd < 2; ++wd) {
        u32 p4[4];
        fp4_to_bf16x8(w[h][wd], p4);
#pragma unroll
        for (int j = 0; j < 4; ++j) dst[4 * wd + j] = bf16x2_mul(p4[j], mul);
        if (mul2) {
#pragma unroll
          for (int j = 0; j < 4; ++j) dst[4 * wd + j] = bf16x2_mul(dst[4 * wd + j], mul2);
        }
      }
    }
  }
#pragma unroll
  for (int s = 0; s < 4; ++s)
#pragma unroll
    for (int f = 0; f < NT; ++f)
      mma_bf16(acc[f], pg[2 * s], ph[2 * s], pg[2 * s + 1], ph[2 * s + 1], a[f][2 * s], a[f][2 * s + 1]);
}

// The epilogue of a tile: rows mt0.. (MT m-tiles, those below n_tiles16) x the tile's cnt token rows from r0 of
// acc, times the per-token FP8 scale (w4a8) or NVFP4's per-expert scale; GEMM1 adds the bias and applies the
// activation into bf16 h [rows, I], GEMM2 writes fp32 y [rows, N].
template <int WF, int AQ, int EPI, int MT, int NT>
__device__ __forceinline__ void store_tile(const float (&acc)[MT][NT][4], const float* AS, const int (&trow)[NT][2],
                                           int r0, int cnt, int le, int mt0, int n_tiles16,
                                           const float* __restrict__ WS2, const float* __restrict__ bias,
                                           void* __restrict__ out, int N, int I, int kind, float alpha, float limit) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int f = 0; f < NT; ++f) {
    float tok_scale[2] = {1.f, 1.f};
    int srow[2];
    bool ok[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int slot = f * 8 + 2 * t + i;
      ok[i] = slot < cnt;
      srow[i] = r0 + min(slot, cnt - 1);
      if constexpr (AQ == AQ_TOKEN) tok_scale[i] = AS[trow[f][i]];
    }
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      const int mt = mt0 + m;
      if (mt >= n_tiles16) continue;
      float v[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) v[i] = acc[m][f][i] * tok_scale[i & 1];
      if constexpr (WF == WF_NVFP4) {
        // per-expert weight_scale_2 (gate, up or down), times the 2^16 folded out of the weights
        const float s0 = WS2[(EPI == EPI_GATED) ? 2 * le : le] * 65536.f;
        const float s1 = WS2[(EPI == EPI_GATED) ? 2 * le + 1 : le] * 65536.f;
        v[0] *= s0; v[1] *= s0; v[2] *= s1; v[3] *= s1;
      }
      if constexpr (EPI == EPI_GATED) {
        const int row_g = mt * 16 + g, ch = mt * 8 + g;   // gate row, up row = row_g + 8
        float bg = 0.f, bu = 0.f;
        if (bias) { bg = bias[(size_t)le * N + row_g]; bu = bias[(size_t)le * N + row_g + 8]; }
        u16* H = reinterpret_cast<u16*>(out);
#pragma unroll
        for (int i = 0; i < 2; ++i)
          if (ok[i]) H[(size_t)srow[i] * I + ch] = f32_to_bf16(act_gated(kind, v[i] + bg, v[2 + i] + bu, alpha, limit));
      } else if constexpr (EPI == EPI_RELU2) {
        const int row = mt * 16 + g;
        float b0 = 0.f, b1 = 0.f;
        if (bias) { b0 = bias[(size_t)le * N + row]; b1 = bias[(size_t)le * N + row + 8]; }
        u16* H = reinterpret_cast<u16*>(out);
#pragma unroll
        for (int i = 0; i < 2; ++i)
          if (ok[i]) {
            float x0 = fmaxf(v[i] + b0, 0.f), x1 = fmaxf(v[2 + i] + b1, 0.f);
            H[(size_t)srow[i] * I + row] = f32_to_bf16(x0 * x0);
            H[(size_t)srow[i] * I + row + 8] = f32_to_bf16(x1 * x1);
          }
      } else {
        const int row = mt * 16 + g;
        float* Y = reinterpret_cast<float*>(out);
#pragma unroll
        for (int i = 0; i < 2; ++i)
          if (ok[i]) {
            Y[(size_t)srow[i] * N + row] = v[i];
            Y[(size_t)srow[i] * N + row + 8] = v[2 + i];
          }
      }
    }
  }
}

// SK > 1 splits K inside the CTA: SK warps share each m-tile group, each walks a contiguous 1/SK of
// the chunks, and the partial sums meet in shared memory (fixed order: deterministic) before warp
// ks = 0 of the group runs the epilogue. The grid then holds SK times more warps for the same
// rows: decode calls whose items would leave SMs idle use it (runtime/experts/cupy_mma.py: _split).
// PT (pair tiles): the tiles are the routing pairs `ids` [pairs] (global expert ids, mapped to this
// rank's by `local_map`; pairs of other ranks' experts are skipped), one row each, and the sort arrays
// are unused. The pair GEMM2 given `combined` also runs the combine (combine_tile).
template <int WF, int AQ, int EPI, int MT, int NT, int SK, bool PT>
__device__ __forceinline__ void moe_gemm_impl(
    const u8* __restrict__ W, const u8* __restrict__ WS, const float* __restrict__ WS2,
    const u8* A, const float* AS, int a_by_token,
    const int* sorted_pair, const int* offs, const int* tile_expert,
    const int* tile_row, const int* num_tiles,
    const long long* ids, const int* __restrict__ local_map, int num_experts, int pairs,
    const float* __restrict__ bias, void* __restrict__ out, int N, int K, int I, int topk, int kind,
    float alpha, float limit, const float* topk_w, const float* __restrict__ combine_bias,
    u16* __restrict__ combined, unsigned int* __restrict__ counters) {
  constexpr int BT = 8 * NT;
  constexpr int WW = WTraits<WF>::WORDS;
  constexpr int AW = ATraits<AQ>::WORDS;
  constexpr int U = Unroll<WF, MT, NT, PT && EPI == EPI_DOWN>::V;
  constexpr bool FP8MMA = (AQ != AQ_NONE);
  constexpr int SB = ScaleBytes<WF>::V;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  static_assert(SK == 1 || SK == 2 || SK == 4, "split K: 2 or 4 warps per m-tile group");
  static_assert(!PT || (MT == 1 && NT == 1), "pair tiles hold one row: the (1, 1) warp tile");
  constexpr int GROUPS = 4 / SK;   // m-tile groups of MT per CTA
  const int grp = warp / SK, ks = warp % SK;
  const int n_tiles16 = N / 16;   // gated: N = 2I and one m-tile holds 8 gate + 8 up rows
  const int nblocks = (n_tiles16 + GROUPS * MT - 1) / (GROUPS * MT);
  const size_t wrow = (size_t)K * WTraits<WF>::CHUNK / 64;     // bytes per weight row
  // GEMM1's tiles are its predecessor's output (moe_align, the router's ids), so it waits first. GEMM2 is
  // launched right after GEMM1 (or after the quantization of GEMM1's output): its tiles and experts come
  // from kernels that completed before GEMM1 passed its own wait, so it reads them at once, issues its first
  // item's first weight loads while GEMM1 finishes, and waits before it loads the activations (GEMM1's
  // output). Every thread waits before it exits, so that this grid never completes ahead of GEMM1.
  bool waited = EPI != EPI_DOWN;
  if (waited) wait_then_release();
  const int items = (PT ? pairs : num_tiles[0]) * nblocks;
  const int nch = K / 64;
  const int kc0 = ks * nch / SK, kc1 = (ks + 1) * nch / SK;   // this warp's chunks [kc0, kc1)
  __shared__ float red[SK > 1 ? 4 : 1][SK > 1 ? MT * NT * 4 : 1][32];
  // bytes from row r to row r + 1 of an m-tile at the same chunk (tiled FP4: the next 32 bytes)
  const size_t rstep = WTraits<WF>::STEP == WTraits<WF>::CHUNK ? wrow : WTraits<WF>::CHUNK;
  const size_t arow_bytes = (size_t)K * ATraits<AQ>::CHUNK / 64;

  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    const int tile = item / nblocks, nb = item - tile * nblocks;
    const int mt0 = (nb * GROUPS + grp) * MT;
    // this warp has no rows in the edge block (split K: it computes clamped rows and stores none,
    // as its group's other warps meet it at the barriers below)
    if (SK == 1 && mt0 >= n_tiles16) continue;
    // the pair GEMM2's fused combine: the warp that stores an m-tile (ks 0) counts it, and its lane's pair of the
    // token's first batch is loaded now, under the K loop
    const bool combines = PT && EPI == EPI_DOWN && combined && ks == 0 && mt0 < n_tiles16;
    CombineLane first{-1, 0.f};
    if (combines) first = combine_lane(ids, local_map, num_experts, topk_w, tile / topk, 0, topk);
    // this warp's m-tile of pair `tile` is final in y, or absent: count it, combine if last
    auto pair_done = [&]() {
      if (combines && last_pair_tile(counters, tile, mt0, N, topk))
        combine_tile(reinterpret_cast<const float*>(out), topk_w, combine_bias, combined, tile / topk, mt0, N, topk,
                     ids, local_map, num_experts, first);
    };
    int le, r0, cnt;
    if constexpr (PT) {
      le = local_expert(ids, local_map, num_experts, tile);
      if (le < 0) {   // another rank's expert (or a dropped slot): the same for the whole CTA
        pair_done();
        continue;
      }
      r0 = tile;              // the pair's row of h and y
      cnt = 1;
    } else {
      le = tile_expert[tile];
      r0 = tile_row[tile];
      cnt = min(BT, offs[le + 1] - r0);
    }

    // activation rows of this lane's B fragments (slot g of fragment f), clamped into the tile
    const u8* ap[NT];
#pragma unroll
    for (int f = 0; f < NT; ++f) {
      const int s = r0 + min(f * 8 + g, cnt - 1);
      const int row = a_by_token ? (PT ? s : sorted_pair[s]) / topk : s;
      ap[f] = A + (size_t)row * arow_bytes + t * ATraits<AQ>::LANE;
    }
    // activation rows of the two output tokens (2t, 2t + 1) of each fragment, for the scales
    int trow[NT][2];
#pragma unroll
    for (int f = 0; f < NT; ++f)
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int s = r0 + min(f * 8 + 2 * t + i, cnt - 1);
        trow[f][i] = a_by_token ? (PT ? s : sorted_pair[s]) / topk : s;
      }
    // weight rows g and g + 8 of each m-tile (edge m-tiles clamp; their results are not stored)
    const u8* wp[MT][2];
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      const int mt = min(mt0 + m, n_tiles16 - 1);
      const size_t r = (size_t)le * N + mt * 16 + g;
      wp[m][0] = W + (r - g) * wrow + g * rstep + t * WTraits<WF>::LANE;
      wp[m][1] = wp[m][0] + 8 * rstep;
    }
    // the FP4 scale tiles of each m-tile (16 rows x SB bytes a chunk: layouts.tile_rows), at chunk 0
    const u8* sp[MT];
#pragma unroll
    for (int m = 0; m < MT; ++m) sp[m] = WS + ((size_t)le * n_tiles16 + min(mt0 + m, n_tiles16 - 1)) * nch * (16 * SB);

    float acc[MT][NT][4];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int f = 0; f < NT; ++f)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[m][f][i] = 0.f;
    float part[WF == WF_FP8B ? MT : 1][WF == WF_FP8B ? NT : 1][4];
    if constexpr (WF == WF_FP8B) {
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int f = 0; f < NT; ++f)
#pragma unroll
          for (int i = 0; i < 4; ++i) part[m][f][i] = 0.f;
    }

    // Software pipeline over groups of U chunks: the next group's loads are issued before the
    // current group is computed (two register buffers), so every warp keeps 2U chunks in flight.
    auto load_weights = [&](int c0, u32 (&w)[U][MT][2][WW], u32 (&sc)[U][MT][2]) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int c = c0 + u;
          if (c < kc1) {
            load_w<WF, MT>(wp, c, w[u]);
            if constexpr (WF == WF_MXFP4 || WF == WF_NVFP4) {
#pragma unroll
              for (int m = 0; m < MT; ++m) {
                const u8* st = sp[m] + (size_t)c * (16 * SB);
#pragma unroll
                for (int h = 0; h < 2; ++h) sc[u][m][h] = load_scale<WF, AQ>(st, g + 8 * h, t);
              }
            }
          }
        }
    };
    auto load_acts = [&](int c0, u32 (&a)[U][NT][AW]) {
#pragma unroll
        for (int u = 0; u < U; ++u)
          if (c0 + u < kc1) load_a<AQ, NT>(ap, c0 + u, a[u]);
    };
    auto load_group = [&](int c0, u32 (&w)[U][MT][2][WW], u32 (&a)[U][NT][AW], u32 (&sc)[U][MT][2]) {
      load_weights(c0, w, sc);
      load_acts(c0, a);
    };
    auto compute_group = [&](int c0, u32 (&w)[U][MT][2][WW], u32 (&a)[U][NT][AW], u32 (&sc)[U][MT][2]) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int c = c0 + u;
          if (c >= kc1) continue;
#pragma unroll
          for (int m = 0; m < MT; ++m) {
            if constexpr (!FP8MMA) {
              mma_chunk_bf16<WF, NT>(acc[m], w[u][m], sc[u][m], a[u]);
            } else if constexpr (WF == WF_FP8B) {
              // e4m3 MMA: two k32 steps; step s uses the lane's bytes 8s..8s+7
#pragma unroll
              for (int s = 0; s < 2; ++s)
#pragma unroll
                for (int f = 0; f < NT; ++f)
                  mma_e4m3(part[m][f], w[u][m][0][2 * s], w[u][m][1][2 * s], w[u][m][0][2 * s + 1],
                           w[u][m][1][2 * s + 1], a[u][f][2 * s], a[u][f][2 * s + 1]);
            } else {
              // w4a8: E2M1 -> E4M3 (value * 2^-6), one MX block per k32 step, promoted per step
#pragma unroll
              for (int s = 0; s < 2; ++s) {
                u32 glo, ghi, hlo, hhi;
                fp4_to_e4m3x8(w[u][m][0][s], glo, ghi);
                fp4_to_e4m3x8(w[u][m][1][s], hlo, hhi);
                const float fg = __uint_as_float(((sc[u][m][0] >> (8 * s)) & 0xffu) + 6u << 23);
                const float fh = __uint_as_float(((sc[u][m][1] >> (8 * s)) & 0xffu) + 6u << 23);
#pragma unroll
                for (int f = 0; f < NT; ++f) {
                  float tmp[4] = {0.f, 0.f, 0.f, 0.f};
                  mma_e4m3(tmp, glo, hlo, ghi, hhi, a[u][f][2 * s], a[u][f][2 * s + 1]);
                  acc[m][f][0] += tmp[0] * fg;
                  acc[m][f][1] += tmp[1] * fg;
                  acc[m][f][2] += tmp[2] * fh;
                  acc[m][f][3] += tmp[3] * fh;
                }
              }
            }
          }
          if constexpr (WF == WF_FP8B) {
            // end of a 128-channel block, or of this warp's share of K inside one (split K): apply the
            // block's weight and activation scales to what `part` holds of it
            if ((c & 1) || c + 1 == kc1) {
              const int kb = c >> 1, KB = K / 128;
#pragma unroll
              for (int m = 0; m < MT; ++m) {
                const int mt = min(mt0 + m, n_tiles16 - 1);
                float ws[2];
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                  const float* S = reinterpret_cast<const float*>(WS);
                  if constexpr (EPI == EPI_GATED) {
                    // [El, 2, I/128, KB]: half h of the m-tile is projection h, channels 8*mt..8*mt+7
                    ws[h] = S[(((size_t)le * 2 + h) * (I / 128) + (8 * mt) / 128) * KB + kb];
                  } else {
                    ws[h] = S[((size_t)le * (N / 128) + (16 * mt) / 128) * KB + kb];
                  }
                }
#pragma unroll
                for (int f = 0; f < NT; ++f) {
                  const float as[2] = {AS[(size_t)trow[f][0] * KB + kb], AS[(size_t)trow[f][1] * KB + kb]};
                  acc[m][f][0] += part[m][f][0] * (ws[0] * as[0]);
                  acc[m][f][1] += part[m][f][1] * (ws[0] * as[1]);
                  acc[m][f][2] += part[m][f][2] * (ws[1] * as[0]);
                  acc[m][f][3] += part[m][f][3] * (ws[1] * as[1]);
#pragma unroll
                  for (int i = 0; i < 4; ++i) part[m][f][i] = 0.f;
                }
              }
            }
          }
        }
    };
    u32 wA[U][MT][2][WW], aA[U][NT][AW], sA[U][MT][2];
    u32 wB[U][MT][2][WW], aB[U][NT][AW], sB[U][MT][2];
    load_weights(kc0, wA, sA);
    if (!waited) {
      wait_then_release();
      waited = true;
    }
    load_acts(kc0, aA);
    for (int c0 = kc0; c0 < kc1; c0 += 2 * U) {
      if (c0 + U < kc1) load_group(c0 + U, wB, aB, sB);
      compute_group(c0, wA, aA, sA);
      if (c0 + 2 * U < kc1) load_group(c0 + 2 * U, wA, aA, sA);
      if (c0 + U < kc1) compute_group(c0 + U, wB, aB, sB);
    }
    if constexpr (SK > 1) {
      if (ks) {
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
          for (int f = 0; f < NT; ++f)
#pragma unroll
            for (int i = 0; i < 4; ++i) red[warp][(m * NT + f) * 4 + i][lane] = acc[m][f][i];
      }
      __syncthreads();
      if (ks == 0) {
#pragma unroll
        for (int j = 1; j < SK; ++j)
#pragma unroll
          for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int f = 0; f < NT; ++f)
#pragma unroll
              for (int i = 0; i < 4; ++i) acc[m][f][i] += red[warp + j][(m * NT + f) * 4 + i][lane];
      }
      __syncthreads();   // the next item's partial sums overwrite red
      if (ks) continue;
    }
    store_tile<WF, AQ, EPI, MT, NT>(acc, AS, trow, r0, cnt, le, mt0, n_tiles16, WS2, bias, out, N, I, kind, alpha, limit);
    pair_done();
  }
  if (!waited) grid_dependency_wait();   // no item here: still never complete ahead of the previous kernel
}

// ------------------------------------------------------------------------------------------------
// the staged decode GEMM: bulk copies into shared memory, one producer warp ahead of four consumer warps
// ------------------------------------------------------------------------------------------------
// Shared-memory barriers and bulk asynchronous copies (sm_90). A stage's `full` barrier completes when the
// producer has arrived and every byte it announced (expect_tx) has landed; its `empty` barrier when each
// consumer warp has arrived, done reading it.
__device__ __forceinline__ u32 smem_u32(const void* p) {
  u32 a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}
__device__ __forceinline__ void mbar_init(u64* bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect(u64* bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u64* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(u64* bar, u32 parity) {
  u32 done;
  do {
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(smem_u32(bar)), "r"(parity) : "memory");
  } while (!done);
}
// `bytes` (a multiple of 16, both addresses 16-byte aligned) from global to shared memory, counted on `bar`.
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, u32 bytes, u64* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ uint2 lds64(const u8* p) { return *reinterpret_cast<const uint2*>(p); }
__device__ __forceinline__ uint4 lds128(const u8* p) { return *reinterpret_cast<const uint4*>(p); }

// Bytes of one stage of KC chunks: 4 m-tiles of 4-bit weights (512 a chunk), their scale tiles, and BT token
// rows of bf16 activations, each row padded by 16 bytes so that the 8 rows g of a quad's 16-byte loads fall
// in distinct banks.
template <int WF, int NT, int KC> struct Stage {
  static constexpr int W = 4 * KC * 512;
  static constexpr int S = 4 * KC * 16 * ScaleBytes<WF>::V;
  static constexpr int AROW = KC * 128 + 16;
  static constexpr int BYTES = W + S + 8 * NT * AROW;
};

// The staged GEMM of W4A16 formats (MXFP4, NVFP4) on the sorted path: warps 0-3 consume, warp 4 produces.
// An item is the (1, NT) tile's: 4 m-tiles of one expert x one token tile of 8 * NT rows. For every item of
// the CTA (the same grid-stride walk in all five warps), the producer fills a ring of ST stages, each KC
// chunks of K: lanes 0-3 copy the weight tiles of m-tile `lane` (contiguous over chunks, layouts.tile_rows),
// lanes 4-7 their scale tiles, lanes 8.. one token row each. It runs up to ST stages ahead, across items, and
// waits only for a stage's consumers to release it. Consumer warp w computes m-tile w from shared memory with
// the register kernel's chunk math (mma_chunk_bf16, the same K order: bit-identical results) and epilogue.
// No weight load waits behind a decode: the copies are in flight while the consumers compute.
template <int WF, int EPI, int NT, int KC, int ST>
__device__ __forceinline__ void moe_gemm_staged_impl(
    const u8* __restrict__ W, const u8* __restrict__ WS, const float* __restrict__ WS2, const u8* A,
    int a_by_token, const int* sorted_pair, const int* offs, const int* tile_expert, const int* tile_row,
    const int* num_tiles, const float* __restrict__ bias, void* __restrict__ out, int N, int K, int I, int topk,
    int kind, float alpha, float limit) {
  using S = Stage<WF, NT, KC>;
  constexpr int BT = 8 * NT, SB = ScaleBytes<WF>::V;
  extern __shared__ __align__(128) u8 ring[];
  u64* full = reinterpret_cast<u64*>(ring + ST * S::BYTES);
  u64* empty = full + ST;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  u32 launched;   // a launch with less dynamic shared memory than the ring needs stops here, not past its end
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(launched));
  if (launched < ST * S::BYTES + 16 * ST) __trap();
  if (threadIdx.x == 0) {
    for (int i = 0; i < ST; ++i) {
      mbar_init(full + i, 1);
      mbar_init(empty + i, 4);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  // the tiles (moe_align) and the activations (GEMM2: GEMM1's h) are earlier kernels' output
  wait_then_release();
  const int n_tiles16 = N / 16, nblocks = (n_tiles16 + 3) / 4, nch = K / 64;
  const int items = num_tiles[0] * nblocks;
  const int stages = (nch + KC - 1) / KC;   // per item; the last may hold fewer chunks
  int slot = 0;
  u32 phase = 0;
  auto next_slot = [&]() {
    if (++slot == ST) {
      slot = 0;
      phase ^= 1u;
    }
  };
  if (warp == 4) {
    for (int item = blockIdx.x; item < items; item += gridDim.x) {
      const int tile = item / nblocks, nb = item - tile * nblocks;
      const int le = tile_expert[tile], r0 = tile_row[tile];
      const int cnt = min(BT, offs[le + 1] - r0);
      // this lane's copy per stage: `unit` bytes a chunk from `src` to `dst` within the stage (none: unit 0)
      const u8* src = nullptr;
      int unit = 0, dst = 0;
      if (lane < 8) {
        const size_t mtile = (size_t)le * n_tiles16 + min(nb * 4 + (lane & 3), n_tiles16 - 1);
        if (lane < 4) {
          src = W + mtile * nch * 512;
          unit = 512;
          dst = lane * KC * 512;
        } else {
          src = WS + mtile * nch * (16 * SB);
          unit = 16 * SB;
          dst = S::W + (lane - 4) * KC * 16 * SB;
        }
      } else if (lane - 8 < cnt) {
        const int s = r0 + lane - 8;
        src = A + (size_t)(a_by_token ? sorted_pair[s] / topk : s) * K * 2;
        unit = 128;
        dst = S::W + S::S + (lane - 8) * S::AROW;
      }
      const u32 chunk_bytes = 4 * 512 + 4 * 16 * SB + cnt * 128;
      for (int st = 0; st < stages; ++st) {
        const int c0 = st * KC, kc = min(KC, nch - c0);
        if (lane == 0) {
          mbar_wait(empty + slot, phase ^ 1u);   // released by its consumers (a fresh barrier passes at once)
          mbar_arrive_expect(full + slot, chunk_bytes * kc);
        }
        __syncwarp();
        if (unit) bulk_copy(ring + slot * S::BYTES + dst, src + (size_t)c0 * unit, unit * kc, full + slot);
        next_slot();
      }
    }
    return;
  }
  const int g = lane >> 2, t = lane & 3;
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    const int tile = item / nblocks, nb = item - tile * nblocks;
    const int le = tile_expert[tile], r0 = tile_row[tile];
    const int cnt = min(BT, offs[le + 1] - r0);
    int arow[NT];   // the lane's activation row (slot f * 8 + g, clamped into the tile) in the stage
#pragma unroll
    for (int f = 0; f < NT; ++f) arow[f] = min(f * 8 + g, cnt - 1) * S::AROW + t * 32;
    float acc[1][NT][4];
#pragma unroll
    for (int f = 0; f < NT; ++f)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[0][f][i] = 0.f;
    for (int st = 0; st < stages; ++st) {
      const int kc = min(KC, nch - st * KC);
      mbar_wait(full + slot, phase);
      const u8* base = ring + slot * S::BYTES;
#pragma unroll
      for (int c = 0; c < KC; ++c) {
        if (c < kc) {
          const u8* wt = base + (warp * KC + c) * 512 + g * 32 + t * 8;
          const u8* sct = base + S::W + (warp * KC + c) * 16 * SB;
          const uint2 w0 = lds64(wt), w1 = lds64(wt + 256);
          const u32 w[2][2] = {{w0.x, w0.y}, {w1.x, w1.y}};
          const u32 sc[2] = {load_scale<WF, AQ_NONE>(sct, g, t), load_scale<WF, AQ_NONE>(sct, g + 8, t)};
          u32 a[NT][8];
#pragma unroll
          for (int f = 0; f < NT; ++f) {
            const u8* ap = base + S::W + S::S + arow[f] + c * 128;
            const uint4 x = lds128(ap), y = lds128(ap + 16);
            a[f][0] = x.x; a[f][1] = x.y; a[f][2] = x.z; a[f][3] = x.w;
            a[f][4] = y.x; a[f][5] = y.y; a[f][6] = y.z; a[f][7] = y.w;
          }
          mma_chunk_bf16<WF, NT>(acc[0], w, sc, a);
        }
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(empty + slot);
      next_slot();
    }
    const int trow[NT][2] = {};   // per-token activation scales: none for bf16 activations
    store_tile<WF, AQ_NONE, EPI, 1, NT>(acc, nullptr, trow, r0, cnt, le, nb * 4 + warp, n_tiles16, WS2, bias, out,
                                        N, I, kind, alpha, limit);
  }
}

#define MOE_GEMM_KERNEL(NAME, WF, AQ, EPI, MT, NT, SK)                                                      \
  extern "C" __global__ void __launch_bounds__(THREADS) NAME(                                               \
      const u8* __restrict__ W, const u8* __restrict__ WS, const float* __restrict__ WS2,                   \
      const u8* A, const float* AS, int a_by_token,                                                         \
      const int* sorted_pair, const int* offs, const int* tile_expert,                                      \
      const int* tile_row, const int* num_tiles, const float* __restrict__ bias,                            \
      void* __restrict__ out, int N, int K, int I, int topk, int kind, float alpha, float limit) {          \
    moe_gemm_impl<WF, AQ, EPI, MT, NT, SK, false>(W, WS, WS2, A, AS, a_by_token, sorted_pair, offs, tile_expert, \
                                              tile_row, num_tiles, nullptr, nullptr, 0, 0, bias, out, N, K, I, \
                                              topk, kind, alpha, limit, nullptr, nullptr, nullptr, nullptr); \
  }
#define MOE_GEMM_INSTANCE(WF, AQ, EPI, MT, NT)                                                              \
  MOE_GEMM_KERNEL(moe_gemm_##WF##_##AQ##_##EPI##_##MT##_##NT, WF, AQ, EPI, MT, NT, 1)
// split-K variants: the name carries SK as a sixth number
#define MOE_GEMM_INSTANCE_SPLIT(WF, AQ, EPI, MT, NT, SK)                                                    \
  MOE_GEMM_KERNEL(moe_gemm_##WF##_##AQ##_##EPI##_##MT##_##NT##_##SK, WF, AQ, EPI, MT, NT, SK)
// pair tiles (calls without moe_align): the (1, 1) warp tile, named with its SK and `pairs`
// CTAs an SM must hold (registers at most 65536 / (128 x that)): what each format's pair GEMMs held before the fused
// combine. Fewer would cost the bf16 GEMM2 a wave (Q's one-token down GEMM: 512 items, one wave at 4 CTAs an SM, 1.3
// at 3); it stays within 128 registers with one chunk a load group (Unroll).
#define PAIRS_MIN_CTAS(WF, AQ) ((WF) == WF_BF16 || (AQ) == AQ_TOKEN ? 4 : 3)
#define MOE_GEMM_INSTANCE_PAIRS(WF, AQ, EPI, SK)                                                            \
  extern "C" __global__ void __launch_bounds__(THREADS, PAIRS_MIN_CTAS(WF, AQ))                            \
      moe_gemm_##WF##_##AQ##_##EPI##_1_1_##SK##_pairs(                                                      \
      const u8* __restrict__ W, const u8* __restrict__ WS, const float* __restrict__ WS2,                   \
      const u8* A, const float* AS, int a_by_token,                                                         \
      const long long* ids, const int* __restrict__ local_map, int num_experts, int pairs,                  \
      const float* __restrict__ bias, void* __restrict__ out, int N, int K, int I, int topk, int kind,      \
      float alpha, float limit, const float* topk_w, const float* __restrict__ combine_bias,                \
      u16* __restrict__ combined, unsigned int* __restrict__ counters) {                                    \
    moe_gemm_impl<WF, AQ, EPI, 1, 1, SK, true>(W, WS, WS2, A, AS, a_by_token, nullptr, nullptr, nullptr,    \
                                             nullptr, nullptr, ids, local_map, num_experts, pairs, bias,    \
                                             out, N, K, I, topk, kind, alpha, limit, topk_w, combine_bias,  \
                                             combined, counters);                                           \
  }
// staged decode GEMMs (W4A16, sorted path): the (1, NT) tile, KC chunks a stage, ST stages; 160 threads
#define MOE_GEMM_INSTANCE_STAGED(WF, EPI, NT, KC, ST)                                                       \
  extern "C" __global__ void __launch_bounds__(160) moe_gemm_##WF##_0_##EPI##_1_##NT##_s##KC##x##ST(       \
      const u8* __restrict__ W, const u8* __restrict__ WS, const float* __restrict__ WS2,                   \
      const u8* A, const float* AS, int a_by_token,                                                         \
      const int* sorted_pair, const int* offs, const int* tile_expert,                                      \
      const int* tile_row, const int* num_tiles, const float* __restrict__ bias,                            \
      void* __restrict__ out, int N, int K, int I, int topk, int kind, float alpha, float limit) {          \
    moe_gemm_staged_impl<WF, EPI, NT, KC, ST>(W, WS, WS2, A, a_by_token, sorted_pair, offs, tile_expert,     \
                                              tile_row, num_tiles, bias, out, N, K, I, topk, kind, alpha,   \
                                              limit);                                                       \
  }
