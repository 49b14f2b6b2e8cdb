// Programmatic dependent launch (sm_90+): a grid launched with programmatic stream serialization may start while
// its predecessor in the stream is still running. It must call grid_dependency_wait() before reading anything the
// predecessor wrote or writing anything it reads; grid_dependents_launch() lets the next such grid be scheduled.
// Both are no-ops for ordinary launches and compile to nothing before sm_90.
#ifndef FQ_GRID_DEPENDENCY_CUH
#define FQ_GRID_DEPENDENCY_CUH

__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void grid_dependents_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

#endif  // FQ_GRID_DEPENDENCY_CUH
