// The 32-bit shared-window address of a generic pointer into shared memory: what ld/st.shared, ldmatrix, cp.async,
// cp.async.bulk and mbarrier instructions take.
#ifndef FQ_SMEM_CUH
#define FQ_SMEM_CUH

__device__ __forceinline__ unsigned int smem_addr(const void* p) {
  return static_cast<unsigned int>(__cvta_generic_to_shared(p));
}

#endif  // FQ_SMEM_CUH
