// The parts of the lo kernels (lo_mma.cu) around their main loop: the kernels' arguments, the tensor-core algebra on packed
// rows, both main loops' work on a group's loaded words and activations (`tile_weights_as_rows`,
// `tiles_tokens_as_rows`), the steps around each main loop (a block's copy wait, its token tiles, the K
// parts' sums, the epilogue), the launch and the dispatch over the instantiations. lo_mma.cu defines
// `lo_mma_kernel`, a `LaunchOne` op that launches one instantiation of it (`launch_programs`), and
// `moetide_lo_mma`.
//
// One kernel template serves gate_up (two matrices: the gate rows and the up rows of the same h
// columns, SiLU·mul in the epilogue, h stored in bf16) and down (one matrix, the routing weight in
// the epilogue, y stored in float32 per pair), for int2 and int4 rows laid out as the Triton path
// reads them (`fused_moe.py`): codes row-major along K, code c of a little-endian int32 word at bits
// c * BITS; float16 scale s and offset o per (row, group), w = s * code + o.
//
// Why tensor cores without a repacked layout. mma.m16n8k16 sums over its 16 k slots in any order,
// so the slots may stand for whichever codes are cheap to unpack, as long as the activations
// (operand B) follow the same order. A group is 256 bits of a row (int2 in groups of 128 codes, int4
// in groups of 64: 8 words); lane t of a quad (lane % 4) loads words 2t and 2t + 1 of it, for rows g
// and g + 8 (g = lane / 4), and its A fragment slots (2t, 2t+1), (2t+8, 2t+9) of each k16 tile are
// codes of those words only: one shift and one LOP3 (int4: two) put two codes that lie 16 bits apart
// into the halves of a register, each ORed into the mantissa of 128 (bf16 0x4300 | code is 128 + code,
// exact):
//   int2 (tile q of 8, s = q % 4, word q / 4): slots (2t, 2t+1) <- codes (2s, 2s+8),
//        (2t+8, 2t+9) <- codes (2s+1, 2s+9)
//   int4 (tile q of 4, s = q % 2, word q / 2): slots (2t, 2t+1) <- codes (2s, 2s+4),
//        (2t+8, 2t+9) <- codes (2s+1, 2s+5)
// The B fragment of lane t takes the same elements of its own 32 (int2) or 16 (int4) activations of
// the group, loaded as 16-byte vectors and paired by PRMT. So every lane loads distinct words, about
// one integer instruction unpacks a code, and one MMA takes 16 x 16 codes. Per group, with
// D = sum (128 + code) x over its slots and X = sum x (an MMA of ones with the same B),
//   a . w = s * D + (o - 128 s) * X,
// applied in float32 to the group's partial sums (the Triton v4 / v5 products' algebra): no weight
// is rounded, the products are exact and summed in float32.
//
// Grid (blocks, N / (16 * WN)), 32 * WK * WN threads: program (block b of up to 8 * NT token rows
// of one expert, 16 * WN output rows); warp (wk, wn) computes rows 16 * wn .. + 16 of the
// program's rows over the wk-th of WK equal parts of K; the parts are summed through shared memory.
// Blocks are those of `fused_moe.align_pairs` (ONE_PAIR: every pair its own block, the router's
// ids as the blocks' experts); a block whose expert is in another pool (or has none) exits at once.
// Built by `lo_cuda.py` with nvcc for the device's architecture (sm_80 or newer) and called through
// ctypes on the caller's stream (CUDA-graph capturable: no host sync, no allocation).

#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

struct LoArgs {
    const void* act;            // (rows, K) bf16: x (gate_up) or h (down)
    long long act_stride;       // elements
    void* out;                  // h (gate_up, bf16) or y (down, float32)
    long long out_stride;       // elements
    const void* routing;        // (P,) routing weights (down), dtype `routing_dtype`
    const int* sorted_pair;     // (blocks * block_m,) pair of each row, num_pairs for padding
    const void* block_expert;   // (blocks,) expert of each block, -1 for none; int64 if `experts_i64`
    const int* pool_of;         // (E,)
    const int* slot_of;         // (pools, E) or (E,)
    long long slot_stride;      // E, or 0
    const int* wait_of;         // (E,) copy number to wait for, or null
    const int* landed;          // (slots,) copy number landed per row
    const unsigned char* arena; // (slots, row_bytes)
    long long row_bytes;
    long long data_off;         // bytes to the matrix's codes in a row
    long long scale_off;        // float16 elements to its scales in a row
    long long offset_off;       // float16 elements to its offsets in a row
    int num_pairs;
    int pool_id;
    int K;                      // reduction length
    int N;                      // output rows (gate_up: I, its up rows at I + i)
    int group;                  // codes per scale / offset: 256 bits of a row (int2 128, int4 64)
    int top_k;
    int block_m;
    int one_pair;
    int experts_i64;
    int routing_dtype;          // 0 float32, 1 bf16, 2 fp16
};

namespace {

constexpr uint32_t kMagic = 0x43004300u;  // bf16 128.0 in both halves
constexpr uint32_t kOnes = 0x3F803F80u;   // bf16 1.0 in both halves
constexpr int kWaitSpins = 1 << 22;

__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Programmatic dependent launch (sm_90+; no-ops elsewhere and in a grid launched without it): a grid
// lets the next one start once all its programs got here, and a dependent grid waits here until the
// one before it has finished and its writes are visible.
__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void wait_for_the_grid_before() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// (shifted & mask) | magic. The compiler emits that as two LOP3s (an instruction takes one immediate);
// int2 has it as one, with both constants in registers (faster for int2 rows; int4 keeps the two
// LOP3s, faster there).
template <int BITS>
__device__ __forceinline__ uint32_t pair_codes(uint32_t shifted, uint32_t mask) {
    if constexpr (BITS == 2) {
        uint32_t codes;
        asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(codes) : "r"(shifted), "r"(mask), "r"(kMagic));
        return codes;
    } else {
        return (shifted & mask) | kMagic;
    }
}

// One group of one row as lane t of a quad holds it: words 2t, 2t + 1 of the group's 8 (a group is
// 256 bits: int2 in groups of 128, int4 in groups of 64).
struct GroupWords {
    uint2 lo, hi;  // rows g, g + 8
};

__device__ __forceinline__ uint32_t word_of(const uint2& v, int i) { return i == 0 ? v.x : v.y; }

// Tiles per word: a lane takes 4 codes of a row per k16 tile, so a word (32 / BITS codes) lasts
// int2 4 tiles, int4 2; tile q reads word q / kTilesPerWord at step s = q % kTilesPerWord.
template <int BITS>
constexpr int kTilesPerWord = 32 / BITS / 4;

// A fragment regs (row g: 0, 2; row g + 8: 1, 3) of k16 tile q of a group, lane t's words: code
// pairs 16 bits apart at bits 2 BITS s and 2 BITS s + BITS of the word (int2: codes (2s, 2s + 8),
// (2s + 1, 2s + 9); int4: (2s, 2s + 4), (2s + 1, 2s + 5)).
template <int BITS>
__device__ __forceinline__ void a_fragment(uint32_t (&a)[4], const GroupWords& w, int q) {
    constexpr uint32_t m = BITS == 2 ? 0x00030003u : 0x000F000Fu;
    const int word = q / kTilesPerWord<BITS>, shift = 2 * BITS * (q % kTilesPerWord<BITS>);
    const uint32_t w0 = word_of(w.lo, word), w1 = word_of(w.hi, word);
    a[0] = pair_codes<BITS>(w0 >> shift, m);
    a[2] = pair_codes<BITS>(w0 >> (shift + BITS), m);
    a[1] = pair_codes<BITS>(w1 >> shift, m);
    a[3] = pair_codes<BITS>(w1 >> (shift + BITS), m);
}

// Lane t's activations of one group for one token: the 2 * 32 / BITS codes its two words hold
// (int2: 32 bf16 in 16 regs, int4: 16 in 8), reg i = elements (2i, 2i + 1).
template <int BITS>
struct GroupActs {
    static constexpr int R = 32 / BITS;
    uint32_t r[R];
};

// B fragment of k16 tile q, in the slot order of `a_fragment`: a word's elements take R / 2 regs,
// and the pair's two codes lie half of them apart (int2: elements 16 word + 2s and + 8).
template <int BITS>
__device__ __forceinline__ void b_fragment(uint32_t& b0, uint32_t& b1, const GroupActs<BITS>& x, int q) {
    constexpr int kRegsPerWord = GroupActs<BITS>::R / 2;
    const int lo = kRegsPerWord * (q / kTilesPerWord<BITS>) + q % kTilesPerWord<BITS>;
    const int hi = lo + kRegsPerWord / 2;
    b0 = __byte_perm(x.r[lo], x.r[hi], 0x5410);
    b1 = __byte_perm(x.r[lo], x.r[hi], 0x7632);
}

__device__ __forceinline__ float routing_weight(const LoArgs& a, int pair) {
    if (a.routing_dtype == 0) return reinterpret_cast<const float*>(a.routing)[pair];
    if (a.routing_dtype == 1) return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(a.routing)[pair]);
    return __half2float(reinterpret_cast<const __half*>(a.routing)[pair]);
}

// The pair of token column c of block b (num_pairs if none), and the scratch row of h it uses.
__device__ __forceinline__ int column_pair(const LoArgs& a, int b, int c) {
    if (a.one_pair) return c == 0 ? b : a.num_pairs;
    return c < a.block_m ? a.sorted_pair[(long long)b * a.block_m + c] : a.num_pairs;
}

__device__ __forceinline__ long long h_row(const LoArgs& a, int b, int c) {
    return a.one_pair ? (long long)b : (long long)b * a.block_m + c;
}

// k16 tiles of a group (256 bits of a row): int2 8, int4 4.
template <int BITS>
constexpr int kTilesPerGroup = BITS == 2 ? 8 : 4;

// The group's sums into the accumulators, in float32: s D + (o - 128 s) X.
__device__ __forceinline__ float scaled(float acc, float part, float xsum, float s, float o) {
    return fmaf(s, part, fmaf(o - 128.f * s, xsum, acc));
}

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

// One token tile j of one group with the weight rows as the MMA's rows (operand A, 16 rows of each
// matrix from its words `w`) and the tile's tokens as its columns (B, from `x`): the group's codes
// unpacked for this tile, an MMA of ones for X, the sums scaled into acc[m][j] (s, o: rows g and g + 8, float
// or float16).
template <int BITS, int NM, int NT, class Scale>
__device__ __forceinline__ void tile_weights_as_rows(float (&acc)[NM][NT][4], int j,
                                                     const GroupWords (&w)[NM], const GroupActs<BITS>& x,
                                                     const Scale (&s)[NM][2], const Scale (&o)[NM][2]) {
    const uint32_t ones[4] = {kOnes, kOnes, kOnes, kOnes};
    float part[NM][4] = {}, xsum[4] = {};
#pragma unroll
    for (int q = 0; q < kTilesPerGroup<BITS>; ++q) {
        uint32_t b0, b1;
        b_fragment<BITS>(b0, b1, x, q);
        mma(xsum, ones, b0, b1);
#pragma unroll
        for (int m = 0; m < NM; ++m) {
            uint32_t af[4];
            a_fragment<BITS>(af, w[m], q);
            mma(part[m], af, b0, b1);
        }
    }
#pragma unroll
    for (int m = 0; m < NM; ++m) {  // rows g (i = 0, 1) and g + 8 (i = 2, 3)
        const float s0 = to_float(s[m][0]), s1 = to_float(s[m][1]);
        const float o0 = to_float(o[m][0]), o1 = to_float(o[m][1]);
        acc[m][j][0] = scaled(acc[m][j][0], part[m][0], xsum[0], s0, o0);
        acc[m][j][1] = scaled(acc[m][j][1], part[m][1], xsum[1], s0, o0);
        acc[m][j][2] = scaled(acc[m][j][2], part[m][2], xsum[2], s1, o1);
        acc[m][j][3] = scaled(acc[m][j][3], part[m][3], xsum[3], s1, o1);
    }
}

// Token tiles 2 jj and 2 jj + 1 of one group with the tokens as the MMA's rows (operand A: the B
// fragments of `x0`, `x1`, 16 tokens) and the weight rows as its columns (B: rows n0 + g and n0 + 8 + g,
// the A fragment's registers 0, 2 and 1, 3): the codes unpacked once per 16 tokens, one MMA of ones,
// the sums scaled into acc[m][2 jj + h] (s, o[m][r]: the lane's rows r = 2 h + i % 2).
template <int BITS, int NM, int NT>
__device__ __forceinline__ void tiles_tokens_as_rows(float (&acc)[NM][NT][4], int jj,
                                                     const GroupWords (&w)[NM], const GroupActs<BITS>& x0,
                                                     const GroupActs<BITS>& x1,
                                                     const float (&s)[NM][4], const float (&o)[NM][4]) {
    float part[NM][2][4] = {}, xsum[4] = {};
#pragma unroll
    for (int q = 0; q < kTilesPerGroup<BITS>; ++q) {
        uint32_t act[4];
        b_fragment<BITS>(act[0], act[2], x0, q);
        b_fragment<BITS>(act[1], act[3], x1, q);
        mma(xsum, act, kOnes, kOnes);
#pragma unroll
        for (int m = 0; m < NM; ++m) {
            uint32_t wf[4];
            a_fragment<BITS>(wf, w[m], q);
            mma(part[m][0], act, wf[0], wf[2]);
            mma(part[m][1], act, wf[1], wf[3]);
        }
    }
#pragma unroll
    for (int m = 0; m < NM; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                float& sum = acc[m][2 * jj + h][i];
                sum = scaled(sum, part[m][h][i], xsum[i], s[m][2 * h + i % 2], o[m][2 * h + i % 2]);
            }
}

// The (token column, output row) of accumulator i of token tile j (see the two main loops).
template <bool TOKENS_AS_ROWS>
__device__ __forceinline__ void cell_of(int j, int i, int n0, int g, int t, int& col, int& row) {
    if constexpr (TOKENS_AS_ROWS)
        col = 16 * (j / 2) + g + 8 * (i / 2), row = n0 + 8 * (j % 2) + 2 * t + i % 2;
    else
        col = 8 * j + 2 * t + i % 2, row = n0 + g + 8 * (i / 2);
}

// A program's thread 0 waits until the copy its block's expert waits for (`wait_of`) has landed in
// `slot`; every thread then goes on.
__device__ __forceinline__ void wait_for_copy(const LoArgs& a, long long expert, long long slot) {
    if (a.wait_of != nullptr) {
        const int want = a.wait_of[expert];
        if (want != 0 && threadIdx.x == 0) {
            const volatile int* landed = a.landed + slot;
            for (int spins = 0; *landed != want && spins < kWaitSpins; ++spins) {
            }
        }
        __syncthreads();
    }
}

// How many n8 tiles of block b hold a token row (1 for one-pair blocks); every lane of the warp calls.
__device__ __forceinline__ int token_tiles_used(const LoArgs& a, int b, int lane) {
    if (a.one_pair) return 1;
    const bool valid = lane < a.block_m && column_pair(a, b, lane) < a.num_pairs;
    return (__popc(__ballot_sync(0xffffffffu, valid)) + 7) >> 3;
}

// The K parts' sums into the wk = 0 warps through `red` ((WK - 1) * WN * NM * NT * 4 * 32 floats of
// shared memory, free for this); false for the other warps, which are done.
template <int NM, int NT, int WK, int WN>
__device__ __forceinline__ bool sum_k_parts(float (&acc)[NM][NT][4], float* red, int wk, int wn, int lane) {
    constexpr int kVals = NM * NT * 4;
    if (wk > 0) {
        float* dst = red + ((wn * (WK - 1) + wk - 1) * kVals) * 32 + lane;
#pragma unroll
        for (int m = 0; m < NM; ++m)
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int i = 0; i < 4; ++i) dst[((m * NT + j) * 4 + i) * 32] = acc[m][j][i];
    }
    __syncthreads();
    if (wk > 0) return false;
#pragma unroll
    for (int p = 0; p < WK - 1; ++p) {
        const float* src = red + ((wn * (WK - 1) + p) * kVals) * 32 + lane;
#pragma unroll
        for (int m = 0; m < NM; ++m)
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[m][j][i] += src[((m * NT + j) * 4 + i) * 32];
    }
    return true;
}

// The epilogue: gate_up (NM 2) stores SiLU(gate) * up as bf16 h, down (NM 1) the routing-weighted sums
// as float32 y per pair, for every accumulator whose token column holds a pair.
template <int NM, int NT, bool TOKENS_AS_ROWS>
__device__ __forceinline__ void store_cells(const float (&acc)[NM][NT][4], const LoArgs& a, int b, int n0,
                                            int g, int t, int nt_used) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        if ((TOKENS_AS_ROWS ? j & ~1 : j) >= nt_used) continue;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            int col, row;
            cell_of<TOKENS_AS_ROWS>(j, i, n0, g, t, col, row);
            const int pair = column_pair(a, b, col);
            if (pair >= a.num_pairs) continue;
            if constexpr (NM == 2) {
                const float gate = acc[0][j][i], up = acc[1][j][i];
                const float h = gate / (1.f + __expf(-gate)) * up;
                __nv_bfloat16* out = reinterpret_cast<__nv_bfloat16*>(a.out);
                out[h_row(a, b, col) * a.out_stride + row] = __float2bfloat16(h);
            } else {
                float* out = reinterpret_cast<float*>(a.out);
                out[(long long)pair * a.out_stride + row] = acc[0][j][i] * routing_weight(a, pair);
            }
        }
    }
}

struct Launch {
    int blocks;
    bool dependent;  // a programmatic dependent of the launch before it on the stream
    cudaStream_t stream;
};

// One launch of `kernel`, an instantiation of WK x WN warps, on the caller's stream with `shared_bytes`
// of dynamic shared memory (capturable: no host sync, no attribute set here).
template <int WK, int WN>
cudaError_t launch_programs(void (*kernel)(LoArgs), const LoArgs& a, const Launch& l, int shared_bytes) {
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(l.blocks, a.N / (16 * WN));
    config.blockDim = dim3(32 * WK * WN);
    config.dynamicSmemBytes = shared_bytes;
    config.stream = l.stream;
    cudaLaunchAttribute attribute[1];
    attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute[0].val.programmaticStreamSerializationAllowed = 1;
    config.attrs = attribute;
    config.numAttrs = l.dependent ? 1 : 0;
    return cudaLaunchKernelEx(&config, kernel, a);
}

// Warp grids (wk along K x wn along N): programs of 4 warps.
template <int BITS, int NM, int NT, bool TOKENS_AS_ROWS, class Op>
cudaError_t by_warps(const Op& op, int wk, int wn) {
    switch (wk * 16 + wn) {
        case 16 + 4: return op.template run<BITS, NM, NT, 1, 4, TOKENS_AS_ROWS>();
        case 32 + 2: return op.template run<BITS, NM, NT, 2, 2, TOKENS_AS_ROWS>();
        case 64 + 1: return op.template run<BITS, NM, NT, 4, 1, TOKENS_AS_ROWS>();
    }
    return cudaErrorInvalidValue;
}

template <int BITS, int NM, class Op>
cudaError_t by_tokens(const Op& op, int nt, int wk, int wn, bool tokens_as_rows) {
    if (tokens_as_rows) {  // 16-token tiles: blocks of 16 or 32 rows
        switch (nt) {
            case 2: return by_warps<BITS, NM, 2, true>(op, wk, wn);
            case 4: return by_warps<BITS, NM, 4, true>(op, wk, wn);
            default: return cudaErrorInvalidValue;
        }
    }
    switch (nt) {
        case 1: return by_warps<BITS, NM, 1, false>(op, wk, wn);
        case 2: return by_warps<BITS, NM, 2, false>(op, wk, wn);
        case 4: return by_warps<BITS, NM, 4, false>(op, wk, wn);
        default: return cudaErrorInvalidValue;
    }
}

template <class Op>
cudaError_t dispatch(const Op& op, int matrices, int bits, int nt, int wk, int wn, bool tokens_as_rows) {
    const bool rows = tokens_as_rows;
    if (bits == 2) return matrices == 2 ? by_tokens<2, 2>(op, nt, wk, wn, rows)
                                        : by_tokens<2, 1>(op, nt, wk, wn, rows);
    if (bits == 4) return matrices == 2 ? by_tokens<4, 2>(op, nt, wk, wn, rows)
                                        : by_tokens<4, 1>(op, nt, wk, wn, rows);
    return cudaErrorInvalidValue;
}

}  // namespace

// Programs of 128 threads an SM keeps resident: down at one token tile 8 (at most 64 registers: at
// T = 1 the OLMoE shape's down is 1,024 programs, one wave of 132 SMs), else as the compiler chooses.
template <int NM, int NT>
constexpr int kMinPrograms = NM == 1 && NT == 1 ? 8 : 1;

extern "C" const char* moetide_lo_error(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }
