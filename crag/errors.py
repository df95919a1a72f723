"""Errors a user can act on. The CLI prints them as one line (`crag: error: ...`) and exits 2;
anything else is a bug and keeps its traceback."""


class CragError(Exception):
    """A problem with what the user asked for: input, config, paths, credentials."""


class ConfigError(CragError):
    pass


class InputError(CragError):
    pass


class UnusableIndexError(CragError):
    """A missing, incomplete or incompatible index directory."""
