// Low-bit expert projections on tensor cores, straight from the lo arena's packed rows (CUDA C++):
// lo_mma.cu with its operands staged through a shared-memory pipeline (see "Memory" below).
//
// Status: a candidate to replace lo_mma.cu, with the same `LoArgs`, entry point and results. On an
// H100 (BENCHMARKS.md §0q) every GPU test passes; on programs of 4 warps it is 1-16 % slower than
// lo_mma.cu up to 128 tokens, equal in decode, and 14-21 % faster at 512 tokens (tokens as the MMA's
// rows, 1 x 4 warps: one staged copy of the activations read by 4 warps). Its programs of 8 warps
// (§0r) beat its own 4-warp ones at 32 and 128 tokens, and lo_mma.cu by 8 % for int4 at 32 tokens
// (163.6 against 176.9 µs); for int2 they tie lo_mma.cu. MOETIDE_LO_SOURCE=<this file> builds and
// runs it in place of lo_mma.cu (`lo_cuda.source`); tests/test_lo_cuda.py runs its GPU tests for both sources, and
// `scripts/bench_lo_cuda.py --against-source <this file>` times it against lo_mma.cu in one process.
// Its index arithmetic (copies that cover every chunk of a stage once, reads that find the bytes
// lo_mma.cu loads from global memory, conflict-free activation reads) is checked without a GPU by
// scripts/check_lo_pipeline_layout.py.
//
// Memory. Codes, scales and activations reach the warps through shared memory, copied by cp.async
// in a pipeline of kStages stages (one group of every row of the program per part of K, and the
// block's activations of that group), kStages - 1 of them in flight while one is computed; the tile's
// scales and offsets are copied once, first. A program thus keeps tens of kilobytes in flight without
// holding registers for them, where lo_mma.cu's loads into registers keep one group a warp in flight
// (§0l, §0n, §0o read its kernels as bound by latency; up to 128 tokens this did not help: §0q).
//
// The algebra (tensor cores on the rows as stored), the grid and what both kernel sources share are
// in lo_mma_common.cuh.

#include "lo_mma_common.cuh"

namespace {

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
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        if (j >= nt_used) continue;
        GroupActs<BITS> x;
        load_acts<BITS>(x, acts, act_row[j], t);
        tile_weights_as_rows<BITS, NM, NT>(acc, j, w, x, s, o);
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
        tiles_tokens_as_rows<BITS, NM, NT>(acc, jj, w, x0, x1, s, o);
    }
}

}  // namespace

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
    wait_for_copy(a, expert, slot);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int wk = warp % WK, wn = warp / WK;
    const int g = lane >> 2, t = lane & 3;
    const int n_first = blockIdx.y * Geo::kRows;  // the program's first output row of each matrix
    const int n0 = n_first + 16 * wn;             // this warp's

    // token rows: how many n8 tiles hold one; the rows a stage holds (`act_rows`) and those copied
    const int nt_used = token_tiles_used(a, b, lane);
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
        __syncthreads();
        if (!sum_k_parts<NM, NT, WK, WN>(acc, reinterpret_cast<float*>(smem), wk, wn, lane)) return;
    }
    store_cells<NM, NT, TOKENS_AS_ROWS>(acc, a, b, n0, g, t, nt_used);
}

namespace {

// One instantiation's launch on the caller's stream, with the dynamic shared memory of its pipeline.
struct LaunchOne {
    const LoArgs& a;
    const Launch& l;
    template <int BITS, int NM, int NT, int WK, int WN, bool TOKENS_AS_ROWS>
    cudaError_t run() const {
        return launch_programs<WK, WN>(lo_mma_kernel<BITS, NM, NT, WK, WN, TOKENS_AS_ROWS>, a, l,
                                       Geometry<BITS, NM, NT, WK, WN>::shared_bytes(a));
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
