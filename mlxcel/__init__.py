"""mlxcel: LLM inference on MLX across one or several hosts."""

from mlxcel.blas import preload_openblas as _preload_openblas

__version__ = "0.1.0"

# Must run before anything imports mlx.core (see mlxcel/blas.py).
_preload_openblas()
