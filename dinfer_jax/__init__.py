"""dinfer_jax: a JAX/XLA port of DeepSeek's DeepInfer inference engine for the DeepSeek-V4 family."""

__version__ = "0.1.0.dev0"
