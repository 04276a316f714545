// Low-bit expert projections on tensor cores, straight from the lo arena's packed rows (CUDA C++).
//
// The algebra (tensor cores on the rows as stored), the grid and what both kernel sources share are in
// lo_mma_common.cuh. Here each warp loads its rows' codes and scales into registers from global
// memory, the next group's while one computes, and its activations straight from global memory. Two
// main loops: the weight rows as the MMA's rows and the tokens as its n8 columns (`weights_as_rows`),
// or, for blocks of 16 or 32 token rows, the tokens as its rows and the same registers as B
// (`tokens_as_rows`: an unpack per 16 tokens; `lo_cuda.tokens_as_rows`).

#include "lo_mma_common.cuh"

namespace {

// Lane t's activations of one group for one token, from global memory (`group_row`: the token's row
// at the group).
template <int BITS>
__device__ __forceinline__ void load_acts(GroupActs<BITS>& x, const __nv_bfloat16* group_row, int t) {
    const uint4* p = reinterpret_cast<const uint4*>(group_row + t * (2 * 32 / BITS));
#pragma unroll
    for (int i = 0; i < GroupActs<BITS>::R / 4; ++i) {
        const uint4 v = p[i];
        x.r[4 * i] = v.x, x.r[4 * i + 1] = v.y, x.r[4 * i + 2] = v.z, x.r[4 * i + 3] = v.w;
    }
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
            tile_weights_as_rows<BITS, NM, NT>(acc, j, cur, x, s_cur, o_cur);
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
            tiles_tokens_as_rows<BITS, NM, NT>(acc, jj, cur, x0, x1, s, o);
        }
#pragma unroll
        for (int m = 0; m < NM; ++m) cur[m] = nxt[m];
    }
}

}  // namespace

// Programs of `lo_mma_kernel` an SM holds at once, as its launch bound (nvcc caps the registers to fit):
// down at one token tile 8 (`kMinPrograms`); with the weights as the MMA's rows, two or more token
// tiles and K split between warps (the grids of 5 to 128 tokens), 16 warps of gate_up and 20 of down
// (at most 128 and 102 registers at 4 warps a program, none spilled on sm_90: the kernels wait on
// memory at 12 to 16 warps an SM, which this keeps resident); else as the compiler chooses (1 warp along K at 4 token tiles would spill).
template <int NM, int NT, int WK, int WN, bool TOKENS_AS_ROWS>
constexpr int kResidentPrograms =
    NT == 1 || TOKENS_AS_ROWS || WK == 1 ? kMinPrograms<NM, NT> : (NM == 2 ? 16 : 20) / (WK * WN);

// NM matrices (1: down, 2: gate_up), NT n8 tiles of tokens, WK x WN warps. Down (NM 1) may run as a
// programmatic dependent of gate_up: it finds its rows, starts their loads and waits for h only then
// (`wait_for_the_grid_before`); it writes nothing before that wait.
template <int BITS, int NM, int NT, int WK, int WN, bool TOKENS_AS_ROWS>
__global__ void __launch_bounds__(32 * WK * WN, (kResidentPrograms<NM, NT, WK, WN, TOKENS_AS_ROWS>))
    lo_mma_kernel(const LoArgs a) {
    launch_dependents();
    const int b = blockIdx.x;
    const long long expert = a.experts_i64 ? reinterpret_cast<const long long*>(a.block_expert)[b]
                                           : (long long)reinterpret_cast<const int*>(a.block_expert)[b];
    if (expert < 0 || a.pool_of[expert] != a.pool_id) return;
    const long long slot = a.slot_of[a.pool_id * a.slot_stride + expert];
    wait_for_copy(a, expert, slot);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int wk = warp % WK, wn = warp / WK;
    const int g = lane >> 2, t = lane & 3;
    const int n0 = (blockIdx.y * WN + wn) * 16;  // this warp's first output row

    // token rows: how many n8 tiles hold one, and the activation row each thread's B column reads
    const int nt_used = token_tiles_used(a, b, lane);
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
        __shared__ float red[(WK - 1) * WN * NM * NT * 4 * 32];
        if (!sum_k_parts<NM, NT, WK, WN>(acc, red, wk, wn, lane)) return;
    }
    store_cells<NM, NT, TOKENS_AS_ROWS>(acc, a, b, n0, g, t, nt_used);
}

namespace {

// One instantiation's launch on the caller's stream.
struct LaunchOne {
    const LoArgs& a;
    const Launch& l;
    template <int BITS, int NM, int NT, int WK, int WN, bool TOKENS_AS_ROWS>
    cudaError_t run() const {
        return launch_programs<WK, WN>(lo_mma_kernel<BITS, NM, NT, WK, WN, TOKENS_AS_ROWS>, a, l, 0);
    }
};

}  // namespace

// matrices 2: gate_up, 1: down; nt n8 token tiles (>= block_m / 8); wk warps along K (1, 2, 4) and wn
// along N (wk * wn 4); dependent: down as a programmatic dependent launch of the
// kernel before it (sm_90+); tokens_as_rows: the main loop of `tokens_as_rows` (nt 2 or 4), else
// `weights_as_rows`. Returns the launch's cudaError_t (0: launched).
extern "C" int moetide_lo_mma(const LoArgs* args, int matrices, int bits, int nt, int wk, int wn,
                              int blocks, int dependent, int tokens_as_rows, void* stream) {
    const Launch l{blocks, dependent != 0 && matrices == 1, reinterpret_cast<cudaStream_t>(stream)};
    if (blocks <= 0) return 0;
    return dispatch(LaunchOne{*args, l}, matrices, bits, nt, wk, wn, tokens_as_rows != 0);
}
