"""Where an operator command acts: through the HTTP API with a token, or,
with no API named, on the database and Temporal directly (as before).

The token is held apart from everything printable: it is never in a
message, a ``repr`` or a command we print for people to run next.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import httpx
import typer

from roundtable.cli.output import usage_error

API_URL_VAR = "ROUNDTABLE_API_URL"
API_TOKEN_VAR = "ROUNDTABLE_API_TOKEN"  # noqa: S105 (a variable's name)

ApiUrl = Annotated[
    str | None,
    typer.Option(
        "--api",
        metavar="URL",
        help="Act through the HTTP API at URL (default: $ROUNDTABLE_API_URL); "
        "without it, on the database and Temporal directly.",
    ),
]
ApiToken = Annotated[
    str | None,
    typer.Option(
        "--token",
        metavar="TOKEN",
        help="Bearer token for the API (default: $ROUNDTABLE_API_TOKEN). A command "
        "line is visible to other local users: prefer the variable or --token-file.",
    ),
]
ApiTokenFile = Annotated[
    Path | None,
    typer.Option("--token-file", metavar="FILE", help="Read the API token from FILE."),
]


@dataclass(frozen=True)
class Endpoint:
    """The API to call and the token to call it with."""

    url: str
    token: str = field(repr=False)
    token_file: Path | None = None  # where the token came from, if a file
    # How the token was given: --token, $ROUNDTABLE_API_TOKEN or --token-file.
    given_as: Literal["flag", "env", "file"] = "env"

    @property
    def shown(self) -> str:
        """The URL as messages print it (it holds no credentials: refused)."""
        return self.url

    @property
    def exposed(self) -> bool:
        """Whether the token would cross a network in the clear: plain http://
        to a host that is not this machine."""
        url = httpx.URL(self.url)
        return url.scheme == "http" and not _loopback(url.host)

    def options(self) -> list[str]:
        """Options that point another command at this API. A token given on
        the command line or in the environment is not repeated: the
        environment may hold it, and a flag's value must not be printed
        (options_note says what such a command needs)."""
        via = ["--api", self.url]
        if self.token_file is not None:
            via += ["--token-file", str(self.token_file)]
        return via

    def options_note(self) -> str | None:
        """What a command printed with ``options()`` needs to work, if anything."""
        if self.given_as == "flag":
            return (
                f"these commands read the API token from ${API_TOKEN_VAR} (a --token value "
                f"is never printed): export {API_TOKEN_VAR} first, or add --token-file FILE"
            )
        if self.given_as == "env":
            return f"these commands read the API token from ${API_TOKEN_VAR}, as this one did"
        return None


def _loopback(host: str) -> bool:
    if host.lower() == "localhost" or host.lower().endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def named(api: str | None) -> bool:
    """Whether an API was named, by option or environment."""
    return bool((api or os.environ.get(API_URL_VAR) or "").strip())


def resolve(api: str | None, token: str | None, token_file: Path | None) -> Endpoint | None:
    """The endpoint the options and environment name, or None: act directly.

    Only the URL chooses the API: a token in the environment alone changes
    nothing, but a token flag without a URL is a mistake worth naming."""
    url = (api or os.environ.get(API_URL_VAR) or "").strip()
    if not url:
        if token is not None or token_file is not None:
            raise usage_error(f"--token and --token-file go with --api URL (or ${API_URL_VAR})")
        return None
    url = _checked_url(url)
    if token is not None and token_file is not None:
        raise usage_error("give the token once: --token or --token-file, not both")
    if token_file is not None:
        secret, source = _read_token_file(token_file), token_file.expanduser().resolve()
        kind = "file"
    else:
        secret, source = token if token is not None else os.environ.get(API_TOKEN_VAR), None
        kind = "flag" if token is not None else "env"
    if secret is None or not secret.strip():
        raise usage_error(
            f"no API token for {url}: set ${API_TOKEN_VAR} or pass --token-file FILE "
            "(`roundtable tokens create --user ID --role operator` makes one)"
        )
    return Endpoint(url=url, token=_checked_token(secret), token_file=source, given_as=kind)


def _checked_url(url: str) -> str:
    # The value is not echoed: a token pasted in the wrong place would be.
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError, ValueError) as exc:
        raise usage_error("--api must be a URL such as http://127.0.0.1:8000") from exc
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise usage_error("--api must be an http:// or https:// URL such as http://127.0.0.1:8000")
    if parsed.userinfo:
        raise usage_error(f"--api takes no credentials: the token goes in ${API_TOKEN_VAR}")
    if parsed.query or parsed.fragment:
        raise usage_error("--api takes the API's base URL, without a query or fragment")
    return url.rstrip("/")


def _read_token_file(path: Path) -> str:
    try:
        return path.expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise usage_error(f"cannot read the token file {path}: {reason}") from exc


def _checked_token(secret: str) -> str:
    token = secret.strip()
    # A header value cannot carry these; say so without echoing the value.
    if not token.isascii() or not token.isprintable() or any(c.isspace() for c in token):
        raise usage_error("the API token has spaces or control characters in it")
    return token
