// Fused TurboQuant compression, one launch: norm + rotation + bucketize + MSB-first bit packing.
//
//   tq_compress_hadamard<D, BITS, T>: Pi = H diag(s) / sqrt(D). fp16/bf16 at D = 64, 128: on tensor cores
//       (exact +-1 products, fp32 accumulation) plus a 4- or 8-point transform in registers; otherwise a
//       fast Walsh-Hadamard transform in registers and warp shuffles (D log D adds instead of D^2 FMAs).
//   tq_compress_dense<D, BITS, T>: any dense fp32 rotation (Haar), a CUDA-core GEMM against a shared-
//       memory copy of Pi with 4 rows x 8 columns of register blocking per thread.
//
// Both compute in fp32 and give, per coordinate, idx = #{k : boundaries[k] <= y} (torch.bucketize with
// right=True). They differ from the PyTorch reference only where a rotated value lies within rounding
// (~1e-7) of a boundary. Output: packed [.., D*BITS/8] uint8 and norms [..] fp32.
// Input rows are addressed through collapsed leading dimensions [n0, n1, n2] with element strides; the last
// dimension is contiguous and every row starts 16-byte aligned (the wrapper guarantees it). Output rows are
// runs of consecutive rows a fixed number of rows apart (OutRows), from a first row read from device memory
// (`out_start`, null for 0): a launch writes a block of rows of every head straight into a larger store. The
// store's rows lie a run-time pitch apart (`packed_pitch` bytes, `norm_pitch` floats): a contiguous output, or rows
// that hold their codes and fp32 norm side by side (pitch PACKED + 4 bytes). The wrapper guarantees a packed pitch
// and base that are multiples of 4 bytes, so the 2- and 4-byte chunk stores stay aligned.
//
// Build switches: none (the wrapper, kernels/compress.py, compiles every instantiation without options).
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
//
// A second, full-range table serves kernels that know |y| <= 1 (a coordinate of a rotated unit vector, up
// to rounding): its map is one FMA, fcell(y) = bits(fma(y, fa, fc)) - MAGIC_BITS, without saturation, over
// [-FULL_RANGE, FULL_RANGE] in cells of 0.75 x the smallest gap. `full_ok` says whether it is exact (every
// cell holds at most one boundary, all boundaries inside the range, at most NFULL cells); the caller must
// only pass |y| <= FULL_RANGE (anything else may address outside the table).
struct TableSmem {
    static constexpr int NCELL = 64;
    static constexpr int NFULL = 256;
    float thr[NCELL];
    int base[NCELL];
    // Full-range map as split arrays, fbase exactly NFULL * 4 bytes after fthr: two conflict-free 4-byte loads
    // from one address ({thr, base} pairs would take one 8-byte load, but lanes whose cells are 16 apart would hit
    // the same banks).
    float fthr[NFULL];
    int fbase[NFULL];
    float bnd[16];
    int bcell[16];
    int fcell[16];
    float a, c, fa, fc;
    int slow, full_ok;
    unsigned full_addr_bias;  // see TableBucketizer
};

// stream * 16 + base + (y >= thr): a shift-add and a predicated increment.
__device__ __forceinline__ unsigned push_cell(unsigned stream, int base, float y, float thr) {
    stream = (stream << 4) + static_cast<unsigned>(base);
    asm("{ .reg .pred p; setp.ge.f32 p, %1, %2; @p add.u32 %0, %0, 1; }" : "+r"(stream) : "f"(y), "f"(thr));
    return stream;
}

// {thr, base} of a full-range cell at the shared-memory byte address of fthr[cell]; volatile keeps it after the
// __syncthreads that publishes the table (the compiler cannot see that the asm reads it).
__device__ __forceinline__ void load_full_cell(unsigned addr, float& thr, int& base) {
    asm volatile("ld.shared.f32 %0, [%2];\n\tld.shared.b32 %1, [%2+%3];"
                 : "=f"(thr), "=r"(base) : "r"(addr), "n"(TableSmem::NFULL * 4));
}

template <int NB>
struct TableBucketizer {
    static constexpr int NCELL = TableSmem::NCELL;
    static constexpr int NFULL = TableSmem::NFULL;
    static constexpr float FULL_RANGE = 1.0625f;
    // 1.5 * 2^23: adding it rounds a value in [0, 2^22) to an integer held in the low mantissa bits; the
    // float's bit pattern is then MAGIC_BITS + that integer.
    static constexpr float MAGIC = 12582912.0f;
    static constexpr unsigned MAGIC_BITS = 0x4B400000u;
    static constexpr int FULL_SHIFT = 2;  // log2 of the full-range entry stride (4-byte fthr entries)
    const TableSmem* s;
    float a, c, fa, fc;
    // Shared-memory byte address of fthr[0] minus MAGIC_BITS << FULL_SHIFT (mod 2^32):
    // adding (bits << FULL_SHIFT) of the rounded float gives the cell's address in one shift-add, without
    // masking off the exponent.
    unsigned full_addr_bias;

    __device__ __forceinline__ float cell_float(float y) const {
        const float u = __saturatef(__fmaf_rn(y, a, c));
        return __fmaf_rn(u, static_cast<float>(NCELL - 1), MAGIC);
    }

    __device__ __forceinline__ int cell(float y) const { return __float_as_int(cell_float(y)) & (NCELL - 1); }

    __device__ __forceinline__ int full_cell(float y) const {
        return static_cast<int>(__float_as_uint(__fmaf_rn(y, fa, fc)) - MAGIC_BITS);
    }

    template <bool SLOW>
    __device__ __forceinline__ int index(float y) const {
        if constexpr (!SLOW) {
            const int k = cell(y);
            return s->base[k] + (y >= s->thr[k] ? 1 : 0);
        } else {
            const int k = cell(y);
            int i = s->base[k];
            while (i < NB && y >= s->bnd[i]) ++i;
            return i;
        }
    }

    // stream_push<4>(stream, index(y)). MODE 0: full-range table (|y| <= FULL_RANGE and full_ok required);
    // 1: saturating table (requires !slow); 2: exact scan.
    template <int MODE>
    __device__ __forceinline__ unsigned push(unsigned stream, float y) const {
        if constexpr (MODE == 0) {
            float thr;
            int base;
            load_full_cell((__float_as_uint(__fmaf_rn(y, fa, fc)) << FULL_SHIFT) + full_addr_bias, thr, base);
            return push_cell(stream, base, y, thr);
        } else {
            return (stream << 4) + static_cast<unsigned>(index<MODE == 2>(y));
        }
    }

    // The boundaries of one cell of a table, given every boundary's cell (`cells` [NB]): how many lie below it, how
    // many inside it, and the first inside it (+inf when none).
    struct CellCount {
        int below, inside;
        float first;
    };
    __device__ __forceinline__ static CellCount count_cell(const int* cells, const float* bnd, int cell_id) {
        CellCount n{0, 0, __int_as_float(0x7f800000)};
        for (int k = 0; k < NB; ++k) {
            const int bc = cells[k];
            n.below += bc < cell_id ? 1 : 0;
            if (bc == cell_id) {
                if (n.inside == 0) n.first = bnd[k];
                ++n.inside;
            }
        }
        return n;
    }

    // Collective: every thread of the block calls it (contains __syncthreads); needs >= NCELL threads. FULL:
    // also build the full-range table (only the tensor-core kernel reads it; the others skip its code).
    template <bool FULL>
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
        if (FULL && tid == 0) {
            const float lo = sm.bnd[0], hi = sm.bnd[NB - 1];
            float gap = hi - lo;
            for (int k = 0; k + 1 < NB; ++k) gap = fminf(gap, sm.bnd[k + 1] - sm.bnd[k]);
            // Full-range map: cells of 0.75 x the smallest gap over [-FULL_RANGE, FULL_RANGE].
            const float fw = 0.75f * gap;
            const bool fits = fw > 0.f && lo > -FULL_RANGE && hi < FULL_RANGE &&
                              2.f * FULL_RANGE / fw + 4.f < static_cast<float>(NFULL);
            sm.fa = fits ? 1.f / fw : 0.f;
            sm.fc = MAGIC + (fits ? FULL_RANGE / fw + 1.f : 0.f);
            sm.full_ok = fits ? 1 : 0;
            // Read back after the barrier: values the compiler cannot fold, so it keeps one shift-add (LEA)
            // per lookup instead of splitting the constant off into a separate add.
            sm.full_addr_bias = smem_addr(&sm.fthr[0]) - (MAGIC_BITS << FULL_SHIFT);
        }
        __syncthreads();
        a = sm.a;
        c = sm.c;
        s = &sm;
        if (FULL) {
            fa = sm.fa;
            fc = sm.fc;
        }
        if (tid < NB) {
            sm.bcell[tid] = cell(sm.bnd[tid]);
            if (FULL) sm.fcell[tid] = full_cell(sm.bnd[tid]);
        }
        __syncthreads();
        if (tid < NCELL) {
            const CellCount n = count_cell(sm.bcell, sm.bnd, tid);
            sm.base[tid] = n.below;
            sm.thr[tid] = n.first;
            if (n.inside > 1) sm.slow = 1;
        }
        for (int cellk = tid; FULL && cellk < NFULL; cellk += blockDim.x) {
            const CellCount n = count_cell(sm.fcell, sm.bnd, cellk);
            sm.fthr[cellk] = n.first;
            sm.fbase[cellk] = n.below;
            if (n.inside > 1) sm.full_ok = 0;
        }
        __syncthreads();
        if (FULL) full_addr_bias = *static_cast<volatile unsigned*>(&sm.full_addr_bias);
    }
};

// One interface over both: setup() is collective; slow() is uniform over the block.
template <int BITS>
struct Bucketizer {
    static constexpr int NB = (1 << BITS) - 1;
    RegisterBucketizer<BITS> reg;
    template <bool FULL = false>
    __device__ __forceinline__ void setup(TableSmem&, const float* __restrict__ boundaries) { reg.load(boundaries); }
    __device__ __forceinline__ bool slow() const { return false; }
    __device__ __forceinline__ bool full_ok() const { return true; }
    template <bool SLOW>
    __device__ __forceinline__ int index(float y) const { return reg(y); }
    __device__ __forceinline__ int index(float y, bool) const { return reg(y); }
    template <int MODE>
    __device__ __forceinline__ unsigned push(unsigned stream, float y) const {
        return (stream << BITS) + static_cast<unsigned>(reg(y));
    }
};

template <>
struct Bucketizer<4> {
    static constexpr int NB = 15;
    TableBucketizer<15> table;
    template <bool FULL = false>
    __device__ __forceinline__ void setup(TableSmem& sm, const float* __restrict__ boundaries) {
        table.template build<FULL>(sm, boundaries);
    }
    __device__ __forceinline__ bool slow() const { return table.s->slow != 0; }
    __device__ __forceinline__ bool full_ok() const { return table.s->full_ok != 0; }
    template <bool SLOW>
    __device__ __forceinline__ int index(float y) const { return table.index<SLOW>(y); }
    // Run-time choice, for kernels whose time goes elsewhere (the dense GEMM).
    __device__ __forceinline__ int index(float y, bool slow) const {
        return slow ? table.index<true>(y) : table.index<false>(y);
    }
    template <int MODE>
    __device__ __forceinline__ unsigned push(unsigned stream, float y) const { return table.push<MODE>(stream, y); }
};

// -------------------------------------------------------------------------------------------------
// Shared pieces
// -------------------------------------------------------------------------------------------------

// Where input row r's outputs go, counted in rows from the launch's first output row: packed + row(r) *
// packed_pitch, norms + row(r) * norm_pitch. The rows form runs of `run.d` consecutive rows (the tokens of one head),
// `run_stride` rows apart (the store's capacity per head); a contiguous output is one run. One multiply-high
// division per row, and one multiply per output pointer.
struct OutRows {
    fq::FastDiv run;
    long long run_stride;
    long long packed_pitch;  // bytes between consecutive store rows
    long long norm_pitch;    // floats between consecutive norms
    __device__ __forceinline__ long long row(unsigned r) const {
        const unsigned k = run.div(r);
        return static_cast<long long>(k) * run_stride + (r - k * run.d);
    }
    __device__ __forceinline__ unsigned char* packed_row(unsigned char* packed, long long orow) const {
        return packed + orow * packed_pitch;
    }
    __device__ __forceinline__ float* norm_at(float* norms, long long orow) const { return norms + orow * norm_pitch; }
};

// The first output row, read from device memory (null: 0), and whether the launch writes: a start outside
// [0, max_start] writes nothing (a captured graph replays the launch with whatever its counter holds).
__device__ __forceinline__ bool output_start(const long long* start_ptr, long long max_start, long long& start) {
    start = start_ptr != nullptr ? *start_ptr : 0;
    return start >= 0 && start <= max_start;
}

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

// Lanes per row of the FWHT kernels: each thread holds E = D / LANES coordinates. Fewer lanes mean fewer
// shuffle stages (the kernel is issue-bound) but more registers: at D = 128, bf16, TQ4 on the H200, 4 lanes reach
// 0.545 of the copy bandwidth (~128 registers), 8 lanes 0.494 (64), 16 lanes 0.418 (40). So E = 16, except 16-bit
// inputs at D = 128 (E = 32; fp32 input would need 183 registers there).
template <int D, typename T>
__host__ __device__ constexpr int hadamard_lanes() {
    constexpr int lanes128 = fq::DType<T>::BYTES == 2 ? 4 : 8;
    return D == 64 ? 4 : D == 128 ? lanes128 : 16;
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
    unsigned rows, const Bucketizer<BITS>& bucket, unsigned neg, const float* s_csq, const OutRows& out_rows,
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
        const long long orow = out_rows.row(r);
        unsigned char* out = out_rows.packed_row(packed, orow);
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
        if (valid && t == 0) *out_rows.norm_at(norms, orow) = stored_norm(n, csq, NC);

        if (!has_next) break;
        cur = nxt;
        g = gn;
    }
}

// -------------------------------------------------------------------------------------------------
// Hadamard path on tensor cores (16-bit inputs, D = 64 or 128)
//
// With T = bf16/fp16, y_raw = H diag(s) x is computed with tensor-core products that are all exact: the
// operands are the 16-bit inputs (sign-flipped, exact) and +-1, and the mma accumulates in fp32, so only
// fp32 additions round (docs/kernels_codec.md bounds the error). H factors over bit positions of the
// coordinate index, H[n][k] = (-1)^popcount(n & k) = (-1)^popcount(n_A & k_A) * (-1)^popcount(n_B & k_B):
//   A bits {0, 2, 3, 4}: a 16-point transform, one m16n8k16 mma (k = 16) per k-block and half of the outputs;
//   B bits {1, 5} (+ {6} when D = 128): a KB-point transform (KB = D / 16) in registers, 2-3 FADD stages.
// A warp owns a tile of 8 rows; lane (g = lane / 4, t = lane % 4) loads row g's 16-byte chunks t + 4i
// (i < D / 32; each load instruction covers whole 32-byte sectors). Such a chunk {x, y, z, w} (words of
// two coordinates) is used unchanged as the A fragment {a0, a1, a2, a3} of mma i: mma rows g and g + 8 are
// two k-blocks of the same data row (coordinate bit 1 = 0: words x, z; bit 1 = 1: words y, w), and within
// a k-block mma index kk = bit 0 | bits 3-4 (= t) << 1 | bit 2 << 3. So the fragments need no register
// moves, and both k-blocks use the same B: H_16 in this bit order (+-1, 4 registers per thread). The
// Hadamard signs are applied to the raw 16-bit words (one XOR per two coordinates).
// Output: accumulator column nn of half h is coordinate bits 0 = nn & 1, 2 = h, 3-4 = nn >> 1 (= t). After
// the KB-point transform over (mma row half, i), thread t holds exactly the chunks t + 4i of row g it
// loaded: position j = e + 2 * (row half) + 4h. Norms: sum of y_raw^2 over the row (= D ||x||^2).
// -------------------------------------------------------------------------------------------------

// Rows per warp and iteration (one 8-row sub-tile), threads per CTA and the warps to keep per SM, which cap the
// registers at 65536 / (32 * warps) per thread.
constexpr int MMA_ROWS = 8;
constexpr int MMA_THREADS = 128;
constexpr int MMA_WARPS_PER_SM = 16;

template <int D, typename T>
__host__ __device__ constexpr bool hadamard_mma() {
    return (D == 64 || D == 128) && fq::DType<T>::BYTES == 2;
}

template <int D, typename T>
struct HadamardLaunch {
    static constexpr bool MMA = hadamard_mma<D, T>();
    static constexpr int THREADS = MMA ? MMA_THREADS : 256;
    static constexpr int MIN_BLOCKS = MMA ? (MMA_WARPS_PER_SM * 32 + THREADS - 1) / THREADS : 0;
};

template <int D, int BITS>
struct MmaShape : CodecShape<D, BITS> {
    static constexpr int NI = D / 32;  // chunks per lane and row: t + 4i
    static constexpr int KB = D / 16;  // k-blocks = values of the B bits: (mma row half) + 2i
    static constexpr int SUB = MMA_ROWS / 8;  // 8-row sub-tiles per iteration
    static constexpr float SQRT_D = D == 64 ? 8.f : 11.313708498984761f;
    static constexpr float INV_D = 1.f / D;
    static_assert(D == 64 || D == 128, "tensor-core Hadamard path: D = 64 or 128");
};

// Raw input of one iteration held by one lane: [sub-tile][i], row = tile * ROWS + 8 * sub + g.
template <int SUB, int NI>
struct TileRaw {
    uint4 c[SUB][NI];
};

template <int D, int BITS, typename T>
__device__ __forceinline__ void load_tile_raw(const T* __restrict__ x, long long sx0, long long sx1, long long sx2,
                                              fq::FastDiv n1, fq::FastDiv n2, unsigned rows, unsigned r0, int g,
                                              int t, TileRaw<MmaShape<D, BITS>::SUB, MmaShape<D, BITS>::NI>& raw) {
    using S = MmaShape<D, BITS>;
#pragma unroll
    for (int u = 0; u < S::SUB; ++u) {
        // Rows past the end re-read the last row (their results are not stored): no zero-fill selects.
        const unsigned r = r0 + 8 * u + g < rows ? r0 + 8 * u + g : rows - 1;
        const T* row = x + fq::row_offset(fq::split_row(r, n1, n2), sx0, sx1, sx2);
#pragma unroll
        for (int i = 0; i < S::NI; ++i) raw.c[u][i] = fq::ld_stream_v4(row + (t + 4 * i) * 8);
    }
}

// Coordinate bits of mma index kk (within a k-block) and of output column n16 = nn + 8h (see above).
__device__ __forceinline__ int mma_k_bits(int kk) { return (kk & 1) | (((kk >> 1) & 3) << 3) | ((kk >> 3) << 2); }
__device__ __forceinline__ int mma_n_bits(int n16) { return (n16 & 1) | (((n16 >> 1) & 3) << 3) | ((n16 >> 3) << 2); }

// B fragments of H_16 (in the bit order above) for output half h: b[h][0] holds kk = 2t, 2t + 1 of column
// nn = g, b[h][1] kk = 2t + 8, 2t + 9; +-1 as bf16 / fp16 bit patterns (low half = lower kk).
template <typename T>
__device__ __forceinline__ void hadamard16_b_fragments(int g, int t, unsigned (&b)[2][2]) {
    constexpr unsigned ONE = fq::DType<T>::IS_HALF ? 0x3C00u : 0x3F80u;
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            unsigned word = 0;
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const unsigned neg = __popc(mma_k_bits(2 * t + 8 * r + e) & mma_n_bits(g + 8 * h)) & 1u;
                word |= (ONE | (neg << 15)) << (16 * e);
            }
            b[h][r] = word;
        }
}

// Sign masks of this lane's input words: bit 15 / 31 set where s of the low / high coordinate is negative.
template <int D>
__device__ __forceinline__ void hadamard_sign_masks(const float* __restrict__ signs, int t, uint4 (&m)[D / 32]) {
#pragma unroll
    for (int i = 0; i < D / 32; ++i) {
        unsigned w[4];
#pragma unroll
        for (int wd = 0; wd < 4; ++wd) {
            const int c = (t + 4 * i) * 8 + 2 * wd;
            w[wd] = (__ldg(signs + c) < 0.f ? 0x8000u : 0u) | (__ldg(signs + c + 1) < 0.f ? 0x80000000u : 0u);
        }
        m[i] = fq::u4(w[0], w[1], w[2], w[3]);
    }
}

// Chunk streams of one lane's outputs: chunk t + 4i holds position j = e + 2 * (row half) + 4h.
template <int D, int BITS, bool NC, int MODE>
__device__ __forceinline__ void bucketize_subtile(const float (&acc)[D / 32][2][4], float scale,
                                                  const Bucketizer<BITS>& bucket, const float* s_csq,
                                                  unsigned (&st)[D / 32], float& csq) {
#pragma unroll
    for (int i = 0; i < D / 32; ++i) {
        unsigned v = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            v = bucket.template push<MODE>(v, acc[i][j >> 2][j & 3] * scale);
            if constexpr (NC) csq += s_csq[v & ((1u << BITS) - 1u)];
        }
        st[i] = v;
    }
}

// One 8-row sub-tile: transform, norms, bucketize, pack, store. MODE: see TableBucketizer::push (0 falls
// back to 2 for tiles with out-of-range norms).
template <int D, int BITS, typename T, bool NC, int MODE>
__device__ __forceinline__ void compress_mma_subtile(const uint4 (&raw)[D / 32], unsigned r, int t, unsigned rows,
                                                     const Bucketizer<BITS>& bucket, const unsigned (&bfrag)[2][2],
                                                     const uint4 (&smask)[D / 32], const float* s_csq,
                                                     const OutRows& out_rows, unsigned char* __restrict__ packed,
                                                     float* __restrict__ norms) {
    using S = MmaShape<D, BITS>;
    constexpr int NI = S::NI;
    // acc[i][h]: {row half 0 (bit 1 = 0): nn = 2t, 2t + 1; row half 1: nn = 2t, 2t + 1}.
    float acc[NI][2][4];
#pragma unroll
    for (int i = 0; i < NI; ++i) {
        const unsigned a[4] = {raw[i].x ^ smask[i].x, raw[i].y ^ smask[i].y, raw[i].z ^ smask[i].z,
                               raw[i].w ^ smask[i].w};
        const float zero[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int h = 0; h < 2; ++h) fq::mma_m16n8k16<T>(acc[i][h], a, bfrag[h], zero);
    }
    // KB-point Walsh-Hadamard transform over the B bits: bit 1 (row half: elements e vs 2 + e), then i.
#pragma unroll
    for (int i = 0; i < NI; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float u = acc[i][h][e], v = acc[i][h][2 + e];
                acc[i][h][e] = u + v;
                acc[i][h][2 + e] = u - v;
            }
#pragma unroll
    for (int m = 1; m < NI; m <<= 1)
#pragma unroll
        for (int i = 0; i < NI; ++i)
            if ((i & m) == 0)
#pragma unroll
                for (int h = 0; h < 2; ++h)
#pragma unroll
                    for (int k = 0; k < 4; ++k) {
                        const float u = acc[i][h][k], v = acc[i + m][h][k];
                        acc[i][h][k] = u + v;
                        acc[i + m][h][k] = u - v;
                    }
    // ||y_raw||^2 = D ||x||^2 over the 4 lanes of the row.
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < NI; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int k = 0; k < 4; ++k) ss = fmaf(acc[i][h][k], acc[i][h][k], ss);
    ss = fq::group_sum<4>(ss);
    const float n = sqrtf(ss * S::INV_D);
    const float scale = 1.f / (fmaxf(n, FLOAT_TINY) * S::SQRT_D);

    unsigned st[NI];
    float csq = 0.f;
    if constexpr (MODE == 0) {
        // The one-FMA full-range table needs |y| <= 1 (+ rounding): true unless ss over- or underflowed
        // (non-finite or huge inputs, or inputs whose squares flush to zero); such tiles take the exact scan.
        const bool ok = ss >= 1e-30f && ss <= 1e30f;
        if (__all_sync(fq::FULL_MASK, ok)) bucketize_subtile<D, BITS, NC, 0>(acc, scale, bucket, s_csq, st, csq);
        else bucketize_subtile<D, BITS, NC, 2>(acc, scale, bucket, s_csq, st, csq);
    } else {
        bucketize_subtile<D, BITS, NC, MODE>(acc, scale, bucket, s_csq, st, csq);
    }
    const bool valid = r < rows;
    const long long orow = out_rows.row(r);
    unsigned char* out = out_rows.packed_row(packed, orow);
    if (valid) {
#pragma unroll
        for (int i = 0; i < NI; ++i) fq::store_chunk<BITS>(out + (t + 4 * i) * BITS, st[i]);
    }
    if constexpr (NC) csq = fq::group_sum<4>(csq);
    if (valid && t == 0) *out_rows.norm_at(norms, orow) = stored_norm(n, csq, NC);
}

// Persistent loop over tiles of MMA_ROWS rows, one warp per tile. Two input buffers used alternately (no
// register copies between iterations); the loads of the next tile are issued before the current one is used.
template <int D, int BITS, typename T, bool NC, int MODE>
__device__ __forceinline__ void compress_mma_rows(
    const T* __restrict__ x, long long sx0, long long sx1, long long sx2, fq::FastDiv n1, fq::FastDiv n2,
    unsigned rows, const Bucketizer<BITS>& bucket, const unsigned (&bfrag)[2][2], const uint4 (&smask)[D / 32],
    const float* s_csq, const OutRows& out_rows, unsigned char* __restrict__ packed, float* __restrict__ norms) {
    using S = MmaShape<D, BITS>;
    constexpr int WARPS = HadamardLaunch<D, T>::THREADS / 32, ROWS = MMA_ROWS;
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const unsigned stride = gridDim.x * WARPS;
    unsigned tile = blockIdx.x * WARPS + threadIdx.x / 32;
    if (static_cast<unsigned long long>(tile) * ROWS >= rows) return;
    TileRaw<S::SUB, S::NI> buf0, buf1;
    load_tile_raw<D, BITS, T>(x, sx0, sx1, sx2, n1, n2, rows, tile * ROWS, g, t, buf0);
    // Compress the tile in `cur` after issuing the loads of the next one into `nxt`; false after the last tile.
    auto step = [&](const TileRaw<S::SUB, S::NI>& cur, TileRaw<S::SUB, S::NI>& nxt) {
        const unsigned next = tile + stride;
        const bool has_next = static_cast<unsigned long long>(next) * ROWS < rows;  // uniform over the warp
        if (has_next) load_tile_raw<D, BITS, T>(x, sx0, sx1, sx2, n1, n2, rows, next * ROWS, g, t, nxt);
#pragma unroll
        for (int u = 0; u < S::SUB; ++u)
            compress_mma_subtile<D, BITS, T, NC, MODE>(cur.c[u], tile * ROWS + 8 * u + g, t, rows, bucket, bfrag,
                                                       smask, s_csq, out_rows, packed, norms);
        tile = next;
        return has_next;
    };
    while (step(buf0, buf1) && step(buf1, buf0)) {
    }
}

}  // namespace fq_compress

// The arguments of both kernels, in the order kernels/compress.py passes them; ROTATION names the rotation input
// (the Hadamard signs, or the dense matrix).
#define FQ_COMPRESS_ARGS(ROTATION)                                                                                \
    const T* __restrict__ x, const long long sx0, const long long sx1, const long long sx2, const unsigned n1,    \
        const unsigned n1_magic, const unsigned n1_shift, const unsigned n2, const unsigned n2_magic,             \
        const unsigned n2_shift, const int rows, const float* __restrict__ ROTATION,                              \
        const float* __restrict__ boundaries, const float* __restrict__ centroids, const int norm_correction,     \
        unsigned char* __restrict__ packed, float* __restrict__ norms, const long long* __restrict__ out_start,   \
        const long long max_start, const unsigned run, const unsigned run_magic, const unsigned run_shift,        \
        const long long run_stride, const long long packed_pitch, const long long norm_pitch

template <int D, int BITS, typename T>
__global__ void __launch_bounds__(fq_compress::HadamardLaunch<D, T>::THREADS, fq_compress::HadamardLaunch<D, T>::MIN_BLOCKS)
tq_compress_hadamard(FQ_COMPRESS_ARGS(signs)) {
    using namespace fq_compress;
    using S = HadamardShape<D, BITS, T>;
    long long start;
    if (!output_start(out_start, max_start, start)) return;  // uniform over the grid, before any barrier
    packed += start * packed_pitch;
    norms += start * norm_pitch;
    __shared__ TableSmem table;
    __shared__ float s_csq[S::LEVELS];
    Bucketizer<BITS> bucket;
    bucket.template setup<HadamardLaunch<D, T>::MMA>(table, boundaries);
    load_centroid_squares<S::LEVELS>(s_csq, centroids, norm_correction != 0);
    const fq::FastDiv d1{n1, n1_magic, n1_shift}, d2{n2, n2_magic, n2_shift};
    const OutRows out_rows{{run, run_magic, run_shift}, run_stride, packed_pitch, norm_pitch};
    const unsigned urows = rows;
    if constexpr (HadamardLaunch<D, T>::MMA) {
        const int lane = threadIdx.x & 31;
        unsigned bfrag[2][2];
        hadamard16_b_fragments<T>(lane >> 2, lane & 3, bfrag);
        uint4 smask[D / 32];
        hadamard_sign_masks<D>(signs, lane & 3, smask);
        __syncthreads();
#define MMA_ROWS_CALL(NC, MODE) \
    compress_mma_rows<D, BITS, T, NC, MODE>(x, sx0, sx1, sx2, d1, d2, urows, bucket, bfrag, smask, s_csq, out_rows, \
                                            packed, norms)
        if constexpr (BITS < 4) {  // register bucketize: no table modes
            if (norm_correction) MMA_ROWS_CALL(true, 1);
            else MMA_ROWS_CALL(false, 1);
        } else {
            // Boundaries too close for the full-range table (or otherwise unusual): exact scan. Two modes only,
            // to keep the instantiation's code (and NVRTC time) small.
            const bool full = bucket.full_ok();  // uniform over the block
            if (norm_correction) {
                if (full) MMA_ROWS_CALL(true, 0);
                else MMA_ROWS_CALL(true, 2);
            } else {
                if (full) MMA_ROWS_CALL(false, 0);
                else MMA_ROWS_CALL(false, 2);
            }
        }
#undef MMA_ROWS_CALL
        return;
    }
    // One bit per coordinate of this thread: set where the Hadamard sign is negative.
    const unsigned neg = fq::negative_sign_bits<S::V, S::LANES>(signs, threadIdx.x % S::LANES);
    __syncthreads();
    const bool slow = bucket.slow();
#define HADAMARD_ROWS_CALL(NC, SLOW)                                                                        \
    compress_hadamard_rows<D, BITS, T, NC, SLOW>(x, sx0, sx1, sx2, d1, d2, urows, bucket, neg, s_csq, out_rows, \
                                                 packed, norms)
    if (norm_correction) {
        if (slow) HADAMARD_ROWS_CALL(true, true);
        else HADAMARD_ROWS_CALL(true, false);
    } else {
        if (slow) HADAMARD_ROWS_CALL(false, true);
        else HADAMARD_ROWS_CALL(false, false);
    }
#undef HADAMARD_ROWS_CALL
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
    const float* s_csq, float* smem, const OutRows& out_rows, unsigned char* __restrict__ packed,
    float* __restrict__ norms) {
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
                    fq::store_chunk<BITS>(out_rows.packed_row(packed, out_rows.row(r)) + (pass * S::TX + tx) * BITS,
                                          stream);
            }
        }
#pragma unroll
        for (int i = 0; i < S::RM; ++i) {
            if (nc) csq[i] = fq::group_sum<S::TX>(csq[i]);
            const int lr = ty * S::RM + i;
            const unsigned r = r0 + lr;
            if (tx == 0 && r < rows) *out_rows.norm_at(norms, out_rows.row(r)) = stored_norm(s_norm[lr], csq[i], nc);
        }
    }
}

}  // namespace fq_compress

template <int D, int BITS, typename T>
__global__ void __launch_bounds__(256) tq_compress_dense(FQ_COMPRESS_ARGS(rotation)) {
    using namespace fq_compress;
    using S = DenseShape<D, BITS>;
    long long start;
    if (!output_start(out_start, max_start, start)) return;  // uniform over the grid, before any barrier
    packed += start * packed_pitch;
    norms += start * norm_pitch;
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
                                     bucket.slow(), norm_correction != 0, s_csq, smem,
                                     OutRows{{run, run_magic, run_shift}, run_stride, packed_pitch, norm_pitch}, packed,
                                     norms);
}

#undef FQ_COMPRESS_ARGS
