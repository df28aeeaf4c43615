"""The project's exception: an expected, user-facing failure with one clear line."""


class MlxEvictError(ValueError):
    """Bad input or an expected fault; the CLI prints ``str(err)`` and exits non-zero."""
