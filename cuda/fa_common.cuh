// Shared device code of the FlashAttention-2 forward kernels (flash_attention.cu, tq_prefill.cu).
//
// Tiling. A CTA owns BM = WARPS * MT * 16 query rows; each warp owns MT row tiles of 16 and keeps their output
// accumulators, running max and running sum in registers (fp32). Keys stream through a two-stage shared-memory
// ring in tiles of BN rows (16-bit K and V, rows XOR-swizzled in 16-byte chunks so every ldmatrix is free of
// bank conflicts). Per tile: S = Q K^T and O += P V on mma.sync.m16n8k16 with fp32 accumulation, online softmax
// in the exp2 domain in between. The fragment layouts are those of the PTX ISA for mma.m16n8k16 and ldmatrix.
//
// Query rows. The rows of a CTA enumerate (position, head in group) pairs, r = pos * G + g, so one CTA serves
// every query head of a KV head (GQA) and short query chunks still fill the tile. G = 1 is plain MHA.
//
// The hardware primitives sit in one block below; a host-side emulation harness can supply its own versions
// by defining FA_HOST_EMULATION as the name of a header that implements them (the rest is plain C++).
#pragma once

#ifndef FA_HOST_EMULATION
#include "smem.cuh"
#endif

namespace fa {

typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;

struct f16 {};   // template tags: which 16-bit float the mma consumes
struct bf16 {};

struct alignas(16) U4 { u32 x, y, z, w; };
struct alignas(8) F2 { float x, y; };

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

#ifndef FA_HOST_EMULATION
#define FA_INLINE __device__ __forceinline__
#define FA_HD __host__ __device__ __forceinline__

FA_INLINE float neg_inf() { return __int_as_float(0xff800000u); }
FA_INLINE u32 dynamic_smem_bytes() { u32 r; asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r)); return r; }
FA_INLINE void block_sync() { __syncthreads(); }
FA_INLINE float shfl_xor(float x, int mask) { return __shfl_xor_sync(0xffffffffu, x, mask); }
FA_INLINE bool warp_any(bool p) { return __any_sync(0xffffffffu, p) != 0; }
FA_HD u32 prmt(u32 a, u32 b, u32 sel) {
#ifdef __CUDA_ARCH__
    return __byte_perm(a, b, sel);
#else
    const unsigned long long x = (static_cast<unsigned long long>(b) << 32) | a;
    u32 r = 0;
    for (int i = 0; i < 4; ++i) r |= static_cast<u32>((x >> (8 * ((sel >> (4 * i)) & 7))) & 0xff) << (8 * i);
    return r;
#endif
}
FA_INLINE float ex2(float x) {  // one MUFU op; ex2(-inf) = +0
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
FA_INLINE u16 bf16_bits(float x) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}
// 16-byte global -> shared copy; src_bytes = 0 zero-fills the destination (rows past the end).
FA_INLINE void cp_async_16(u32 dst, const void* src, u32 src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
template <int BYTES>
FA_INLINE void cp_async_small(u32 dst, const void* src) {  // 4 or 8 bytes
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(dst), "l"(src), "n"(BYTES));
}
FA_INLINE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
FA_INLINE void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
FA_INLINE void ldsm_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
FA_INLINE void ldsm_x4_t(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
template <typename T> FA_INLINE void mma(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1);
template <> FA_INLINE void mma<bf16>(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <> FA_INLINE void mma<f16>(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// Two fp32 -> one register of two 16-bit floats, `lo` in the low half (the lower column / k index).
template <typename T> FA_INLINE u32 pack2(float lo, float hi);
template <> FA_INLINE u32 pack2<bf16>(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
template <> FA_INLINE u32 pack2<f16>(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
#else
#include FA_HOST_EMULATION
#endif  // FA_HOST_EMULATION

FA_HD int imin(int a, int b) { return a < b ? a : b; }

// ----------------------------------------------------------------------------------------------------------
// Tile configuration
// ----------------------------------------------------------------------------------------------------------

template <int D_, int WARPS_, int MT_, int BN_, bool QREG_>
struct Cfg {
    static constexpr int D = D_;          // head dim
    static constexpr int WARPS = WARPS_;
    static constexpr int MT = MT_;        // 16-row tiles per warp
    static constexpr int BN = BN_;        // keys per tile
    static constexpr bool QREG = QREG_;   // Q fragments live in registers (else re-read from shared memory)
    static constexpr int THREADS = WARPS * 32;
    static constexpr int BM = WARPS * MT * 16;
    static constexpr int ROW_BYTES = 2 * D;
    static constexpr int CHUNKS = D / 8;  // 16-byte chunks per row
    static constexpr int KSTEPS = D / 16;
    static constexpr int SNT = BN / 8;    // n8 tiles of S
    static constexpr int ONT = D / 8;     // n8 tiles of O
    static constexpr int TILE_BYTES = BN * ROW_BYTES;
    static constexpr int Q_BYTES = BM * ROW_BYTES;
    static_assert(D == 64 || D == 128 || D == 256, "head_dim must be 64, 128 or 256");
    static_assert(BN % 16 == 0 && BN >= 16 && BN <= 128, "BN must be a multiple of 16 in [16, 128]");
    static_assert(MT == 1 || MT == 2, "MT must be 1 or 2");
    static_assert((BN * CHUNKS) % THREADS == 0 && (BM * CHUNKS) % THREADS == 0, "tile loads must split evenly");

    // Byte offset of 16-byte chunk `chunk` of row `row` in a swizzled tile.
    FA_HD static u32 swz(int row, int chunk) { return row * ROW_BYTES + ((chunk ^ (row & 7)) << 4); }
};

template <class C>
struct Acc {
    float o[C::MT][C::ONT][4];
    float m[C::MT][2];  // running max of the transformed scores x (see tile_step)
    float l[C::MT][2];  // this thread's partial running sum (reduced over the quad at the end)
};

template <class C>
FA_INLINE void acc_init(Acc<C>& a) {
#pragma unroll
    for (int mt = 0; mt < C::MT; ++mt) {
#pragma unroll
        for (int nt = 0; nt < C::ONT; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) a.o[mt][nt][e] = 0.f;
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            a.m[mt][h] = neg_inf();
            a.l[mt][h] = 0.f;
        }
    }
}

// Per-lane ldmatrix addressing. Tile row bases are multiples of 8, so a lane's row & 7 is lane & 7 and the
// swizzled chunk of logical chunk 8j + c (c < 8) is 8j + (c ^ (lane & 7)): the four patterns of c = 2 (k % 4) + sub
// are precomputed here, the 8j part is a compile-time offset.
template <class C>
struct Lanes {
    u32 a_row, k_row;      // a_row serves Q (A operand) and V (transposed B operand): same matrix order
    u32 a_sw[4], k_sw[4];

    FA_INLINE void init(int lane) {
        const int r8 = lane & 7;
        const int b3 = (lane >> 3) & 1;
        const int b4 = lane >> 4;
        // Q (A operand, row-major): matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15).
        // V (B operand from key rows, .trans): (keys 0-7, d 0-7), (keys 8-15, d 0-7), (keys 0-7, d 8-15), (keys 8-15, d 8-15).
        a_row = (r8 + 8 * b3) * C::ROW_BYTES;
        // K (B operand from key rows): (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15).
        k_row = (r8 + 8 * b4) * C::ROW_BYTES;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            a_sw[i] = ((2 * i + b4) ^ r8) << 4;
            k_sw[i] = ((2 * i + b3) ^ r8) << 4;
        }
    }
    FA_INLINE u32 q(int kk) const { return a_row + (kk >> 2) * 128 + a_sw[kk & 3]; }
    FA_INLINE u32 k(int kk) const { return k_row + (kk >> 2) * 128 + k_sw[kk & 3]; }
    FA_INLINE u32 v(int dp) const { return a_row + (dp >> 2) * 128 + a_sw[dp & 3]; }
};

template <class C>
FA_INLINE void load_q_fragments(u32 (&qf)[C::MT][C::KSTEPS][4], u32 q_warp, const Lanes<C>& ln) {
#pragma unroll
    for (int mt = 0; mt < C::MT; ++mt) {
#pragma unroll
        for (int kk = 0; kk < C::KSTEPS; ++kk) ldsm_x4(qf[mt][kk], q_warp + mt * 16 * C::ROW_BYTES + ln.q(kk));
    }
}

// One key tile: S = Q K^T, transform, mask, online softmax, O += P V.
//
// FUSED = false (plain FA2): x = raw score, p = 2^(x E - m E) with E = scale * log2(e); columns >= n_valid masked.
// FUSED = true (TurboQuant): K and V tiles hold bare centroids; meta = [cs | cb | vs] per key column with
// cs = |k| * scale * log2(e), cb = bias * log2(e) (-inf past the end), vs = |v|; x = s cs + cb, E = 1, and
// P is scaled by vs on its way into the second mma (the row sum l uses the unscaled P).
// MASK (only for tiles that cross a diagonal or the end of the keys; a separate instantiation keeps the
// per-element compares out of the other tiles): column c is dropped if c >= n_valid or, when causal,
// c > row_lim of its row.
// Hooks: `after_qk()` runs right after the S = Q K^T mmas are issued and `after_pv()` after the O += P V ones, in
// the same basic block, so independent integer work placed there (the fused kernel's decompression of the next
// tile) can issue while the tensor cores work instead of before them.
struct NoHook {
    FA_INLINE void operator()() const {}
};

template <class C, typename T, bool FUSED, bool MASK, class AfterQK = NoHook, class AfterPV = NoHook>
FA_INLINE void tile_step(Acc<C>& acc, const u32 (&qf)[C::MT][C::KSTEPS][4], u32 q_warp, u32 k_tile, u32 v_tile,
                         const Lanes<C>& ln, const float* meta, int n0, int n_valid, bool causal,
                         const int (&row_lim)[C::MT][2], float E, AfterQK after_qk = AfterQK(),
                         AfterPV after_pv = AfterPV()) {
    constexpr int MT = C::MT, SNT = C::SNT, BN = C::BN;
    const int lane = threadIdx.x & 31;
    const int tig = lane & 3;

    float s[MT][SNT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int nt = 0; nt < SNT; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;
        }
    }

#pragma unroll
    for (int kk = 0; kk < C::KSTEPS; ++kk) {
        u32 a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            if constexpr (C::QREG) {
#pragma unroll
                for (int i = 0; i < 4; ++i) a[mt][i] = qf[mt][kk][i];
            } else {
                ldsm_x4(a[mt], q_warp + mt * 16 * C::ROW_BYTES + ln.q(kk));
            }
        }
#pragma unroll
        for (int np = 0; np < SNT / 2; ++np) {
            u32 b[4];
            ldsm_x4(b, k_tile + np * 16 * C::ROW_BYTES + ln.k(kk));
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma<T>(s[mt][2 * np], a[mt], b[0], b[1]);
                mma<T>(s[mt][2 * np + 1], a[mt], b[2], b[3]);
            }
        }
    }

    after_qk();

    // Transform and mask. Element e of n-tile nt sits at column nt*8 + 2*tig + (e & 1), row +8 if e >= 2.
    if constexpr (FUSED) {
#pragma unroll
        for (int nt = 0; nt < SNT; ++nt) {
            const int c = nt * 8 + 2 * tig;
            const F2 cs = *reinterpret_cast<const F2*>(meta + c);
            const F2 cb = *reinterpret_cast<const F2*>(meta + BN + c);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                s[mt][nt][0] = fmaf(s[mt][nt][0], cs.x, cb.x);
                s[mt][nt][1] = fmaf(s[mt][nt][1], cs.y, cb.y);
                s[mt][nt][2] = fmaf(s[mt][nt][2], cs.x, cb.x);
                s[mt][nt][3] = fmaf(s[mt][nt][3], cs.y, cb.y);
            }
        }
    }
    if constexpr (MASK) {
#pragma unroll
        for (int nt = 0; nt < SNT; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int col = n0 + nt * 8 + 2 * tig + (e & 1);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    const bool drop = col >= n_valid || (causal && col > row_lim[mt][e >> 1]);
                    if (drop) s[mt][nt][e] = neg_inf();
                }
            }
        }
    }

    // Online softmax. A row that has seen only -inf keeps m = -inf and uses 0 as its offset (no inf - inf).
    float alpha[MT][2];
    bool changed = false;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float mx = acc.m[mt][h];
#pragma unroll
            for (int nt = 0; nt < SNT; ++nt) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * h], s[mt][nt][2 * h + 1]));
            mx = fmaxf(mx, shfl_xor(mx, 1));
            mx = fmaxf(mx, shfl_xor(mx, 2));
            const float m_use = (mx == neg_inf()) ? 0.f : mx * E;
            alpha[mt][h] = ex2(acc.m[mt][h] * E - m_use);
            changed |= (mx != acc.m[mt][h]);
            acc.m[mt][h] = mx;
            float sum = 0.f;
#pragma unroll
            for (int nt = 0; nt < SNT; ++nt) {
#pragma unroll
                for (int e = 2 * h; e < 2 * h + 2; ++e) {
                    const float p = ex2(fmaf(s[mt][nt][e], E, -m_use));
                    s[mt][nt][e] = p;
                    sum += p;
                }
            }
            acc.l[mt][h] = acc.l[mt][h] * alpha[mt][h] + sum;
        }
    }
    // Rows whose max did not move have alpha == 1 exactly; skip the rescale when that holds for the warp.
    if (warp_any(changed)) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int nt = 0; nt < C::ONT; ++nt) {
                acc.o[mt][nt][0] *= alpha[mt][0];
                acc.o[mt][nt][1] *= alpha[mt][0];
                acc.o[mt][nt][2] *= alpha[mt][1];
                acc.o[mt][nt][3] *= alpha[mt][1];
            }
        }
    }

    // O += P V. The A fragment of k-step kk is S n-tiles 2kk (k 0-7) and 2kk+1 (k 8-15).
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
        u32 a[MT][4];
        F2 v0 = {1.f, 1.f}, v1 = {1.f, 1.f};
        if constexpr (FUSED) {
            v0 = *reinterpret_cast<const F2*>(meta + 2 * BN + kk * 16 + 2 * tig);
            v1 = *reinterpret_cast<const F2*>(meta + 2 * BN + kk * 16 + 8 + 2 * tig);
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            const float* p0 = s[mt][2 * kk];
            const float* p1 = s[mt][2 * kk + 1];
            a[mt][0] = pack2<T>(p0[0] * v0.x, p0[1] * v0.y);
            a[mt][1] = pack2<T>(p0[2] * v0.x, p0[3] * v0.y);
            a[mt][2] = pack2<T>(p1[0] * v1.x, p1[1] * v1.y);
            a[mt][3] = pack2<T>(p1[2] * v1.x, p1[3] * v1.y);
        }
#pragma unroll
        for (int dp = 0; dp < C::ONT / 2; ++dp) {
            u32 b[4];
            ldsm_x4_t(b, v_tile + kk * 16 * C::ROW_BYTES + ln.v(dp));
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma<T>(acc.o[mt][2 * dp], a[mt], b[0], b[1]);
                mma<T>(acc.o[mt][2 * dp + 1], a[mt], b[2], b[3]);
            }
        }
    }
    after_pv();
}

// Final per-row values: 1 / l (0 for a row that saw nothing) and the natural-log LSE (-inf then).
template <class C>
FA_INLINE void finish_rows(Acc<C>& acc, float E, float (&inv)[C::MT][2], float (&lse)[C::MT][2]) {
#pragma unroll
    for (int mt = 0; mt < C::MT; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float l = acc.l[mt][h];
            l += shfl_xor(l, 1);
            l += shfl_xor(l, 2);
            const bool seen = l > 0.f;
            inv[mt][h] = seen ? 1.f / l : 0.f;
            lse[mt][h] = seen ? (acc.m[mt][h] * E + log2f(l)) * kLn2 : neg_inf();
        }
    }
}

// Query row mapping of one CTA: block rows [m0, m0 + BM) of the (position, head-in-group) enumeration.
struct RowBlock {
    int m0, rows, group, diag;  // diag = N - Lq: query position i sees key j iff j <= i + diag (causal)

    FA_INLINE int pos(int r) const { return imin(r, rows - 1) / group; }
    FA_INLINE int head(int r, int kv_head) const { return kv_head * group + imin(r, rows - 1) % group; }
    FA_INLINE int lim_lo() const { return m0 / group + diag; }                           // first row's limit
    FA_INLINE int lim_hi(int bm) const { return (imin(m0 + bm, rows) - 1) / group + diag; }  // last row's limit
};

// Causal limits of the rows this lane's accumulator fragments hold (rows mt * 16 + lane / 4 + 8 h of the warp's
// MT row tiles): tile_step's row_lim.
template <int MT>
FA_INLINE void fragment_limits(int (&row_lim)[MT][2], const RowBlock& rb, int warp, int lane) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            row_lim[mt][h] = rb.pos(rb.m0 + warp * MT * 16 + mt * 16 + (lane >> 2) + 8 * h) + rb.diag;
        }
    }
}

}  // namespace fa
