"""Who may talk to the dashboard: the bind rule, the token and where it comes from, the Host
allow-list (DNS rebinding) and the same-origin rule for requests that act (POST)."""

from __future__ import annotations

import hmac
import ipaddress
import os
import socket
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import urlsplit

from aiohttp import web

TOKEN_ENV = "DELTAS_DASHBOARD_TOKEN"
LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")


class Refused(Exception):
    """A request answered with a 4xx and its reason (as JSON)."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


def is_loopback(host: str) -> bool:
    """True for a host only this machine can reach (the safe default)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, token: str) -> None:
    """Refuse to serve the memory beyond this machine without a token."""
    if not is_loopback(host) and not token:
        raise ValueError(f"host {host} is not loopback: give a token (--token-file or "
                         f"{TOKEN_ENV}) to serve it")


def read_token(given: str = "", token_file: str = "") -> str:
    """The token from --token-file, else --token, else $DELTAS_DASHBOARD_TOKEN ("": none)."""
    if token_file:
        token = Path(token_file).read_text().strip()
        if not token:
            raise ValueError(f"the token file {token_file} is empty")
        return token
    return given or os.environ.get(TOKEN_ENV, "").strip()


def host_name(authority: str) -> str:
    """The host part of a Host header or an Origin's authority, lower case, no port."""
    try:
        return (urlsplit(f"//{authority}").hostname or "").lower()
    except ValueError:  # e.g. an unclosed "[": no host we allow
        return ""


class Access:
    """The rules one dashboard applies to every request, before it is routed."""

    def __init__(self, bound: str, token: str = "", allow_hosts: Iterable[str] = ()) -> None:
        check_bind(bound, token)
        self.token = token
        names = {*LOCAL_NAMES, bound, *allow_hosts}
        if bound in ("0.0.0.0", "::"):  # every interface: the machine's own name too
            names.add(socket.gethostname())
        self.hosts = {n.strip("[]").lower() for n in names}

    def check(self, request: web.BaseRequest) -> None:
        """Raise Refused unless the request names an allowed host, carries the token when one
        is set and, when it acts (POST), comes from no page or from the dashboard's own."""
        host = request.headers.get("Host", "")
        if host_name(host) not in self.hosts:
            raise Refused(403, f"host {host!r} is not allowed (--allow-host adds one)")
        if self.token:
            given = request.headers.get("X-Token") or request.query.get("token", "")
            if not hmac.compare_digest(given.encode(), self.token.encode()):
                raise Refused(401, "token required (?token= or an X-Token header)")
        if request.method == "POST":
            origin = request.headers.get("Origin")
            if origin is not None and urlsplit(origin).netloc.lower() != host.lower():
                raise Refused(403, f"origin {origin!r} is not this dashboard's")
