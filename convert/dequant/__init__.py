"""bnb -> float numerics, pure NumPy: products, kernels, float16 rounding."""
