"""PyTorch implementations of ops for CPU tensors: the reference's signatures and results, in fewer and larger
ops (:mod:`flashquant_hf.ops` chooses them for CPU tensors on the torch backend)."""
