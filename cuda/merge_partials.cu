// Log-sum-exp merge of S partial attention results over disjoint key sets (split-K decode, exact-window merge).
//
//   outs [S, rows, D] fp32, each normalised by its own softmax sum; lses [S, rows] fp32, natural log, -inf for a
//   split that saw no key.  out[r] = sum_s w_s outs[s, r] / sum_s w_s with w_s = exp(lse_s - max_s lse_s);
//   lse[r] = max + log(sum_s w_s), or -inf (and out 0) when every split is empty.
//
// One warp per row; each lane owns D/32 consecutive floats (vector loads), so a row costs S coalesced reads.
// The weights are computed lane-parallel (lane j: split s0 + j, its lse read once) and broadcast with shuffles,
// so the S row reads do not wait on each other: a row with 32 splits (B=1, N=128K decode) at D <= 128 costs two
// L2 round trips (lses, then every row read), not 32 as a loop over the splits would. D = 0 selects a generic
// loop over any head_dim.
//
// Build switches: none (kernels/merge_partials.py compiles every instantiation without options).

#include "fast_math.cuh"
#include "grid_dependency.cuh"

namespace fqr {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr int kRowsPerBlock = 8;

template <int N>
struct Vec {
  float x[N];
};

template <int N>
__device__ __forceinline__ void load_vec(Vec<N>& v, const float* p) {
  if constexpr (N == 2) {
    const float2 a = *reinterpret_cast<const float2*>(p);
    v.x[0] = a.x, v.x[1] = a.y;
  } else {
#pragma unroll
    for (int i = 0; i < N; i += 4) {
      const float4 a = *reinterpret_cast<const float4*>(p + i);
      v.x[i] = a.x, v.x[i + 1] = a.y, v.x[i + 2] = a.z, v.x[i + 3] = a.w;
    }
  }
}

template <int N>
__device__ __forceinline__ void store_vec(float* p, const Vec<N>& v) {
  if constexpr (N == 2) {
    *reinterpret_cast<float2*>(p) = make_float2(v.x[0], v.x[1]);
  } else {
#pragma unroll
    for (int i = 0; i < N; i += 4) {
      *reinterpret_cast<float4*>(p + i) = make_float4(v.x[i], v.x[i + 1], v.x[i + 2], v.x[i + 3]);
    }
  }
}

// outs element (s, r, d) at outs[s * o_ss + r * o_sr + d]; lses (s, r) at lses[s * l_ss + r * l_sr];
// out [rows, head_dim] and lse [rows] contiguous. kInFlight: row reads issued before the first is used (32 for
// many splits; 4 keeps the registers low for the many-row, few-split merges of the prefill).
template <int D, int kInFlight>
__global__ void __launch_bounds__(32 * kRowsPerBlock)
merge_partials_kernel(const float* __restrict__ outs, long long o_ss, long long o_sr, const float* __restrict__ lses,
              long long l_ss, long long l_sr, float* __restrict__ out, float* __restrict__ lse, int num_splits,
              int rows, int head_dim) {
  grid_dependency_wait();  // the partials come from the decode or prefill grid launched just before
  const int lane = threadIdx.x & 31;
  const int row = blockIdx.x * kRowsPerBlock + (threadIdx.x >> 5);
  if (row >= rows) return;
  const float* l_row = lses + row * l_sr;
  const float l_first = lane < num_splits ? l_row[lane * l_ss] : -inf();  // kept for the first 32 weights
  float mx = l_first;
  for (int s = lane + 32; s < num_splits; s += 32) mx = fmaxf(mx, l_row[s * l_ss]);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  const float* o_row = outs + row * o_sr;
  float* dst = out + static_cast<long long>(row) * head_dim;
  if (mx == -inf()) {  // every split empty: out 0, lse -inf (and no NaN from -inf - -inf)
    for (int d = lane; d < head_dim; d += 32) dst[d] = 0.f;
    if (lane == 0) lse[row] = -inf();
    return;
  }
  const float mx2 = mx * kLog2e;
  float total = 0.f;
  if constexpr (D > 0) {
    static_assert(D == 64 || D == 128 || D == 256, "vector path: D in {64, 128, 256}");
    constexpr int N = D / 32;
    Vec<N> acc;
#pragma unroll
    for (int i = 0; i < N; ++i) acc.x[i] = 0.f;
    static_assert(kInFlight >= 1 && kInFlight <= 32 && kInFlight * N <= 128, "reads in flight: registers");
    for (int s0 = 0; s0 < num_splits; s0 += 32) {
      const int count = min(32, num_splits - s0);
      const float l = s0 == 0 ? l_first : (lane < count ? l_row[(s0 + lane) * l_ss] : -inf());
      const float w_lane = ex2(fmaf(l, kLog2e, -mx2));  // 0 for an empty split (lse -inf)
      total += w_lane;
      const float* o_split = o_row + s0 * o_ss + lane * N;
      for (int j0 = 0; j0 < count; j0 += kInFlight) {
        Vec<N> v[kInFlight];  // every read of the batch issued before the first is used
#pragma unroll
        for (int j = 0; j < kInFlight; ++j) {
          if (j0 + j < count) load_vec(v[j], o_split + (j0 + j) * o_ss);
        }
#pragma unroll
        for (int j = 0; j < kInFlight; ++j) {
          const float w = __shfl_sync(0xffffffffu, w_lane, j0 + j);
          if (j0 + j >= count) break;
          // An empty split (w = 0) may hold anything: select, so its row neither counts nor turns acc into NaN.
#pragma unroll
          for (int i = 0; i < N; ++i) acc.x[i] = w != 0.f ? fmaf(w, v[j].x[i], acc.x[i]) : acc.x[i];
        }
      }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) total += __shfl_xor_sync(0xffffffffu, total, off);
    const float inv = 1.f / total;
#pragma unroll
    for (int i = 0; i < N; ++i) acc.x[i] *= inv;
    store_vec(dst + lane * N, acc);
  } else {
    for (int s = 0; s < num_splits; ++s) total += ex2(fmaf(l_row[s * l_ss], kLog2e, -mx2));
    const float inv = 1.f / total;
    for (int d = lane; d < head_dim; d += 32) {
      float acc = 0.f;
      for (int s = 0; s < num_splits; ++s) {
        const float w = ex2(fmaf(l_row[s * l_ss], kLog2e, -mx2));
        if (w != 0.f) acc = fmaf(w, o_row[s * o_ss + d], acc);
      }
      dst[d] = acc * inv;
    }
  }
  if (lane == 0) lse[row] = mx + lg2(total) * kLn2;
}

}  // namespace fqr
