"""The GPU kernel: one fused Pallas kernel per block of rows (Triton on CUDA and ROCm,
interpret mode elsewhere), certified inside the kernel.

* :mod:`~implicit_topk.kernels.gpu.pallas_threshold`: the kernel and its calls;
* :mod:`~implicit_topk.kernels.gpu.pallas_derivatives`: its implicit derivatives, one
  Pallas kernel each way (tangent, cotangent);
* :mod:`~implicit_topk.kernels.gpu.bounded_newton`: the safeguarded Newton iteration with
  ordered-bit bisection that bounds its passes (``proofs/pallas_bounded_iteration.md``);
* :mod:`~implicit_topk.kernels.gpu.pallas_long_rows`: rows read in chunks;
* :mod:`~implicit_topk.kernels.gpu.platform_select`: one branch per platform, each lowered
  for its own platform only.
"""
