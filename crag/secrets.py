"""Keeping secrets out of every text crag writes: error texts, decision reasons, screen output and
stored configs.

Two things are scrubbed, whatever the exception type or config key they come in:
- credentials inside URLs: the user:password@ part of any scheme://user:password@host, and the values
  of query parameters named like a credential (?token=..., &api_key=...);
- every secret value crag has resolved (`remember`, called where a credential is read), also in its
  URL-encoded form and as Python's repr and JSON escape it (an HTTP library's error quotes a header).

A credential that is itself a URL (DATABRICKS_HOST may be http://user:TOKEN@host) is not secret as a
whole: only its user:password part is remembered, so error texts still name the host.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Iterable
from typing import Any
from urllib.parse import quote, quote_plus, urlsplit

MASK = "***"
# Shorter values are not recognisable in free text: masking them would garble every message (a
# one-letter "secret" would mask that letter everywhere) and protect nothing.
MIN_SECRET_CHARS = 4

# scheme://userinfo@ : the userinfo runs to the last "@" before the host part ends ("/", space, quote).
_URL_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*://)(?P<userinfo>[^/\s'\"<>@]*(?:@[^/\s'\"<>@]*)*)@")
# Names that are nothing but a credential's ("token", "api_key", "passwords", "http_auth", ...)
_CREDENTIAL_WORDS = (
    r"token|(?:secret|password|passwd|pwd|passphrase|api_?key|access_?key|secret_?key|private_?key|auth|cookie"
    r"|credential)s?"
)
# name=value where the name ends like a credential's: in a URL's query or parameters (?token=, ;code=),
# and, for names that are nothing but a credential's, also where a message quotes the parameter alone
# ("Parameter 'token=...' should be ..."; not "status_code=503" or "index_key=abc" in free text)
_CREDENTIAL_PARAM = re.compile(
    r"(?P<name>(?:[?&;][A-Za-z0-9_\-]*(?:token|(?:secret|password|passwd|pwd|passphrase|key|signature|sig|auth|code"
    rf"|cookie)s?)|(?:^|(?<=[\s'\"(\[,]))[A-Za-z0-9_\-]*(?:{_CREDENTIAL_WORDS}))=)(?P<value>[^&#;\s'\"<>)\],]+)",
    re.I,
)

_known: set[str] = set()
_lock = threading.Lock()


def secret_parts(value: str | None) -> list[str]:
    """The parts of a credential's value that are secret: its user:password (and password) when it is
    a URL, else the whole value."""
    if not value:
        return []
    parts = urlsplit(value) if "://" in value else None
    if parts is not None and parts.scheme and parts.netloc:
        found = []
        if "@" in parts.netloc:
            userinfo = parts.netloc.rpartition("@")[0]
            found.append(userinfo)
            user, _, password = userinfo.partition(":")
            found += [password] if password else [user]
        return [p for p in found if len(p) >= MIN_SECRET_CHARS]
    return [value] if len(value) >= MIN_SECRET_CHARS else []


def remember(values: Iterable[str | None]) -> None:
    """Add resolved credential values to the ones this process scrubs from every text."""
    with _lock:
        for value in values:
            for part in secret_parts(value):
                _known.update(_written_forms(part))


def _written_forms(part: str) -> set[str]:
    """The ways a secret appears in text: as is, URL-encoded, and escaped by repr and by JSON."""
    return {part, quote(part, safe=""), quote_plus(part), repr(part)[1:-1], json.dumps(part)[1:-1]}


def known() -> frozenset[str]:
    with _lock:
        return frozenset(_known)


def scrub_credentials(text: Any) -> Any:
    """`text` with the credentials inside URLs masked (user:password@, ?token=...): what can be seen in
    the text itself, whatever this process has resolved. Non-strings pass unchanged."""
    if not isinstance(text, str) or not text:
        return text
    return _CREDENTIAL_PARAM.sub(lambda m: f"{m.group('name')}{MASK}", _mask_userinfo(text))


def _mask_userinfo(text: str) -> str:
    return _URL_USERINFO.sub(lambda m: f"{m.group('scheme')}{MASK}@", text)


def scrub(text: Any, extra: Iterable[str] = ()) -> Any:
    """`text` with URL credentials and every known secret value masked; non-strings pass unchanged."""
    if not isinstance(text, str) or not text:
        return text
    text = scrub_credentials(text)
    # Longest first, so a value that contains another is masked whole.
    for value in sorted(known() | set(extra), key=len, reverse=True):
        if value and value in text:
            text = text.replace(value, MASK)
    return text


# Keys whose value is a secret. A suffix rule on the lower-cased key: "token", "api_key", "password",
# "secret_access_key", "Authorization", "http_auth", "basic_auth", "Cookie" and the like at the end of
# the name, and their plurals ("api_keys"; not "tokens": `max_tokens` and `prompt_tokens` are counts). crag's
# `guided_regex_key` names a request field. Keys ending in _env name an environment variable (where a
# secret comes from), not the secret; crag.config checks that they hold a variable's name.
_SECRET_KEY = re.compile(
    r"(token|(secret|password|passwd|pwd|passphrase|(?<!regex_)key|auth|credential|cookie)s?|authorization"
    r"|connection[_-]?string)$",
    re.I,
)


def is_secret_key(key: str) -> bool:
    return bool(_SECRET_KEY.search(str(key))) and not str(key).lower().endswith("_env")


def _env_secrets(value: Any, found: set[str]) -> None:
    """Secret parts of the environment variables a config names in its *_env keys."""
    if isinstance(value, dict):
        for k, v in value.items():
            if str(k).endswith("_env") and isinstance(v, str):
                for part in secret_parts(os.environ.get(v)):
                    found.update(_written_forms(part))
            else:
                _env_secrets(v, found)
    elif isinstance(value, list):
        for v in value:
            _env_secrets(v, found)


def redact_config(value: Any) -> Any:
    """A JSON-able config fit to store: secret-bearing keys masked, and every string value scrubbed of
    URL credentials, of resolved secrets and of the values of the environment variables the config
    names as credentials (token_env, api_key_env, host_env, ...)."""
    extra: set[str] = set()
    _env_secrets(value, extra)
    return _masked(value, is_secret_key, lambda text: scrub(text, extra))


# Keys, and URL parameters, that hold a credential and nothing else: a narrower rule than is_secret_key,
# which also masks settings such as a vector store's `text_key` in stored configs (harmless there).
_CREDENTIAL_NAME = re.compile(rf"({_CREDENTIAL_WORDS}|authorization|connection[_-]?string)$", re.I)
_URL_CREDENTIAL_PARAM = re.compile(r"(?P<name>[?&;][A-Za-z0-9_\-]*=)(?P<value>[^&#;\s'\"<>]+)")


def masked(value: Any) -> Any:
    """A JSON-able config with its credentials masked by their look alone, the same in every process:
    values of credential keys, and the user info and credential parameters of URLs (sc://...;token=).
    What a stored hash of a config is taken over, so that it cannot confirm a guess at one of them;
    narrower than redact_config's masking, so that configs that differ in what they compute (a store's
    `text_key`, a filter's text) still hash apart."""
    return _masked(value, _credential_key, _scrub_url_credentials)


def _credential_key(key: str) -> bool:
    return bool(_CREDENTIAL_NAME.search(str(key))) and not str(key).lower().endswith("_env")


def _scrub_url_credentials(text: Any) -> Any:
    if not isinstance(text, str) or "://" not in text:
        return text
    return _URL_CREDENTIAL_PARAM.sub(
        lambda m: m.group("name") + (MASK if _credential_key(m.group("name")[1:-1]) else m.group("value")),
        _mask_userinfo(text),
    )


def _masked(node: Any, is_secret, scrub_text) -> Any:
    if isinstance(node, dict):
        return {k: (MASK if v and is_secret(k) else _masked(v, is_secret, scrub_text)) for k, v in node.items()}
    if isinstance(node, list):
        return [_masked(v, is_secret, scrub_text) for v in node]
    return scrub_text(node)
