"""The CPU kernels: numba handlers called as typed XLA FFI custom calls.

* :mod:`~implicit_topk.kernels.cpu.abi`: the C side of the FFI handler protocol (numba);
* :mod:`~implicit_topk.kernels.cpu.ffi`: the JAX side (the custom-call primitives, no numba);
* :mod:`~implicit_topk.kernels.cpu.registry`: each handler compiled and registered on
  first use;
* :mod:`~implicit_topk.kernels.cpu.partitioning`: the kernel calls custom-partitioned
  under ``jit`` (a split reduced axis runs the threshold iteration with ``psum``);
* the default solver's kernels, :mod:`~implicit_topk.kernels.cpu.native_mask` (the
  mask kernel's entry) over :mod:`~implicit_topk.kernels.cpu.native_threshold` (one row)
  and :mod:`~implicit_topk.kernels.cpu.native_lanes` (short rows across a block),
  :mod:`~implicit_topk.kernels.cpu.native_derivatives` and
  :mod:`~implicit_topk.kernels.cpu.native_magnitude`, called from JAX by
  :mod:`~implicit_topk.kernels.cpu.native_calls`;
* the PAV kernels (:mod:`~implicit_topk.kernels.cpu.pav_ffi`, their JAX calls
  :mod:`~implicit_topk.kernels.cpu.pav_calls`, the PAV loop
  :mod:`~implicit_topk.kernels.cpu.isotonic_pav`, the problems' drivers and
  :mod:`~implicit_topk.kernels.cpu.radix_sort`).
"""
