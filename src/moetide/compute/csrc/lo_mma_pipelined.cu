// Low-bit expert projections on tensor cores, straight from the lo arena's packed rows (CUDA C++):
// lo_mma.cu with its operands staged through a shared-memory pipeline (see "Memory" below).
//
// Status: a candidate to replace lo_mma.cu, with the same `LoArgs`, entry point and results. On an
// H100 (BENCHMARKS.md §0q) every GPU test passes; on programs of 4 warps it is 1-16 % slower than
// lo_mma.cu up to 128 tokens, equal in decode, and 14-21 % faster at 512 tokens (tokens as the MMA's
// rows, 1 x 4 warps: one staged copy of the activations read by 4 warps); its programs of 8 warps
// are not yet measured. MOETIDE_LO_SOURCE=<this file> builds and runs it in place of lo_mma.cu
// (`lo_cuda.source`); tests/test_lo_cuda.py runs its GPU tests for both sources, and
// `scripts/bench_lo_cuda.py --against-source <this file>` times it against lo_mma.cu in one process.
// Its index arithmetic (copies that cover every chunk of a stage once, reads that find the bytes
// lo_mma.cu loads from global memory, conflict-free activation reads) is checked without a GPU by
// scripts/check_lo_pipeline_layout.py.
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
// the group, read as 16-byte vectors and paired by PRMT. So every lane reads distinct words, about
// one integer instruction unpacks a code, and one MMA takes 16 x 16 codes. Per group, with
// D = sum (128 + code) x over its slots and X = sum x (an MMA of ones with the same B),
//   a . w = s * D + (o - 128 s) * X,
// applied in float32 to the group's partial sums (the Triton v4 / v5 products' algebra): no weight
// is rounded, the products are exact and summed in float32. Two main loops: the weight rows as the
// MMA's rows and the tokens as its n8 columns (`weights_as_rows`), or, for blocks of 16 or 32 token
// rows, the tokens as its rows and the same registers as B (`tokens_as_rows`: an unpack per 16
// tokens; `lo_cuda.tokens_as_rows`).
//
// Memory. Codes, scales and activations reach the warps through shared memory, copied by cp.async
// in a pipeline of kStages stages (one group of every row of the program per part of K, and the
// block's activations of that group), kStages - 1 of them in flight while one is computed; the tile's
// scales and offsets are copied once, first. A program thus keeps tens of kilobytes in flight without
// holding registers for them, where lo_mma.cu's loads into registers keep one group a warp in flight
// (its kernels are bound by latency: BENCHMARKS.md §0l, §0n, §0o).
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

// 16-byte chunks of one token's activations of a group (256 bits of a row: int2 128 codes, 256 bytes;
// int4 64 codes, 128 bytes).
template <int BITS>
constexpr int kActChunks = 32 / BITS;

// Where chunk q of a staged activation row `row` lies among the row's chunks: lane t reads chunks
// q = (R / 4) t + i of token rows g (i fixed per load), 8 lanes (two rows, t = 0..3) per shared-memory
// phase; the swap keeps those 8 chunks in 8 distinct bank groups (int2 rows are 16 chunks, int4 8).
template <int BITS>
__device__ __forceinline__ int act_chunk(int q, int row) {
    return q ^ (row & 1) ^ (BITS == 2 ? (q >> 2) & 2 : 0);
}

// Lane t's activations of one group from a staged row (`acts`: the stage's rows of this K part).
template <int BITS>
__device__ __forceinline__ void load_acts(GroupActs<BITS>& x, const uint4* acts, int row, int t) {
    constexpr int kLoads = GroupActs<BITS>::R / 4;
    const uint4* chunks = acts + row * kActChunks<BITS>;
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
        const uint4 v = chunks[act_chunk<BITS>(kLoads * t + i, row)];
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

// ---- The shared-memory pipeline ----
// A program's rows stream through shared memory in stages: stage s holds, for each of the WK parts of
// K, group (part start + s) of every row of the program's tile (32 bytes a row and matrix) and the
// block's activations of that group; the scales and offsets of every group of the tile are copied
// once, up front. Copies are cp.async (no registers held while they fly), kStages - 1 stages ahead of
// the one computed, so a program keeps tens of kilobytes in flight where a load into registers kept
// one group; warps read their fragments from shared memory.

__device__ __forceinline__ uint32_t shared_address(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared (cp.async, sm_80+), the whole 128-byte line asked of L2 (the row's next
// groups, which the next stages read); `bytes` 0 fills the 16 bytes with zeros and reads nothing.
__device__ __forceinline__ void copy16(void* dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(shared_address(dst)), "l"(src),
                 "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void commit_copies() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int PENDING>
__device__ __forceinline__ void wait_copies() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory");
}

// A program of WK x WN warps: its tile is 16 WN rows of each of NM matrices over all of K; stages of
// one group per K part; kStages of them in shared memory (more at one token tile, whose stages are
// small and whose programs are short).
template <int BITS, int NM, int NT, int WK, int WN>
struct Geometry {
    static constexpr int kThreads = 32 * WK * WN;
    static constexpr int kRows = 16 * WN;
    static constexpr int kCodeBytes = WK * NM * kRows * 32;  // a stage's codes, [part][matrix][row][32 B]
    static constexpr int kStages = NT == 1 ? 6 : NT == 2 ? 4 : 3;
    // a thread's activation copies per stage, at most (8 NT rows a part)
    static constexpr int kActCopies = (8 * NT * kActChunks<BITS> + 32 * WN - 1) / (32 * WN);

    __host__ __device__ static int act_rows(const LoArgs& a) { return a.one_pair ? 1 : 8 * NT; }
    __host__ __device__ static int scale_bytes(const LoArgs& a) {
        return (NM * 2 * kRows * (a.K / a.group) * 2 + 15) & ~15;  // [matrix][scale, offset][row][group]
    }
    __host__ __device__ static int stage_bytes(const LoArgs& a) {
        return kCodeBytes + WK * act_rows(a) * kActChunks<BITS> * 16;  // codes, then [part][row][chunk]
    }
    __host__ __device__ static int shared_bytes(const LoArgs& a) {
        const int pipeline = scale_bytes(a) + kStages * stage_bytes(a);
        const int reduction = (WK - 1) * WN * NM * NT * 4 * 32 * 4;  // the K parts' sums, after the pipeline
        return pipeline > reduction ? pipeline : reduction;
    }
};

// One group of the main loop with the weight rows as MMA rows (operand A, 16 rows) and the tokens as
// its columns (B, n8 tiles): acc[m][j][i] is (row n0 + g + 8 (i / 2), token 8 j + 2 t + i % 2). Each
// token tile unpacks the group's codes again and takes an MMA of ones; the layout for blocks of at
// most 8 tokens. `acts`: the stage's activation rows of this K part; `act_row[j]`: the staged row of
// lane column g of tile j; s, o: rows g and g + 8 of each matrix.
template <int BITS, int NM, int NT>
__device__ __forceinline__ void weights_as_rows(float (&acc)[NM][NT][4], const GroupWords (&w)[NM],
                                                const float (&s)[NM][2], const float (&o)[NM][2], const uint4* acts,
                                                const int (&act_row)[NT], int t, int nt_used) {
    const uint32_t ones[4] = {kOnes, kOnes, kOnes, kOnes};
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        if (j >= nt_used) continue;
        GroupActs<BITS> x;
        load_acts<BITS>(x, acts, act_row[j], t);
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
            acc[m][j][0] = scaled(acc[m][j][0], part[m][0], xsum[0], s[m][0], o[m][0]);
            acc[m][j][1] = scaled(acc[m][j][1], part[m][1], xsum[1], s[m][0], o[m][0]);
            acc[m][j][2] = scaled(acc[m][j][2], part[m][2], xsum[2], s[m][1], o[m][1]);
            acc[m][j][3] = scaled(acc[m][j][3], part[m][3], xsum[3], s[m][1], o[m][1]);
        }
    }
}

// One group of the main loop with the tokens as MMA rows (operand A: token tiles 2 jj and 2 jj + 1
// of the block, 16 tokens, their B fragments of `weights_as_rows` as its registers) and the weight
// rows as its columns (B: rows n0 + g and n0 + 8 + g, the A fragment's registers 0, 2 and 1, 3). A
// group's codes are unpacked once per 16 tokens instead of per 8, and the ones' MMA (X, the same for
// every column) once per 16 too. acc[m][2 jj + h][i] is (token 16 jj + g + 8 (i / 2), row n0 + 8 h +
// 2 t + i % 2), so a lane scales rows 2 t, 2 t + 1, 2 t + 8, 2 t + 9 of the warp's 16 (s, o[m][r]:
// r = 2 h + i % 2). Staged rows 16 jj + g and 16 jj + 8 + g are tile 2 jj's and 2 jj + 1's.
template <int BITS, int NM, int NT>
__device__ __forceinline__ void tokens_as_rows(float (&acc)[NM][NT][4], const GroupWords (&w)[NM],
                                               const float (&s)[NM][4], const float (&o)[NM][4], const uint4* acts,
                                               int g, int t, int nt_used) {
    static_assert(NT % 2 == 0, "tokens as rows takes 16-token tiles");
#pragma unroll
    for (int jj = 0; jj < NT / 2; ++jj) {
        if (2 * jj >= nt_used) continue;
        GroupActs<BITS> x0, x1;  // tokens 16 jj + g and 16 jj + 8 + g
        load_acts<BITS>(x0, acts, 16 * jj + g, t);
        load_acts<BITS>(x1, acts, 16 * jj + 8 + g, t);
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
// programmatic dependent of gate_up: it finds its rows and starts copying their codes and scales, and
// waits for h only then (`wait_for_the_grid_before`); it writes nothing before that wait.
template <int BITS, int NM, int NT, int WK, int WN, bool TOKENS_AS_ROWS>
__global__ void __launch_bounds__(32 * WK * WN, (kMinPrograms<NM, NT>)) lo_mma_kernel(const LoArgs a) {
    using Geo = Geometry<BITS, NM, NT, WK, WN>;
    extern __shared__ __align__(16) unsigned char smem[];
    launch_dependents();
    const int b = blockIdx.x;
    const long long expert = a.experts_i64 ? reinterpret_cast<const long long*>(a.block_expert)[b]
                                           : (long long)reinterpret_cast<const int*>(a.block_expert)[b];
    if (expert < 0) return;
    const int pool = a.pool_of[expert];  // both looked up at once: one round trip, not two
    const long long slot = a.slot_of[a.pool_id * a.slot_stride + expert];
    if (pool != a.pool_id) return;
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
    const int n_first = blockIdx.y * Geo::kRows;  // the program's first output row of each matrix
    const int n0 = n_first + 16 * wn;             // this warp's

    // token rows: how many n8 tiles hold one; the rows a stage holds (`act_rows`) and those copied
    int nt_used = 1;
    if (!a.one_pair) {
        const bool valid = lane < a.block_m && column_pair(a, b, lane) < a.num_pairs;
        nt_used = (__popc(__ballot_sync(0xffffffffu, valid)) + 7) >> 3;
    }
    const int act_rows = Geo::act_rows(a);
    int staged = a.one_pair ? 1 : 8 * nt_used;
    if (TOKENS_AS_ROWS) staged = min(act_rows, (staged + 15) & ~15);  // a 16-token tile is read whole

    const int groups = a.K / a.group, per_part = groups / WK;
    const int stage_bytes = Geo::stage_bytes(a);
    const __half* scales = reinterpret_cast<const __half*>(smem);
    unsigned char* stages = smem + Geo::scale_bytes(a);

    // This thread's copies of a stage: NM 16-byte chunks of codes (chunk c: part, matrix, row, half),
    // up to kActCopies of activations (part, staged row, chunk); a stage s reads s groups further.
    const unsigned char* row_base = a.arena + slot * a.row_bytes;
    const long long code_row_bytes = (long long)a.K * BITS / 8;
    const unsigned char* code_src[NM];
    int code_dst[NM];
#pragma unroll
    for (int i = 0; i < NM; ++i) {
        const int c = threadIdx.x + i * Geo::kThreads, half = c & 1, r = (c >> 1) % Geo::kRows;
        const int m = (c >> 1) / Geo::kRows % NM, part = (c >> 1) / Geo::kRows / NM;
        code_src[i] = row_base + a.data_off + (m * a.N + n_first + r) * code_row_bytes + part * per_part * 32 + half * 16;
        code_dst[i] = ((part * NM + m) * Geo::kRows + r) * 32 + half * 16;
    }
    const __nv_bfloat16* act = reinterpret_cast<const __nv_bfloat16*>(a.act);
    const __nv_bfloat16* act_src[Geo::kActCopies];
    int act_dst[Geo::kActCopies], act_bytes[Geo::kActCopies];
#pragma unroll
    for (int i = 0; i < Geo::kActCopies; ++i) {
        const int c = threadIdx.x + i * Geo::kThreads;
        act_dst[i] = -1, act_bytes[i] = 0, act_src[i] = act;
        if (c >= WK * staged * kActChunks<BITS>) continue;
        const int q = c % kActChunks<BITS>, row = c / kActChunks<BITS> % staged;
        const int part = c / kActChunks<BITS> / staged;
        const int pair = column_pair(a, b, row);
        if (pair < a.num_pairs) {  // a padding row is filled with zeros
            const long long src_row = NM == 2 ? (long long)(pair / a.top_k) : h_row(a, b, row);
            act_src[i] = act + src_row * a.act_stride + (long long)part * per_part * a.group + q * 8;
            act_bytes[i] = 16;
        }
        act_dst[i] = Geo::kCodeBytes + ((part * act_rows + row) * kActChunks<BITS> + act_chunk<BITS>(q, row)) * 16;
    }
    auto copy_codes = [&](int s) {
        unsigned char* buf = stages + (s % Geo::kStages) * stage_bytes;
#pragma unroll
        for (int i = 0; i < NM; ++i) copy16(buf + code_dst[i], code_src[i] + s * 32, 16);
    };
    auto copy_acts = [&](int s) {
        unsigned char* buf = stages + (s % Geo::kStages) * stage_bytes;
#pragma unroll
        for (int i = 0; i < Geo::kActCopies; ++i)
            if (act_dst[i] >= 0) copy16(buf + act_dst[i], act_src[i] + (long long)s * a.group, act_bytes[i]);
    };

    // Prologue: the tile's scales and offsets and the first kStages - 1 stages' codes, later lines of
    // the rows on their way to L2; then (down: once gate_up's h is visible) those stages' activations.
    {
        const int range = Geo::kRows * groups * 2 / 16;  // chunks of one matrix's scales (or offsets)
        const __half* params = reinterpret_cast<const __half*>(row_base);
        for (int c = threadIdx.x; c < NM * 2 * range; c += Geo::kThreads) {
            const int m = c / range / 2, offsets = c / range % 2;
            const __half* src = params + (offsets ? a.offset_off : a.scale_off) + (long long)(m * a.N + n_first) * groups;
            copy16(smem + c * 16, reinterpret_cast<const unsigned char*>(src) + (c % range) * 16, 16);
        }
    }
#pragma unroll
    for (int s = 0; s < Geo::kStages - 1; ++s)
        if (s < per_part) copy_codes(s);
    if ((code_dst[0] & 16) == 0)
        for (int s = (Geo::kStages + 2) & ~3; s < per_part; s += 4)  // a 128-byte line holds 4 groups
#pragma unroll
            for (int i = 0; i < NM; ++i) asm volatile("prefetch.global.L2 [%0];" ::"l"(code_src[i] + s * 32));
    if constexpr (NM == 1) wait_for_the_grid_before();  // h: gate_up's output
#pragma unroll
    for (int s = 0; s < Geo::kStages - 1; ++s)
        if (s < per_part) copy_acts(s);
    commit_copies();
#pragma unroll
    for (int s = 1; s < Geo::kStages - 1; ++s) commit_copies();  // empty: one group per stage from here

    // this lane's scale rows and staged activation rows
    int act_row[NT];
#pragma unroll
    for (int j = 0; j < NT; ++j) act_row[j] = 8 * j + g < staged ? 8 * j + g : 0;
    float acc[NM][NT][4];
#pragma unroll
    for (int m = 0; m < NM; ++m)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[m][j][i] = 0.f;

    for (int s = 0; s < per_part; ++s) {
        wait_copies<Geo::kStages - 2>();  // stage s has landed (this thread's copies) ...
        __syncthreads();                   // ... every thread's; and stage s - 1's buffer is free
        if (s + Geo::kStages - 1 < per_part) copy_codes(s + Geo::kStages - 1), copy_acts(s + Geo::kStages - 1);
        commit_copies();
        const unsigned char* buf = stages + (s % Geo::kStages) * stage_bytes;
        const int gi = wk * per_part + s;
        GroupWords w[NM];
#pragma unroll
        for (int m = 0; m < NM; ++m) {
            const unsigned char* rows = buf + ((wk * NM + m) * Geo::kRows + 16 * wn + g) * 32 + 8 * t;
            w[m].lo = *reinterpret_cast<const uint2*>(rows), w[m].hi = *reinterpret_cast<const uint2*>(rows + 8 * 32);
        }
        const uint4* acts = reinterpret_cast<const uint4*>(buf + Geo::kCodeBytes) + wk * act_rows * kActChunks<BITS>;
        if constexpr (TOKENS_AS_ROWS) {
            float sc[NM][4], of[NM][4];
#pragma unroll
            for (int m = 0; m < NM; ++m)
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const int row = 16 * wn + (r / 2) * 8 + r % 2 + 2 * t;
                    sc[m][r] = __half2float(scales[((m * 2) * Geo::kRows + row) * groups + gi]);
                    of[m][r] = __half2float(scales[((m * 2 + 1) * Geo::kRows + row) * groups + gi]);
                }
            tokens_as_rows<BITS, NM, NT>(acc, w, sc, of, acts, g, t, nt_used);
        } else {
            float sc[NM][2], of[NM][2];
#pragma unroll
            for (int m = 0; m < NM; ++m)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int row = 16 * wn + g + 8 * h;
                    sc[m][h] = __half2float(scales[((m * 2) * Geo::kRows + row) * groups + gi]);
                    of[m][h] = __half2float(scales[((m * 2 + 1) * Geo::kRows + row) * groups + gi]);
                }
            weights_as_rows<BITS, NM, NT>(acc, w, sc, of, acts, act_row, t, nt_used);
        }
    }

    if constexpr (WK > 1) {  // the K parts' sums, through shared memory (the pipeline's, now idle)
        constexpr int kVals = NM * NT * 4;
        float* red = reinterpret_cast<float*>(smem);
        __syncthreads();
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

// One instantiation's launch on the caller's stream (capturable: no host sync, no attribute set here).
struct LaunchOne {
    const LoArgs& a;
    const Launch& l;
    template <int BITS, int NM, int NT, int WK, int WN, bool TOKENS_AS_ROWS>
    cudaError_t run() const {
        cudaLaunchConfig_t config = {};
        config.gridDim = dim3(l.blocks, a.N / (16 * WN));
        config.blockDim = dim3(32 * WK * WN);
        config.dynamicSmemBytes = Geometry<BITS, NM, NT, WK, WN>::shared_bytes(a);
        config.stream = l.stream;
        cudaLaunchAttribute attribute[1];
        attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attribute[0].val.programmaticStreamSerializationAllowed = 1;
        config.attrs = attribute;
        config.numAttrs = l.dependent ? 1 : 0;
        return cudaLaunchKernelEx(&config, lo_mma_kernel<BITS, NM, NT, WK, WN, TOKENS_AS_ROWS>, a);
    }
};

// Lets one instantiation take up to `bytes` of dynamic shared memory (beyond the default 48 KiB).
struct AllowShared {
    int bytes;
    template <int BITS, int NM, int NT, int WK, int WN, bool TOKENS_AS_ROWS>
    cudaError_t run() const {
        return cudaFuncSetAttribute(lo_mma_kernel<BITS, NM, NT, WK, WN, TOKENS_AS_ROWS>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    }
};

// Warp grids (wk along K x wn along N): programs of 4 warps, and of 8 for blocks of 16 or more token rows
// (twice the rows per program: a stage's activations read by twice as many warps).
template <int BITS, int NM, int NT, bool TOKENS_AS_ROWS, class Op>
cudaError_t by_warps(const Op& op, int wk, int wn) {
    switch (wk * 16 + wn) {
        case 16 + 4: return op.template run<BITS, NM, NT, 1, 4, TOKENS_AS_ROWS>();
        case 32 + 2: return op.template run<BITS, NM, NT, 2, 2, TOKENS_AS_ROWS>();
        case 64 + 1: return op.template run<BITS, NM, NT, 4, 1, TOKENS_AS_ROWS>();
    }
    if constexpr (NT > 1) {
        switch (wk * 16 + wn) {
            case 16 + 8: return op.template run<BITS, NM, NT, 1, 8, TOKENS_AS_ROWS>();
            case 32 + 4: return op.template run<BITS, NM, NT, 2, 4, TOKENS_AS_ROWS>();
            case 64 + 2: return op.template run<BITS, NM, NT, 4, 2, TOKENS_AS_ROWS>();
        }
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
    if (bits == 2) return matrices == 2 ? by_tokens<2, 2>(op, nt, wk, wn, rows) : by_tokens<2, 1>(op, nt, wk, wn, rows);
    if (bits == 4) return matrices == 2 ? by_tokens<4, 2>(op, nt, wk, wn, rows) : by_tokens<4, 1>(op, nt, wk, wn, rows);
    return cudaErrorInvalidValue;
}

}  // namespace

// matrices 2: gate_up, 1: down; nt n8 token tiles (>= block_m / 8); wk warps along K (1, 2, 4) and wn
// along N (wk * wn 4, or 8 where nt > 1); dependent: down as a programmatic dependent launch of the
// kernel before it (sm_90+); tokens_as_rows: the main loop of `tokens_as_rows` (nt 2 or 4), else
// `weights_as_rows`. Returns the launch's cudaError_t (0: launched).
extern "C" int moetide_lo_mma(const LoArgs* args, int matrices, int bits, int nt, int wk, int wn,
                              int blocks, int dependent, int tokens_as_rows, void* stream) {
    const Launch l{blocks, dependent != 0 && matrices == 1, reinterpret_cast<cudaStream_t>(stream)};
    if (blocks <= 0) return 0;
    return dispatch(LaunchOne{*args, l}, matrices, bits, nt, wk, wn, tokens_as_rows != 0);
}

// Once per device, before any launch (and so outside any graph capture): every instantiation may take
// as much dynamic shared memory as a block of this device can (the pipeline's stages need more than
// the default 48 KiB at wide blocks). Returns the first failing call's cudaError_t (0: done).
extern "C" int moetide_lo_prepare() {
    int device = 0, bytes = 0;
    cudaError_t e = cudaGetDevice(&device);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    const AllowShared op{bytes};
    for (int matrices = 1; matrices <= 2 && e == cudaSuccess; ++matrices)
        for (int bits = 2; bits <= 4 && e == cudaSuccess; bits += 2)
            for (int nt = 1; nt <= 4 && e == cudaSuccess; nt *= 2)
                for (int warps = 4; warps <= (nt > 1 ? 8 : 4) && e == cudaSuccess; warps *= 2)
                    for (int wk = 1; wk <= 4 && e == cudaSuccess; wk *= 2)
                        for (int rows = 0; rows <= (nt > 1 ? 1 : 0) && e == cudaSuccess; ++rows)
                            e = dispatch(op, matrices, bits, nt, wk, warps / wk, rows != 0);
    return static_cast<int>(e);
}

extern "C" const char* moetide_lo_error(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }
