"""Errors a user can act on. The CLI prints them as one line (`crag: error: ...`) and exits 2;
anything else is a bug and keeps its traceback."""

from crag.secrets import scrub


class CragError(Exception):
    """A problem with what the user asked for: input, config, paths, credentials."""


class ConfigError(CragError):
    pass


class InputError(CragError):
    pass


class UnusableIndexError(CragError):
    """A missing, incomplete or incompatible index directory."""


def describe(exc: BaseException, limit: int = 300, with_type: bool = True) -> str:
    """`exc` for a one-line message: `Type: first line of its text` (with_type=False: the first line,
    or the type's name when there is no text), scrubbed of secrets, at most `limit` characters.

    Scrubbed before it is cut, so a secret cut in two cannot slip past the mask half by half."""
    lines = str(exc).strip().splitlines()
    name = type(exc).__name__
    if not lines:
        text = name
    elif with_type:
        text = f"{name}: {lines[0]}"
    else:
        text = lines[0]
    return scrub(text)[:limit]
