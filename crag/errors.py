"""Errors a user can act on. The CLI prints them as one line (`crag: error: ...`) and exits 2;
anything else is a bug and keeps its traceback (scrubbed, exit 1)."""

import re

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
    or the type's name when there is no text), scrubbed of secrets, at most `limit` characters. When
    the first line only introduces the cause, the cause comes with it: the links of a chain of
    "caused by" lines (DataFusion), or the lines after one that ends in ':' (gRPC's status and
    details, from Spark Connect).

    Scrubbed before it is cut, so a secret cut in two cannot slip past the mask half by half."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    name = type(exc).__name__
    if not lines:
        return scrub(name)[:limit]
    text = lines[0]
    if any(line.lower() == "caused by" for line in lines):
        text = ": ".join(line for line in lines if line.lower() != "caused by")
    elif text.endswith(":") and len(lines) > 1:
        text = " ".join(lines)
    return scrub(f"{name}: {text}" if with_type else text)[:limit]


def spark_error_line(exc: BaseException) -> str:
    """The line of a Spark error that says what went wrong (py4j puts "An error occurred while calling
    ..." first, and Java's exception class before the text)."""
    lines = [
        line.strip()
        for line in str(exc).splitlines()
        if line.strip() and not line.startswith("An error occurred while calling")
    ]
    # py4j's Java error: ": org.apache.spark.SparkException: [CLASS] text"
    return re.sub(r"^(: )?[\w.$]+(Exception|Error): ", "", lines[0]) if lines else type(exc).__name__


def interrupt_in(exc: BaseException | None) -> KeyboardInterrupt | None:
    """The Ctrl-C or SIGTERM behind an error, if any: Spark's collect turns an interrupted read into an
    error of the cancelled job, raised while the interrupt is handled."""
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, KeyboardInterrupt):
            return exc
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None
