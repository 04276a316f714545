// Low-bit expert projections on tensor cores, straight from the lo arena's packed rows (CUDA C++).
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
// is rounded, the products are exact and summed in float32. The next group's words and scales are
// loaded while one computes. Two main loops: the weight rows as the MMA's rows and the tokens as its
// n8 columns (`weights_as_rows`), or, for blocks of 16 or 32 token rows, the tokens as its rows and
// the same registers as B (`tokens_as_rows`: an unpack per 16 tokens; `lo_cuda.tokens_as_rows`).
//
// Grid (blocks, N / (16 * WN)), 32 * WK * WN threads: program (block b of up to 8 * NT token rows
// of one expert, 16 * WN output rows); warp (wk, wn) computes rows 16 * wn .. + 16 of the
// program's rows over the wk-th of WK equal parts of K; the parts are summed through shared memory.
// Blocks are those of `fused_moe.align_pairs` (ONE_PAIR: every pair its own block, the router's
// ids as the blocks' experts); a block whose expert is in another pool (or has none) exits at once.
// Built by `lo_cuda.py` with nvcc for the device's architecture (sm_80 or newer) and called through
// ctypes on the caller's stream (CUDA-graph capturable: no host sync, no allocation).

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
// int2 has it as one, with both constants in registers (3-5 % faster per int2 layer on the H200;
// int4 was 3-4 % slower that way up to 32 tokens, BENCHMARKS.md §0p).
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

template <int BITS>
__device__ __forceinline__ void load_acts(GroupActs<BITS>& x, const __nv_bfloat16* group_row, int t) {
    const uint4* p = reinterpret_cast<const uint4*>(group_row + t * (2 * 32 / BITS));
#pragma unroll
    for (int i = 0; i < GroupActs<BITS>::R / 4; ++i) {
        const uint4 v = p[i];
        x.r[4 * i] = v.x, x.r[4 * i + 1] = v.y, x.r[4 * i + 2] = v.z, x.r[4 * i + 3] = v.w;
    }
}

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

// The main loop with the weight rows as MMA rows (operand A, 16 rows) and the tokens as its columns
// (B, n8 tiles): acc[m][j][i] is (row n0 + g + 8 (i / 2), token 8 j + 2 t + i % 2). Each token tile
// unpacks the group's codes again and takes an MMA of ones; the layout for blocks of at most 8 tokens.
template <int BITS, int NM, int NT>
__device__ __forceinline__ void weights_as_rows(float (&acc)[NM][NT][4], const LoArgs& a,
                                                const uint2* const (&rows)[NM][2], const __half* params,
                                                const __nv_bfloat16* const (&x_rows)[NT], int n0, int g, int t,
                                                int g_begin, int g_end, int nt_used) {
    const int groups_per_row = a.K / a.group;
    const __half* scales[NM][2];
    const __half* offsets[NM][2];
#pragma unroll
    for (int m = 0; m < NM; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const long long r = (long long)(m * a.N + n0 + g + 8 * h) * groups_per_row;
            scales[m][h] = params + a.scale_off + r;
            offsets[m][h] = params + a.offset_off + r;
        }
    const uint32_t ones[4] = {kOnes, kOnes, kOnes, kOnes};
    GroupWords cur[NM], nxt[NM];
    __half s_cur[NM][2], o_cur[NM][2], s_nxt[NM][2], o_nxt[NM][2];
#pragma unroll
    for (int m = 0; m < NM; ++m) {
        cur[m].lo = __ldg(rows[m][0] + g_begin * 4), cur[m].hi = __ldg(rows[m][1] + g_begin * 4);
#pragma unroll
        for (int h = 0; h < 2; ++h) s_cur[m][h] = scales[m][h][g_begin], o_cur[m][h] = offsets[m][h][g_begin];
    }
    if constexpr (NM == 1) wait_for_the_grid_before();  // h: gate_up's output
    for (int gi = g_begin; gi < g_end; ++gi) {
        if (gi + 1 < g_end) {  // the next group's words and scales in flight while this one computes
#pragma unroll
            for (int m = 0; m < NM; ++m) {
                nxt[m].lo = __ldg(rows[m][0] + (gi + 1) * 4), nxt[m].hi = __ldg(rows[m][1] + (gi + 1) * 4);
#pragma unroll
                for (int h = 0; h < 2; ++h) s_nxt[m][h] = scales[m][h][gi + 1], o_nxt[m][h] = offsets[m][h][gi + 1];
            }
        }
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            if (j >= nt_used) continue;
            GroupActs<BITS> x;
            load_acts<BITS>(x, x_rows[j] + (long long)gi * a.group, t);
            float part[NM][4] = {}, xsum[4] = {};
#pragma unroll
            for (int q = 0; q < kTilesPerGroup<BITS>; ++q) {
                uint32_t b0, b1;
                b_fragment<BITS>(b0, b1, x, q);
                mma(xsum, ones, b0, b1);
#pragma unroll
                for (int m = 0; m < NM; ++m) {
                    uint32_t af[4];
                    a_fragment<BITS>(af, cur[m], q);
                    mma(part[m], af, b0, b1);
                }
            }
#pragma unroll
            for (int m = 0; m < NM; ++m) {  // rows g (i = 0, 1) and g + 8 (i = 2, 3)
                const float s0 = __half2float(s_cur[m][0]), s1 = __half2float(s_cur[m][1]);
                const float o0 = __half2float(o_cur[m][0]), o1 = __half2float(o_cur[m][1]);
                acc[m][j][0] = scaled(acc[m][j][0], part[m][0], xsum[0], s0, o0);
                acc[m][j][1] = scaled(acc[m][j][1], part[m][1], xsum[1], s0, o0);
                acc[m][j][2] = scaled(acc[m][j][2], part[m][2], xsum[2], s1, o1);
                acc[m][j][3] = scaled(acc[m][j][3], part[m][3], xsum[3], s1, o1);
            }
        }
#pragma unroll
        for (int m = 0; m < NM; ++m) {
            cur[m] = nxt[m];
#pragma unroll
            for (int h = 0; h < 2; ++h) s_cur[m][h] = s_nxt[m][h], o_cur[m][h] = o_nxt[m][h];
        }
    }
}

// The main loop with the tokens as MMA rows (operand A: token tiles 2 jj and 2 jj + 1 of the block, 16
// tokens, their B fragments of `weights_as_rows` as its registers) and the weight rows as its columns
// (B: rows n0 + g and n0 + 8 + g, the A fragment's registers 0, 2 and 1, 3). A group's codes are
// unpacked once per 16 tokens instead of per 8, and the ones' MMA (X, the same for every column) once
// per 16 too. acc[m][2 jj + h][i] is (token 16 jj + g + 8 (i / 2), row n0 + 8 h + 2 t + i % 2), so a
// lane scales rows 2 t, 2 t + 1, 2 t + 8, 2 t + 9 of the warp's 16 (r = 2 h + i % 2). Scales are read
// per group from L1 (a row's scales for all its groups are one 32-byte sector).
template <int BITS, int NM, int NT>
__device__ __forceinline__ void tokens_as_rows(float (&acc)[NM][NT][4], const LoArgs& a,
                                               const uint2* const (&rows)[NM][2], const __half* params,
                                               const __nv_bfloat16* const (&x_rows)[NT], int n0, int t,
                                               int g_begin, int g_end, int nt_used) {
    static_assert(NT % 2 == 0, "tokens as rows takes 16-token tiles");
    const int groups_per_row = a.K / a.group;
    const __half* scales[NM];  // row n0 + 2t of matrix m; the lane's rows r are + (r / 2) 8 + r % 2
#pragma unroll
    for (int m = 0; m < NM; ++m)
        scales[m] = params + a.scale_off + (long long)(m * a.N + n0 + 2 * t) * groups_per_row;
    const long long to_offsets = a.offset_off - a.scale_off;
    GroupWords cur[NM], nxt[NM];
#pragma unroll
    for (int m = 0; m < NM; ++m)
        cur[m].lo = __ldg(rows[m][0] + g_begin * 4), cur[m].hi = __ldg(rows[m][1] + g_begin * 4);
    if constexpr (NM == 1) wait_for_the_grid_before();  // h: gate_up's output
    for (int gi = g_begin; gi < g_end; ++gi) {
        if (gi + 1 < g_end) {  // the next group's words in flight while this one computes
#pragma unroll
            for (int m = 0; m < NM; ++m)
                nxt[m].lo = __ldg(rows[m][0] + (gi + 1) * 4), nxt[m].hi = __ldg(rows[m][1] + (gi + 1) * 4);
        }
        float s[NM][4], o[NM][4];
#pragma unroll
        for (int m = 0; m < NM; ++m)
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const __half* p = scales[m] + (long long)((r / 2) * 8 + r % 2) * groups_per_row + gi;
                s[m][r] = __half2float(p[0]), o[m][r] = __half2float(p[to_offsets]);
            }
#pragma unroll
        for (int jj = 0; jj < NT / 2; ++jj) {
            if (2 * jj >= nt_used) continue;
            GroupActs<BITS> x0, x1;  // tokens 16 jj + g and 16 jj + 8 + g
            load_acts<BITS>(x0, x_rows[2 * jj] + (long long)gi * a.group, t);
            load_acts<BITS>(x1, x_rows[2 * jj + 1] + (long long)gi * a.group, t);
            float part[NM][2][4] = {}, xsum[4] = {};
#pragma unroll
            for (int q = 0; q < kTilesPerGroup<BITS>; ++q) {
                uint32_t act[4];
                b_fragment<BITS>(act[0], act[2], x0, q);
                b_fragment<BITS>(act[1], act[3], x1, q);
                mma(xsum, act, kOnes, kOnes);
#pragma unroll
                for (int m = 0; m < NM; ++m) {
                    uint32_t w[4];
                    a_fragment<BITS>(w, cur[m], q);
                    mma(part[m][0], act, w[0], w[2]);
                    mma(part[m][1], act, w[1], w[3]);
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
#pragma unroll
        for (int m = 0; m < NM; ++m) cur[m] = nxt[m];
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

}  // namespace

// Programs of 128 threads an SM keeps resident: down at one token tile 8 (at most 64 registers: at
// T = 1 the OLMoE shape's down is 1,024 programs, one wave of 132 SMs), else as the compiler chooses.
template <int NM, int NT>
constexpr int kMinPrograms = NM == 1 && NT == 1 ? 8 : 1;

// NM matrices (1: down, 2: gate_up), NT n8 tiles of tokens, WK x WN warps. Down (NM 1) may run as a
// programmatic dependent of gate_up: it finds its rows, starts their loads and waits for h only then
// (`wait_for_the_grid_before`); it writes nothing before that wait.
template <int BITS, int NM, int NT, int WK, int WN, bool TOKENS_AS_ROWS>
__global__ void __launch_bounds__(32 * WK * WN, (kMinPrograms<NM, NT>)) lo_mma_kernel(const LoArgs a) {
    launch_dependents();
    const int b = blockIdx.x;
    const long long expert = a.experts_i64 ? reinterpret_cast<const long long*>(a.block_expert)[b]
                                           : (long long)reinterpret_cast<const int*>(a.block_expert)[b];
    if (expert < 0 || a.pool_of[expert] != a.pool_id) return;
    const long long slot = a.slot_of[a.pool_id * a.slot_stride + expert];
    if (a.wait_of != nullptr) {
        const int want = a.wait_of[expert];
        if (want != 0 && threadIdx.x == 0) {
            const volatile int* landed = a.landed + slot;
            for (int spins = 0; *landed != want && spins < kWaitSpins; ++spins) {
            }
        }
        __syncthreads();
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int wk = warp % WK, wn = warp / WK;
    const int g = lane >> 2, t = lane & 3;
    const int n0 = (blockIdx.y * WN + wn) * 16;  // this warp's first output row

    // token rows: how many n8 tiles hold one, and the activation row each thread's B column reads
    int nt_used = 1;
    if (!a.one_pair) {
        const bool valid = lane < a.block_m && column_pair(a, b, lane) < a.num_pairs;
        nt_used = (__popc(__ballot_sync(0xffffffffu, valid)) + 7) >> 3;
    }
    const __nv_bfloat16* act = reinterpret_cast<const __nv_bfloat16*>(a.act);
    const __nv_bfloat16* x_rows[NT];
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        int c = 8 * j + g, pair = column_pair(a, b, c);
        if (pair >= a.num_pairs) c = 0, pair = column_pair(a, b, 0);  // a padding column reads row 0
        long long r = NM == 2 ? (long long)(pair / a.top_k) : h_row(a, b, c);
        x_rows[j] = act + r * a.act_stride;
    }

    const int words_per_row = a.K * BITS / 32;
    const uint32_t* base = reinterpret_cast<const uint32_t*>(a.arena + slot * a.row_bytes + a.data_off);
    const uint2* rows[NM][2];  // lane t's first pair of words of each row, group 0
#pragma unroll
    for (int m = 0; m < NM; ++m) {
        const uint32_t* r0 = base + (long long)(m * a.N + n0 + g) * words_per_row + 2 * t;
        rows[m][0] = reinterpret_cast<const uint2*>(r0);
        rows[m][1] = reinterpret_cast<const uint2*>(r0 + 8LL * words_per_row);
    }
    const __half* params = reinterpret_cast<const __half*>(a.arena + slot * a.row_bytes);
    const int groups_per_row = a.K / a.group;
    const int per_warp = groups_per_row / WK, g_begin = wk * per_warp, g_end = g_begin + per_warp;
    for (int gi = g_begin + 1; gi < g_end; ++gi)  // the warp's later groups on their way to L2 now
#pragma unroll
        for (int m = 0; m < NM; ++m)
#pragma unroll
            for (int h = 0; h < 2; ++h) asm volatile("prefetch.global.L2 [%0];" ::"l"(rows[m][h] + gi * 4));

    float acc[NM][NT][4];
#pragma unroll
    for (int m = 0; m < NM; ++m)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[m][j][i] = 0.f;
    if constexpr (TOKENS_AS_ROWS)
        tokens_as_rows<BITS, NM, NT>(acc, a, rows, params, x_rows, n0, t, g_begin, g_end, nt_used);
    else
        weights_as_rows<BITS, NM, NT>(acc, a, rows, params, x_rows, n0, g, t, g_begin, g_end, nt_used);

    if constexpr (WK > 1) {  // the K parts' sums, through shared memory, into the wk = 0 warps
        constexpr int kVals = NM * NT * 4;
        __shared__ float red[(WK - 1) * WN * kVals * 32];
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
        if (wk > 0) return;
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
    }

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

namespace {

struct Launch {
    int blocks;
    bool dependent;  // a programmatic dependent of the launch before it on the stream
    cudaStream_t stream;
};

template <int BITS, int NM, int NT, int WK, int WN, bool TOKENS_AS_ROWS>
cudaError_t launch(const LoArgs& a, const Launch& l) {
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(l.blocks, a.N / (16 * WN));
    config.blockDim = dim3(32 * WK * WN);
    config.stream = l.stream;
    cudaLaunchAttribute attribute[1];
    attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute[0].val.programmaticStreamSerializationAllowed = 1;
    config.attrs = attribute;
    config.numAttrs = l.dependent ? 1 : 0;
    return cudaLaunchKernelEx(&config, lo_mma_kernel<BITS, NM, NT, WK, WN, TOKENS_AS_ROWS>, a);
}

// Warp grids (wk along K x wn along N): programs of 4 warps, and of 8 for blocks of 16 or more token rows
// (twice the rows per program: a block's activations read by twice as many warps of one program).
template <int BITS, int NM, int NT, bool TOKENS_AS_ROWS = false>
cudaError_t by_warps(const LoArgs& a, const Launch& l, int wk, int wn) {
    switch (wk * 16 + wn) {
        case 16 + 4: return launch<BITS, NM, NT, 1, 4, TOKENS_AS_ROWS>(a, l);
        case 32 + 2: return launch<BITS, NM, NT, 2, 2, TOKENS_AS_ROWS>(a, l);
        case 64 + 1: return launch<BITS, NM, NT, 4, 1, TOKENS_AS_ROWS>(a, l);
    }
    if constexpr (NT > 1) {
        switch (wk * 16 + wn) {
            case 16 + 8: return launch<BITS, NM, NT, 1, 8, TOKENS_AS_ROWS>(a, l);
            case 32 + 4: return launch<BITS, NM, NT, 2, 4, TOKENS_AS_ROWS>(a, l);
            case 64 + 2: return launch<BITS, NM, NT, 4, 2, TOKENS_AS_ROWS>(a, l);
        }
    }
    return cudaErrorInvalidValue;
}

template <int BITS, int NM>
cudaError_t by_tokens(const LoArgs& a, const Launch& l, int nt, int wk, int wn, bool tokens_as_rows) {
    if (tokens_as_rows) {  // 16-token tiles: blocks of 16 or 32 rows
        switch (nt) {
            case 2: return by_warps<BITS, NM, 2, true>(a, l, wk, wn);
            case 4: return by_warps<BITS, NM, 4, true>(a, l, wk, wn);
            default: return cudaErrorInvalidValue;
        }
    }
    switch (nt) {
        case 1: return by_warps<BITS, NM, 1>(a, l, wk, wn);
        case 2: return by_warps<BITS, NM, 2>(a, l, wk, wn);
        case 4: return by_warps<BITS, NM, 4>(a, l, wk, wn);
        default: return cudaErrorInvalidValue;
    }
}

}  // namespace

// matrices 2: gate_up, 1: down; nt n8 token tiles (>= block_m / 8); wk warps along K (1, 2, 4) and wn
// along N (wk * wn 4, or 8 where nt > 1); dependent: down as a programmatic dependent launch of the
// kernel before it (sm_90+); tokens_as_rows: the main loop of `tokens_as_rows` (nt 2 or 4), else
// `weights_as_rows`. Returns the launch's cudaError_t (0: launched).
extern "C" int moetide_lo_mma(const LoArgs* args, int matrices, int bits, int nt, int wk, int wn,
                              int blocks, int dependent, int tokens_as_rows, void* stream) {
    const LoArgs& a = *args;
    const Launch l{blocks, dependent != 0 && matrices == 1, reinterpret_cast<cudaStream_t>(stream)};
    if (blocks <= 0) return 0;
    const bool rows = tokens_as_rows != 0;
    if (bits == 2) return matrices == 2 ? by_tokens<2, 2>(a, l, nt, wk, wn, rows)
                                        : by_tokens<2, 1>(a, l, nt, wk, wn, rows);
    if (bits == 4) return matrices == 2 ? by_tokens<4, 2>(a, l, nt, wk, wn, rows)
                                        : by_tokens<4, 1>(a, l, nt, wk, wn, rows);
    return cudaErrorInvalidValue;
}

extern "C" const char* moetide_lo_error(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }
