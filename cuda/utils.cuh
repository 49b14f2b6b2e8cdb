// Device helpers of the codec kernels (compress.cu, decompress.cu): header-only, device-only, everything
// __forceinline__. kernels/loader.py inlines it into each source before NVRTC sees the code (so a changed header
// changes CuPy's cache key). Nothing here is a kernel.
//
// Contents: fp16/bf16/fp32 <-> fp32 conversions on raw bits (no dependence on the operator overloads of
// cuda_fp16.h / cuda_bf16.h, which vary between CUDA versions), 16-byte vector loads/stores, warp and
// block reductions through shuffles, mma.sync wrappers for tensor cores, and the TurboQuant
// bit-stream primitives.
#ifndef FQ_UTILS_CUH
#define FQ_UTILS_CUH

#include "smem.cuh"

// The storage types __half / __nv_bfloat16 name the template arguments of the codec kernels. Take them from
// CUDA's headers when NVRTC (or nvcc) can see them; otherwise declare storage-only stand-ins so this
// header never fails to compile on a machine whose CuPy finds no CUDA include directory.
#if !defined(FQ_NO_CUDA_FP_HEADERS) && defined(__has_include)
#if __has_include(<cuda_fp16.h>) && __has_include(<cuda_bf16.h>)
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#define FQ_HAVE_CUDA_FP_HEADERS 1
#endif
#endif
#ifndef FQ_HAVE_CUDA_FP_HEADERS
struct alignas(2) __half { unsigned short storage; };
struct alignas(2) __nv_bfloat16 { unsigned short storage; };
#endif

namespace fq {

constexpr unsigned FULL_MASK = 0xffffffffu;

// ---------------------------------------------------------------------------------------------------
// Element types
// ---------------------------------------------------------------------------------------------------

template <typename T> struct DType;
template <> struct DType<float> { static constexpr int BYTES = 4; static constexpr bool IS_HALF = false; };
template <> struct DType<__half> { static constexpr int BYTES = 2; static constexpr bool IS_HALF = true; };
template <> struct DType<__nv_bfloat16> { static constexpr int BYTES = 2; static constexpr bool IS_HALF = false; };

// 16-bit pattern -> fp32 (exact for both 16-bit formats).
template <typename T> __device__ __forceinline__ float bits_to_float(unsigned bits16);
template <> __device__ __forceinline__ float bits_to_float<__nv_bfloat16>(unsigned bits16) {
    return __uint_as_float(bits16 << 16);
}
template <> __device__ __forceinline__ float bits_to_float<__half>(unsigned bits16) {
    float f;
    unsigned short h = static_cast<unsigned short>(bits16);
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// fp32 -> 16-bit pattern, round to nearest even (what torch's .to(dtype) does).
template <typename T> __device__ __forceinline__ unsigned float_to_bits(float f);
template <> __device__ __forceinline__ unsigned float_to_bits<__nv_bfloat16>(float f) {
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
template <> __device__ __forceinline__ unsigned float_to_bits<__half>(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// Two fp32 -> one 32-bit word holding two 16-bit values (lo in the low half), round to nearest even.
template <typename T> __device__ __forceinline__ unsigned pack2(float lo, float hi);
template <> __device__ __forceinline__ unsigned pack2<__nv_bfloat16>(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
template <> __device__ __forceinline__ unsigned pack2<__half>(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// Scalar conversions for code that holds a T value.
template <typename T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_float<__half>(__half v) {
    return bits_to_float<__half>(*reinterpret_cast<const unsigned short*>(&v));
}
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) {
    return bits_to_float<__nv_bfloat16>(*reinterpret_cast<const unsigned short*>(&v));
}

template <typename T> __device__ __forceinline__ T from_float(float f);
template <> __device__ __forceinline__ float from_float<float>(float f) { return f; }
template <> __device__ __forceinline__ __half from_float<__half>(float f) {
    unsigned short h = static_cast<unsigned short>(float_to_bits<__half>(f));
    return *reinterpret_cast<const __half*>(&h);
}
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float f) {
    unsigned short h = static_cast<unsigned short>(float_to_bits<__nv_bfloat16>(f));
    return *reinterpret_cast<const __nv_bfloat16*>(&h);
}

// ---------------------------------------------------------------------------------------------------
// Vector memory access. Pointers must be 16-byte aligned (callers check this in Python).
// ---------------------------------------------------------------------------------------------------

// uint4 from four words (make_uint4 lives in a header NVRTC may not see).
__device__ __forceinline__ uint4 u4(unsigned x, unsigned y, unsigned z, unsigned w) {
    uint4 r;
    r.x = x; r.y = y; r.z = z; r.w = w;
    return r;
}

__device__ __forceinline__ uint4 ld_v4(const void* p) { return *reinterpret_cast<const uint4*>(p); }

// Read-only path, no L1 allocation: for data streamed once (inputs of the codec kernels).
__device__ __forceinline__ uint4 ld_stream_v4(const void* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

__device__ __forceinline__ void st_v4(void* p, uint4 v) { *reinterpret_cast<uint4*>(p) = v; }

// Streaming store (evict-first): outputs that no later kernel of this launch reads.
__device__ __forceinline__ void st_stream_v4(void* p, uint4 v) {
    asm volatile("st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}

// Eight consecutive elements of T as raw 16-byte words: one for 16-bit types, two for fp32. Loading raw
// words first lets a kernel issue the loads of its next row before it converts the current one.
template <typename T>
struct Raw8 {
    static constexpr int WORDS = DType<T>::BYTES == 4 ? 2 : 1;
    uint4 w[WORDS];
};

template <typename T, bool STREAM = true>
__device__ __forceinline__ void load8_raw(const T* p, Raw8<T>& raw) {
#pragma unroll
    for (int i = 0; i < Raw8<T>::WORDS; ++i) raw.w[i] = STREAM ? ld_stream_v4(p + i * (16 / DType<T>::BYTES)) : ld_v4(p + i * (16 / DType<T>::BYTES));
}

template <typename T>
__device__ __forceinline__ void zero8_raw(Raw8<T>& raw) {
#pragma unroll
    for (int i = 0; i < Raw8<T>::WORDS; ++i) raw.w[i] = u4(0u, 0u, 0u, 0u);
}

template <typename T>
__device__ __forceinline__ void convert8(const Raw8<T>& raw, float (&out)[8]) {
    if constexpr (DType<T>::BYTES == 4) {
        out[0] = __uint_as_float(raw.w[0].x); out[1] = __uint_as_float(raw.w[0].y);
        out[2] = __uint_as_float(raw.w[0].z); out[3] = __uint_as_float(raw.w[0].w);
        out[4] = __uint_as_float(raw.w[1].x); out[5] = __uint_as_float(raw.w[1].y);
        out[6] = __uint_as_float(raw.w[1].z); out[7] = __uint_as_float(raw.w[1].w);
    } else {
        const unsigned w[4] = {raw.w[0].x, raw.w[0].y, raw.w[0].z, raw.w[0].w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            out[2 * i] = bits_to_float<T>(w[i] & 0xffffu);
            out[2 * i + 1] = bits_to_float<T>(w[i] >> 16);
        }
    }
}

// Eight consecutive elements -> fp32 (one 16-byte load for 16-bit types, two for fp32).
template <typename T, bool STREAM = true>
__device__ __forceinline__ void load8(const T* p, float (&out)[8]) {
    Raw8<T> raw;
    load8_raw<T, STREAM>(p, raw);
    convert8<T>(raw, out);
}

// fp32 x 8 -> eight consecutive elements of T (16-byte stores).
template <typename T, bool STREAM = true>
__device__ __forceinline__ void store8(T* p, const float (&v)[8]) {
    if constexpr (DType<T>::BYTES == 4) {
        const uint4 a = u4(__float_as_uint(v[0]), __float_as_uint(v[1]), __float_as_uint(v[2]), __float_as_uint(v[3]));
        const uint4 b = u4(__float_as_uint(v[4]), __float_as_uint(v[5]), __float_as_uint(v[6]), __float_as_uint(v[7]));
        if (STREAM) { st_stream_v4(p, a); st_stream_v4(p + 4, b); } else { st_v4(p, a); st_v4(p + 4, b); }
    } else {
        const uint4 a = u4(pack2<T>(v[0], v[1]), pack2<T>(v[2], v[3]), pack2<T>(v[4], v[5]), pack2<T>(v[6], v[7]));
        if (STREAM) st_stream_v4(p, a); else st_v4(p, a);
    }
}

// ---------------------------------------------------------------------------------------------------
// Reductions
// ---------------------------------------------------------------------------------------------------

// Sum over aligned groups of WIDTH consecutive lanes (WIDTH a power of two <= 32); every lane gets it.
template <int WIDTH = 32>
__device__ __forceinline__ float group_sum(float v) {
    static_assert(WIDTH >= 1 && WIDTH <= 32 && (WIDTH & (WIDTH - 1)) == 0, "WIDTH must be a power of two <= 32");
#pragma unroll
    for (int m = WIDTH / 2; m > 0; m >>= 1) v += __shfl_xor_sync(FULL_MASK, v, m);
    return v;
}

template <int WIDTH = 32>
__device__ __forceinline__ float group_max(float v) {
    static_assert(WIDTH >= 1 && WIDTH <= 32 && (WIDTH & (WIDTH - 1)) == 0, "WIDTH must be a power of two <= 32");
#pragma unroll
    for (int m = WIDTH / 2; m > 0; m >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, m));
    return v;
}

__device__ __forceinline__ float warp_sum(float v) { return group_sum<32>(v); }
__device__ __forceinline__ float warp_max(float v) { return group_max<32>(v); }

// Block-wide sum; every thread gets it. `scratch` holds >= 32 floats of shared memory. Contains two
// __syncthreads, so every thread of the block must call it.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : 0.f;
    v = warp_sum(v);
    __syncthreads();
    return v;
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : __int_as_float(0xff800000);  // -inf
    v = warp_max(v);
    __syncthreads();
    return v;
}

// ---------------------------------------------------------------------------------------------------
// Tensor cores (sm_80+): mma.sync m16n8k16 with fp32 accumulation.
// Fragment layouts are the PTX ISA's ("Matrix Fragments for mma.m16n8k16"): A row-major 16x16 in four
// 32-bit registers of two 16-bit values, B column-major 16x8 in two, C/D 16x8 fp32 in four.
// ---------------------------------------------------------------------------------------------------

// mma for the element type T (__half or __nv_bfloat16); FQ_MMA_M16N8K16 writes the instruction for one PTX type.
#define FQ_MMA_M16N8K16(AB)                                                                                     \
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." AB "." AB ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, " \
                 "{%8, %9}, {%10, %11, %12, %13};"                                                               \
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])                                                \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]),       \
                   "f"(c[2]), "f"(c[3]))
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                                             const float (&c)[4]) {
    static_assert(DType<T>::BYTES == 2, "mma_m16n8k16 takes __half or __nv_bfloat16");
    if constexpr (DType<T>::IS_HALF) FQ_MMA_M16N8K16("f16"); else FQ_MMA_M16N8K16("bf16");
}
#undef FQ_MMA_M16N8K16

// ---------------------------------------------------------------------------------------------------
// Small integer helpers
// ---------------------------------------------------------------------------------------------------

// Reverse the byte order of a 32-bit word: turns an MSB-first bit stream held in a register into the
// little-endian word that stores those bytes in stream order.
__device__ __forceinline__ unsigned byteswap32(unsigned v) { return __byte_perm(v, 0u, 0x0123); }

__host__ __device__ constexpr int ilog2(int v) { return v <= 1 ? 0 : 1 + ilog2(v / 2); }


// ---------------------------------------------------------------------------------------------------
// TurboQuant codec primitives (docs/ARCHITECTURE.md): the packed indices of one vector form an MSB-first
// bit stream. Eight consecutive coordinates ("a chunk") occupy exactly BITS bytes, so chunk c of a row
// starts at byte c * BITS. A chunk is handled as an 8*BITS-bit "stream" value whose most significant bits
// are coordinate 0.
// ---------------------------------------------------------------------------------------------------

// Append one index to a chunk stream (call 8 times, coordinate 0 first).
template <int BITS>
__device__ __forceinline__ unsigned stream_push(unsigned stream, int idx) {
    return (stream << BITS) | static_cast<unsigned>(idx);
}

// Index of coordinate j (0..7) of a chunk stream.
template <int BITS>
__device__ __forceinline__ int stream_index(unsigned stream, int j) {
    return static_cast<int>((stream >> ((7 - j) * BITS)) & ((1u << BITS) - 1u));
}

// Store the BITS bytes of a chunk stream at p, stream order. Alignment: 4 bytes for BITS == 4, 2 bytes
// for BITS == 2 (true for every chunk of a row whose byte offset has that alignment).
template <int BITS>
__device__ __forceinline__ void store_chunk(unsigned char* p, unsigned stream) {
    static_assert(BITS >= 1 && BITS <= 4, "BITS must be 1..4");
    if constexpr (BITS == 4) {
        *reinterpret_cast<unsigned*>(p) = byteswap32(stream);
    } else if constexpr (BITS == 2) {
        *reinterpret_cast<unsigned short*>(p) = static_cast<unsigned short>(((stream >> 8) | (stream << 8)) & 0xffffu);
    } else if constexpr (BITS == 3) {
        p[0] = static_cast<unsigned char>(stream >> 16);
        p[1] = static_cast<unsigned char>(stream >> 8);
        p[2] = static_cast<unsigned char>(stream);
    } else {
        p[0] = static_cast<unsigned char>(stream);
    }
}

// Inverse of store_chunk.
template <int BITS>
__device__ __forceinline__ unsigned load_chunk(const unsigned char* p) {
    static_assert(BITS >= 1 && BITS <= 4, "BITS must be 1..4");
    if constexpr (BITS == 4) {
        return byteswap32(*reinterpret_cast<const unsigned*>(p));
    } else if constexpr (BITS == 2) {
        const unsigned v = *reinterpret_cast<const unsigned short*>(p);
        return ((v & 0xffu) << 8) | (v >> 8);
    } else if constexpr (BITS == 3) {
        return (static_cast<unsigned>(p[0]) << 16) | (static_cast<unsigned>(p[1]) << 8) | p[2];
    } else {
        return p[0];
    }
}

// Division by a run-time divisor d (1 <= d < 2^31) as a multiply-high, add and shift (the magic
// numbers come from the host, see flashquant_hf/kernels/compress.py::fast_divider); exact for n < 2^31.
struct FastDiv {
    unsigned d, magic, shift;
    __device__ __forceinline__ unsigned div(unsigned n) const { return (__umulhi(n, magic) + n) >> shift; }
};

// Row r of a tensor whose leading dimensions were collapsed (in Python) to [n0, n1, n2]; n0 is implied by
// the row count. Offsets use per-tensor element strides (s0, s1, s2).
struct RowIndex3 {
    unsigned i0, i1, i2;
};

__device__ __forceinline__ RowIndex3 split_row(unsigned r, FastDiv n1, FastDiv n2) {
    const unsigned q = n2.div(r);
    const unsigned i0 = n1.div(q);
    return RowIndex3{i0, q - i0 * n1.d, r - q * n2.d};
}

__device__ __forceinline__ long long row_offset(RowIndex3 i, long long s0, long long s1, long long s2) {
    return static_cast<long long>(i.i0) * s0 + static_cast<long long>(i.i1) * s1 + static_cast<long long>(i.i2) * s2;
}

// Unnormalised fast Walsh-Hadamard transform (Sylvester order, H[i][j] = (-1)^popcount(i & j)) of one
// vector of E * LANES coordinates spread over LANES consecutive, aligned lanes. Lane t of the group holds
// coordinate (v * LANES + t) * 8 + j in y[v * 8 + j]: the butterflies over the j and v bits run in
// registers, those over the t bits through shuffles. Every lane of the warp must call it.
template <int LANES, int E>
__device__ __forceinline__ void fwht_distributed(float (&y)[E], int t) {
    static_assert((E & (E - 1)) == 0 && E >= 8, "E must be a power of two >= 8");
    static_assert((LANES & (LANES - 1)) == 0 && LANES <= 32, "LANES must be a power of two <= 32");
#pragma unroll
    for (int h = 1; h < E; h <<= 1) {
#pragma unroll
        for (int e = 0; e < E; ++e) {
            if ((e & h) == 0) {
                const float a = y[e], b = y[e + h];
                y[e] = a + b;
                y[e + h] = a - b;
            }
        }
    }
#pragma unroll
    for (int m = 1; m < LANES; m <<= 1) {
        // The lane whose bit is clear holds a, its partner b: it keeps a + b, the partner a - b.
        const float sign = (t & m) ? -1.f : 1.f;
#pragma unroll
        for (int e = 0; e < E; ++e) {
            const float other = __shfl_xor_sync(FULL_MASK, y[e], m);
            y[e] = fmaf(sign, y[e], other);
        }
    }
}

// The Hadamard signs of the coordinates fwht_distributed puts in lane t's y (V chunks of 8): bit v * 8 + j is set
// where the sign of coordinate (v * LANES + t) * 8 + j is negative.
template <int V, int LANES>
__device__ __forceinline__ unsigned negative_sign_bits(const float* __restrict__ signs, int t) {
    unsigned neg = 0;
#pragma unroll
    for (int v = 0; v < V; ++v)
#pragma unroll
        for (int j = 0; j < 8; ++j)
            neg |= (__ldg(signs + (v * LANES + t) * 8 + j) < 0.f ? 1u : 0u) << (v * 8 + j);
    return neg;
}

}  // namespace fq

#endif  // FQ_UTILS_CUH
