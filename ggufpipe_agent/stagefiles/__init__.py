"""Stage files: writing one from a model, streaming it, and the private cache that holds them."""
