"""The regularizer kinds the native mask kernels dispatch on (attribute ``kind``), in a
module without numba so that the JAX side can name them without importing the kernels."""

# The mask of z = (x - lam) / l for each kind: the p-norms' clip(z, 0, 1)^a, the
# entropy's exp(z), the binary entropy's sigmoid(z) and the Laplace CDF.
PNORM, ENTROPY, SIGMOID, LAPLACE = 0, 1, 2, 3
KINDS = {"pnorm": PNORM, "exp": ENTROPY, "sigmoid": SIGMOID, "laplace": LAPLACE}
