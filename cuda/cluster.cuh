// Thread-block clusters (sm_90+): rank, distributed shared memory stores and the cluster barrier, for kernels with
// compile-time __cluster_dims__ (FQ_CLUSTER_DIMS). Below sm_90 no cluster kernel is launched: the helpers trap.
#ifndef FQ_CLUSTER_CUH
#define FQ_CLUSTER_CUH

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define FQ_CLUSTER_DIMS(n)
__device__ __forceinline__ unsigned int cluster_rank() { __trap(); return 0; }
__device__ __forceinline__ unsigned int cluster_map(unsigned int, unsigned int) { __trap(); return 0; }
__device__ __forceinline__ void st_cluster_v4(unsigned int, unsigned int, unsigned int, unsigned int, unsigned int) {
  __trap();
}
__device__ __forceinline__ void st_cluster_f32(unsigned int, float) { __trap(); }
__device__ __forceinline__ void cluster_arrive() { __trap(); }
__device__ __forceinline__ void cluster_wait() { __trap(); }
#else
#define FQ_CLUSTER_DIMS(n) __cluster_dims__(n, 1, 1)
__device__ __forceinline__ unsigned int cluster_rank() {
  unsigned int r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
// shared::cluster address of shared::cta address `addr` in the CTA of rank `rank`.
__device__ __forceinline__ unsigned int cluster_map(unsigned int addr, unsigned int rank) {
  unsigned int r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
  return r;
}
__device__ __forceinline__ void st_cluster_v4(unsigned int addr, unsigned int x, unsigned int y, unsigned int z,
                                              unsigned int w) {
  asm volatile("st.shared::cluster.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(x), "r"(y), "r"(z), "r"(w)
               : "memory");
}
__device__ __forceinline__ void st_cluster_f32(unsigned int addr, float v) {
  asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(addr), "f"(v) : "memory");
}
// Every thread of every CTA of the cluster must arrive; release / acquire order the shared-memory accesses.
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }
#endif

#endif  // FQ_CLUSTER_CUH
