"""The one exception type that entry points turn into a one-paragraph message (no traceback)."""


class LmcalError(Exception):
    """A user-facing error: bad input, missing files, bad settings. Its message says how to fix it."""


class DataError(LmcalError):
    """Missing, corrupt or malformed corpus files."""
