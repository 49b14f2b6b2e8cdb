// How the split-K decode (tq_decode.cu) reads b-bit codes, b = 1 .. 4, for keys and values independently:
// the loads of a lane's slice of a packed row, the byte -> centroid tables in shared memory, and the A operands
// of both mma products built from them.
//
// Packing (flashquant_hf/packing.py): one MSB-first bit stream per row. 4 bits: byte j = idx[2j] << 4 | idx[2j+1];
// 2 bits: byte j holds idx[4j..4j+3] from the top, 1 bit: idx[8j..8j+7]; 3 bits: 8 indices fill 3 bytes as the
// big-endian 24-bit value sum_k idx[8g+k] << (21 - 3k).
//
// Lane (g, t) of a warp holds, per 16-key tile, a quarter of two key rows (dims t*D/4 .., the contraction of
// S^T = K Q^T) and an eighth of four value rows (dims g*D/8 .., rows of O^T = V^T P^T). Every A register of an
// mma is a pair of fp16/bf16 centroids. A lookup turns a few bits into such a pair (or two pairs) with one
// shared-memory load from a per-lane copy of a table, so no lookups of one warp conflict:
//   4 bits: a byte (two indices) -> one pair,  256 entries of 4 bytes, address = PRMT of the byte
//   2 bits: a byte (four indices) -> two pairs, 256 entries of 8 bytes (16 copies; a 64-bit load is two phases)
//   3 bits: six bits (two indices) -> one pair, 256 entries of 4 bytes indexed by a byte whose low six bits are the
//           field (the two above it are ignored), address = PRMT of that byte after a shift shared by the lookups
//           of one group
//   1 bit:  a nibble (four indices) -> two pairs, 16 entries of 8 bytes, address = shift + LOP3 of the nibble
// Entry e of table `tab` (0 keys, 1 values) for lane l lives at byte e*256 + tab*128 + l*4 (4-byte entries) or
// e*256 + tab*128 + (l % 16)*8 (8-byte entries) of the table block, which sits at the fixed shared-window address
// kLutWindow: the address of a lookup is the lane's constant with the entry index in bits 8.., and kLutWindow is
// the load's immediate.
//
// Values pair two keys per A register (V^T's columns are keys): the codes of the same dims of the two keys are
// merged first (one LOP3 per word or group), so a value lookup reads one dim of two keys exactly like a key lookup
// reads two dims of one key.
#ifndef FQ_DECODE_CODES_CUH
#define FQ_DECODE_CODES_CUH

namespace fqd {

typedef unsigned int u32;

constexpr unsigned int kLutWindow = 0x400;

// Two floats -> one register of the mma element type, `lo` in the low half (the lower k / n index).
template <bool F16>
__device__ __forceinline__ u32 pack2(float lo, float hi) {
  u32 r;
  if constexpr (F16) {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  }
  return r;
}

// (a & mask) | (b & ~mask) in one LOP3 (ptxas emits two when the masks are written as separate constants).
__device__ __forceinline__ u32 select_bits(u32 a, u32 b, u32 mask) {
  u32 r;
  asm("lop3.b32 %0, %1, %2, %3, 0xE4;" : "=r"(r) : "r"(a), "r"(b), "r"(mask));
  return r;
}

__host__ __device__ constexpr int lowest_bit(int x) { return x & -x; }
__host__ __device__ constexpr int min_int(int a, int b) { return a < b ? a : b; }

// --------------------------------------------------------------------------------------------- loads
// Streaming loads (every byte is read once, so it stays out of L1) of BYTES bytes at an address aligned to ALIGN,
// into little-endian words (byte i in bits 8*(i%4) of word i/4), in the widest pieces the alignment allows.
template <int N>
__device__ __forceinline__ void load_piece(u32* w, const unsigned char* p) {
  if constexpr (N == 16) {
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "l"(p));
  } else if constexpr (N == 8) {
    asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(w[0]), "=r"(w[1]) : "l"(p));
  } else if constexpr (N == 4) {
    asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(w[0]) : "l"(p));
  } else {
    static_assert(N == 2 || N == 1, "pieces of 1, 2, 4, 8 or 16 bytes");
    unsigned short x;
    if constexpr (N == 2) {
      asm volatile("ld.global.nc.L1::no_allocate.u16 %0, [%1];" : "=h"(x) : "l"(p));
    } else {
      asm volatile("ld.global.nc.L1::no_allocate.u8 %0, [%1];" : "=h"(x) : "l"(p));
    }
    w[0] = x;
  }
}

template <int BYTES, int ALIGN>
__device__ __forceinline__ void load_bytes(u32 (&w)[(BYTES + 3) / 4], const unsigned char* p) {
  constexpr int kPiece = min_int(min_int(lowest_bit(BYTES), lowest_bit(ALIGN)), 16);
  if constexpr (kPiece >= 4) {
#pragma unroll
    for (int i = 0; i < BYTES; i += kPiece) load_piece<kPiece>(&w[i / 4], p + i);
  } else {
#pragma unroll
    for (int i = 0; i < (BYTES + 3) / 4; ++i) w[i] = 0u;
#pragma unroll
    for (int i = 0; i < BYTES; i += kPiece) {
      u32 x;
      load_piece<kPiece>(&x, p + i);
      w[i / 4] |= x << (8 * (i % 4));
    }
  }
}

// The same from shared memory (bytes staged by a bulk copy).
template <int BYTES, int ALIGN>
__device__ __forceinline__ void load_shared_bytes(u32 (&w)[(BYTES + 3) / 4], const unsigned char* p) {
  constexpr int kPiece = min_int(min_int(lowest_bit(BYTES), lowest_bit(ALIGN)), 16);
  if constexpr (kPiece >= 4) {
#pragma unroll
    for (int i = 0; i < BYTES; i += kPiece) {
      if constexpr (kPiece == 16) {
        const uint4 x = *reinterpret_cast<const uint4*>(p + i);
        w[i / 4] = x.x, w[i / 4 + 1] = x.y, w[i / 4 + 2] = x.z, w[i / 4 + 3] = x.w;
      } else if constexpr (kPiece == 8) {
        const uint2 x = *reinterpret_cast<const uint2*>(p + i);
        w[i / 4] = x.x, w[i / 4 + 1] = x.y;
      } else {
        w[i / 4] = *reinterpret_cast<const u32*>(p + i);
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < (BYTES + 3) / 4; ++i) w[i] = 0u;
#pragma unroll
    for (int i = 0; i < BYTES; i += kPiece) {
      const u32 x = kPiece == 2 ? *reinterpret_cast<const unsigned short*>(p + i) : p[i];
      w[i / 4] |= x << (8 * (i % 4));
    }
  }
}

// --------------------------------------------------------------------------------------------- lookups
// Three-bit groups: group j of a slice is bytes 3j .. 3j + 2, as the big-endian 24-bit value in bits 0..23 (the
// top byte is not used by any field).
template <int WORDS>
__device__ __forceinline__ u32 group24(const u32 (&w)[WORDS], int j) {
  const int b = 3 * j;
  const int i = b >> 2, o = b & 3;
  const u32 hi = i + 1 < WORDS ? w[i + 1] : 0u;
  // result byte 2 <- source byte o, byte 1 <- o + 1, byte 0 <- o + 2 (sources 4..7 are `hi`)
  return __byte_perm(w[i], hi, static_cast<u32>((o + 2) | ((o + 1) << 4) | (o << 8) | (7 << 12)));
}

// One lane's view of a table (see the file comment). `lane` is the lane's constant: l*4 + tab*128, or
// (l % 16)*8 + tab*128 for 8-byte entries.
struct Lut {
  u32 lane;

  __device__ __forceinline__ Lut(int lane_id, int tab, bool wide)
      : lane(wide ? static_cast<u32>(lane_id & 15) * 8u + tab * 128u : static_cast<u32>(lane_id) * 4u + tab * 128u) {}

  __device__ __forceinline__ u32 load(u32 address) const {
    u32 value;
    // volatile: LLVM must not sink the load past the barrier before the reduction reuses this memory.
    asm volatile("ld.shared.u32 %0, [%1+%2];" : "=r"(value) : "r"(address), "n"(kLutWindow));
    return value;
  }

  __device__ __forceinline__ void load2(u32 address, u32& lo, u32& hi) const {
    asm volatile("ld.shared.v2.u32 {%0,%1}, [%2+%3];" : "=r"(lo), "=r"(hi) : "r"(address), "n"(kLutWindow));
  }

  // The callers' k, s and width are constants once their loops are unrolled, so each address below is the one or
  // two instructions written here, with immediate operands.

  // Entry of byte k (0..3) of `w` (one PRMT puts the byte into bits 8..15 of the lane's constant).
  __device__ __forceinline__ u32 byte_address(u32 w, int k) const {
    return __byte_perm(w, lane, 0x7604u | (k << 4));
  }

  // Entry of the `width` bits of `x` starting at bit s (the nibbles of 1-bit codes).
  __device__ __forceinline__ u32 field_address(u32 x, int s, int width) const {
    const u32 at8 = s >= 8 ? x >> (s - 8) : x << (8 - s);
    return (at8 & (((1u << width) - 1u) << 8)) | lane;
  }
};

// --------------------------------------------------------------------------------------------- codes
// What one width costs a lane and how its lookups run. kRowBytes: a packed row; kKeyBytes: the lane's quarter of
// a key row (dims t*D/4 ..); kValueBytes: its eighth of a value row (dims g*D/8 ..); kEntries: table entries.
template <int B, int D>
struct Code {
  static_assert(B >= 1 && B <= 4, "1 to 4 bits");
  static_assert(D == 64 || D == 128 || D == 256, "head_dim 64, 128 or 256");
  static constexpr int kBits = B;
  static constexpr int kRowBytes = D * B / 8;
  static constexpr int kKeyBytes = D * B / 32;
  static constexpr int kValueBytes = D * B / 64;
  static constexpr int kKeyWords = (kKeyBytes + 3) / 4;
  static constexpr int kValueWords = (kValueBytes + 3) / 4;
  // Alignment of a lane's slice: its offset (t * kKeyBytes, g * kValueBytes) in rows of kRowBytes.
  static constexpr int kKeyAlign = lowest_bit(kKeyBytes);
  static constexpr int kValueAlign = lowest_bit(kValueBytes);
  static constexpr bool kWide = B <= 2;  // 8-byte entries (two pairs per lookup)
  static constexpr int kEntries = B == 1 ? 16 : 256;
};

// Table entries (built by tq_decode.cu's build_tables): the entry of the index bits (i, j) of a 3- or 4-bit code is
// the pair c(i) in the low half (the lower mma index), c(j) in the high half; the 8-byte entry of four 1- or 2-bit
// indices (i0, i1, i2, i3) is the pairs (c(i0), c(i1)) and (c(i2), c(i3)).

// The lookup of the entry at `address` into one register, or (8-byte entries) two.
__device__ __forceinline__ u32 lookup(const Lut& lut, u32 address) { return lut.load(address); }

// Entry address of byte k (0..3) of `w`.
__device__ __forceinline__ u32 byte_entry(const Lut& lut, u32 w, int k) { return lut.byte_address(w, k); }

// Entry address of stream nibble q (0..7) of `w`: the high nibble of byte q / 2 for even q.
__device__ __forceinline__ u32 nibble_entry(const Lut& lut, u32 w, int q) {
  return lut.field_address(w, 4 * (q ^ 1), 4);
}

// Entry address of the six-bit field f (0..3, from the top) of a 24-bit group: the field (bits 18 - 6f ..) shifted
// to the bottom of byte 3 - f, whose two top bits the 3-bit tables ignore (one PRMT instead of a mask per field).
__device__ __forceinline__ u32 field_entry(const Lut& lut, u32 g, int f) {
  return lut.byte_address(g << (6 - 2 * f), 3 - f);
}

// A operands of k-step kk of S^T = K Q^T from the quarters `w0`, `w1` of the lane's two key rows: a0 / a1 = dims
// 4kk, 4kk + 1 of rows 0 / 1 (A rows g, g + 8), a2 / a3 = dims 4kk + 2, 4kk + 3 (the Q^T fragment holds the same
// dims).
template <int B, int D>
__device__ __forceinline__ void key_operands(const Lut& lut, const u32 (&w0)[Code<B, D>::kKeyWords],
                                             const u32 (&w1)[Code<B, D>::kKeyWords], int kk, u32& a0, u32& a1,
                                             u32& a2, u32& a3) {
  if constexpr (B == 4) {  // bytes 2kk, 2kk + 1
    const int i = kk >> 1, k = 2 * (kk & 1);
    a0 = lookup(lut, byte_entry(lut, w0[i], k));
    a1 = lookup(lut, byte_entry(lut, w1[i], k));
    a2 = lookup(lut, byte_entry(lut, w0[i], k + 1));
    a3 = lookup(lut, byte_entry(lut, w1[i], k + 1));
  } else if constexpr (B == 3) {  // group kk / 2, fields 2 (kk % 2) and the next
    const u32 g0 = group24(w0, kk >> 1), g1 = group24(w1, kk >> 1);
    const int f = 2 * (kk & 1);
    a0 = lookup(lut, field_entry(lut, g0, f));
    a1 = lookup(lut, field_entry(lut, g1, f));
    a2 = lookup(lut, field_entry(lut, g0, f + 1));
    a3 = lookup(lut, field_entry(lut, g1, f + 1));
  } else if constexpr (B == 2) {  // byte kk: both pairs in one 8-byte entry
    lut.load2(byte_entry(lut, w0[kk >> 2], kk & 3), a0, a2);
    lut.load2(byte_entry(lut, w1[kk >> 2], kk & 3), a1, a3);
  } else {  // stream nibble kk: both pairs in one 8-byte entry
    lut.load2(nibble_entry(lut, w0[kk >> 3], kk & 7), a0, a2);
    lut.load2(nibble_entry(lut, w1[kk >> 3], kk & 7), a1, a3);
  }
}

// The value side of one tile for one lane: the four value rows (keys of columns 2t, 2t + 1 in rows 0, 1 and of
// columns 2t + 8, 2t + 9 in rows 2, 3), merged per key pair so that a lookup returns one dim of two keys. Operand
// index i covers dims 2i (A row g) and 2i + 1 (A row g + 8) of the lane's eighth; key pair 0 is columns 2t, 2t + 1,
// key pair 1 columns 2t + 8, 2t + 9.
//   pair(lut, p, i, x, y): x = dim 2i, y = dim 2i + 1 of key pair p (3- and 4-bit codes, one lookup each)
//   pairs(lut, p, q, o):   o[h][0], o[h][1] = the same for i = 2q + h (1- and 2-bit codes: one 8-byte lookup gives
//                          both indices)
template <int B, int D>
struct ValueOperands {
  using C = Code<B, D>;
  static constexpr int kMerged = B == 3 ? D / 64 : C::kValueWords;  // 3 bits: 24-bit groups; else words
  // x: the first index of each pair of dims (dims 2i) of both keys of a pair, y: the second (dims 2i + 1)
  u32 x[2][kMerged], y[2][kMerged];

  __device__ __forceinline__ ValueOperands(const u32 (&v)[4][C::kValueWords]) {
    constexpr u32 kMask = B == 4 ? 0xF0F0F0F0u : B == 2 ? 0xCCCCCCCCu : B == 1 ? 0xAAAAAAAAu : 0x00E38E38u;
#pragma unroll
    for (int m = 0; m < kMerged; ++m) {
#pragma unroll
      for (int p = 0; p < 2; ++p) {
        const u32 r0 = B == 3 ? group24(v[2 * p], m) : v[2 * p][m];
        const u32 r1 = B == 3 ? group24(v[2 * p + 1], m) : v[2 * p + 1][m];
        x[p][m] = select_bits(r0, r1 >> B, kMask);
        y[p][m] = select_bits(r0 << B, r1, kMask);
      }
    }
  }

  __device__ __forceinline__ void pair(const Lut& lut, int p, int i, u32& xi, u32& yi) const {
    static_assert(B >= 3, "1- and 2-bit codes look up two indices at once (pairs)");
    if constexpr (B == 4) {  // index i is byte i of x / y
      xi = lookup(lut, byte_entry(lut, x[p][i >> 2], i & 3));
      yi = lookup(lut, byte_entry(lut, y[p][i >> 2], i & 3));
    } else {  // group i / 4, field i % 4
      xi = lookup(lut, field_entry(lut, x[p][i >> 2], i & 3));
      yi = lookup(lut, field_entry(lut, y[p][i >> 2], i & 3));
    }
  }

  __device__ __forceinline__ void pairs(const Lut& lut, int p, int q, u32 (&o)[2][2]) const {
    static_assert(B <= 2, "3- and 4-bit codes look up one index at a time (pair)");
    if constexpr (B == 2) {  // byte q of x holds dims 4q and 4q + 2 (= 2i for i = 2q, 2q + 1), of y the next ones
      lut.load2(byte_entry(lut, x[p][q >> 2], q & 3), o[0][0], o[1][0]);
      lut.load2(byte_entry(lut, y[p][q >> 2], q & 3), o[0][1], o[1][1]);
    } else {  // stream nibble q of x holds dims 4q and 4q + 2
      lut.load2(nibble_entry(lut, x[p][q >> 3], q & 7), o[0][0], o[1][0]);
      lut.load2(nibble_entry(lut, y[p][q >> 3], q & 7), o[0][1], o[1][1]);
    }
  }
};

}  // namespace fqd

#endif  // FQ_DECODE_CODES_CUH
