"""Compiled per-row kernels behind the solvers: a numba CPU kernel called through the
XLA FFI (:mod:`implicit_topk.kernels.ffi`) and a fused Pallas GPU kernel
(:mod:`implicit_topk.kernels.pallas_threshold`)."""
