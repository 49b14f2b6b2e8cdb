// The hardware exp2 / log2 approximations and +inf, for the kernels that weight by exp2 (the decode kernel and the
// split merge): device-only, global namespace, inlined into each source by kernels/loader.py.
#ifndef FQ_FAST_MATH_CUH
#define FQ_FAST_MATH_CUH

// NVRTC has no <math.h>: +inf from its bit pattern.
__device__ __forceinline__ float inf() { return __int_as_float(0x7f800000); }

// 2^x in one MUFU op (ex2.approx.ftz: 2 ulp; ex2(-inf) = +0).
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// log2(x) in one MUFU op (lg2.approx.ftz).
__device__ __forceinline__ float lg2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

#endif  // FQ_FAST_MATH_CUH
