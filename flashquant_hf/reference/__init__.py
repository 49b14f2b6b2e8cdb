"""PyTorch reference implementation of every op: the oracle for the CUDA kernels and the CPU path."""
