// Fused TurboQuant compression, one launch: norm + rotation + bucketize + MSB-first bit packing.
//
//   tq_compress_hadamard<D, BITS, T>: Pi = H diag(s) / sqrt(D) applied as a fast Walsh-Hadamard transform
//       in registers and warp shuffles (D log D adds instead of D^2 FMAs).
//   tq_compress_dense<D, BITS, T>: any dense fp32 rotation (Haar), a CUDA-core GEMM against a shared-
//       memory copy of Pi with 4 rows x 8 columns of register blocking per thread.
//
// Both compute in fp32 and give, per coordinate, idx = #{k : boundaries[k] <= y} (torch.bucketize with
// right=True). They differ from the PyTorch reference only where a rotated value lies within rounding
// (~1e-7) of a boundary. Output: packed [rows, D*BITS/8] uint8 and norms [rows] fp32, both contiguous.
// Input rows are addressed through collapsed leading dimensions [n0, n1, n2] with element strides; the last
// dimension is contiguous and every row starts 16-byte aligned (the wrapper guarantees it).
#include "utils.cuh"

namespace fq_compress {

constexpr float FLOAT_TINY = 1.17549435e-38f;  // torch.finfo(torch.float32).tiny, the reference's clamp

// -------------------------------------------------------------------------------------------------
// Bucketize: idx = #{k : b[k] <= y} over NB = 2^BITS - 1 sorted boundaries.
// -------------------------------------------------------------------------------------------------

// BITS <= 3: boundaries in registers, a branch-free binary search by selects.
template <int BITS>
struct RegisterBucketizer {
    static constexpr int NB = (1 << BITS) - 1;
    float b[NB];

    __device__ __forceinline__ void load(const float* __restrict__ boundaries) {
#pragma unroll
        for (int k = 0; k < NB; ++k) b[k] = __ldg(boundaries + k);
    }

    __device__ __forceinline__ int operator()(float y) const {
        if constexpr (BITS == 1) {
            return y >= b[0] ? 1 : 0;
        } else if constexpr (BITS == 2) {
            const bool p1 = y >= b[1];
            const float t = p1 ? b[2] : b[0];
            return (p1 ? 2 : 0) + (y >= t ? 1 : 0);
        } else {
            const bool p2 = y >= b[3];
            const float t1 = p2 ? b[5] : b[1];
            const bool p1 = y >= t1;
            const float t0 = p2 ? (p1 ? b[6] : b[4]) : (p1 ? b[2] : b[0]);
            return (p2 ? 4 : 0) + (p1 ? 2 : 0) + (y >= t0 ? 1 : 0);
        }
    }
};

// BITS == 4: a 64-cell lookup table in shared memory. cell(y) is a monotone non-decreasing function of y
// (two correctly rounded FMAs and a saturation), evaluated with the same instructions for the boundaries
// and for the data, so every boundary whose cell is below y's cell is <= y and every boundary whose cell is
// above is > y: only boundaries in y's own cell need a comparison. Cells are sized from the smallest gap
// between boundaries, so each normally holds at most one (`thr`, +inf if none) and
// idx = base[cell] + (y >= thr[cell]) is exact. When some cell holds two or more (closely spaced or
// unsorted boundaries), `slow` is set and a short exact scan from base[cell] is used instead.
struct TableSmem {
    static constexpr int NCELL = 64;
    float bnd[16];
    float thr[NCELL];
    int base[NCELL];
    int bcell[16];
    float a, c;
    int slow;
};

template <int NB>
struct TableBucketizer {
    static constexpr int NCELL = TableSmem::NCELL;
    const TableSmem* s;
    float a, c;

    __device__ __forceinline__ int cell(float y) const {
        const float u = __saturatef(__fmaf_rn(y, a, c));
        // 1.5 * 2^23: adding it rounds u * (NCELL - 1) to an integer held in the low mantissa bits.
        return __float_as_int(__fmaf_rn(u, static_cast<float>(NCELL - 1), 12582912.0f)) & (NCELL - 1);
    }

    template <bool SLOW>
    __device__ __forceinline__ int index(float y) const {
        const int k = cell(y);
        if constexpr (!SLOW) {
            return s->base[k] + (y >= s->thr[k] ? 1 : 0);
        } else {
            int i = s->base[k];
            while (i < NB && y >= s->bnd[i]) ++i;
            return i;
        }
    }

    // Collective: every thread of the block calls it (contains __syncthreads).
    __device__ void build(TableSmem& sm, const float* __restrict__ boundaries) {
        const int tid = threadIdx.x;
        if (tid < NB) sm.bnd[tid] = boundaries[tid];
        if (tid == 0) sm.slow = 0;
        __syncthreads();
        if (tid == 0) {
            const float lo = sm.bnd[0], hi = sm.bnd[NB - 1];
            float gap = hi - lo;
            for (int k = 0; k + 1 < NB; ++k) gap = fminf(gap, sm.bnd[k + 1] - sm.bnd[k]);
            float w = fmaxf(0.75f * gap, (hi - lo) / static_cast<float>(NCELL - 4));
            float ca, cc;
            if (w > 0.f && w < 1e30f && lo == lo) {
                ca = 1.f / (w * static_cast<float>(NCELL - 1));
                cc = 0.5f - 0.5f * (lo + hi) * ca;
            } else {  // degenerate or non-finite boundaries: any monotone map, exact scan
                ca = 0.5f;
                cc = 0.5f;
                sm.slow = 1;
            }
            sm.a = ca;
            sm.c = cc;
        }
        __syncthreads();
        a = sm.a;
        c = sm.c;
        s = &sm;
        if (tid < NB) sm.bcell[tid] = cell(sm.bnd[tid]);
        __syncthreads();
        if (tid < NCELL) {
            int below = 0, inside = 0;
            float t = __int_as_float(0x7f800000);  // +inf: no boundary in this cell
            for (int k = 0; k < NB; ++k) {
                const int bc = sm.bcell[k];
                below += bc < tid ? 1 : 0;
                if (bc == tid) {
                    if (inside == 0) t = sm.bnd[k];
                    ++inside;
                }
            }
            sm.base[tid] = below;
            sm.thr[tid] = t;
            if (inside > 1) sm.slow = 1;
        }
        __syncthreads();
    }
};

// One interface over both: setup() is collective; slow() is uniform over the block.
template <int BITS>
struct Bucketizer {
    static constexpr int NB = (1 << BITS) - 1;
    RegisterBucketizer<BITS> reg;
    __device__ __forceinline__ void setup(TableSmem&, const float* __restrict__ boundaries) { reg.load(boundaries); }
    __device__ __forceinline__ bool slow() const { return false; }
    template <bool SLOW>
    __device__ __forceinline__ int index(float y) const { return reg(y); }
    __device__ __forceinline__ int index(float y, bool) const { return reg(y); }
};

template <>
struct Bucketizer<4> {
    static constexpr int NB = 15;
    TableBucketizer<15> table;
    __device__ __forceinline__ void setup(TableSmem& sm, const float* __restrict__ boundaries) {
        table.build(sm, boundaries);
    }
    __device__ __forceinline__ bool slow() const { return table.s->slow != 0; }
    template <bool SLOW>
    __device__ __forceinline__ int index(float y) const { return table.index<SLOW>(y); }
    // Run-time choice, for kernels whose time goes elsewhere (the dense GEMM).
    __device__ __forceinline__ int index(float y, bool slow) const {
        return slow ? table.index<true>(y) : table.index<false>(y);
    }
};

// -------------------------------------------------------------------------------------------------
// Shared pieces
// -------------------------------------------------------------------------------------------------

template <int D, int BITS>
struct CodecShape {
    static_assert(D == 64 || D == 128 || D == 256, "head_dim must be 64, 128 or 256");
    static_assert(BITS >= 2 && BITS <= 4, "bits must be 2, 3 or 4");
    static constexpr int LEVELS = 1 << BITS;
    static constexpr int PACKED = D * BITS / 8;  // bytes per row; chunk c of 8 coordinates at byte c * BITS
    static constexpr int CHUNKS = D / 8;
};

// Squared centroids for norm correction (||centroids[idx]||^2 is a sum of table lookups).
template <int LEVELS>
__device__ __forceinline__ void load_centroid_squares(float* s_csq, const float* __restrict__ centroids, bool enabled) {
    if (enabled && threadIdx.x < LEVELS) {
        const float c = centroids[threadIdx.x];
        s_csq[threadIdx.x] = c * c;
    }
}

__device__ __forceinline__ float stored_norm(float n, float csq, bool norm_correction) {
    return norm_correction ? n / fmaxf(sqrtf(csq), FLOAT_TINY) : n;
}

// -------------------------------------------------------------------------------------------------
// Hadamard path
// -------------------------------------------------------------------------------------------------

// Lanes per row of the Hadamard kernels: each thread holds E = D / LANES coordinates. Fewer lanes mean fewer
// shuffle stages (the kernel is issue-bound) but more registers. Measured on the H200 at D = 128, bf16, TQ4:
// 4 lanes 0.545 of the copy bandwidth (~128 registers), 8 lanes 0.494 (64), 16 lanes 0.418 (40). Defaults:
// E = 16, except 16-bit inputs at D = 128 (E = 32; fp32 input would need 183 registers there).
// -DFQ_HADAMARD_LANES_<D>=<lanes> overrides the choice for every dtype (the benchmark times variants).
#ifndef FQ_HADAMARD_LANES_64
#define FQ_HADAMARD_LANES_64 4
#endif
#ifndef FQ_HADAMARD_LANES_256
#define FQ_HADAMARD_LANES_256 16
#endif

template <int D, typename T>
__host__ __device__ constexpr int hadamard_lanes() {
#ifdef FQ_HADAMARD_LANES_128
    constexpr int lanes128 = FQ_HADAMARD_LANES_128;
#else
    constexpr int lanes128 = fq::DType<T>::BYTES == 2 ? 4 : 8;
#endif
    return D == 64 ? FQ_HADAMARD_LANES_64 : D == 128 ? lanes128 : FQ_HADAMARD_LANES_256;
}

template <int D, int BITS, typename T>
struct HadamardShape : CodecShape<D, BITS> {
    static constexpr int THREADS = 256;
    static constexpr int LANES = hadamard_lanes<D, T>();
    static constexpr int V = (D / 8) / LANES;             // chunks per thread
    static constexpr int E = V * 8;                       // coordinates per thread
    static constexpr int ROWS_PER_CTA = THREADS / LANES;
    static constexpr float SQRT_D = D == 64 ? 8.f : D == 128 ? 11.313708498984761f : 16.f;
    static_assert(LANES >= 1 && LANES <= 32 && V >= 1 && V * LANES * 8 == D, "bad lane count for this head_dim");
    static_assert(E <= 32, "the sign mask holds one bit per coordinate of a thread");
};

// The raw input words of one row held by one thread (issued one row ahead of the math).
template <typename T, int V>
struct RowRaw {
    fq::Raw8<T> chunk[V];
};

template <int D, int BITS, typename T>
__device__ __forceinline__ void load_row_raw(const T* __restrict__ x, long long sx0, long long sx1, long long sx2,
                                             fq::FastDiv n1, fq::FastDiv n2, unsigned rows, unsigned r, int t,
                                             RowRaw<T, HadamardShape<D, BITS, T>::V>& raw) {
    using S = HadamardShape<D, BITS, T>;
    if (r < rows) {
        const T* row = x + fq::row_offset(fq::split_row(r, n1, n2), sx0, sx1, sx2);
#pragma unroll
        for (int v = 0; v < S::V; ++v) fq::load8_raw<T>(row + (v * S::LANES + t) * 8, raw.chunk[v]);
    } else {
#pragma unroll
        for (int v = 0; v < S::V; ++v) fq::zero8_raw<T>(raw.chunk[v]);
    }
}

template <int D, int BITS, typename T, bool NC, bool SLOW>
__device__ __forceinline__ void compress_hadamard_rows(
    const T* __restrict__ x, long long sx0, long long sx1, long long sx2, fq::FastDiv n1, fq::FastDiv n2,
    unsigned rows, const Bucketizer<BITS>& bucket, unsigned neg, const float* s_csq,
    unsigned char* __restrict__ packed, float* __restrict__ norms) {
    using S = HadamardShape<D, BITS, T>;
    const int t = threadIdx.x % S::LANES;
    const unsigned slot = threadIdx.x / S::LANES;
    unsigned g = blockIdx.x;
    if (static_cast<unsigned long long>(g) * S::ROWS_PER_CTA >= rows) return;
    RowRaw<T, S::V> cur;
    load_row_raw<D, BITS, T>(x, sx0, sx1, sx2, n1, n2, rows, g * S::ROWS_PER_CTA + slot, t, cur);
    while (true) {
        const unsigned gn = g + gridDim.x;
        const bool has_next = static_cast<unsigned long long>(gn) * S::ROWS_PER_CTA < rows;  // uniform
        RowRaw<T, S::V> nxt;
        if (has_next) load_row_raw<D, BITS, T>(x, sx0, sx1, sx2, n1, n2, rows, gn * S::ROWS_PER_CTA + slot, t, nxt);

        const unsigned r = g * S::ROWS_PER_CTA + slot;
        const bool valid = r < rows;
        float y[S::E];
#pragma unroll
        for (int v = 0; v < S::V; ++v) {
            float chunk[8];
            fq::convert8<T>(cur.chunk[v], chunk);
#pragma unroll
            for (int j = 0; j < 8; ++j) y[v * 8 + j] = chunk[j];
        }
        float ss = 0.f;
#pragma unroll
        for (int e = 0; e < S::E; ++e) {
            ss = fmaf(y[e], y[e], ss);
            y[e] = __int_as_float(__float_as_int(y[e]) ^ static_cast<int>((neg << (31 - e)) & 0x80000000u));
        }
        ss = fq::group_sum<S::LANES>(ss);
        fq::fwht_distributed<S::LANES>(y, t);
        const float n = sqrtf(ss);
        const float scale = 1.f / (fmaxf(n, FLOAT_TINY) * S::SQRT_D);
        float csq = 0.f;
        unsigned char* out = packed + static_cast<long long>(r) * S::PACKED;
#pragma unroll
        for (int v = 0; v < S::V; ++v) {
            unsigned stream = 0;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const int idx = bucket.template index<SLOW>(y[v * 8 + j] * scale);
                stream = fq::stream_push<BITS>(stream, idx);
                if constexpr (NC) csq += s_csq[idx];
            }
            if (valid) fq::store_chunk<BITS>(out + (v * S::LANES + t) * BITS, stream);
        }
        if constexpr (NC) csq = fq::group_sum<S::LANES>(csq);
        if (valid && t == 0) norms[r] = stored_norm(n, csq, NC);

        if (!has_next) break;
        cur = nxt;
        g = gn;
    }
}

}  // namespace fq_compress

template <int D, int BITS, typename T>
__global__ void __launch_bounds__(256) tq_compress_hadamard(
    const T* __restrict__ x, const long long sx0, const long long sx1, const long long sx2,
    const unsigned n1, const unsigned n1_magic, const unsigned n1_shift,
    const unsigned n2, const unsigned n2_magic, const unsigned n2_shift, const int rows,
    const float* __restrict__ signs, const float* __restrict__ boundaries, const float* __restrict__ centroids,
    const int norm_correction, unsigned char* __restrict__ packed, float* __restrict__ norms) {
    using namespace fq_compress;
    using S = HadamardShape<D, BITS, T>;
    __shared__ TableSmem table;
    __shared__ float s_csq[S::LEVELS];
    Bucketizer<BITS> bucket;
    bucket.setup(table, boundaries);
    load_centroid_squares<S::LEVELS>(s_csq, centroids, norm_correction != 0);
    // One bit per coordinate of this thread: set where the Hadamard sign is negative.
    const int t = threadIdx.x % S::LANES;
    unsigned neg = 0;
#pragma unroll
    for (int v = 0; v < S::V; ++v)
#pragma unroll
        for (int j = 0; j < 8; ++j)
            neg |= (__ldg(signs + (v * S::LANES + t) * 8 + j) < 0.f ? 1u : 0u) << (v * 8 + j);
    __syncthreads();
    const bool slow = bucket.slow();
    const fq::FastDiv d1{n1, n1_magic, n1_shift}, d2{n2, n2_magic, n2_shift};
    const unsigned urows = rows;
    if (norm_correction) {
        if (slow) compress_hadamard_rows<D, BITS, T, true, true>(x, sx0, sx1, sx2, d1, d2, urows, bucket, neg, s_csq, packed, norms);
        else compress_hadamard_rows<D, BITS, T, true, false>(x, sx0, sx1, sx2, d1, d2, urows, bucket, neg, s_csq, packed, norms);
    } else {
        if (slow) compress_hadamard_rows<D, BITS, T, false, true>(x, sx0, sx1, sx2, d1, d2, urows, bucket, neg, s_csq, packed, norms);
        else compress_hadamard_rows<D, BITS, T, false, false>(x, sx0, sx1, sx2, d1, d2, urows, bucket, neg, s_csq, packed, norms);
    }
}

// -------------------------------------------------------------------------------------------------
// Dense path: y = x @ Pi.T on CUDA cores.
//
// A CTA keeps NCOL rows of Pi (all of Pi when D <= 128; two passes of 128 for D = 256) in shared memory,
// row-major with the 16-byte groups of each row XOR-swizzled by (row / 8) so that the 8 lanes of a
// quarter-warp, which read 8 different rows at the same k, hit 8 different bank groups. A tile of R input
// rows is staged transposed (xt[k][r], fp32) with its norms. Thread (ty, tx) accumulates rows ty*4..+3 x
// columns tx*8..+7: per 4 k-steps 4 + 8 LDS.128 feed 128 FMAs.
// -------------------------------------------------------------------------------------------------

namespace fq_compress {

template <int D, int BITS>
struct DenseShape : CodecShape<D, BITS> {
    static constexpr int THREADS = 256;
    static constexpr int NCOL = D < 128 ? D : 128;     // rows of Pi (output columns) per pass
    static constexpr int PASSES = D / NCOL;
    static constexpr int TX = NCOL / 8;                // threads across output columns, 8 columns each
    static constexpr int TY = THREADS / TX;
    static constexpr int RM = 4;                       // rows per thread
    static constexpr int R = TY * RM;                  // rows per tile
    static constexpr int PI_FLOATS = NCOL * D;
    static constexpr int XT_FLOATS = D * R;
    static constexpr int SMEM_BYTES = (PI_FLOATS + XT_FLOATS + 2 * R + THREADS) * 4;
    static_assert(THREADS % R == 0, "each staging thread must keep one row");
    static_assert(D / 4 >= 8, "the swizzle needs 8 groups of 4 floats per row");
};

__device__ __forceinline__ int swizzle4(int row, int group4) { return group4 ^ ((row >> 3) & 7); }

// Stage Pi rows [pass * NCOL, +NCOL) into pi_s (swizzled row-major, row stride D floats).
template <int D, int NCOL>
__device__ __forceinline__ void stage_rotation(float* pi_s, const float* __restrict__ rotation, int pass) {
    constexpr int GROUPS = D / 4;
    for (int i = threadIdx.x; i < NCOL * GROUPS; i += blockDim.x) {
        const int n = i / GROUPS, g = i % GROUPS;
        const float4 v = *reinterpret_cast<const float4*>(rotation + static_cast<long long>(pass * NCOL + n) * D + g * 4);
        *reinterpret_cast<float4*>(pi_s + n * D + swizzle4(n, g) * 4) = v;
    }
}

// Norm correction and the exact-scan bucketize are run-time switches here: next to 4*D FMAs per coordinate
// they cost nothing measurable, and one code path per instantiation keeps compilation short.
template <int D, int BITS, typename T>
__device__ __forceinline__ void compress_dense_tiles(
    const T* __restrict__ x, long long sx0, long long sx1, long long sx2, fq::FastDiv n1, fq::FastDiv n2,
    unsigned rows, const float* __restrict__ rotation, const Bucketizer<BITS>& bucket, bool slow, bool nc,
    const float* s_csq, float* smem, unsigned char* __restrict__ packed, float* __restrict__ norms) {
    using S = DenseShape<D, BITS>;
    float* pi_s = smem;
    float* xt = pi_s + S::PI_FLOATS;
    float* s_norm = xt + S::XT_FLOATS;
    float* s_inv = s_norm + S::R;
    float* s_part = s_inv + S::R;
    const int tid = threadIdx.x;
    const int tx = tid % S::TX, ty = tid / S::TX;
    const int srow = tid % S::R;  // the tile row this thread stages

    for (unsigned tile = blockIdx.x; static_cast<unsigned long long>(tile) * S::R < rows; tile += gridDim.x) {
        const unsigned r0 = tile * S::R;
        __syncthreads();  // the previous tile's readers of xt / pi_s are done
        {
            const unsigned r = r0 + srow;
            const bool valid = r < rows;
            const T* row = valid ? x + fq::row_offset(fq::split_row(r, n1, n2), sx0, sx1, sx2) : x;
            float ss = 0.f;
            for (int kc = tid / S::R; kc < D / 8; kc += S::THREADS / S::R) {
                float v[8];
                if (valid) {
                    fq::load8<T, false>(row + kc * 8, v);
                } else {
#pragma unroll
                    for (int j = 0; j < 8; ++j) v[j] = 0.f;
                }
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    ss = fmaf(v[j], v[j], ss);
                    xt[(kc * 8 + j) * S::R + srow] = v[j];
                }
            }
            s_part[tid] = ss;
        }
        if (S::PASSES == 1 && tile == blockIdx.x) stage_rotation<D, S::NCOL>(pi_s, rotation, 0);
        __syncthreads();
        if (tid < S::R) {
            float ss = 0.f;
            for (int p = tid; p < S::THREADS; p += S::R) ss += s_part[p];
            const float n = sqrtf(ss);
            s_norm[tid] = n;
            s_inv[tid] = 1.f / fmaxf(n, FLOAT_TINY);
        }
        float csq[S::RM];
#pragma unroll
        for (int i = 0; i < S::RM; ++i) csq[i] = 0.f;

        for (int pass = 0; pass < S::PASSES; ++pass) {
            if (S::PASSES > 1) {
                __syncthreads();
                stage_rotation<D, S::NCOL>(pi_s, rotation, pass);
            }
            __syncthreads();
            float acc[S::RM][8];
#pragma unroll
            for (int i = 0; i < S::RM; ++i)
#pragma unroll
                for (int j = 0; j < 8; ++j) acc[i][j] = 0.f;
            const float* xrow = xt + ty * S::RM;
#pragma unroll 2
            for (int k = 0; k < D; k += 4) {
                float4 xv[4], pv[8];
#pragma unroll
                for (int q = 0; q < 4; ++q) xv[q] = *reinterpret_cast<const float4*>(xrow + (k + q) * S::R);
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const int n = tx * 8 + j;
                    pv[j] = *reinterpret_cast<const float4*>(pi_s + n * D + swizzle4(n, k >> 2) * 4);
                }
#pragma unroll
                for (int j = 0; j < 8; ++j) {
#pragma unroll
                    for (int i = 0; i < S::RM; ++i) {
                        const float x0 = i == 0 ? xv[0].x : i == 1 ? xv[0].y : i == 2 ? xv[0].z : xv[0].w;
                        const float x1 = i == 0 ? xv[1].x : i == 1 ? xv[1].y : i == 2 ? xv[1].z : xv[1].w;
                        const float x2 = i == 0 ? xv[2].x : i == 1 ? xv[2].y : i == 2 ? xv[2].z : xv[2].w;
                        const float x3 = i == 0 ? xv[3].x : i == 1 ? xv[3].y : i == 2 ? xv[3].z : xv[3].w;
                        float a = acc[i][j];
                        a = fmaf(x0, pv[j].x, a);
                        a = fmaf(x1, pv[j].y, a);
                        a = fmaf(x2, pv[j].z, a);
                        a = fmaf(x3, pv[j].w, a);
                        acc[i][j] = a;
                    }
                }
            }
#pragma unroll
            for (int i = 0; i < S::RM; ++i) {
                const int lr = ty * S::RM + i;
                const unsigned r = r0 + lr;
                const float inv = s_inv[lr];
                unsigned stream = 0;
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const int idx = bucket.index(acc[i][j] * inv, slow);
                    stream = fq::stream_push<BITS>(stream, idx);
                    if (nc) csq[i] += s_csq[idx];
                }
                if (r < rows)
                    fq::store_chunk<BITS>(packed + static_cast<long long>(r) * S::PACKED + (pass * S::TX + tx) * BITS, stream);
            }
        }
#pragma unroll
        for (int i = 0; i < S::RM; ++i) {
            if (nc) csq[i] = fq::group_sum<S::TX>(csq[i]);
            const int lr = ty * S::RM + i;
            const unsigned r = r0 + lr;
            if (tx == 0 && r < rows) norms[r] = stored_norm(s_norm[lr], csq[i], nc);
        }
    }
}

}  // namespace fq_compress

template <int D, int BITS, typename T>
__global__ void __launch_bounds__(256) tq_compress_dense(
    const T* __restrict__ x, const long long sx0, const long long sx1, const long long sx2,
    const unsigned n1, const unsigned n1_magic, const unsigned n1_shift,
    const unsigned n2, const unsigned n2_magic, const unsigned n2_shift, const int rows,
    const float* __restrict__ rotation, const float* __restrict__ boundaries, const float* __restrict__ centroids,
    const int norm_correction, unsigned char* __restrict__ packed, float* __restrict__ norms) {
    using namespace fq_compress;
    using S = DenseShape<D, BITS>;
    extern __shared__ float4 dense_smem[];
    __shared__ TableSmem table;
    __shared__ float s_csq[S::LEVELS];
    Bucketizer<BITS> bucket;
    bucket.setup(table, boundaries);
    load_centroid_squares<S::LEVELS>(s_csq, centroids, norm_correction != 0);
    __syncthreads();
    float* smem = reinterpret_cast<float*>(dense_smem);
    const fq::FastDiv un1{n1, n1_magic, n1_shift}, un2{n2, n2_magic, n2_shift};
    compress_dense_tiles<D, BITS, T>(x, sx0, sx1, sx2, un1, un2, static_cast<unsigned>(rows), rotation, bucket,
                                     bucket.slow(), norm_correction != 0, s_csq, smem, packed, norms);
}
