// TurboQuant decompression: unpack + centroid lookup + norm scale, coalesced 16-byte stores.
//
//   tq_dequantize_rotated<D, BITS, TOUT>: y = norm * centroids[idx] in rotated space (what the attention
//       kernels read; reference/decompress.py::dequantize_rotated).
//   tq_decompress_hadamard<D, BITS, TOUT>: the same followed by the inverse rotation of Pi = H diag(s)/sqrt(D),
//       fused as an in-register/shuffle fast Walsh-Hadamard transform: x = s * FWHT(y) / sqrt(D).
// A dense (Haar) rotation is applied by the wrapper with one fp32 GEMM on the rotated-space output.
//
// LANES consecutive threads share a row; lane t owns chunks v * LANES + t (8 coordinates each), so each
// store instruction of a warp writes LANES * 16 contiguous bytes per row (LANES * 32 for fp32), whole
// sectors. Each thread issues the loads of its next row before it works on the current one. The packed
// and norm inputs may be strided views (the cache's [:, :, :N]): rows are addressed through collapsed
// leading dimensions [n0, n1, n2] with separate element strides for packed and norms. Output is contiguous.
//
// Build switches: none (the wrapper, kernels/decompress.py, compiles every instantiation without options).
#include "utils.cuh"

namespace fq_decompress {

template <int D, int BITS>
struct Shape {
    static_assert(D == 64 || D == 128 || D == 256, "head_dim must be 64, 128 or 256");
    static_assert(BITS >= 2 && BITS <= 4, "bits must be 2, 3 or 4");
    static constexpr int THREADS = 256;
    static constexpr int LEVELS = 1 << BITS;
    static constexpr int PACKED = D * BITS / 8;
    static constexpr int LANES = D / 16;  // lanes per row: 16 coordinates per thread, as in the compress kernel
    static constexpr int V = (D / 8) / LANES;
    static constexpr int E = V * 8;
    static constexpr int ROWS_PER_CTA = THREADS / LANES;
    static constexpr float INV_SQRT_D = D == 64 ? 0.125f : D == 128 ? 0.08838834764831845f : 0.0625f;
    static_assert(LANES >= 1 && LANES <= 32 && V >= 1 && V * LANES * 8 == D, "bad lane count for this head_dim");
    static_assert(E <= 32, "the sign mask holds one bit per coordinate of a thread");
};

// One row's inputs held by one thread: its chunk streams and the row's norm (loaded one row ahead).
template <int V>
struct RowIn {
    unsigned streams[V];
    float norm;
};

template <int D, int BITS>
__device__ __forceinline__ void load_row(const unsigned char* __restrict__ packed, long long sp0, long long sp1,
                                         long long sp2, const float* __restrict__ norms, long long sn0, long long sn1,
                                         long long sn2, fq::FastDiv n1, fq::FastDiv n2, unsigned rows, unsigned r,
                                         int t, RowIn<Shape<D, BITS>::V>& in) {
    using S = Shape<D, BITS>;
    if (r < rows) {
        const fq::RowIndex3 ri = fq::split_row(r, n1, n2);
        const unsigned char* src = packed + fq::row_offset(ri, sp0, sp1, sp2);
        in.norm = __ldg(norms + fq::row_offset(ri, sn0, sn1, sn2));
#pragma unroll
        for (int v = 0; v < S::V; ++v) in.streams[v] = fq::load_chunk<BITS>(src + (v * S::LANES + t) * BITS);
    } else {
        in.norm = 0.f;
#pragma unroll
        for (int v = 0; v < S::V; ++v) in.streams[v] = 0u;
    }
}

template <int D, int BITS, typename TOUT, bool HADAMARD>
__device__ __forceinline__ void decompress_rows(
    const unsigned char* __restrict__ packed, long long sp0, long long sp1, long long sp2,
    const float* __restrict__ norms, long long sn0, long long sn1, long long sn2, fq::FastDiv n1, fq::FastDiv n2,
    unsigned rows, const float* __restrict__ centroids, const float* __restrict__ signs, TOUT* __restrict__ out) {
    using S = Shape<D, BITS>;
    __shared__ float s_c[S::LEVELS];
    if (threadIdx.x < S::LEVELS) s_c[threadIdx.x] = centroids[threadIdx.x];
    const int t = threadIdx.x % S::LANES;
    const unsigned slot = threadIdx.x / S::LANES;
    unsigned neg = 0;  // bit e: the Hadamard sign of this thread's coordinate e is negative
    if constexpr (HADAMARD) neg = fq::negative_sign_bits<S::V, S::LANES>(signs, t);
    __syncthreads();

    unsigned g = blockIdx.x;
    if (static_cast<unsigned long long>(g) * S::ROWS_PER_CTA >= rows) return;
    RowIn<S::V> cur;
    load_row<D, BITS>(packed, sp0, sp1, sp2, norms, sn0, sn1, sn2, n1, n2, rows, g * S::ROWS_PER_CTA + slot, t, cur);
    while (true) {
        const unsigned gn = g + gridDim.x;
        const bool has_next = static_cast<unsigned long long>(gn) * S::ROWS_PER_CTA < rows;  // uniform
        RowIn<S::V> nxt;
        if (has_next)
            load_row<D, BITS>(packed, sp0, sp1, sp2, norms, sn0, sn1, sn2, n1, n2, rows, gn * S::ROWS_PER_CTA + slot, t, nxt);

        const unsigned r = g * S::ROWS_PER_CTA + slot;
        // Rows past the end computed zeros; the Hadamard variant still needs every lane for its shuffles.
        float y[S::E];
#pragma unroll
        for (int v = 0; v < S::V; ++v)
#pragma unroll
            for (int j = 0; j < 8; ++j) y[v * 8 + j] = s_c[fq::stream_index<BITS>(cur.streams[v], j)] * cur.norm;
        if constexpr (HADAMARD) {
            fq::fwht_distributed<S::LANES>(y, t);
#pragma unroll
            for (int e = 0; e < S::E; ++e) {
                const float v = y[e] * S::INV_SQRT_D;
                y[e] = __int_as_float(__float_as_int(v) ^ static_cast<int>((neg << (31 - e)) & 0x80000000u));
            }
        }
        if (r < rows) {
            TOUT* dst = out + static_cast<long long>(r) * D;
#pragma unroll
            for (int v = 0; v < S::V; ++v) {
                float chunk[8];
#pragma unroll
                for (int j = 0; j < 8; ++j) chunk[j] = y[v * 8 + j];
                fq::store8<TOUT>(dst + (v * S::LANES + t) * 8, chunk);
            }
        }

        if (!has_next) break;
        cur = nxt;
        g = gn;
    }
}

}  // namespace fq_decompress

// The arguments both kernels take first, in the order kernels/decompress.py passes them (the Hadamard kernel then
// takes the signs, both the output last).
#define FQ_DECOMPRESS_ARGS                                                                                      \
    const unsigned char* __restrict__ packed, const long long sp0, const long long sp1, const long long sp2,    \
        const float* __restrict__ norms, const long long sn0, const long long sn1, const long long sn2,         \
        const unsigned n1, const unsigned n1_magic, const unsigned n1_shift, const unsigned n2,                 \
        const unsigned n2_magic, const unsigned n2_shift, const int rows, const float* __restrict__ centroids

template <int D, int BITS, typename TOUT>
__global__ void __launch_bounds__(256) tq_dequantize_rotated(FQ_DECOMPRESS_ARGS, TOUT* __restrict__ out) {
    fq_decompress::decompress_rows<D, BITS, TOUT, false>(
        packed, sp0, sp1, sp2, norms, sn0, sn1, sn2, fq::FastDiv{n1, n1_magic, n1_shift},
        fq::FastDiv{n2, n2_magic, n2_shift}, static_cast<unsigned>(rows), centroids, nullptr, out);
}

template <int D, int BITS, typename TOUT>
__global__ void __launch_bounds__(256)
tq_decompress_hadamard(FQ_DECOMPRESS_ARGS, const float* __restrict__ signs, TOUT* __restrict__ out) {
    fq_decompress::decompress_rows<D, BITS, TOUT, true>(
        packed, sp0, sp1, sp2, norms, sn0, sn1, sn2, fq::FastDiv{n1, n1_magic, n1_shift},
        fq::FastDiv{n2, n2_magic, n2_shift}, static_cast<unsigned>(rows), centroids, signs, out);
}

#undef FQ_DECOMPRESS_ARGS
