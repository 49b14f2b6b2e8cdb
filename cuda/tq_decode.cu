// Split-K FlashDecoding over a TurboQuant-compressed KV cache (paged store or contiguous per-layer layout), for key
// and value codes of 1 to 4 bits each (decode_codes.cuh: loads, tables and lookups per width).
//
// One CTA (4 or 8 warps) serves up to 8 query heads (4 in the paired build) of one KV head for one key range
// ("split") of one sequence, so the K/V bytes are read once under GQA. Both products run on tensor cores
// (mma.sync m16n8k16, fp32 accumulate):
//
//   S^T = K Q^T   A = 16 keys x 16 dims of centroid pairs looked up from the codes, B = Q^T (8 columns: head slots,
//                 or (head, half) pairs in the paired build), C = keys x columns
//   O^T = V^T P^T A = 16 dims x 16 keys of centroid pairs, B = P^T (after one movmatrix transpose)
//
// The contraction dimension of an mma may be permuted freely as long as A and B agree. The kernel uses this
// twice so that every A register is one table lookup (decode_codes.cuh):
//   * QK: k-step kk of lane (g, t) takes dims 4kk .. 4kk + 3 of the lane's quarter of a key row (dims t*D/4 ..),
//     so the lane's Q^T fragment is the contiguous dims t*D/4 + 4kk + {0,1} and {2,3} of head g.
//   * PV: output row g of m-tile m is dim (D/8)g + 2m of the lane's eighth of a value row, row g+8 the next dim.
//     The two keys of one A register (columns 2t, 2t+1; key_row says which keys those are) have the codes of their
//     dims merged with one logic op per word, so a lookup returns one dim of both keys.
// Paired build (FQD_HEAD_SLOTS=4, GQA <= 4): the 8 mma columns are (head, half) pairs. QK splits its contraction
// into two halves whose partial scores land in the two columns of a head (B is zero where they differ); PV's 16
// contraction rows are 8 keys twice, pairing each with a different half of the output dims, so one mma covers
// 8 keys x 32 dims x 4 heads. No head slot is idle, each lane scores one head, and O^T needs 16 accumulator
// registers instead of 32 at D = 128 (see accumulate_pv).
// The tables map codes to centroid pairs in the mma element type, with one copy per lane (K and V tables
// interleaved, see decode_codes.cuh), so lookups never conflict.
//
// Softmax runs in the log2 domain (log2(e) folded into the scale); norms scale the scores per key after the
// mma and P (not the denominator) is multiplied by the value norms before the transpose. The column maxima are
// reduced across lanes only when a vote finds a lane whose scores exceed the running max. Each split writes a
// normalised partial output and its natural-log lse (-inf, out 0 for an empty split); merge_partials.cu merges.
//
// Template parameters: D head dim (64/128/256), QK query dtype (0 fp16 -> fp16 mma, 1 bf16, 2 fp32 -> bf16 mma),
// MODE 0 contiguous, 1 contiguous + key_bias, 2 paged (paged and contiguous differ only in address computation),
// W warps per CTA: 4 (two 16-key tiles per warp iteration, 168 registers, 3 CTAs per SM) or 8 (D <= 128 only: one
// tile per iteration in <= 128 registers, 2 CTAs x 8 warps per SM sharing one pair of tables per CTA), KB / VB the
// bits of the key and value codes (1 to 4).
//
// Build switches (NVRTC -D options; kernels/decode_launch.py build_options picks them per launch):
//   FQD_HEAD_SLOTS     8 (default), 4   query heads per CTA; 4 for GQA groups of at most 4 heads (the paired build)
//   FQD_PAGED_LOG2_BS  3, 4, 5, 6       paged builds (MODE 2): log2 of the paged block size, so the page arithmetic
//                                       is constant shifts; the contiguous modes ignore it
//   FQD_TMA_TILES      0 (default), 1   staged tiles, 8 warps, compute capability 9.x: paged blocks of 16 keys, or
//                                       the contiguous layout (MODE 0) with packed rows and 16-byte aligned runs
//   FQD_INLINE_NORMS   0 (default), 1   staged contiguous tiles (with FQD_TMA_TILES) whose sides keep their norms
//                                       after their code rows where the row's alignment allows (pitch kKRow + 4,
//                                       kVRow + 4): one run per such side

#include "decode_codes.cuh"
#include "fast_math.cuh"
#include "grid_dependency.cuh"
#include "tile_copy.cuh"

namespace fqd {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
// The table block sits at the fixed shared-window address kLutWindow (the 1 KB the driver reserves per CTA ends
// there), so a lookup's LDS takes that address as its immediate ([R + 0x400]) instead of adding a base register.
// The block starts kLutWindow - (window address of smem) bytes into the dynamic allocation, which has kLutSlack
// bytes of room for that.
constexpr int kLutSlack = 1024;

enum { kQHalf = 0, kQBf16 = 1, kQFloat = 2 };
enum { kContiguous = 0, kContiguousBias = 1, kPaged = 2 };

// Query-head slots per CTA: 8 (the n = 8 columns of the mma are heads) or 4 (GQA <= 4: the columns are (head, half)
// pairs, so every lane scores one head and O^T takes 16 instead of 32 accumulator registers; see accumulate_pv).
#ifndef FQD_HEAD_SLOTS
#define FQD_HEAD_SLOTS 8
#endif

// Paged builds are made for one block size (log2; the host passes it, see decode_launch.block_size_option), so the
// page arithmetic folds to constant shifts and the other sizes' paths go.
#ifndef FQD_PAGED_LOG2_BS
#define FQD_PAGED_LOG2_BS 0
#endif

// Staged tiles on sm_90 (8 warps): each 16-key tile reaches shared memory by the copy engine, two tiles ahead per warp,
// and the lanes read their fragments from there (see load_staged) instead of ten register loads per lane. A paged
// block of 16 keys is one run of bytes (one bulk copy); the contiguous layout (MODE 0) copies its runs (key codes,
// key norms, value codes, value norms of the tile's keys; a side whose norms follow its rows is one run) into the
// same stage layout. The host builds the contiguous variant only where rows are packed and every (sequence, head)
// run starts 16-byte aligned.
#ifndef FQD_TMA_TILES
#define FQD_TMA_TILES 0
#endif
#ifndef FQD_INLINE_NORMS
#define FQD_INLINE_NORMS 0
#endif

// Whether an instantiation stages its tiles: FQD_TMA_TILES applies to the 8-warp kernels of the paged layout with
// blocks of 16 keys and of the contiguous layout without key_bias.
template <int MODE, int W>
__host__ __device__ constexpr bool staged_tiles() {
  return FQD_TMA_TILES && W == 8 && ((MODE == kPaged && FQD_PAGED_LOG2_BS == 4) || MODE == kContiguous);
}

// How far (log2 units) a score may exceed the running max before the accumulators are rescaled to it (bf16 P V only:
// P then reaches 2^slack, which bf16 holds at full precision; fp16 P V, whose P * value norm must stay in fp16 range,
// rescales at every new max). Fewer steps take the rescale path.
constexpr float kRescaleSlack = 8.f;

enum { kPartK = 1, kPartV = 2, kPartKV = 3 };  // which half of a tile a load fetches

template <int D_, int W, int KB, int VB>
struct Traits {
  static constexpr int D = D_;
  static_assert(D == 64 || D == 128 || D == 256, "head_dim must be 64, 128 or 256");
  static_assert(W == 4 || (W == 8 && D <= 128), "4 warps, or 8 warps for head_dim <= 128");
  using KeyCode = Code<KB, D>;
  using ValueCode = Code<VB, D>;
  static constexpr int kKeyBits = KB;
  static constexpr int kValueBits = VB;
  static constexpr int kWarps = W;
  static constexpr int kThreads = 32 * W;
  static constexpr int kSteps = D / 16;                     // k-steps of S^T = K Q^T
  static constexpr int kKRow = KeyCode::kRowBytes;          // bytes of a packed key / value row
  static constexpr int kVRow = ValueCode::kRowBytes;
  static constexpr int kKBytes = KeyCode::kKeyBytes;        // bytes of a key row held by one lane (a quarter)
  static constexpr int kVBytes = ValueCode::kValueBytes;    // bytes of a value row held by one lane (an eighth)
  static constexpr int kKWords = KeyCode::kKeyWords;
  static constexpr int kVWords = ValueCode::kValueWords;
  static constexpr int kTokenBytes = kKRow + kVRow + 8;     // one token of one head: codes and fp32 norms
  // The table block: entries at a 256-byte stride, K and V interleaved (decode_codes.cuh).
  static constexpr int kLutBlock = 256 * (KeyCode::kEntries > ValueCode::kEntries ? KeyCode::kEntries
                                                                                   : ValueCode::kEntries);
  static constexpr int kPagesOffset = kLutSlack + kLutBlock;
  // 16-key tiles per warp iteration: 2 need ~168 registers (D = 256: spills), so 8-warp CTAs take 1.
  static constexpr int kTiles = (D == 256 || W == 8) ? 1 : 2;
  static constexpr int kChunk = 16 * kTiles;
  // Resident CTAs per SM the register budget is cut for (launch bounds): 8-warp CTAs 2 (128 registers).
  static constexpr int kMinBlocks = W == 8 ? 2 : (D == 256 ? 2 : 3);
  // Head slots of a CTA (8: mma column = head; 4: column 2h + j = half j of head h) and what a lane holds of them:
  // kCols head columns (2t, 2t+1 or t), kScores scores per tile, kPVTiles O^T m-tiles of 4 accumulators.
  static constexpr int kHeadSlots = FQD_HEAD_SLOTS;
  static constexpr bool kPairs = kHeadSlots == 4;
  static constexpr int kCols = kPairs ? 1 : 2;
  static constexpr int kScores = 2 * kCols;
  static constexpr int kPVTiles = kPairs ? D / 32 : D / 16;
  static_assert(kHeadSlots == 4 || kHeadSlots == 8, "4 or 8 head slots");
};

template <bool F16>
__device__ __forceinline__ void mma16816(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  if constexpr (F16) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

// 8x8 b16 transpose across the warp: lane (g, t) holds row g, cols 2t, 2t+1 before and after.
__device__ __forceinline__ u32 transpose8x8(u32 x) {
  u32 y;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}

__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// `bytes` (a multiple of 16) from the 16-byte aligned `p` into L2, by the copy engine (sm_90+).
__device__ __forceinline__ void prefetch_l2_bulk(const void* p, u32 bytes) {
#if __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}

__device__ __forceinline__ float load_f32(const float* p) {
  float x;
  asm volatile("ld.global.nc.L1::no_allocate.f32 %0, [%1];" : "=f"(x) : "l"(p));
  return x;
}

template <int QK>
__device__ __forceinline__ float load_query(const void* q, long long index) {
  if constexpr (QK == kQFloat) {
    return static_cast<const float*>(q)[index];
  } else {
    const unsigned short bits = static_cast<const unsigned short*>(q)[index];
    if constexpr (QK == kQBf16) {
      return __uint_as_float(static_cast<u32>(bits) << 16);
    } else {
      float f;
      asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(bits));
      return f;
    }
  }
}

// Four consecutive query elements from one aligned vector load (fp16/bf16: 8 bytes, fp32: 16 bytes).
template <int QK>
__device__ __forceinline__ void load_query4(float (&x)[4], const void* q, long long index) {
  if constexpr (QK == kQFloat) {
    const float4 v = *reinterpret_cast<const float4*>(static_cast<const float*>(q) + index);
    x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
  } else {
    const uint2 v = *reinterpret_cast<const uint2*>(static_cast<const unsigned short*>(q) + index);
    const u32 w[2] = {v.x, v.y};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const unsigned short bits = static_cast<unsigned short>(w[i >> 1] >> (16 * (i & 1)));
      if constexpr (QK == kQBf16) {
        x[i] = __uint_as_float(static_cast<u32>(bits) << 16);
      } else {
        asm("cvt.f32.f16 %0, %1;" : "=f"(x[i]) : "h"(bits));
      }
    }
  }
}

// Code -> centroid-pair tables for K (fp16) and V (PV type), interleaved and replicated per lane (a 16-byte store
// fills the copies of 4 lanes, or 2 for 8-byte entries), at the fixed window address kLutWindow (decode_codes.cuh).
// Lane l holds centroid l (keys) or l - 16 (values) and the entries come from shuffles: one global load per lane
// instead of several per entry.
template <class T, bool F16PV>
__device__ __forceinline__ void build_tables(unsigned char* smem, float centroid) {
  const u32 window = static_cast<u32>(__cvta_generic_to_shared(smem)) & 0xFFFFFFu;
  if (window > kLutWindow) __trap();  // the reserved area grew beyond kLutSlack: never seen (sm_80, sm_90: 1 KB)
  unsigned char* const table = smem + (kLutWindow - window);
  // Each thread forms one (table, entry) value from shuffles and stores its 8 16-byte copies, starting at copy
  // (thread & 7) so the 8 lanes of a store phase cover all banks (the shuffles are paid per stored value rather than
  // per 16-byte store).
  using K = typename T::KeyCode;
  using V = typename T::ValueCode;
  constexpr int kEntries = T::kLutBlock / 256;  // a power of two: 16, 64 or 256
  constexpr int kEntriesLog2 = kEntries == 256 ? 8 : kEntries == 64 ? 6 : 4;
  static_assert(kEntries == 1 << kEntriesLog2, "table entries are a power of two");
  const int rot = threadIdx.x & 7;
  for (int i = threadIdx.x; i < 2 * kEntries; i += T::kThreads) {
    // i advances by whole warps, so the warp is converged at the shuffles.
    const int tab = i >> kEntriesLog2, e = i & (kEntries - 1);
    const int bits = K::kBits == V::kBits ? K::kBits : (tab ? V::kBits : K::kBits);
    const int entries = K::kEntries == V::kEntries ? kEntries : (tab ? V::kEntries : K::kEntries);
    const int idx = e & (entries - 1);
    // The indices an entry pairs (decode_codes.cuh): two of `bits` bits from the top of idx, and for the 8-byte entries
    // of 1- and 2-bit codes two more below them.
    const int step = bits <= 2 ? 3 * bits : bits;
    const int mask = (1 << bits) - 1;
    const float c0 = __shfl_sync(0xffffffffu, centroid, tab * 16 + ((idx >> step) & mask));
    const float c1 = __shfl_sync(0xffffffffu, centroid, tab * 16 + ((idx >> (step - bits)) & mask));
    uint4 copies;
    const u32 lo = tab ? pack2<F16PV>(c0, c1) : pack2<true>(c0, c1);
    if constexpr (K::kWide || V::kWide) {
      const float c2 = __shfl_sync(0xffffffffu, centroid, tab * 16 + ((idx >> bits) & mask));
      const float c3 = __shfl_sync(0xffffffffu, centroid, tab * 16 + (idx & mask));
      const u32 hi = tab ? pack2<F16PV>(c2, c3) : pack2<true>(c2, c3);
      copies = bits <= 2 ? make_uint4(lo, hi, lo, hi) : make_uint4(lo, lo, lo, lo);
    } else {
      copies = make_uint4(lo, lo, lo, lo);
    }
    if (entries < kEntries && e >= entries) continue;  // the narrower table of mixed widths
    unsigned char* const row = table + e * 256 + tab * 128;
#pragma unroll
    for (int k = 0; k < 8; ++k) *reinterpret_cast<uint4*>(row + ((rot + k) & 7) * 16) = copies;
  }
}

// Both products may take the keys of a tile in any order, as long as S^T's rows (keys in QK, then P^T's rows after
// the transpose) and V^T's columns agree. Row i of S^T is key key_row(i): lane (g, t) scores keys key_row(g) and
// key_row(g) + 8, and its V^T columns 2t, 2t+1, 2t+8, 2t+9 are the keys of S^T rows 2t, 2t+1, 2t+8, 2t+9, i.e.
// value_row(0..3, t). Register loads from global memory (STAGED false): key_row(2u) = u and key_row(2u + 1) = u + 4,
// so value_row(i, t) = t + 4i: the 8 lanes sharing t read one whole value row each, and the four t of one load read
// rows t..t+3 (two 128-byte lines, against four half-used lines for rows 2t in the plain order); the key loads still
// cover rows 0-7 / 8-15 whole.
// Staged tiles (STAGED, loads from shared memory): key_row(g) = g ^ (g >> 1 & 1), so the two rows of one 16-byte key
// load phase (g = 2u, 2u + 1) are an odd number of 64-byte rows apart (no bank conflict) and each value load phase
// reads two even and two odd rows (two-way instead of four-way).
template <bool STAGED>
__device__ __forceinline__ int key_row(int g) {
  if constexpr (STAGED) return g ^ ((g >> 1) & 1);
  return (g >> 1) | ((g & 1) << 2);
}
template <bool STAGED>
__device__ __forceinline__ int value_row(int i, int t) {
  if constexpr (STAGED) return key_row<true>(2 * t + (i & 1)) + 8 * (i >> 1);
  return t + 4 * i;
}

// Registers of one 16-key tile for lane (g, t).
template <class T>
struct Tile {
  u32 k[2][T::kKWords];          // keys key_row(g), key_row(g) + 8: the lane's quarter (dims t*D/4 ..)
  u32 v[4][T::kVWords];          // values value_row(0..3, t): the lane's eighth (dims g*D/8 ..)
  float kn[2];                   // key norms of keys key_row(g), key_row(g) + 8
  float vn[2];                   // value norms of the same keys (they scale P's rows g, g+8)
  float bias[2];                 // key_bias of the same keys (MODE 1)
};

// `base + index * stride` (bytes) in one IMAD.WIDE.U32 (written in PTX so it is not split into a wide
// multiply plus a 64-bit add).
__device__ __forceinline__ const unsigned char* at(const unsigned char* base, u32 index, u32 stride) {
  unsigned long long r;
  asm("mad.wide.u32 %0, %1, %2, %3;" : "=l"(r) : "r"(index), "r"(stride), "l"(base));
  return reinterpret_cast<const unsigned char*>(r);
}

// Where the bytes of one (sequence, KV head) live; the only place the two layouts differ.
// Contiguous: one base per tensor plus byte strides between keys.
// Paged: [block][kv head][K idx bs*kKRow | K norm bs*4 | V idx bs*kVRow | V norm bs*4]; the split's block-table
// slice sits in shared memory and pages are found with shifts.
// The K base already points at the lane's quarter of a row, the V base at its eighth. Paged bases
// also hold the lane's rows in a tile (key_row(g) for K and both norms, value_row(0, t) for V), so a whole tile of a
// 16-key block costs one page lookup, one wide multiply and four 64-bit adds (at 128 registers ptxas would rederive
// the tile's rows from %tid at every tile otherwise). STAGED: the key order of staged tiles (see key_row).
template <class T, int MODE, bool STAGED>
struct KVAddress {
  static constexpr int kKRow = T::kKRow, kVRow = T::kVRow;
  const unsigned char* k;   // contiguous: sequence base; paged: this head's K section in block 0 (+ lane offsets)
  const unsigned char* v;
  const unsigned char* kn;
  const unsigned char* vn;
  const unsigned char* bias;
  u32 k_sn, v_sn, kn_sn, vn_sn, bias_sn;  // contiguous: bytes between consecutive keys
  const int* pages;                       // paged: block ids of this split (shared memory)
  int page0, log2_bs;
  u32 page_stride;                        // paged: bytes per block (all heads)

  // Paged: the four bases without the lane's rows (kr = key_row(g), v0 = value_row(0, t)), i.e. the sections' starts
  // plus the lane's columns, for the paths that address rows one by one.
  struct Sections {
    const unsigned char *k, *v, *kn, *vn;
  };
  __device__ __forceinline__ Sections section_starts(int kr, int v0) const {
    return {k - kr * kKRow, v - v0 * kVRow, kn - kr * 4, vn - kr * 4};
  }

  __device__ __forceinline__ static void load_key(u32 (&w)[T::kKWords], const unsigned char* p) {
    load_bytes<T::kKBytes, T::KeyCode::kKeyAlign>(w, p);
  }
  __device__ __forceinline__ static void load_value(u32 (&w)[T::kVWords], const unsigned char* p) {
    load_bytes<T::kVBytes, T::ValueCode::kValueAlign>(w, p);
  }

  // Loads the lane's slice of the tile starting at key ts (its keys and key norms / bias for PART kPartK, its
  // values and value norms for kPartV); keys past `last` are clamped to it (masked later).
  template <int PART>
  __device__ __forceinline__ void load(Tile<T>& tile, int ts, int last) const {
    const int lane = threadIdx.x & 31, kr = key_row<STAGED>(lane >> 2), t = lane & 3;
    // value rows: v0, v0 + dv1, v0 + 8, v0 + dv1 + 8
    const int v0 = value_row<STAGED>(0, t), dv1 = value_row<STAGED>(1, t) - v0;
    const u32 rk0 = min(ts + kr, last), rk1 = min(ts + kr + 8, last);
    const u32 rv0 = min(ts + v0, last), rv1 = min(ts + v0 + dv1, last);
    const u32 rv2 = min(ts + v0 + 8, last), rv3 = min(ts + v0 + dv1 + 8, last);
    if constexpr (MODE == kPaged) {
      if (ts + 15 <= last && log2_bs >= 4) {
        // Common case: a whole tile inside one block (blocks of >= 16 keys, tiles at multiples of 16). The bases
        // already hold the lane's rows, so each section is one IMAD.WIDE from the page (blocks of 16 keys), and the
        // other rows are immediate offsets.
        const u32 page = pages[(ts >> log2_bs) - page0];
        const unsigned char *kp, *vp, *knp, *vnp;
        if (log2_bs == 4) {
          kp = at(k, page, page_stride), vp = at(v, page, page_stride);
          knp = at(kn, page, page_stride), vnp = at(vn, page, page_stride);
        } else {
          const u32 r = static_cast<u32>(ts) & ((1u << log2_bs) - 1u);
          kp = at(k + r * kKRow, page, page_stride), vp = at(v + r * kVRow, page, page_stride);
          knp = at(kn + r * 4, page, page_stride), vnp = at(vn + r * 4, page, page_stride);
        }
        if constexpr ((PART & kPartK) != 0) load_key(tile.k[0], kp);
        if constexpr ((PART & kPartK) != 0) load_key(tile.k[1], kp + 8 * kKRow);
        if constexpr ((PART & kPartV) != 0) load_value(tile.v[0], vp);
        if constexpr ((PART & kPartV) != 0) load_value(tile.v[1], vp + dv1 * kVRow);
        if constexpr ((PART & kPartV) != 0) load_value(tile.v[2], vp + 8 * kVRow);
        if constexpr ((PART & kPartV) != 0) load_value(tile.v[3], vp + (dv1 + 8) * kVRow);
        if constexpr ((PART & kPartK) != 0) tile.kn[0] = load_f32(reinterpret_cast<const float*>(knp));
        if constexpr ((PART & kPartK) != 0) tile.kn[1] = load_f32(reinterpret_cast<const float*>(knp + 32));
        if constexpr ((PART & kPartV) != 0) tile.vn[0] = load_f32(reinterpret_cast<const float*>(vnp));
        if constexpr ((PART & kPartV) != 0) tile.vn[1] = load_f32(reinterpret_cast<const float*>(vnp + 32));
        return;
      }
      const auto [k, v, kn, vn] = section_starts(kr, v0);  // the general path addresses rows from there
      // Tiles start at multiples of 16, so keys ts..ts+7 share a block, and so do ts+8..ts+15.
      const u32 plo = pages[(min(ts, last) >> log2_bs) - page0];  // a tile past `last` reuses its block
      const u32 phi = pages[(min(ts + 8, last) >> log2_bs) - page0];
      const u32 mask = (1u << log2_bs) - 1u;
      const unsigned char* k_lo = at(k, plo, page_stride);
      const unsigned char* k_hi = at(k, phi, page_stride);
      const unsigned char* v_lo = at(v, plo, page_stride);
      const unsigned char* v_hi = at(v, phi, page_stride);
      const unsigned char* kn_lo = at(kn, plo, page_stride);
      const unsigned char* kn_hi = at(kn, phi, page_stride);
      const unsigned char* vn_lo = at(vn, plo, page_stride);
      const unsigned char* vn_hi = at(vn, phi, page_stride);
      if constexpr ((PART & kPartK) != 0) load_key(tile.k[0], at(k_lo, rk0 & mask, kKRow));
      if constexpr ((PART & kPartK) != 0) load_key(tile.k[1], at(k_hi, rk1 & mask, kKRow));
      if constexpr ((PART & kPartV) != 0) load_value(tile.v[0], at(v_lo, rv0 & mask, kVRow));
      if constexpr ((PART & kPartV) != 0) load_value(tile.v[1], at(v_lo, rv1 & mask, kVRow));
      if constexpr ((PART & kPartV) != 0) load_value(tile.v[2], at(v_hi, rv2 & mask, kVRow));
      if constexpr ((PART & kPartV) != 0) load_value(tile.v[3], at(v_hi, rv3 & mask, kVRow));
      if constexpr ((PART & kPartK) != 0) tile.kn[0] = load_f32(reinterpret_cast<const float*>(at(kn_lo, rk0 & mask, 4)));
      if constexpr ((PART & kPartK) != 0) tile.kn[1] = load_f32(reinterpret_cast<const float*>(at(kn_hi, rk1 & mask, 4)));
      if constexpr ((PART & kPartV) != 0) tile.vn[0] = load_f32(reinterpret_cast<const float*>(at(vn_lo, rk0 & mask, 4)));
      if constexpr ((PART & kPartV) != 0) tile.vn[1] = load_f32(reinterpret_cast<const float*>(at(vn_hi, rk1 & mask, 4)));
    } else {
      if (ts + 15 <= last) {  // a whole tile: no clamping; the other rows from the first row's address
        const u32 r = static_cast<u32>(ts);
        const unsigned char* kp = at(k, r + kr, k_sn);
        const unsigned char* vp = at(v, r + v0, v_sn);
        if constexpr ((PART & kPartK) != 0) load_key(tile.k[0], kp);
        if constexpr ((PART & kPartK) != 0) load_key(tile.k[1], at(kp, 8u, k_sn));
        if constexpr ((PART & kPartV) != 0) load_value(tile.v[0], vp);
        if constexpr ((PART & kPartV) != 0) load_value(tile.v[1], at(vp, dv1, v_sn));
        if constexpr ((PART & kPartV) != 0) load_value(tile.v[2], at(vp, 8u, v_sn));
        if constexpr ((PART & kPartV) != 0) load_value(tile.v[3], at(vp, dv1 + 8u, v_sn));
        const unsigned char* knp = at(kn, r + kr, kn_sn);
        const unsigned char* vnp = at(vn, r + kr, vn_sn);
        if constexpr ((PART & kPartK) != 0) tile.kn[0] = load_f32(reinterpret_cast<const float*>(knp));
        if constexpr ((PART & kPartK) != 0) tile.kn[1] = load_f32(reinterpret_cast<const float*>(at(knp, 8u, kn_sn)));
        if constexpr ((PART & kPartV) != 0) tile.vn[0] = load_f32(reinterpret_cast<const float*>(vnp));
        if constexpr ((PART & kPartV) != 0) tile.vn[1] = load_f32(reinterpret_cast<const float*>(at(vnp, 8u, vn_sn)));
        if constexpr (MODE == kContiguousBias) {
          const unsigned char* bp = at(bias, r + kr, bias_sn);
          if constexpr ((PART & kPartK) != 0) tile.bias[0] = load_f32(reinterpret_cast<const float*>(bp));
          if constexpr ((PART & kPartK) != 0) tile.bias[1] = load_f32(reinterpret_cast<const float*>(at(bp, 8u, bias_sn)));
        }
        return;
      }
      if constexpr ((PART & kPartK) != 0) load_key(tile.k[0], at(k, rk0, k_sn));
      if constexpr ((PART & kPartK) != 0) load_key(tile.k[1], at(k, rk1, k_sn));
      if constexpr ((PART & kPartV) != 0) load_value(tile.v[0], at(v, rv0, v_sn));
      if constexpr ((PART & kPartV) != 0) load_value(tile.v[1], at(v, rv1, v_sn));
      if constexpr ((PART & kPartV) != 0) load_value(tile.v[2], at(v, rv2, v_sn));
      if constexpr ((PART & kPartV) != 0) load_value(tile.v[3], at(v, rv3, v_sn));
      if constexpr ((PART & kPartK) != 0) tile.kn[0] = load_f32(reinterpret_cast<const float*>(at(kn, rk0, kn_sn)));
      if constexpr ((PART & kPartK) != 0) tile.kn[1] = load_f32(reinterpret_cast<const float*>(at(kn, rk1, kn_sn)));
      if constexpr ((PART & kPartV) != 0) tile.vn[0] = load_f32(reinterpret_cast<const float*>(at(vn, rk0, vn_sn)));
      if constexpr ((PART & kPartV) != 0) tile.vn[1] = load_f32(reinterpret_cast<const float*>(at(vn, rk1, vn_sn)));
      if constexpr (MODE == kContiguousBias) {
        if constexpr ((PART & kPartK) != 0) tile.bias[0] = load_f32(reinterpret_cast<const float*>(at(bias, rk0, bias_sn)));
        if constexpr ((PART & kPartK) != 0) tile.bias[1] = load_f32(reinterpret_cast<const float*>(at(bias, rk1, bias_sn)));
      }
    }
  }

  // L2 prefetch of the chunk starting at ts0 (kRows keys). Paged (sm_90): lane 0 issues cp.async.bulk.prefetch of
  // whole 16-key tiles (a chunk's last, partial tile is not prefetched); lane 0's bases are the sections' starts (its
  // column and row offsets are 0). Otherwise lane l touches the 128-byte lines of key ts0 + l (K row, V row, both
  // norms), so the warp covers all rows without holding registers for them.
  template <int kRows>
  __device__ __forceinline__ void prefetch_chunk(int ts0, int last) const {
    const int lane = threadIdx.x & 31;
#if __CUDA_ARCH__ >= 900
    if constexpr (MODE == kPaged) {
      if (log2_bs == 4) {  // the common block size: the tile is one block, its four sections one run of bytes
#pragma unroll
        for (int j = 0; j < kRows / 16; ++j) {
          const int ts = ts0 + 16 * j;
          if (ts + 15 > last) break;
          const u32 page = pages[(ts >> 4) - page0];
          if (lane == 0) prefetch_l2_bulk(at(k, page, page_stride), T::kTokenBytes << 4);
        }
        return;
      }
      // Blocks of 8 keys: two blocks per tile; larger blocks: one prefetch per section.
      if (lane != 0) return;
      for (int ts = ts0; ts < ts0 + kRows && ts + 15 <= last; ts += 16) {
        if (log2_bs < 4) {
          for (int n = ts; n < ts + 16; n += 1 << log2_bs)
            prefetch_l2_bulk(at(k, pages[(n >> log2_bs) - page0], page_stride), T::kTokenBytes << log2_bs);
        } else {
          const u32 page = pages[(ts >> log2_bs) - page0];
          const u32 r = static_cast<u32>(ts) & ((1u << log2_bs) - 1u);
          prefetch_l2_bulk(at(at(k, page, page_stride), r, kKRow), 16 * kKRow);
          prefetch_l2_bulk(at(at(v, page, page_stride), r, kVRow), 16 * kVRow);
          prefetch_l2_bulk(at(at(kn, page, page_stride), r, 4), 64);
          prefetch_l2_bulk(at(at(vn, page, page_stride), r, 4), 64);
        }
      }
      return;
    }
#endif
    const int n = ts0 + lane;
    if (lane >= kRows || n > last) return;
    if constexpr (MODE == kPaged) {
      const auto [k, v, kn, vn] = section_starts(key_row<STAGED>(lane >> 2), value_row<STAGED>(0, lane & 3));
      const u32 page = pages[(n >> log2_bs) - page0];
      const u32 r = static_cast<u32>(n) & ((1u << log2_bs) - 1u);
      prefetch_l2(at(at(k, page, page_stride), r, kKRow));
      prefetch_l2(at(at(v, page, page_stride), r, kVRow));
      prefetch_l2(at(at(kn, page, page_stride), r, 4));
      prefetch_l2(at(at(vn, page, page_stride), r, 4));
    } else {
      prefetch_l2(at(k, n, k_sn));
      prefetch_l2(at(v, n, v_sn));
      prefetch_l2(at(kn, n, kn_sn));
      prefetch_l2(at(vn, n, vn_sn));
    }
  }
};

// The lane's slice of the tile starting at key ts from its staged block (16 keys: [K idx | K norm | V idx | V norm]),
// the same registers KVAddress::load fills; rows past `last` (a split's last tile) are clamped to it. A side whose
// norms follow its code rows (INLINE_K, INLINE_V) holds 16 x (row | norm) instead: the same bytes, the V side at the
// same offset.
template <class T, bool INLINE_K, bool INLINE_V>
__device__ __forceinline__ void load_staged(Tile<T>& tile, const unsigned char* stage, int ts, int last) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  int rk[2] = {key_row<true>(g), key_row<true>(g) + 8};
  int rv[4] = {value_row<true>(0, t), value_row<true>(1, t), value_row<true>(2, t), value_row<true>(3, t)};
  if (ts + 15 > last) {
    for (int i = 0; i < 2; ++i) rk[i] = min(rk[i], last - ts);
    for (int i = 0; i < 4; ++i) rv[i] = min(rv[i], last - ts);
  }
  constexpr int kPitchK = INLINE_K ? T::kKRow + 4 : T::kKRow, kPitchV = INLINE_V ? T::kVRow + 4 : T::kVRow;
  constexpr int kNormPitchK = INLINE_K ? kPitchK : 4, kNormPitchV = INLINE_V ? kPitchV : 4;
  const unsigned char* const kn = stage + (INLINE_K ? T::kKRow : 16 * T::kKRow);
  const unsigned char* const v = stage + 16 * (T::kKRow + 4);
  const unsigned char* const vn = v + (INLINE_V ? T::kVRow : 16 * T::kVRow);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    load_shared_bytes<T::kKBytes, T::KeyCode::kKeyAlign>(tile.k[i], stage + rk[i] * kPitchK + t * T::kKBytes);
    tile.kn[i] = *reinterpret_cast<const float*>(kn + rk[i] * kNormPitchK);
    tile.vn[i] = *reinterpret_cast<const float*>(vn + rk[i] * kNormPitchV);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    load_shared_bytes<T::kVBytes, T::ValueCode::kValueAlign>(tile.v[i], v + rv[i] * kPitchV + g * T::kVBytes);
  }
}

// Per-warp online-softmax state for the lane's head columns (8 slots: heads 2t, 2t+1; 4 slots: head t) plus the O^T
// accumulators. Accumulator e of an m-tile belongs to column e % kCols.
template <class T>
struct WarpState {
  static constexpr int kCols = T::kCols;
  float acc[T::kPVTiles][4];  // O^T. 8 slots: rows dims (D/8)g+2m (+1 for [2],[3]), cols heads 2t, 2t+1;
                                      // 4 slots: head t, dims (D/8)g + 4m + {0, 2, 1, 3}
  float mu[kCols];                    // the value subtracted before exp2: the running max at the last rescale
                                      // (log2 domain, uniform over g; later scores may exceed it by kRescaleSlack),
                                      // or 0 while that is -inf
  float thr[kCols];                   // max - mu: 0, or -inf while no key was seen (scores arrive as s - mu)
  float l[kCols];                     // partial denominators over this lane's keys

  // The max that l and acc are relative to (the running max at the last rescale; -inf while no key was seen).
  __device__ __forceinline__ float running_max(int i) const { return mu[i] + thr[i]; }
};

// The three stages of one warp iteration over kTiles tiles of 16 keys starting at ts0:
//   tile_scores    S^T = K Q^T on tensor cores, scaled by the key norms (log2 domain), keys at or past `end` -inf
//   update_max     the running max per head column; the accumulators are rescaled only when it moves (by more
//                  than kRescaleSlack for bf16 P V)
//   (the step)     P = exp2(S - mu)
//   accumulate_pv  l += P, O^T += V^T (P * value norms)^T on tensor cores
// The stages run one after the other: interleaving accumulate_pv of one chunk with tile_scores of the next in one
// basic block (so their lookup -> mma chains overlap) is slower.
template <class T, int MODE>
__device__ __forceinline__ void tile_scores(float (&s)[T::kTiles][T::kScores], const Tile<T> (&tiles)[T::kTiles],
                                            const u32 (&qf)[T::kSteps][2], const Lut& lut_k, int ts0, int end,
                                            float scale_log2, int kr, const float (&mu)[T::kCols]) {
  constexpr int kCols = T::kCols, kScores = T::kScores;
#pragma unroll
  for (int j = 0; j < T::kTiles; ++j) {
    // kQKChains accumulators (k-steps round-robin) shorten the dependent mma chain: 2 with 4 head slots, whose
    // freed accumulator registers pay for the second chain, 1 with 8 (where the registers are the limit).
    constexpr int kQKChains = T::kPairs ? 2 : 1;
    float acc_qk[kQKChains][4];
#pragma unroll
    for (int a = 0; a < kQKChains; ++a) acc_qk[a][0] = acc_qk[a][1] = acc_qk[a][2] = acc_qk[a][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < T::kSteps; ++kk) {
      u32 a0, a1, a2, a3;  // rows g / g + 8 (keys kr, kr + 8) x dims 4kk + {0, 1} / {2, 3} of the lane's quarter
      key_operands<T::kKeyBits, T::D>(lut_k, tiles[j].k[0], tiles[j].k[1], kk, a0, a1, a2, a3);
      mma16816<true>(acc_qk[kk % kQKChains], a0, a1, a2, a3, qf[kk][0], qf[kk][1]);
    }
    float raw[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      raw[i] = acc_qk[0][i];
#pragma unroll
      for (int a = 1; a < kQKChains; ++a) raw[i] += acc_qk[a][i];
    }
    const float kn[2] = {tiles[j].kn[0] * scale_log2, tiles[j].kn[1] * scale_log2};
    // Score i is row i / kCols (key kr, kr + 8) of column i % kCols. With 4 head slots a head's score is the sum of
    // its two columns (the halves of the contraction, see the query load in the kernel).
    // Scores leave shifted by the running max (mu, per head column), which update_max corrects when it moves, so
    // the subtraction before exp2 rides on this FFMA.
#pragma unroll
    for (int i = 0; i < kScores; ++i) {
      const int row = i / kCols, col = i % kCols;
      const float dot = kCols == 1 ? raw[2 * i] + raw[2 * i + 1] : raw[i];
      float shift = -mu[col];
      if constexpr (MODE == kContiguousBias) shift = tiles[j].bias[row] * kLog2e - mu[col];
      s[j][i] = fmaf(dot, kn[row], shift);
    }
  }
  if (ts0 + T::kChunk > end) {  // only the last iteration of a split has keys past its end
#pragma unroll
    for (int j = 0; j < T::kTiles; ++j) {
#pragma unroll
      for (int i = 0; i < kScores; ++i) {
        if (ts0 + 16 * j + kr + 8 * (i / kCols) >= end) s[j][i] = -inf();
      }
    }
  }
}

// s arrives as score - mu and leaves shifted by the new mu.
template <class T, bool F16PV>
__device__ __forceinline__ void update_max(WarpState<T>& st, float (&s)[T::kTiles][T::kScores]) {
  constexpr int kCols = T::kCols, kScores = T::kScores;
  constexpr float kSlack = F16PV ? 0.f : kRescaleSlack;
  float mx[kCols];
#pragma unroll
  for (int c = 0; c < kCols; ++c) mx[c] = -inf();
#pragma unroll
  for (int j = 0; j < T::kTiles; ++j) {
#pragma unroll
    for (int i = 0; i < kScores; ++i) mx[i % kCols] = fmaxf(mx[i % kCols], s[j][i]);
  }
  // Once the running max has settled, no lane's scores exceed it (by more than kSlack): one vote then replaces the
  // column-max shuffles and the rescale. Only when some lane's score is above that are the lane maxima reduced over
  // the 8 lanes of each column and the accumulators rescaled to the new max.
  bool above = false;
#pragma unroll
  for (int c = 0; c < kCols; ++c) above |= mx[c] > st.thr[c] + kSlack;
  if (__any_sync(0xffffffffu, above)) {
    float al[kCols], d[kCols];
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
#pragma unroll
      for (int off = 4; off < 32; off <<= 1) mx[c] = fmaxf(mx[c], __shfl_xor_sync(0xffffffffu, mx[c], off));
      const float m = st.running_max(c);
      const float mn = fmaxf(m, mx[c] + st.mu[c]);
      // A column that has seen only masked keys keeps max -inf; subtract 0 instead so no inf - inf appears.
      const float mu = mn == -inf() ? 0.f : mn;
      al[c] = ex2(m - mu);
      d[c] = st.mu[c] - mu;
      st.thr[c] = mn - mu;
      st.mu[c] = mu;
      st.l[c] *= al[c];
    }
#pragma unroll
    for (int j = 0; j < T::kTiles; ++j) {
#pragma unroll
      for (int i = 0; i < kScores; ++i) s[j][i] += d[i % kCols];
    }
#pragma unroll
    for (int m = 0; m < T::kPVTiles; ++m) {
#pragma unroll
      for (int e = 0; e < 4; ++e) st.acc[m][e] *= al[e % kCols];
    }
  }
}

template <class T, bool F16PV>
__device__ __forceinline__ void accumulate_pv(WarpState<T>& st, const float (&p)[T::kTiles][T::kScores],
                                              const Tile<T> (&tiles)[T::kTiles], const Lut& lut_v, u32 even_g) {
#pragma unroll
  for (int j = 0; j < T::kTiles; ++j) {
    // The value codes of the keys of columns 2t, 2t+1 (key_row) merged per dim, and of columns 2t+8, 2t+9.
    const ValueOperands<T::kValueBits, T::D> values(tiles[j].v);
    const float v0 = tiles[j].vn[0], v1 = tiles[j].vn[1];
    if constexpr (!T::kPairs) {
      const float p0 = p[j][0], p1 = p[j][1], p2 = p[j][2], p3 = p[j][3];
      st.l[0] += p0 + p2;
      st.l[1] += p1 + p3;
      // P (keys x heads) rows g and g+8 -> P^T fragments (keys 2t,2t+1 / 2t+8,2t+9 of head g).
      const u32 b0 = transpose8x8(pack2<F16PV>(p0 * v0, p1 * v0));
      const u32 b1 = transpose8x8(pack2<F16PV>(p2 * v1, p3 * v1));
      if constexpr (T::ValueCode::kWide) {
#pragma unroll
        for (int q = 0; q < T::kPVTiles / 2; ++q) {
          // m-tiles 2q and 2q + 1: rows g / g+8 of m-tile m are dims (D/8)g + 2m and the next one
          u32 a[2][2], c[2][2];
          values.pairs(lut_v, 0, q, a);
          values.pairs(lut_v, 1, q, c);
          mma16816<F16PV>(st.acc[2 * q], a[0][0], a[0][1], c[0][0], c[0][1], b0, b1);
          mma16816<F16PV>(st.acc[2 * q + 1], a[1][0], a[1][1], c[1][0], c[1][1], b0, b1);
        }
      } else {
#pragma unroll
        for (int m = 0; m < T::kPVTiles; ++m) {
          // rows g / g+8 of m-tile m: dims (D/8)g + 2m and the next one
          u32 a0, a1, a2, a3;
          values.pair(lut_v, 0, m, a0, a1);
          values.pair(lut_v, 1, m, a2, a3);
          mma16816<F16PV>(st.acc[m], a0, a1, a2, a3, b0, b1);
        }
      }
    } else {
      // 4 head slots: column 2h + j' of an mma is half j' of head h's output dims, and its 16 contraction rows are
      // 8 keys twice: rows r < 8 pair key r with dims of half 0, rows r >= 8 key r - 8 with half 1, and B is zero
      // where the halves differ. So one mma takes 8 keys x 32 dims x 4 heads, and O^T needs D/32 m-tiles.
      // P^T: lane (g, t) holds P of keys (rows) g, g+8 for head t; duplicated into both columns of a pair and
      // transposed, lane (g, t) gets P of rows 2t, 2t+1 (+8) for head g / 2, which B needs in its first register
      // (half 0) for even g and in its second (half 1) for odd g.
      const float p0 = p[j][0], p1 = p[j][1];
      st.l[0] += p0 + p1;
      const float q0 = p0 * v0, q1 = p1 * v1;
      const u32 lo = transpose8x8(pack2<F16PV>(q0, q0));  // keys of S^T rows 0-7: value rows value_row(0/1, t)
      const u32 hi = transpose8x8(pack2<F16PV>(q1, q1));  // rows 8-15: value_row(2/3, t)
      // The A operands of key pair `kp` for m-tile m: rows g / g+8, half j': dims (D/8)g + 4m + 2j' and the next one
      // (operand index 2m + j').
      auto operands = [&](int kp, int m, u32(&o)[2][2]) {
        if constexpr (T::ValueCode::kWide) {
          values.pairs(lut_v, kp, m, o);
        } else {
          values.pair(lut_v, kp, 2 * m, o[0][0], o[0][1]);
          values.pair(lut_v, kp, 2 * m + 1, o[1][0], o[1][1]);
        }
      };
#pragma unroll
      for (int m = 0; m < T::kPVTiles; ++m) {
        u32 a[2][2], c[2][2];
        operands(0, m, a);
        mma16816<F16PV>(st.acc[m], a[0][0], a[0][1], a[1][0], a[1][1], lo & even_g, lo & ~even_g);
        operands(1, m, c);
        mma16816<F16PV>(st.acc[m], c[0][0], c[0][1], c[1][0], c[1][1], hi & even_g, hi & ~even_g);
      }
    }
  }
}

// Column of element d of row `row` in the cross-warp reduction's [kWarps * 8][D] array (kSwizzle 0: plain).
// kSwizzle 1 (8 head slots, contiguous layouts): lane (g, t) stores dims (D/8)g + 2m of rows 2t, 2t+1 as float2;
// unswizzled those land on two bank pairs per store. XOR-ing the float2 index with t and the bits of g above the
// 32-float bank window spreads the 32 lanes over all 16 bank pairs (two lanes each, the minimum for 256 bytes). The
// XOR is constant over aligned runs of 32 columns, so the merge's reads of consecutive d stay conflict-free. The
// paged 8-slot kernel keeps the plain layout: with the swizzle ptxas schedules its main loop worse, which costs
// more than the conflicts.
// kSwizzle 2 (4 head slots: lane (g, t) stores float4s of row t): the float4 index XOR t, so at D = 128 the 8 lanes
// of one store phase (g = 0, 1 x t = 0..3) cover all 32 banks (two-way at D = 64 and 256, where g = 0, 1 share them).
template <int D, int kSwizzle>
__device__ __forceinline__ int red_col(int row, int d) {
  if constexpr (kSwizzle == 0) return d;
  if constexpr (kSwizzle == 2) return d ^ ((row & 3) << 2);
  const int x = (((row >> 1) & 3) | ((d >> 5) << 2)) & (D / 16 - 1);
  return d ^ (2 * x);
}

// Grid (splits, H_kv * head_groups, batch); block kThreads. Output row of query head hq of sequence b is
// b * num_q_heads + hq; partial s of a row lives at part_out[(s * rows + row) * D], part_lse[s * rows + row].
template <int D, int QK, int MODE, int W, int KB, int VB>
__global__ void __launch_bounds__(Traits<D, W, KB, VB>::kThreads, Traits<D, W, KB, VB>::kMinBlocks)
tq_decode_kernel(const void* __restrict__ q, long long q_sb, long long q_sh, long long q_sd,
                 const unsigned char* __restrict__ k_idx, long long k_sb, long long k_sh, long long k_sn,
                 const float* __restrict__ k_nrm, long long kn_sb, long long kn_sh, long long kn_sn,
                 const unsigned char* __restrict__ v_idx, long long v_sb, long long v_sh, long long v_sn,
                 const float* __restrict__ v_nrm, long long vn_sb, long long vn_sh, long long vn_sn,
                 const float* __restrict__ key_bias, long long bias_sb, long long bias_sn,
                 const int* __restrict__ block_table, long long bt_sb, const int* __restrict__ seq_lens,
                 long long page_stride, int log2_bs, int num_keys,
                 const float* __restrict__ k_cent, const float* __restrict__ v_cent, float scale_log2,
                 int num_q_heads, int group, int split_len, int long_splits, int short_len,
                 float* __restrict__ part_out,
                 float* __restrict__ part_lse, int rows, int prefetch
                 ) {
  using T = Traits<D, W, KB, VB>;
  constexpr int kWarps = T::kWarps, kThreads = T::kThreads;
  constexpr int kPagesOffset = T::kPagesOffset;
  // S^T = K Q^T always runs in fp16 (3 more mantissa bits than bf16 for the key centroids; queries are scaled
  // by a power of two into fp16 range). P V runs in fp16 for fp16 queries and in bf16 (range-safe for large
  // value norms) otherwise.
  constexpr bool F16PV = QK == kQHalf;
  // Bulk-copied tiles (FQD_TMA_TILES): two 16-key stages per warp and their barriers, ahead of the block ids.
  constexpr bool kTma = staged_tiles<MODE, kWarps>();
  static_assert(MODE != kPaged || (FQD_PAGED_LOG2_BS >= 3 && FQD_PAGED_LOG2_BS <= 6),
                "paged builds are made per block size: FQD_PAGED_LOG2_BS in 3..6");
  extern __shared__ __align__(16) unsigned char smem[];

  // Under programmatic dependent launch this grid may start while the previous kernel of the stream runs: wait for
  // it (and its memory) before reading any input or writing a partial the previous merge may still read. A no-op
  // for ordinary launches.
  grid_dependency_wait();
  // CTAs start in linear block order, the first one per SM ahead of the second, and an SM's first CTA runs faster
  // than its second (the schedulers favour older warps). So the CTAs are numbered split-major: the first
  // `long_splits` splits of every unit, which the plan makes that much longer, come first and take the first places.
  const int linear = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  const int units = gridDim.y * gridDim.z;
  const int split = linear / units;
  const int unit = linear - split * units;
  const int b = unit / gridDim.y;
  const int unit_y = unit - b * gridDim.y;
  constexpr int kSlots = T::kHeadSlots;
  const int head_groups = (group + kSlots - 1) / kSlots;
  const int h = unit_y / head_groups;
  const int hg = unit_y - h * head_groups;
  const int nh = min(kSlots, group - hg * kSlots);  // query heads served by this CTA
  const int hq0 = h * group + hg * kSlots;
  // A build for one block size: the page arithmetic folds to shifts by a constant and the other sizes' paths go.
  if constexpr (MODE == kPaged) {
    if (log2_bs != FQD_PAGED_LOG2_BS) __trap();  // the host picks this build for that block size only
    log2_bs = FQD_PAGED_LOG2_BS;
  }
  // Contiguous layouts take per-sequence lengths too when given (a fixed-capacity store whose live length is on the
  // device); otherwise every sequence holds num_keys keys.
  const int len = (MODE == kPaged || seq_lens != nullptr) ? seq_lens[b] : num_keys;
  // Splits [0, long_splits) hold split_len keys, the later ones short_len.
  const int s0 = split < long_splits ? split * split_len : long_splits * split_len + (split - long_splits) * short_len;
  const int s1 = min(s0 + (split < long_splits ? split_len : short_len), len);
  const int tid = threadIdx.x;

  if (s0 >= s1) {  // empty split: contributes nothing to the merge
    for (int i = tid; i < nh * D; i += kThreads) {
      const int hh = i / D, d = i - hh * D;
      const long long row = static_cast<long long>(split) * rows + static_cast<long long>(b) * num_q_heads + hq0 + hh;
      part_out[row * D + d] = 0.f;
      if (d == 0) part_lse[row] = -inf();
    }
    return;
  }

  const int lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  KVAddress<T, MODE, kTma> kv;
  constexpr int kStageBytes = 16 * T::kTokenBytes;
  // The sides whose norms follow their code rows (FQD_INLINE_NORMS): those whose rows keep the alignment of the
  // lanes' loads with the 4 norm bytes added, the sides flashquant_hf.store_layout.inline_norms stores so.
  constexpr bool kInline = MODE != kPaged && FQD_INLINE_NORMS;
  constexpr bool kInlineK = kInline && lowest_bit(T::kKRow + 4) >= T::KeyCode::kKeyAlign;
  constexpr bool kInlineV = kInline && lowest_bit(T::kVRow + 4) >= T::ValueCode::kValueAlign;
  unsigned char* const stage = smem + kPagesOffset + warp * 2 * kStageBytes;
  unsigned long long* const stage_bar =
      reinterpret_cast<unsigned long long*>(smem + kPagesOffset + kWarps * 2 * kStageBytes) + 2 * warp;
  int* const pages = reinterpret_cast<int*>(smem + kPagesOffset + (kTma ? kWarps * 2 * (kStageBytes + 8) : 0));
  if constexpr (MODE == kPaged) {
    const int page0 = s0 >> log2_bs;
    const int npages = ((s1 - 1) >> log2_bs) - page0 + 1;
    for (int i = tid; i < npages; i += kThreads) pages[i] = block_table[b * bt_sb + page0 + i];
    const long long bs = 1ll << log2_bs;
    const unsigned char* head = k_idx + h * (bs * T::kTokenBytes);
    // The bases include the lane's rows in a tile (keys key_row(g), values value_row(0, t)).
    const int key_rows = key_row<kTma>(g), value_rows = value_row<kTma>(0, t);
    kv.k = head + t * T::kKBytes + key_rows * T::kKRow;
    kv.kn = head + bs * T::kKRow + key_rows * 4;
    kv.v = head + bs * (T::kKRow + 4) + g * T::kVBytes + value_rows * T::kVRow;
    kv.vn = head + bs * (T::kKRow + 4 + T::kVRow) + key_rows * 4;
    kv.pages = block_table + b * bt_sb + page0;  // the first tiles' loads read it before the shared copy is ready
    kv.page0 = page0;
    kv.log2_bs = log2_bs;
    kv.page_stride = static_cast<u32>(page_stride);
  } else {
    kv.k = k_idx + b * k_sb + h * k_sh + t * T::kKBytes;
    kv.v = v_idx + b * v_sb + h * v_sh + g * T::kVBytes;
    kv.kn = reinterpret_cast<const unsigned char*>(k_nrm + b * kn_sb + h * kn_sh);
    kv.vn = reinterpret_cast<const unsigned char*>(v_nrm + b * vn_sb + h * vn_sh);
    kv.k_sn = static_cast<u32>(k_sn);
    kv.v_sn = static_cast<u32>(v_sn);
    kv.kn_sn = static_cast<u32>(kn_sn * 4);
    kv.vn_sn = static_cast<u32>(vn_sn * 4);
    if constexpr (MODE == kContiguousBias) {
      kv.bias = reinterpret_cast<const unsigned char*>(key_bias + b * bias_sb);
      kv.bias_sn = static_cast<u32>(bias_sn * 4);
    }
  }

  const int last = s1 - 1;
  const int nchunks = (s1 - s0 + T::kChunk - 1) / T::kChunk;
  // Warps take chunks round-robin, with the registers of two chunks swapping roles (each loop iteration runs two
  // steps with the buffers exchanged, so no copies). Beyond the chunks held in registers, `prefetch` more chunks
  // per warp are prefetched into L2, which keeps more bytes in flight without registers.
  int c = warp;
  auto tile_at = [&](int chunk, int j) { return s0 + chunk * T::kChunk + 16 * j; };
  // Each step scores chunk c, updates the max and accumulates its PV.
  //  * Contiguous layouts (kSplitLoads): the values of chunk c + kWarps are loaded when chunk c starts, its keys
  //    one iteration earlier, right after chunk c - kWarps's keys were consumed (its QK mma), into the registers
  //    they freed. Keys, which an iteration needs first, and values both get ~1.5 iterations to arrive.
  //  * Paged: all of chunk c + kWarps is loaded when chunk c starts (one page lookup per tile instead of two, which
  //    outweighs the earlier key loads that split loads give the contiguous layouts).
  //  * Staged tiles (kTma): no register loads; chunks c + kWarps and c + 2 kWarps are in flight to shared memory
  //    (the loop below).
  constexpr bool kSplitLoads = MODE != kPaged;
  constexpr int kAhead = kSplitLoads ? kPartV : kPartKV;  // what is loaded for chunk c + kWarps when c starts
  Tile<T> bufa[T::kTiles], bufb[T::kTiles];
  // Bulk-copied tiles (a chunk is one tile here), issued by lane 0. Paged: the block of chunk c from this head's
  // slice. Contiguous: the tile's runs (two to four), from lane 0's bases (its lane offsets are 0); the sequence's last
  // tile, when partial, is not copied (rows past the end may not exist) but read from global memory by the loop.
  const unsigned char* const tile_src = k_idx + h * kStageBytes;
  auto copy_tile = [&](int chunk, int slot) {
    const int ts = tile_at(chunk, 0);
    unsigned char* const dst = stage + slot * kStageBytes;
    if constexpr (MODE == kPaged) {
      const u32 page = kv.pages[(ts >> 4) - kv.page0];
      bulk_copy(dst, at(tile_src, page, kv.page_stride), kStageBytes, stage_bar + slot);
    } else {
      if (ts + 15 > last) return;
      barrier_expect(stage_bar + slot, kStageBytes);
      // One run per side whose norms follow its rows, else the codes' run and the norms' run.
      if constexpr (kInlineK) {
        bulk_copy_counted(dst, at(kv.k, ts, T::kKRow + 4), 16 * (T::kKRow + 4), stage_bar + slot);
      } else {
        bulk_copy_counted(dst, at(kv.k, ts, T::kKRow), 16 * T::kKRow, stage_bar + slot);
        bulk_copy_counted(dst + 16 * T::kKRow, at(kv.kn, ts, 4), 64, stage_bar + slot);
      }
      unsigned char* const dst_v = dst + 16 * (T::kKRow + 4);
      if constexpr (kInlineV) {
        bulk_copy_counted(dst_v, at(kv.v, ts, T::kVRow + 4), 16 * (T::kVRow + 4), stage_bar + slot);
      } else {
        bulk_copy_counted(dst_v, at(kv.v, ts, T::kVRow), 16 * T::kVRow, stage_bar + slot);
        bulk_copy_counted(dst_v + 16 * T::kVRow, at(kv.vn, ts, 4), 64, stage_bar + slot);
      }
    }
  };
  // The first tiles are in flight during the prologue (the paged layout reads their block ids from the global
  // block table, see above).
  if constexpr (kTma) {
    if (lane == 0) {
      barrier_init(stage_bar);
      barrier_init(stage_bar + 1);
      fence_barrier_init();
      if (c < nchunks) copy_tile(c, 0);
      if (c + kWarps < nchunks) copy_tile(c + kWarps, 1);
    }
    __syncwarp();
  } else if (c < nchunks) {
#pragma unroll
    for (int j = 0; j < T::kTiles; ++j) kv.template load<kPartKV>(bufa[j], tile_at(c, j), last);
  }
  if (!kTma && kSplitLoads && c + kWarps < nchunks) {
#pragma unroll
    for (int j = 0; j < T::kTiles; ++j) kv.template load<kPartK>(bufb[j], tile_at(c + kWarps, j), last);
  }
  if constexpr (MODE == kPaged) kv.pages = pages;  // the loop's copy, published by the barrier after the build
  // The queries (vector loads where the head dim is contiguous and aligned) and the centroids (lanes 0-15 keys,
  // 16-31 values; the table build shuffles them), after the first tiles.
  float x[T::kSteps][4];
  {
    // The lane's head of the B operand (column g): head g, or with 4 slots head g / 2, whose half g % 2 of the
    // contraction is the lane's when t % 2 agrees (tile_scores adds the two halves).
    const int qh = T::kPairs ? g >> 1 : g;
    const bool valid = qh < nh && (!T::kPairs || ((g ^ t) & 1) == 0);
    const long long base = static_cast<long long>(b) * q_sb + static_cast<long long>(hq0 + (valid ? qh : 0)) * q_sh;
    constexpr int kElem = QK == kQFloat ? 4 : 2;
    const bool vector = q_sd == 1 &&
                        ((reinterpret_cast<unsigned long long>(q) + base * kElem) & (4 * kElem - 1)) == 0;
    if (valid && vector) {
#pragma unroll
      for (int kk = 0; kk < T::kSteps; ++kk) load_query4<QK>(x[kk], q, base + t * (D / 4) + 4 * kk);
    } else {
#pragma unroll
      for (int kk = 0; kk < T::kSteps; ++kk) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int d = t * (D / 4) + 4 * kk + i;
          x[kk][i] = valid ? load_query<QK>(q, base + d * q_sd) : 0.f;
        }
      }
    }
  }
  // Lanes past a codebook's 2^bits centroids hold 0 (no table entry reads them).
  const float centroid = lane < 16 ? (lane < (1 << KB) ? k_cent[lane] : 0.f)
                                   : (lane - 16 < (1 << VB) ? v_cent[lane - 16] : 0.f);

  WarpState<T> st;
#pragma unroll
  for (int m = 0; m < T::kPVTiles; ++m) st.acc[m][0] = st.acc[m][1] = st.acc[m][2] = st.acc[m][3] = 0.f;
#pragma unroll
  for (int c = 0; c < T::kCols; ++c) st.thr[c] = -inf(), st.mu[c] = 0.f, st.l[c] = 0.f;
  const u32 even_g = (g & 1) ? 0u : ~0u;  // 4 head slots: which half of P^T's rows this lane's B column takes

  const Lut lut_k(lane, 0, T::KeyCode::kWide);
  const Lut lut_v(lane, 1, T::ValueCode::kWide);
  // The table build runs while the first tiles, the queries and the centroids are in flight.
  build_tables<T, F16PV>(smem, centroid);
  u32 qf[T::kSteps][2];
  // The queries are multiplied by 2^-e so that their largest magnitude lies in [2^14, 2^15) (exact; fp16 range
  // and full fp16 precision for any input scale); 2^e goes back into the score scale. Q^T fragments: head g of
  // this group (paired build: head g / 2, zero unless t % 2 == g % 2), dims t*D/4 + 4kk + {0,1} and {2,3}; missing
  // heads are zero.
  {
    float amax = 0.f;
#pragma unroll
    for (int kk = 0; kk < T::kSteps; ++kk) {
#pragma unroll
      for (int i = 0; i < 4; ++i) amax = fmaxf(amax, fabsf(x[kk][i]));
    }
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    const int biased = static_cast<int>((__float_as_uint(amax) >> 23) & 0xFFu);
    const int e = biased == 0 ? 0 : max(-120, min(120, biased - 127 - 14));
    const float down = __uint_as_float(static_cast<u32>(127 - e) << 23);  // 2^-e
    scale_log2 *= __uint_as_float(static_cast<u32>(127 + e) << 23);      // 2^e
#pragma unroll
    for (int kk = 0; kk < T::kSteps; ++kk) {
      qf[kk][0] = pack2<true>(x[kk][0] * down, x[kk][1] * down);
      qf[kk][1] = pack2<true>(x[kk][2] * down, x[kk][3] * down);
    }
  }
  __syncthreads();  // tables and pages are ready
  for (int i = 1; i <= prefetch; ++i) {
    const int ahead = c + (kTma ? i + 1 : i) * kWarps;
    if (ahead < nchunks) kv.template prefetch_chunk<T::kChunk>(tile_at(ahead, 0), last);
  }
  // The rest of a step once the scores are in: the running max, P = exp2(s) (s arrives as score - mu), l and O^T.
  auto softmax_pv = [&](const Tile<T>(&cur)[T::kTiles], float (&s)[T::kTiles][T::kScores]) {
    update_max<T, F16PV>(st, s);
    float p[T::kTiles][T::kScores];
#pragma unroll
    for (int j = 0; j < T::kTiles; ++j) {
#pragma unroll
      for (int i = 0; i < T::kScores; ++i) p[j][i] = ex2(s[j][i]);
    }
    accumulate_pv<T, F16PV>(st, p, cur, lut_v, even_g);
  };
  auto step = [&](Tile<T>(&cur)[T::kTiles], Tile<T>(&nxt)[T::kTiles]) {
    const int cn = c + kWarps, ck = c + 2 * kWarps;
    if (cn < nchunks) {
#pragma unroll
      for (int j = 0; j < T::kTiles; ++j) kv.template load<kAhead>(nxt[j], tile_at(cn, j), last);
    }
    if (prefetch > 0 && cn + prefetch * kWarps < nchunks)
      kv.template prefetch_chunk<T::kChunk>(tile_at(cn + prefetch * kWarps, 0), last);
    float s[T::kTiles][T::kScores];
    tile_scores<T, MODE>(s, cur, qf, lut_k, tile_at(c, 0), s1, scale_log2, key_row<kTma>(g), st.mu);
    if (kSplitLoads && ck < nchunks) {
#pragma unroll
      for (int j = 0; j < T::kTiles; ++j) kv.template load<kPartK>(cur[j], tile_at(ck, j), last);
    }
    softmax_pv(cur, s);
    c = cn;
    return c < nchunks;
  };
  if constexpr (kTma) {
    // Step i consumes slot i % 2 (its barrier's phase i / 2 % 2), then refills it with chunk c + 2 kWarps once
    // every lane has its registers.
    for (int i = 0; c < nchunks; ++i, c += kWarps) {
      const int slot = i & 1;
      if (MODE != kPaged && tile_at(c, 0) + 15 > last) {  // the partial last tile (never copied, see copy_tile)
        kv.template load<kPartKV>(bufa[0], tile_at(c, 0), last);
      } else {
        barrier_wait(stage_bar + slot, (i >> 1) & 1);
        load_staged<T, kInlineK, kInlineV>(bufa[0], stage + slot * kStageBytes, tile_at(c, 0), last);
      }
      __syncwarp();
      if (lane == 0 && c + 2 * kWarps < nchunks) copy_tile(c + 2 * kWarps, slot);
      if (prefetch > 0 && c + (2 + prefetch) * kWarps < nchunks)
        kv.template prefetch_chunk<T::kChunk>(tile_at(c + (2 + prefetch) * kWarps, 0), last);
      float s[T::kTiles][T::kScores];
      tile_scores<T, MODE>(s, bufa, qf, lut_k, tile_at(c, 0), s1, scale_log2, key_row<kTma>(g), st.mu);
      softmax_pv(bufa, s);
    }
  } else {
    while (c < nchunks && step(bufa, bufb) && step(bufb, bufa)) {
    }
  }

  // The merge (launched programmatically) may now be scheduled; it waits for this grid to finish.
  grid_dependents_launch();
  // Denominators: sum the lane partials over the 8 lanes of each head column.
#pragma unroll
  for (int off = 4; off < 32; off <<= 1) {
#pragma unroll
    for (int c = 0; c < T::kCols; ++c) st.l[c] += __shfl_xor_sync(0xffffffffu, st.l[c], off);
  }

  // Merge the W warps through shared memory (the tables are dead now).
  __syncthreads();
  constexpr int kRedSwizzle = T::kPairs ? 2 : MODE == kPaged ? 0 : 1;  // see red_col
  float* red_acc = reinterpret_cast<float*>(smem);            // [kWarps][8][D], columns red_col
  float* red_m = red_acc + kWarps * 8 * D;                    // [kWarps][8]
  float* red_l = red_m + kWarps * 8;                          // [kWarps][8]
  if constexpr (T::kPairs) {
    // Lane (g, t) holds head t, dims (D/8)g + 4m .. + 3: one float4 per m-tile.
    const int row = warp * 8 + t;
#pragma unroll
    for (int m = 0; m < T::kPVTiles; ++m) {
      const int col = red_col<D, kRedSwizzle>(row, (D / 8) * g + 4 * m);
      *reinterpret_cast<float4*>(red_acc + row * D + col) =
          make_float4(st.acc[m][0], st.acc[m][2], st.acc[m][1], st.acc[m][3]);
    }
    if (g == 0) {
      red_m[row] = st.running_max(0);
      red_l[row] = st.l[0];
    }
  } else {
    const int row = warp * 8 + 2 * t;
    float* a0 = red_acc + row * D;
    float* a1 = a0 + D;
#pragma unroll
    for (int m = 0; m < T::kPVTiles; ++m) {
      const int col = red_col<D, kRedSwizzle>(row, (D / 8) * g + 2 * m);  // (rows 2t and 2t + 1 share their swizzle)
      *reinterpret_cast<float2*>(a0 + col) = make_float2(st.acc[m][0], st.acc[m][2]);
      *reinterpret_cast<float2*>(a1 + col) = make_float2(st.acc[m][1], st.acc[m][3]);
    }
    if (g == 0) {
      red_m[warp * 8 + 2 * t] = st.running_max(0);
      red_m[warp * 8 + 2 * t + 1] = st.running_max(1);
      red_l[warp * 8 + 2 * t] = st.l[0];
      red_l[warp * 8 + 2 * t + 1] = st.l[1];
    }
  }
  __syncthreads();
  for (int i = tid; i < nh * D; i += kThreads) {
    const int hh = i / D, d = i - hh * D;
    float mx = -inf();
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, red_m[w * 8 + hh]);
    float o = 0.f, lsum = 0.f;
    if (mx != -inf()) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float wt = ex2(red_m[w * 8 + hh] - mx);
        lsum += wt * red_l[w * 8 + hh];
        o += wt * red_acc[(w * 8 + hh) * D + red_col<D, kRedSwizzle>(w * 8 + hh, d)];
      }
      o /= lsum;
    }
    auto split_lse = [&] { return mx == -inf() ? -inf() : (mx + lg2(lsum)) * kLn2; };
    const long long row = static_cast<long long>(split) * rows + static_cast<long long>(b) * num_q_heads + hq0 + hh;
    part_out[row * D + d] = o;
    if (d == 0) part_lse[row] = split_lse();
  }
}

}  // namespace fqd
