"""The configuration errors, where every config module can import them."""


class UnsupportedArchitectureError(ValueError):
    """A checkpoint's config.json names a model (or a setting of one) that jspec does not run."""
