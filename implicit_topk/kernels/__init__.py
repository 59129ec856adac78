"""The kernels behind the solvers, one room per backend.

* :mod:`implicit_topk.kernels.cpu`: numba kernels called as typed XLA FFI custom calls
  (the default CPU solver's, the PAV solver's), built on first use;
* :mod:`implicit_topk.kernels.gpu`: the fused Pallas kernel (Triton on CUDA and ROCm);
* :mod:`~implicit_topk.kernels.linear_map`: the primitive both backends' derivative
  kernels are bound through (a linear map and its transpose, each a kernel);
* :mod:`~implicit_topk.kernels.isotonic_dykstra`: isotonic regression by Dykstra's
  alternating projections (pure JAX, every backend);
* :mod:`~implicit_topk.kernels.export`: what ``jax.export`` is told about them.
"""
