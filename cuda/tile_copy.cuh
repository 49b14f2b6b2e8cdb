// Bulk copies global -> shared memory by the Hopper copy engine (cp.async.bulk, no tensor map), completed on an
// mbarrier that counts the bytes. sm_90+ only: before sm_90 the bodies compile to a trap (fence_barrier_init to
// nothing); callers build them only for sm_90 launches.
#ifndef FQ_TILE_COPY_CUH
#define FQ_TILE_COPY_CUH

#include "smem.cuh"

// One arrival (the copy's issuing thread) per phase; visible to the copy engine after fence_barrier_init.
__device__ __forceinline__ void barrier_init(unsigned long long* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bar)) : "memory");
#else
  __trap();
#endif
}

__device__ __forceinline__ void fence_barrier_init() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}

// The one arrival of `bar`'s current phase, which then completes once `bytes` more bytes of bulk copies counted on
// it (bulk_copy_counted) have landed. The shared bytes' previous readers must be done (see copy_tile's caller).
__device__ __forceinline__ void barrier_expect(unsigned long long* bar, unsigned int bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // generic reads of the stage before the engine's writes
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
#else
  __trap();
#endif
}

// `bytes` (a multiple of 16, both addresses 16-byte aligned) from global `src` to shared `dst`, counted on `bar`,
// whose phase barrier_expect armed for them.
__device__ __forceinline__ void bulk_copy_counted(void* dst, const void* src, unsigned int bytes,
                                                  unsigned long long* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
#else
  __trap();
#endif
}

// One bulk copy as the whole of `bar`'s phase: the phase completes when the `bytes` have landed.
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned int bytes, unsigned long long* bar) {
  barrier_expect(bar, bytes);
  bulk_copy_counted(dst, src, bytes, bar);
}

// Waits until the phase with parity `parity` of `bar` has completed.
__device__ __forceinline__ void barrier_wait(unsigned long long* bar, unsigned int parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "wait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n"
      "}\n" ::"r"(smem_addr(bar)), "r"(parity) : "memory");
#else
  __trap();
#endif
}

#endif  // FQ_TILE_COPY_CUH
