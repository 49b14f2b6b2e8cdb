// FlashAttention-2 forward on tensor cores for uncompressed fp16/bf16 K/V (wrapper: kernels/flash_attention.py).
//
// Grid (row blocks, H_kv, B); block WARPS * 32 threads. Rows of a block are (position, head-in-group) pairs of
// one KV head (see fa_common.cuh). Causal blocks run heaviest first and skip key tiles past their last row's
// diagonal; only tiles crossing a diagonal or the end of the keys are masked element-wise.
//
// Pipeline (one __syncthreads per key tile): at the top of tile t the copies of tile t are awaited, the block
// syncs (tile t visible, everybody done with tile t-1), the cp.async copies of tile t+1 are issued into the
// other stage, then tile t is consumed while they fly.
//
// Shared memory: [stage 0: K | V][stage 1: K | V][Q]; with Q in registers, Q is staged in stage 1 (it is
// moved to registers before stage 1 is first written).
//
// Build switches: none (kernels/flash_attention.py selects tilings by template arguments).
#include "fa_common.cuh"

template <int D, typename T, int WARPS, int MT, int BN, bool QREG>
__global__ void __launch_bounds__(WARPS * 32)
flash_attention_fwd(const fa::u16* __restrict__ q, const fa::u16* __restrict__ k, const fa::u16* __restrict__ v,
                    fa::u16* __restrict__ out, float* __restrict__ lse,
                    int q_heads, int kv_heads, int q_len, int kv_len,
                    fa::i64 q_sb, fa::i64 q_sh, fa::i64 q_sl,
                    fa::i64 k_sb, fa::i64 k_sh, fa::i64 k_sn,
                    fa::i64 v_sb, fa::i64 v_sh, fa::i64 v_sn,
                    float scale_log2, int causal) {
    using namespace fa;
    using C = Cfg<D, WARPS, MT, BN, QREG>;
    constexpr int STAGE = 2 * C::TILE_BYTES;
    constexpr int SMEM = QREG ? STAGE + (C::Q_BYTES > STAGE ? C::Q_BYTES : STAGE) : 2 * STAGE + C::Q_BYTES;
    extern __shared__ __align__(128) unsigned char fa_smem[];

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    if (tid == 0 && dynamic_smem_bytes() < SMEM) __trap();  // the wrapper's size formula drifted from this one

    const u32 s_base = smem_addr(fa_smem);
    const u32 s_q = QREG ? s_base + STAGE : s_base + 2 * STAGE;

    const int group = q_heads / kv_heads;
    const int blk = causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    const int kvh = blockIdx.y, b = blockIdx.z;
    const RowBlock rb{blk * C::BM, q_len * group, group, kv_len - q_len};

    // Key range of the block and the causal limits of this thread's fragment rows.
    const int n_end = causal ? imin(kv_len, rb.lim_hi(C::BM) + 1) : kv_len;
    const int n_tiles = n_end > 0 ? (n_end + BN - 1) / BN : 0;
    const int lim_lo = rb.lim_lo();
    int row_lim[MT][2];
    fragment_limits(row_lim, rb, warp, lane);

    // Q tile (rows past the end zero-filled).
#pragma unroll
    for (int i = 0; i < C::BM * C::CHUNKS / C::THREADS; ++i) {
        const int u = tid + i * C::THREADS;
        const int row = u / C::CHUNKS, c = u % C::CHUNKS;
        const int r = rb.m0 + row;
        const fa::u16* src = q + b * q_sb + rb.head(r, kvh) * q_sh + rb.pos(r) * q_sl + c * 8;
        cp_async_16(s_q + C::swz(row, c), src, r < rb.rows ? 16 : 0);
    }
    cp_async_commit();

    // K/V tile copies: thread tid moves chunk tid % CHUNKS of rows tid / CHUNKS + i * RSTEP, with running
    // pointers (few 64-bit multiplies, few registers). Only the last tile checks rows against the end.
    constexpr int RSTEP = C::THREADS / C::CHUNKS;
    constexpr int ITERS = BN / RSTEP;
    static_assert(C::THREADS % C::CHUNKS == 0 && BN % RSTEP == 0, "a thread keeps one chunk column");
    const int row0 = tid / C::CHUNKS, chunk = tid % C::CHUNKS;
    const fa::u16* k_bh = k + b * k_sb + kvh * k_sh;
    const fa::u16* v_bh = v + b * v_sb + kvh * v_sh;
    const fa::u16* k_src = k_bh + row0 * k_sn + chunk * 8;
    const fa::u16* v_src = v_bh + row0 * v_sn + chunk * 8;
    const i64 k_step = RSTEP * k_sn, v_step = RSTEP * v_sn;
    auto load_kv = [&](int t, u32 stage) {
        const int n0 = t * BN;
        const fa::u16* kp = k_src + n0 * k_sn;
        const fa::u16* vp = v_src + n0 * v_sn;
        if (n0 + BN <= kv_len) {
#pragma unroll
            for (int i = 0; i < ITERS; ++i, kp += k_step, vp += v_step) {
                const u32 dst = stage + C::swz(row0 + i * RSTEP, chunk);
                cp_async_16(dst, kp, 16);
                cp_async_16(dst + C::TILE_BYTES, vp, 16);
            }
        } else {
#pragma unroll 1
            for (int row = row0; row < BN; row += RSTEP, kp += k_step, vp += v_step) {
                const bool ok = n0 + row < kv_len;  // rows past the end: zero-filled, never read from memory
                const u32 dst = stage + C::swz(row, chunk);
                cp_async_16(dst, ok ? kp : k_bh, ok ? 16 : 0);
                cp_async_16(dst + C::TILE_BYTES, ok ? vp : v_bh, ok ? 16 : 0);
            }
        }
    };
    if (n_tiles > 0) load_kv(0, s_base);
    cp_async_commit();

    Lanes<C> ln;
    ln.init(lane);
    const u32 q_warp = s_q + warp * MT * 16 * C::ROW_BYTES;
    u32 qf[MT][C::KSTEPS][4];
    if constexpr (QREG) {
        cp_async_wait<1>();
        block_sync();
        load_q_fragments<C>(qf, q_warp, ln);
    }

    Acc<C> acc;
    acc_init(acc);
    for (int t = 0; t < n_tiles; ++t) {
        cp_async_wait<0>();
        block_sync();
        if (t + 1 < n_tiles) load_kv(t + 1, s_base + ((t + 1) & 1) * STAGE);
        cp_async_commit();
        const u32 st = s_base + (t & 1) * STAGE;
        const int n0 = t * BN;
        if (n0 + BN > kv_len || (causal && n0 + BN - 1 > lim_lo)) {
            tile_step<C, T, false, true>(acc, qf, q_warp, st, st + C::TILE_BYTES, ln, nullptr, n0, kv_len,
                                         causal != 0, row_lim, scale_log2);
        } else {
            tile_step<C, T, false, false>(acc, qf, q_warp, st, st + C::TILE_BYTES, ln, nullptr, n0, kv_len,
                                          causal != 0, row_lim, scale_log2);
        }
    }

    float inv[MT][2], row_lse[MT][2];
    finish_rows(acc, scale_log2, inv, row_lse);
    const int tig = lane & 3;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = rb.m0 + warp * MT * 16 + mt * 16 + (lane >> 2) + 8 * h;
            if (r >= rb.rows) continue;
            const i64 row = (static_cast<i64>(b) * q_heads + rb.head(r, kvh)) * q_len + rb.pos(r);
            fa::u16* o_row = out + row * D;
#pragma unroll
            for (int nt = 0; nt < C::ONT; ++nt) {
                *reinterpret_cast<u32*>(o_row + nt * 8 + 2 * tig) =
                    pack2<T>(acc.o[mt][nt][2 * h] * inv[mt][h], acc.o[mt][nt][2 * h + 1] * inv[mt][h]);
            }
            if (tig == 0) lse[row] = row_lse[mt][h];
        }
    }
}
