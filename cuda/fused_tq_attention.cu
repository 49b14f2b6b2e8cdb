// FlashAttention-2 forward over TurboQuant-compressed K/V, decompressing inside the tile loop
// (wrapper: kernels/tq_prefill.py). No full-precision K/V ever reaches HBM.
//
// Math (rotated space, see docs/ARCHITECTURE.md): key j = |k_j| c_K[idx_j], value j = |v_j| c_V[idx_j]. The bf16
// tiles in shared memory hold the bare centroids; the key norm scales the score column (folded with
// scale * log2(e) and the additive key bias into one FMA) and the value norm scales P's column before the
// second mma, so decompression is a pure table lookup. Queries arrive pre-rotated as bf16.
//
// Grid (row blocks, H_kv, B * splits); split s covers keys [s * split_len, (s + 1) * split_len) and writes its
// own partial (out, lse) slice (the wrapper merges splits > 1). Rows: see fa_common.cuh.
//
// Pipeline, one __syncthreads per key tile. Packed bytes and norms of tile t+2 are fetched with cp.async into a
// single raw buffer while tile t is consumed; each thread decodes exactly the bytes it fetched itself, so the raw
// buffer needs no block barrier. Per tile t, after the barrier: decode raw tile t+1 into bf16 stage (t+1) % 2,
// issue the fetch of tile t+2, run the tensor-core step on stage t % 2. OVERLAP moves the K half of that work
// right behind the S = Q K^T mmas of tile t and the V half behind its P V mmas (tile_step hooks), so a warp
// issues its decompression while its own mmas run rather than all warps decoding while the tensor cores idle.
//
// Shared memory: [stage 0: K | V | meta][stage 1: K | V | meta][raw: K bytes | V bytes | |k| | |v| | bias]
// [tables][Q]; with Q in registers, Q is staged in stage 1 instead.
#include "fa_common.cuh"

namespace fa {

template <int D, int B>
struct Packed {
    static constexpr int BYTES = D * B / 8;                                      // per vector
    static constexpr int PART = B == 3 ? BYTES : (BYTES < 16 ? BYTES : 16);      // bytes one thread fetches+decodes
    static constexpr int PARTS = BYTES / PART;
    static constexpr int GROUPS = PART / B;                                      // 8-coordinate groups per part
    static_assert(B >= 1 && B <= 4, "bits must be 1..4");
    static_assert(BYTES % PART == 0 && PART % B == 0 && PART % 4 == 0, "part layout");
};

// TQ4: two packed bytes (4 coordinates; nibble order of `sel` is idx1, idx0, idx3, idx2) -> two registers of two
// bf16 each, in coordinate order. lut[0..3] hold the low bytes of the 16 bf16 centroids, lut[4..7] the high
// bytes; a byte permute looks up 4 entries of one half-table at once, bit 3 of each index picks the half.
FA_HD void tq4_pair(u32 sel, u32 hb, const u32 (&lut)[8], u32& e01, u32& e23) {
    const u32 upper = prmt(0x0000ff00u, 0u, hb);  // 0xff in byte i iff index i >= 8
    const u32 lo = (prmt(lut[0], lut[1], sel) & ~upper) | (prmt(lut[2], lut[3], sel) & upper);
    const u32 hi = (prmt(lut[4], lut[5], sel) & ~upper) | (prmt(lut[6], lut[7], sel) & upper);
    e01 = prmt(lo, hi, 0x4051u);
    e23 = prmt(lo, hi, 0x6273u);
}

// TQ4: one little-endian word of 4 packed bytes (coordinates 8g .. 8g+7) -> 8 bf16 in coordinate order.
FA_HD U4 tq4_decode8(u32 w, const u32 (&lut)[8]) {
    const u32 hb = (w >> 3) & 0x11111111u;
    U4 r;
    tq4_pair(w, hb, lut, r.x, r.y);
    tq4_pair(w >> 16, hb >> 16, lut, r.z, r.w);
    return r;
}

// Any width: B big-endian bytes (8 coordinates, MSB first) -> 8 bf16 through the centroid table tab[2^B].
template <int B>
FA_HD U4 generic_decode8(const unsigned char* src, const u32* tab) {
    u32 v = 0;
#pragma unroll
    for (int i = 0; i < B; ++i) v = (v << 8) | src[i];
    constexpr u32 M = (1u << B) - 1;
    U4 r;
    r.x = tab[(v >> (7 * B)) & M] | (tab[(v >> (6 * B)) & M] << 16);
    r.y = tab[(v >> (5 * B)) & M] | (tab[(v >> (4 * B)) & M] << 16);
    r.z = tab[(v >> (3 * B)) & M] | (tab[(v >> (2 * B)) & M] << 16);
    r.w = tab[(v >> B) & M] | (tab[v & M] << 16);
    return r;
}

// Work items of one tile: item i of thread tid is u = tid + i * THREADS -> (row u / PARTS, part u % PARTS). The
// same thread fetches (cp.async) and later decodes an item, so the raw buffer needs no block barrier.
template <class C, int B>
struct Items {
    using P = Packed<C::D, B>;
    static constexpr int TOTAL = C::BN * P::PARTS;
    static constexpr int PER_THREAD = (TOTAL + C::THREADS - 1) / C::THREADS;
    FA_INLINE static bool valid(int u) { return TOTAL % C::THREADS == 0 || u < TOTAL; }
};

template <int BYTES, int VEC>
FA_INLINE void fetch_bytes(u32 dst, const unsigned char* src) {
#pragma unroll
    for (int i = 0; i < BYTES / VEC; ++i) {
        if constexpr (VEC == 16) {
            cp_async_16(dst + 16 * i, src + 16 * i, 16);
        } else {
            cp_async_small<VEC>(dst + VEC * i, src + VEC * i);
        }
    }
}

template <class C, int B, int VEC>
FA_INLINE void fetch_items(u32 raw, const unsigned char* src_bh, i64 row_stride, int n0, int kv_len) {
    using I = Items<C, B>;
    using P = typename I::P;
#pragma unroll
    for (int i = 0; i < I::PER_THREAD; ++i) {
        const int u = threadIdx.x + i * C::THREADS;
        const int row = u / P::PARTS, part = u % P::PARTS;
        if (I::valid(u) && n0 + row < kv_len) {
            fetch_bytes<P::PART, VEC>(raw + u * P::PART, src_bh + (n0 + row) * row_stride + part * P::PART);
        }
    }
}

// Rows past the end are not fetched (their stale bytes decode to finite values that the meta bias masks).
template <class C, int B>
FA_INLINE void fetch_tile(u32 raw, const unsigned char* src_bh, i64 row_stride, int n0, int kv_len, int vec) {
    constexpr int PART = Packed<C::D, B>::PART;
    if constexpr (PART % 16 == 0) {
        if (vec == 16) return fetch_items<C, B, 16>(raw, src_bh, row_stride, n0, kv_len);
    }
    if constexpr (PART % 8 == 0) {
        if (vec == 8) return fetch_items<C, B, 8>(raw, src_bh, row_stride, n0, kv_len);
    }
    fetch_items<C, B, 4>(raw, src_bh, row_stride, n0, kv_len);
}

// Packed items of one tile -> bare-centroid bf16 rows of a swizzled tile (raw item u sits at u * PART, i.e. the
// raw buffer keeps the rows back to back).
template <class C, int B>
FA_INLINE void decode_tile(unsigned char* tile, const unsigned char* raw, const u32* lut_smem, const u32* tab) {
    using I = Items<C, B>;
    using P = typename I::P;
    if constexpr (B == 4) {
        u32 lut[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) lut[i] = lut_smem[i];
#pragma unroll
        for (int i = 0; i < I::PER_THREAD; ++i) {
            const int u = threadIdx.x + i * C::THREADS;
            if (!I::valid(u)) continue;
            const int row = u / P::PARTS, part = u % P::PARTS;
            const U4 w = *reinterpret_cast<const U4*>(raw + u * 16);
            // chunks part*4 + j, j < 4: ROW_BYTES is a multiple of 64, so the swizzle of chunk j is base ^ (j << 4).
            const u32 base = C::swz(row, part * 4);
            *reinterpret_cast<U4*>(tile + base) = tq4_decode8(w.x, lut);
            *reinterpret_cast<U4*>(tile + (base ^ 16)) = tq4_decode8(w.y, lut);
            *reinterpret_cast<U4*>(tile + (base ^ 32)) = tq4_decode8(w.z, lut);
            *reinterpret_cast<U4*>(tile + (base ^ 48)) = tq4_decode8(w.w, lut);
        }
    } else {
#pragma unroll
        for (int i = 0; i < I::PER_THREAD; ++i) {
            const int u = threadIdx.x + i * C::THREADS;
            if (!I::valid(u)) continue;
            const int row = u / P::PARTS, part = u % P::PARTS;
            const unsigned char* src = raw + u * P::PART;
#pragma unroll
            for (int g = 0; g < P::GROUPS; ++g) {
                *reinterpret_cast<U4*>(tile + C::swz(row, part * (P::PART / B) + g)) = generic_decode8<B>(src + g * B, tab);
            }
        }
    }
}

}  // namespace fa

template <int D, int KB, int VB, int WARPS, int MT, int BN, bool QREG, bool OVERLAP>
__global__ void __launch_bounds__(WARPS * 32)
fused_tq_attention_fwd(const fa::u16* __restrict__ q, const unsigned char* __restrict__ kp, const float* __restrict__ kn,
                       const unsigned char* __restrict__ vp, const float* __restrict__ vn,
                       const float* __restrict__ k_centroids, const float* __restrict__ v_centroids,
                       const float* __restrict__ bias, float* __restrict__ out, float* __restrict__ lse,
                       int batch, int q_heads, int kv_heads, int q_len, int kv_len, int split_len, int k_vec, int v_vec,
                       fa::i64 q_sb, fa::i64 q_sh, fa::i64 q_sl,
                       fa::i64 kp_sb, fa::i64 kp_sh, fa::i64 kp_sn, fa::i64 kn_sb, fa::i64 kn_sh, fa::i64 kn_sn,
                       fa::i64 vp_sb, fa::i64 vp_sh, fa::i64 vp_sn, fa::i64 vn_sb, fa::i64 vn_sh, fa::i64 vn_sn,
                       fa::i64 bias_sb, fa::i64 bias_sn, float scale_log2, int causal) {
    using namespace fa;
    using C = Cfg<D, WARPS, MT, BN, QREG>;
    using PK = Packed<D, KB>;
    using PV = Packed<D, VB>;
    constexpr int META = 3 * BN * 4;
    constexpr int STAGE = 2 * C::TILE_BYTES + META;
    constexpr int STAGE1 = (QREG && C::Q_BYTES > STAGE) ? C::Q_BYTES : STAGE;
    constexpr int RAW_V = BN * PK::BYTES;
    constexpr int RAW_KN = RAW_V + BN * PV::BYTES;
    constexpr int RAW_VN = RAW_KN + 4 * BN;
    constexpr int RAW_BIAS = RAW_VN + 4 * BN;
    constexpr int RAW_BYTES = RAW_BIAS + 4 * BN;
    constexpr int OFF_RAW = STAGE + STAGE1;
    constexpr int OFF_TAB = OFF_RAW + RAW_BYTES;  // u32: [0, 8) K lut, [8, 16) V lut, [16, 32) K table, [32, 48) V table
    constexpr int OFF_Q = QREG ? STAGE : OFF_TAB + 192;
    constexpr int SMEM = QREG ? OFF_TAB + 192 : OFF_Q + C::Q_BYTES;
    static_assert(BN <= WARPS * 32, "one thread per key column handles the norms");
    extern __shared__ __align__(128) unsigned char fa_smem[];

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    if (tid == 0 && dynamic_smem_bytes() < SMEM) __trap();  // the wrapper's size formula drifted from this one

    const u32 s_base = smem_addr(fa_smem);
    const int splits = gridDim.z / batch;
    const int b = blockIdx.z / splits, split = blockIdx.z % splits;
    const int group = q_heads / kv_heads;
    const int blk = causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    const int kvh = blockIdx.y;
    const RowBlock rb{blk * C::BM, q_len * group, group, kv_len - q_len};

    // Centroid tables: bf16 bits per entry (any width) and the byte-split lookup table of the TQ4 path.
    u32* tabs = reinterpret_cast<u32*>(fa_smem + OFF_TAB);
    if (tid < 16) {
        tabs[16 + tid] = tid < (1 << KB) ? bf16_bits(k_centroids[tid]) : 0u;
        tabs[32 + tid] = tid < (1 << VB) ? bf16_bits(v_centroids[tid]) : 0u;
    } else if (tid < 32) {
        const int j = tid - 16;  // 0-7 K, 8-15 V
        const float* cent = j < 8 ? k_centroids : v_centroids;
        if ((j < 8 ? KB : VB) == 4) {
            const int base = 4 * (j & 3);
            const int shift = (j & 4) ? 8 : 0;
            u32 word = 0;
            for (int i = 0; i < 4; ++i) word |= ((static_cast<u32>(bf16_bits(cent[base + i])) >> shift) & 0xffu) << (8 * i);
            tabs[j] = word;
        }
    }

    // Key range of this (block, split).
    const int n_begin = split * split_len;
    int n_stop = imin(kv_len, n_begin + split_len);
    if (causal) n_stop = imin(n_stop, rb.lim_hi(C::BM) + 1);
    const int n_tiles = n_stop > n_begin ? (n_stop - n_begin + BN - 1) / BN : 0;
    const int t_begin = n_begin / BN;
    const int lim_lo = rb.lim_lo();
    int row_lim[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) row_lim[mt][h] = rb.pos(rb.m0 + warp * MT * 16 + mt * 16 + (lane >> 2) + 8 * h) + rb.diag;
    }

    // Q tile (bf16, rows past the end zero-filled).
    const u32 s_q = s_base + OFF_Q;
#pragma unroll
    for (int i = 0; i < C::BM * C::CHUNKS / C::THREADS; ++i) {
        const int u = tid + i * C::THREADS;
        const int row = u / C::CHUNKS, c = u % C::CHUNKS;
        const int r = rb.m0 + row;
        const fa::u16* src = q + b * q_sb + rb.head(r, kvh) * q_sh + rb.pos(r) * q_sl + c * 8;
        cp_async_16(s_q + C::swz(row, c), src, r < rb.rows ? 16 : 0);
    }
    cp_async_commit();

    const unsigned char* kp_bh = kp + b * kp_sb + kvh * kp_sh;
    const unsigned char* vp_bh = vp + b * vp_sb + kvh * vp_sh;
    const float* kn_bh = kn + b * kn_sb + kvh * kn_sh;
    const float* vn_bh = vn + b * vn_sb + kvh * vn_sh;
    const float* bias_b = bias == nullptr ? nullptr : bias + b * bias_sb;
    const u32 s_raw = s_base + OFF_RAW;
    const unsigned char* raw = fa_smem + OFF_RAW;

    auto fetch_k = [&](int t) {  // packed K bytes, |k|, |v| and the bias of tile t
        const int n0 = t * BN;
        fetch_tile<C, KB>(s_raw, kp_bh, kp_sn, n0, kv_len, k_vec);
        const int n = n0 + tid;
        if (tid < BN && n < kv_len) {
            cp_async_small<4>(s_raw + RAW_KN + 4 * tid, kn_bh + n * kn_sn);
            cp_async_small<4>(s_raw + RAW_VN + 4 * tid, vn_bh + n * vn_sn);
            if (bias_b != nullptr) cp_async_small<4>(s_raw + RAW_BIAS + 4 * tid, bias_b + n * bias_sn);
        }
    };
    auto fetch_v = [&](int t) { fetch_tile<C, VB>(s_raw + RAW_V, vp_bh, vp_sn, t * BN, kv_len, v_vec); };
    auto decode_k = [&](int t, int stage_off) {  // K tile and the per-key meta of stage `stage_off`
        unsigned char* st = fa_smem + stage_off;
        decode_tile<C, KB>(st, raw, tabs, tabs + 16);
        const int n = t * BN + tid;
        if (tid < BN) {
            const bool ok = n < kv_len;
            float* meta = reinterpret_cast<float*>(st + 2 * C::TILE_BYTES);
            const float* r_kn = reinterpret_cast<const float*>(raw + RAW_KN);
            const float* r_vn = reinterpret_cast<const float*>(raw + RAW_VN);
            const float* r_bias = reinterpret_cast<const float*>(raw + RAW_BIAS);
            meta[tid] = ok ? r_kn[tid] * scale_log2 : 0.f;
            meta[BN + tid] = ok ? (bias_b != nullptr ? r_bias[tid] * kLog2e : 0.f) : neg_inf();
            meta[2 * BN + tid] = ok ? r_vn[tid] : 0.f;
        }
    };
    auto decode_v = [&](int stage_off) {
        decode_tile<C, VB>(fa_smem + stage_off + C::TILE_BYTES, raw + RAW_V, tabs + 8, tabs + 32);
    };

    if (n_tiles > 0) {
        fetch_k(t_begin);
        fetch_v(t_begin);
    }
    cp_async_commit();
    cp_async_wait<0>();
    block_sync();  // Q and the tables visible to all; this thread's raw bytes of the first tile landed

    Lanes<C> ln;
    ln.init(lane);
    const u32 q_warp = s_q + warp * MT * 16 * C::ROW_BYTES;
    u32 qf[MT][C::KSTEPS][4];
    if constexpr (QREG) load_q_fragments<C>(qf, q_warp, ln);

    if (n_tiles > 0) {
        decode_k(t_begin, 0);
        decode_v(0);
    }
    if (n_tiles > 1) {
        fetch_k(t_begin + 1);
        fetch_v(t_begin + 1);
    }
    cp_async_commit();

    Acc<C> acc;
    acc_init(acc);
    for (int i = 0; i < n_tiles; ++i) {
        cp_async_wait<0>();
        block_sync();
        const int t = t_begin + i;
        const int st = (i & 1) * STAGE, next = ((i + 1) & 1) * STAGE;
        const int n0 = t * BN;
        const float* meta = reinterpret_cast<const float*>(fa_smem + st + 2 * C::TILE_BYTES);
        const bool mask = causal && n0 + BN - 1 > lim_lo;  // keys past the end are -inf through the meta bias
        if constexpr (OVERLAP) {
            // Decode tile t+1 (and fetch t+2) between the tensor-core phases of tile t. Unconditional, so the hooks
            // stay straight-line code: past the range they decode stale bytes into a stage nobody reads and
            // fetch nothing past the end of the keys.
            auto after_qk = [&] { decode_k(t + 1, next); fetch_k(t + 2); };
            auto after_pv = [&] { decode_v(next); fetch_v(t + 2); };
            if (mask) {
                tile_step<C, bf16, true, true>(acc, qf, q_warp, s_base + st, s_base + st + C::TILE_BYTES, ln, meta, n0,
                                               0x7fffffff, true, row_lim, 1.f, after_qk, after_pv);
            } else {
                tile_step<C, bf16, true, false>(acc, qf, q_warp, s_base + st, s_base + st + C::TILE_BYTES, ln, meta,
                                                n0, 0x7fffffff, false, row_lim, 1.f, after_qk, after_pv);
            }
            cp_async_commit();
        } else {
            if (i + 1 < n_tiles) {
                decode_k(t + 1, next);
                decode_v(next);
                if (i + 2 < n_tiles) {
                    fetch_k(t + 2);
                    fetch_v(t + 2);
                }
            }
            cp_async_commit();
            if (mask) {
                tile_step<C, bf16, true, true>(acc, qf, q_warp, s_base + st, s_base + st + C::TILE_BYTES, ln, meta, n0,
                                               0x7fffffff, true, row_lim, 1.f);
            } else {
                tile_step<C, bf16, true, false>(acc, qf, q_warp, s_base + st, s_base + st + C::TILE_BYTES, ln, meta,
                                                n0, 0x7fffffff, false, row_lim, 1.f);
            }
        }
    }

    float inv[MT][2], row_lse[MT][2];
    finish_rows(acc, 1.f, inv, row_lse);
    const int tig = lane & 3;
    const i64 rows_all = static_cast<i64>(batch) * q_heads * q_len;
    float* out_s = out + split * rows_all * D;
    float* lse_s = lse + split * rows_all;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = rb.m0 + warp * MT * 16 + mt * 16 + (lane >> 2) + 8 * h;
            if (r >= rb.rows) continue;
            const i64 row = (static_cast<i64>(b) * q_heads + rb.head(r, kvh)) * q_len + rb.pos(r);
            float* o_row = out_s + row * D;
#pragma unroll
            for (int nt = 0; nt < C::ONT; ++nt) {
                *reinterpret_cast<F2*>(o_row + nt * 8 + 2 * tig) =
                    F2{acc.o[mt][nt][2 * h] * inv[mt][h], acc.o[mt][nt][2 * h + 1] * inv[mt][h]};
            }
            if (tig == 0) lse_s[row] = row_lse[mt][h];
        }
    }
}
