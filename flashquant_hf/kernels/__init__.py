"""Thin CuPy wrappers over the CUDA kernels in ``cuda/``: one module per ``cuda/<op>.cu``.

Importing a wrapper never imports CuPy; the first launch does. Each wrapper lists the template
instantiations it supports in ``NAME_EXPRESSIONS`` (the CI compile check instantiates exactly these).
"""
