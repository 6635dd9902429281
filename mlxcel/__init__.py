"""mlxcel: LLM inference on MLX across one or several hosts."""

__version__ = "0.1.0"
