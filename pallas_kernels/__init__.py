"""Pallas kernels, each beside its pure-``jnp`` reference. The model currently runs its pure-``jnp`` paths."""
