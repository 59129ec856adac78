"""Compiled per-row kernels behind the solvers, and the isotonic regressions they share.

* :mod:`~implicit_topk.kernels.cpu.ffi`: the bridge that makes a numba ``@cfunc`` an XLA FFI
  custom call (no host callback: exportable, batch partitionable);
* :mod:`~implicit_topk.kernels.cpu.native_threshold`: the sort-free threshold of the mask;
* :mod:`~implicit_topk.kernels.cpu.pav_ffi`: the PAV kernels as custom calls, with
  :mod:`~implicit_topk.kernels.cpu.isotonic_pav` (the PAV loop and its block solvers),
  :mod:`~implicit_topk.kernels.cpu.pav_capped_simplex`,
  :mod:`~implicit_topk.kernels.cpu.pav_magnitude`,
  :mod:`~implicit_topk.kernels.cpu.pav_permutahedron` and
  :mod:`~implicit_topk.kernels.cpu.radix_sort` (numba, no jax);
* :mod:`~implicit_topk.kernels.isotonic_dykstra`: isotonic regression by Dykstra's
  alternating projections (pure JAX);
* :mod:`~implicit_topk.kernels.gpu.pallas_threshold`: a fused Pallas GPU kernel.
"""
