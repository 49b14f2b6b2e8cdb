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
//
// Also here: tq_prefill_cluster_kernel (sm_90 thread-block clusters that decode each key tile once per
// cluster and share it through distributed shared memory; see its section). The key splits are merged by the
// decode path's log-sum-exp merge, fqr::merge_partials_kernel in merge_partials.cu.
//
// Build switches: none (kernels/tq_prefill.py selects tilings and the cluster kernel by template arguments).
#include "cluster.cuh"
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

// Centroid tables: tabs[16..31] K and tabs[32..47] V bf16 bits per entry (any width); tabs[0..7] K and
// tabs[8..15] V: the byte-split lookup table of the TQ4 path (low bytes of the 16 entries, then high bytes).
template <int KB, int VB>
FA_INLINE void init_tables(u32* tabs, const float* k_centroids, const float* v_centroids) {
    const int tid = threadIdx.x;
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
}

// Q tile of one row block into swizzled shared memory (bf16, rows past the end zero-filled), as one committed
// cp.async group.
template <class C>
FA_INLINE void load_q_tile(u32 s_q, const u16* q, const RowBlock& rb, int b, int kvh, i64 q_sb, i64 q_sh, i64 q_sl) {
#pragma unroll
    for (int i = 0; i < C::BM * C::CHUNKS / C::THREADS; ++i) {
        const int u = threadIdx.x + i * C::THREADS;
        const int row = u / C::CHUNKS, c = u % C::CHUNKS;
        const int r = rb.m0 + row;
        const u16* src = q + b * q_sb + rb.head(r, kvh) * q_sh + rb.pos(r) * q_sl + c * 8;
        cp_async_16(s_q + C::swz(row, c), src, r < rb.rows ? 16 : 0);
    }
    cp_async_commit();
}

// The part of the per-CTA setup both prefill kernels share, once they know their row block `rb` of (sequence b, KV
// head kvh) and the first key n_begin of their split: it loads the block's Q tile into shared memory at s_base + off_q
// (one committed cp.async group), writes the causal limits of the rows this lane's fragments hold into row_lim
// (tile_step's row_lim) and holds the other values the key loop reads. row_lim stays the caller's array: as a member
// of this struct it changes the kernels' generated code.
template <class C>
struct CtaSetup {
    int t_begin;                  // first key tile of the split
    int lim_lo;                   // causal limit of the block's first row
    u32 s_q;                      // the Q tile
    const unsigned char* kp_bh;   // the (sequence, KV head)'s compressed rows: key n's packed bytes at
    const unsigned char* vp_bh;   // kp_bh + n * kp_sn and its norm at kn_bh + n * kn_sn (likewise V)
    const float* kn_bh;
    const float* vn_bh;
    const float* bias_b;          // the sequence's key-bias row (bias_b + n * bias_sn); null without a bias
    u32 s_raw;                    // the raw buffer, as a shared-memory address and as a pointer
    const unsigned char* raw;

    FA_INLINE CtaSetup(int (&row_lim)[C::MT][2], const RowBlock& rb, int b, int kvh, int n_begin, int warp, int lane,
                       const unsigned char* smem, u32 s_base, int off_q, int off_raw, const u16* q,
                       const unsigned char* kp, const float* kn, const unsigned char* vp, const float* vn,
                       const float* bias, i64 q_sb, i64 q_sh, i64 q_sl, i64 kp_sb, i64 kp_sh, i64 kn_sb, i64 kn_sh,
                       i64 vp_sb, i64 vp_sh, i64 vn_sb, i64 vn_sh, i64 bias_sb) {
        t_begin = n_begin / C::BN;
        lim_lo = rb.lim_lo();
        fragment_limits(row_lim, rb, warp, lane);
        s_q = s_base + off_q;
        load_q_tile<C>(s_q, q, rb, b, kvh, q_sb, q_sh, q_sl);
        kp_bh = kp + b * kp_sb + kvh * kp_sh;
        vp_bh = vp + b * vp_sb + kvh * vp_sh;
        kn_bh = kn + b * kn_sb + kvh * kn_sh;
        vn_bh = vn + b * vn_sb + kvh * vn_sh;
        bias_b = bias == nullptr ? nullptr : bias + b * bias_sb;
        s_raw = s_base + off_raw;
        raw = smem + off_raw;
    }
};

// Normalised output rows and their LSE into split `split`'s slice of out [splits, B, Hq, Lq, D], lse [..., Lq].
template <class C>
FA_INLINE void store_rows(Acc<C>& acc, float* out, float* lse, const RowBlock& rb, int b, int kvh, int split,
                          int batch, int q_heads, int q_len) {
    float inv[C::MT][2], row_lse[C::MT][2];
    finish_rows(acc, 1.f, inv, row_lse);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int tig = lane & 3;
    const i64 rows_all = static_cast<i64>(batch) * q_heads * q_len;
    float* out_s = out + split * rows_all * C::D;
    float* lse_s = lse + split * rows_all;
#pragma unroll
    for (int mt = 0; mt < C::MT; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = rb.m0 + warp * C::MT * 16 + mt * 16 + (lane >> 2) + 8 * h;
            if (r >= rb.rows) continue;
            const i64 row = (static_cast<i64>(b) * q_heads + rb.head(r, kvh)) * q_len + rb.pos(r);
            float* o_row = out_s + row * C::D;
#pragma unroll
            for (int nt = 0; nt < C::ONT; ++nt) {
                *reinterpret_cast<F2*>(o_row + nt * 8 + 2 * tig) =
                    F2{acc.o[mt][nt][2 * h] * inv[mt][h], acc.o[mt][nt][2 * h + 1] * inv[mt][h]};
            }
            if (tig == 0) lse_s[row] = row_lse[mt][h];
        }
    }
}

}  // namespace fa

template <int D, int KB, int VB, int WARPS, int MT, int BN, bool QREG, bool OVERLAP>
__global__ void __launch_bounds__(WARPS * 32)
tq_prefill_kernel(const fa::u16* __restrict__ q, const unsigned char* __restrict__ kp, const float* __restrict__ kn,
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

    u32* tabs = reinterpret_cast<u32*>(fa_smem + OFF_TAB);
    init_tables<KB, VB>(tabs, k_centroids, v_centroids);

    // Key range of this (block, split).
    const int n_begin = split * split_len;
    int n_stop = imin(kv_len, n_begin + split_len);
    if (causal) n_stop = imin(n_stop, rb.lim_hi(C::BM) + 1);
    const int n_tiles = n_stop > n_begin ? (n_stop - n_begin + BN - 1) / BN : 0;

    int row_lim[MT][2];
    const CtaSetup<C> cta(row_lim, rb, b, kvh, n_begin, warp, lane, fa_smem, s_base, OFF_Q, OFF_RAW, q, kp, kn, vp, vn,
                          bias, q_sb, q_sh, q_sl, kp_sb, kp_sh, kn_sb, kn_sh, vp_sb, vp_sh, vn_sb, vn_sh, bias_sb);

    auto fetch_k = [&](int t) {  // packed K bytes, |k|, |v| and the bias of tile t
        const int n0 = t * BN;
        fetch_tile<C, KB>(cta.s_raw, cta.kp_bh, kp_sn, n0, kv_len, k_vec);
        const int n = n0 + tid;
        if (tid < BN && n < kv_len) {
            cp_async_small<4>(cta.s_raw + RAW_KN + 4 * tid, cta.kn_bh + n * kn_sn);
            cp_async_small<4>(cta.s_raw + RAW_VN + 4 * tid, cta.vn_bh + n * vn_sn);
            if (cta.bias_b != nullptr) cp_async_small<4>(cta.s_raw + RAW_BIAS + 4 * tid, cta.bias_b + n * bias_sn);
        }
    };
    auto fetch_v = [&](int t) { fetch_tile<C, VB>(cta.s_raw + RAW_V, cta.vp_bh, vp_sn, t * BN, kv_len, v_vec); };
    auto decode_k = [&](int t, int stage_off) {  // K tile and the per-key meta of stage `stage_off`
        unsigned char* st = fa_smem + stage_off;
        decode_tile<C, KB>(st, cta.raw, tabs, tabs + 16);
        const int n = t * BN + tid;
        if (tid < BN) {
            const bool ok = n < kv_len;
            float* meta = reinterpret_cast<float*>(st + 2 * C::TILE_BYTES);
            const float* r_kn = reinterpret_cast<const float*>(cta.raw + RAW_KN);
            const float* r_vn = reinterpret_cast<const float*>(cta.raw + RAW_VN);
            const float* r_bias = reinterpret_cast<const float*>(cta.raw + RAW_BIAS);
            meta[tid] = ok ? r_kn[tid] * scale_log2 : 0.f;
            meta[BN + tid] = ok ? (cta.bias_b != nullptr ? r_bias[tid] * kLog2e : 0.f) : neg_inf();
            meta[2 * BN + tid] = ok ? r_vn[tid] : 0.f;
        }
    };
    auto decode_v = [&](int stage_off) {
        decode_tile<C, VB>(fa_smem + stage_off + C::TILE_BYTES, cta.raw + RAW_V, tabs + 8, tabs + 32);
    };

    if (n_tiles > 0) {
        fetch_k(cta.t_begin);
        fetch_v(cta.t_begin);
    }
    cp_async_commit();
    cp_async_wait<0>();
    block_sync();  // Q and the tables visible to all; this thread's raw bytes of the first tile landed

    Lanes<C> ln;
    ln.init(lane);
    const u32 q_warp = cta.s_q + warp * MT * 16 * C::ROW_BYTES;
    u32 qf[MT][C::KSTEPS][4];
    if constexpr (QREG) load_q_fragments<C>(qf, q_warp, ln);

    if (n_tiles > 0) {
        decode_k(cta.t_begin, 0);
        decode_v(0);
    }
    if (n_tiles > 1) {
        fetch_k(cta.t_begin + 1);
        fetch_v(cta.t_begin + 1);
    }
    cp_async_commit();

    Acc<C> acc;
    acc_init(acc);
    for (int i = 0; i < n_tiles; ++i) {
        cp_async_wait<0>();
        block_sync();
        const int t = cta.t_begin + i;
        const int st = (i & 1) * STAGE, next = ((i + 1) & 1) * STAGE;
        const int n0 = t * BN;
        const float* meta = reinterpret_cast<const float*>(fa_smem + st + 2 * C::TILE_BYTES);
        const bool mask = causal && n0 + BN - 1 > cta.lim_lo;  // keys past the end are -inf through the meta bias
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

    store_rows<C>(acc, out, lse, rb, b, kvh, split, batch, q_heads, q_len);
}

// ----------------------------------------------------------------------------------------------------------
// Thread-block clusters (sm_90): the CL CTAs of a cluster serve CL row blocks of the same (KV head, batch,
// split), so they read the same key tiles. (CL = 1: the same pipeline without sharing; barrier.cluster then acts as
// a split-phase CTA barrier.) Each decodes 1/CL of every tile (a slice of BN / CL key rows, K and
// V) and stores the bf16 rows into its own shared memory and, through distributed shared memory, into its peers'
// (st.shared::cluster at addresses from mapa): the decode work per CTA falls by CL.
//
// Ring of three stages, one cluster barrier per tile, its latency hidden behind the tensor-core step: in
// iteration i a CTA decodes its slice of tile i+1 into stage (i+1) % 3 of every CTA, arrives, runs the tile step
// on stage i % 3, waits. The wait of iteration i-1 guaranteed that every CTA finished its tile step i-2 (stage
// (i+1) % 3 is free) and stored its slice of tile i. The CTAs of a cluster run the same tile range (the longest
// causal range among them); a CTA skips the tile step of tiles past its own range but still decodes its slice.
// OVERLAP: the arrive sits right behind the S = Q K^T mmas of the tile step (its release then waits for the decoded
// stores while the tensor cores run) instead of before the tile step.
// ----------------------------------------------------------------------------------------------------------

namespace fa {

// 16 bytes into the same shared-memory offset of this CTA (`local`) and of the CL - 1 peers (`peer`: their
// shared::cluster base addresses, in rank order after this CTA's).
template <int CL>
FA_INLINE void put_all(unsigned char* local, u32 off, const U4& v, const u32 (&peer)[CL > 1 ? CL - 1 : 1]) {
    *reinterpret_cast<U4*>(local + off) = v;
#pragma unroll
    for (int d = 0; d < CL - 1; ++d) st_cluster_v4(peer[d] + off, v.x, v.y, v.z, v.w);
}
template <int CL>
FA_INLINE void put_all_f32(unsigned char* local, u32 off, float v, const u32 (&peer)[CL > 1 ? CL - 1 : 1]) {
    *reinterpret_cast<float*>(local + off) = v;
#pragma unroll
    for (int d = 0; d < CL - 1; ++d) st_cluster_f32(peer[d] + off, v);
}

// Packed item (row `row` of the tile, part `part`) at `src` -> its bf16 chunks of a swizzled tile at `tile_off`.
template <class C, int B, int CL>
FA_INLINE void decode_item_all(unsigned char* local, u32 tile_off, const unsigned char* src, int row, int part,
                               const u32* lut_smem, const u32* tab, const u32 (&peer)[CL > 1 ? CL - 1 : 1]) {
    using P = Packed<C::D, B>;
    if constexpr (B == 4) {
        u32 lut[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) lut[i] = lut_smem[i];
        const U4 w = *reinterpret_cast<const U4*>(src);
        const u32 base = tile_off + C::swz(row, part * 4);
        put_all<CL>(local, base, tq4_decode8(w.x, lut), peer);
        put_all<CL>(local, base ^ 16, tq4_decode8(w.y, lut), peer);
        put_all<CL>(local, base ^ 32, tq4_decode8(w.z, lut), peer);
        put_all<CL>(local, base ^ 48, tq4_decode8(w.w, lut), peer);
    } else {
#pragma unroll
        for (int g = 0; g < P::GROUPS; ++g) {
            put_all<CL>(local, tile_off + C::swz(row, part * (P::PART / B) + g), generic_decode8<B>(src + g * B, tab),
                        peer);
        }
    }
}

template <int PART>
FA_INLINE void fetch_part(u32 dst, const unsigned char* src, int vec) {
    if constexpr (PART % 16 == 0) {
        if (vec == 16) return fetch_bytes<PART, 16>(dst, src);
    }
    if constexpr (PART % 8 == 0) {
        if (vec == 8) return fetch_bytes<PART, 8>(dst, src);
    }
    fetch_bytes<PART, 4>(dst, src);
}

}  // namespace fa

template <int D, int KB, int VB, int WARPS, int MT, int BN, bool QREG, bool OVERLAP, int CL>
__global__ void __launch_bounds__(WARPS * 32) FQ_CLUSTER_DIMS(CL)
tq_prefill_cluster_kernel(const fa::u16* __restrict__ q, const unsigned char* __restrict__ kp,
                               const float* __restrict__ kn, const unsigned char* __restrict__ vp,
                               const float* __restrict__ vn, const float* __restrict__ k_centroids,
                               const float* __restrict__ v_centroids, const float* __restrict__ bias,
                               float* __restrict__ out, float* __restrict__ lse, int batch, int q_heads, int kv_heads,
                               int q_len, int kv_len, int split_len, int k_vec, int v_vec,
                               fa::i64 q_sb, fa::i64 q_sh, fa::i64 q_sl,
                               fa::i64 kp_sb, fa::i64 kp_sh, fa::i64 kp_sn, fa::i64 kn_sb, fa::i64 kn_sh, fa::i64 kn_sn,
                               fa::i64 vp_sb, fa::i64 vp_sh, fa::i64 vp_sn, fa::i64 vn_sb, fa::i64 vn_sh, fa::i64 vn_sn,
                               fa::i64 bias_sb, fa::i64 bias_sn, float scale_log2, int causal) {
    static_assert(CL >= 1 && CL <= 8 && BN % CL == 0, "cluster size: 1..8, dividing BN");
    static_assert(!QREG, "the cluster kernel keeps Q in shared memory");
    using namespace fa;
    using C = Cfg<D, WARPS, MT, BN, QREG>;
    using PK = Packed<D, KB>;
    using PV = Packed<D, VB>;
    constexpr int SLICE = BN / CL;              // key rows of a tile this CTA decodes
    constexpr int TK = SLICE * PK::PARTS;       // its K items
    constexpr int TV = SLICE * PV::PARTS;       // its V items
    constexpr int PER_THREAD = (TK + TV + C::THREADS - 1) / C::THREADS;
    constexpr int META = 3 * BN * 4;
    constexpr int STAGE = 2 * C::TILE_BYTES + META;
    constexpr int STAGES = 3;
    constexpr int RAW_V = TK * PK::PART;
    constexpr int RAW_KN = RAW_V + TV * PV::PART;
    constexpr int RAW_VN = RAW_KN + 4 * SLICE;
    constexpr int RAW_BIAS = RAW_VN + 4 * SLICE;
    constexpr int RAW_BYTES = (RAW_BIAS + 4 * SLICE + 15) / 16 * 16;
    constexpr int OFF_RAW = STAGES * STAGE;
    constexpr int OFF_TAB = OFF_RAW + RAW_BYTES;
    constexpr int OFF_Q = OFF_TAB + 192;
    constexpr int SMEM = OFF_Q + C::Q_BYTES;
    static_assert(SLICE <= WARPS * 32, "one thread per key row of the slice handles the norms");
    extern __shared__ __align__(128) unsigned char fa_smem[];

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    if (tid == 0 && dynamic_smem_bytes() < SMEM) __trap();  // the wrapper's size formula drifted from this one

    const u32 s_base = smem_addr(fa_smem);
    const u32 rank = cluster_rank();
    u32 peer[CL > 1 ? CL - 1 : 1];
#pragma unroll
    for (int d = 0; d < CL - 1; ++d) peer[d] = cluster_map(s_base, (rank + 1 + d) % CL);
    const int slice0 = rank * SLICE;  // first key row of the tile this CTA decodes

    const int splits = gridDim.z / batch;
    const int b = blockIdx.z / splits, split = blockIdx.z % splits;
    const int group = q_heads / kv_heads;
    const int blk = causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    // The cluster's last row block (largest m0) has the longest causal key range.
    const int blk_last = causal ? gridDim.x - 1 - (blockIdx.x / CL) * CL : blockIdx.x;
    const int kvh = blockIdx.y;
    const RowBlock rb{blk * C::BM, q_len * group, group, kv_len - q_len};
    const RowBlock rb_last{blk_last * C::BM, q_len * group, group, kv_len - q_len};

    u32* tabs = reinterpret_cast<u32*>(fa_smem + OFF_TAB);
    init_tables<KB, VB>(tabs, k_centroids, v_centroids);

    const int n_begin = split * split_len;
    const int n_limit = imin(kv_len, n_begin + split_len);
    const int n_stop = causal ? imin(n_limit, rb.lim_hi(C::BM) + 1) : n_limit;
    const int n_stop_cl = causal ? imin(n_limit, rb_last.lim_hi(C::BM) + 1) : n_limit;
    const int n_tiles = n_stop > n_begin ? (n_stop - n_begin + BN - 1) / BN : 0;
    const int n_tiles_cl = n_stop_cl > n_begin ? (n_stop_cl - n_begin + BN - 1) / BN : 0;

    int row_lim[MT][2];
    const CtaSetup<C> cta(row_lim, rb, b, kvh, n_begin, warp, lane, fa_smem, s_base, OFF_Q, OFF_RAW, q, kp, kn, vp, vn,
                          bias, q_sb, q_sh, q_sl, kp_sb, kp_sh, kn_sb, kn_sh, vp_sb, vp_sh, vn_sb, vn_sh, bias_sb);

    // Item w of this CTA's slice: K items [0, TK), then V items; thread tid owns w = tid + i * THREADS and both
    // fetches and decodes it (no barrier on the raw buffer).
    auto fetch = [&](int t) {
        const int n0 = t * BN;
#pragma unroll
        for (int i = 0; i < PER_THREAD; ++i) {
            const int w = tid + i * C::THREADS;
            if (w < TK) {
                const int row = slice0 + w / PK::PARTS, part = w % PK::PARTS;
                if (n0 + row < kv_len) {
                    fetch_part<PK::PART>(cta.s_raw + w * PK::PART, cta.kp_bh + (n0 + row) * kp_sn + part * PK::PART,
                                         k_vec);
                }
            } else if (w < TK + TV) {
                const int wv = w - TK;
                const int row = slice0 + wv / PV::PARTS, part = wv % PV::PARTS;
                if (n0 + row < kv_len) {
                    fetch_part<PV::PART>(cta.s_raw + RAW_V + wv * PV::PART,
                                         cta.vp_bh + (n0 + row) * vp_sn + part * PV::PART, v_vec);
                }
            }
        }
        const int n = n0 + slice0 + tid;
        if (tid < SLICE && n < kv_len) {
            cp_async_small<4>(cta.s_raw + RAW_KN + 4 * tid, cta.kn_bh + n * kn_sn);
            cp_async_small<4>(cta.s_raw + RAW_VN + 4 * tid, cta.vn_bh + n * vn_sn);
            if (cta.bias_b != nullptr) cp_async_small<4>(cta.s_raw + RAW_BIAS + 4 * tid, cta.bias_b + n * bias_sn);
        }
    };
    // Rows past the end are not fetched: their stale bytes decode to finite values that the meta bias masks.
    auto decode = [&](int t, int stage) {
        const u32 st = stage * STAGE;
#pragma unroll
        for (int i = 0; i < PER_THREAD; ++i) {
            const int w = tid + i * C::THREADS;
            if (w < TK) {
                decode_item_all<C, KB, CL>(fa_smem, st, cta.raw + w * PK::PART, slice0 + w / PK::PARTS, w % PK::PARTS,
                                           tabs, tabs + 16, peer);
            } else if (w < TK + TV) {
                const int wv = w - TK;
                decode_item_all<C, VB, CL>(fa_smem, st + C::TILE_BYTES, cta.raw + RAW_V + wv * PV::PART,
                                           slice0 + wv / PV::PARTS, wv % PV::PARTS, tabs + 8, tabs + 32, peer);
            }
        }
        if (tid < SLICE) {
            const int row = slice0 + tid;
            const bool ok = t * BN + row < kv_len;
            const float* r_kn = reinterpret_cast<const float*>(cta.raw + RAW_KN);
            const float* r_vn = reinterpret_cast<const float*>(cta.raw + RAW_VN);
            const float* r_bias = reinterpret_cast<const float*>(cta.raw + RAW_BIAS);
            const u32 meta = st + 2 * C::TILE_BYTES + 4 * row;
            put_all_f32<CL>(fa_smem, meta, ok ? r_kn[tid] * scale_log2 : 0.f, peer);
            put_all_f32<CL>(fa_smem, meta + 4 * BN,
                            ok ? (cta.bias_b != nullptr ? r_bias[tid] * kLog2e : 0.f) : neg_inf(), peer);
            put_all_f32<CL>(fa_smem, meta + 8 * BN, ok ? r_vn[tid] : 0.f, peer);
        }
    };

    if (n_tiles_cl > 0) fetch(cta.t_begin);
    cp_async_commit();
    cp_async_wait<0>();
    // Every CTA of the cluster has started (its shared memory may be written); Q and the tables are visible.
    cluster_arrive();
    cluster_wait();

    Lanes<C> ln;
    ln.init(lane);
    const u32 q_warp = cta.s_q + warp * MT * 16 * C::ROW_BYTES;
    u32 qf[MT][C::KSTEPS][4];  // unused (Q stays in shared memory)

    // barrier.cluster.arrive.release waits for this thread's earlier memory operations: the global fetches are
    // issued after it, so an arrive waits for the decoded stores (local and remote) only.
    if (n_tiles_cl > 0) decode(cta.t_begin, 0);
    cluster_arrive();
    if (n_tiles_cl > 1) fetch(cta.t_begin + 1);
    cp_async_commit();
    cluster_wait();

    Acc<C> acc;
    acc_init(acc);
    int stage = 0;
    for (int i = 0; i < n_tiles_cl; ++i) {
        const int t = cta.t_begin + i;
        const int next = stage == STAGES - 1 ? 0 : stage + 1;
        if (i + 1 < n_tiles_cl) {
            cp_async_wait<0>();
            decode(t + 1, next);
        }
        auto signal = [&] {
            cluster_arrive();
            if (i + 2 < n_tiles_cl) fetch(t + 2);
            cp_async_commit();
        };
        if (i < n_tiles) {
            const u32 st = s_base + stage * STAGE;
            const float* meta = reinterpret_cast<const float*>(fa_smem + stage * STAGE + 2 * C::TILE_BYTES);
            const int n0 = t * BN;
            const bool mask = causal && n0 + BN - 1 > cta.lim_lo;
            if constexpr (OVERLAP) {  // arrive right behind the S mmas: the stores complete while they run
                if (mask) {
                    tile_step<C, bf16, true, true>(acc, qf, q_warp, st, st + C::TILE_BYTES, ln, meta, n0, 0x7fffffff,
                                                   true, row_lim, 1.f, signal);
                } else {
                    tile_step<C, bf16, true, false>(acc, qf, q_warp, st, st + C::TILE_BYTES, ln, meta, n0, 0x7fffffff,
                                                    false, row_lim, 1.f, signal);
                }
            } else {
                signal();
                if (mask) {
                    tile_step<C, bf16, true, true>(acc, qf, q_warp, st, st + C::TILE_BYTES, ln, meta, n0, 0x7fffffff,
                                                   true, row_lim, 1.f);
                } else {
                    tile_step<C, bf16, true, false>(acc, qf, q_warp, st, st + C::TILE_BYTES, ln, meta, n0, 0x7fffffff,
                                                    false, row_lim, 1.f);
                }
            }
        } else {
            signal();
        }
        cluster_wait();
        stage = next;
    }
    // The last wait also guarantees that no peer still writes into this CTA's shared memory when it exits.

    store_rows<C>(acc, out, lse, rb, b, kvh, split, batch, q_heads, q_len);
}
