"""What stands between the dashboard and the rest of the world, as one ASGI layer in front of every route.

A server on 127.0.0.1 is still reachable by every web page the user's browser opens: a page can send it requests
(a cross-site POST needs no permission), and a page whose DNS name was rebound to 127.0.0.1 can even read the
answers. The checks, in the order they run (Jupyter's server is the model):

1. **Host**: the `Host` header must name this machine as the URL printed at start does (127.0.0.1, localhost, ::1,
   or the address bound); a page on evil.example rebound to 127.0.0.1 sends `Host: evil.example` and is refused.
   Bound to every address (0.0.0.0), any host name is accepted: the token then decides.
2. **Token**: a secret made per launch, printed in the URL (`?token=...`, exchanged for an HttpOnly SameSite=Strict
   cookie and removed from the address bar), or sent as `Authorization: Bearer ...`. Another site's page cannot know
   it, and its requests carry no SameSite=Strict cookie.
3. **Origin**: a request that changes something (POST, PUT, PATCH, DELETE) from a browser must come from this
   server's own pages: its `Origin` (or, without one, `Sec-Fetch-Site`) must say so; and a body must be JSON (a
   cross-site form or `text/plain` post cannot send that without a preflight this server never grants).
4. **Size**: a request body is read here, chunked or not, and refused past `limit` bytes before any route sees it.

Every refusal is a JSON answer with a 4xx status and the reason.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from http.cookies import SimpleCookie
from urllib.parse import parse_qs, urlencode, urlsplit

COOKIE = "lorakit_token"
CHANGES = {"POST", "PUT", "PATCH", "DELETE"}
LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1"}
WILDCARD = {"0.0.0.0", "::", ""}  # noqa: S104 - the names of "every address", compared, not bound here


class TooLarge(Exception):
    pass


class BadLength(Exception):
    pass


def host_name(host_header: str) -> str:
    """The host part of a Host header (port and IPv6 brackets removed), lower case."""
    h = host_header.strip().lower()
    if h.startswith("["):
        return h[1:h.find("]")] if "]" in h else h[1:]
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


def allowed_host(name: str, bound: str) -> bool:
    """May a request naming `name` in its Host header be served by a server bound to `bound`?"""
    bound = host_name(bound)
    if bound in WILDCARD:
        return True
    if name in LOOPBACK_NAMES or name == bound:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class Guard:
    """ASGI middleware: Host, token, Origin and body-size checks (see the module's docstring).

    Args:
        app: the ASGI app behind it.
        token: the per-launch secret; None: no token is asked (tests, and callers that check it themselves).
        bound: the address the server listens on (decides which Host names are this machine).
        limit: bytes a request body may have.
    """

    def __init__(self, app, token: str | None, bound: str = "127.0.0.1", limit: int = 64 * 1024):
        self.app, self.token, self.bound, self.limit = app, token, bound, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        method = scope.get("method", "GET")
        host = headers.get("host", "")
        if not allowed_host(host_name(host), self.bound):
            return await _refuse(send, 403, f"Host {host!r} is not this machine's name: lorakit ui answers requests "
                                            "for the address it printed (a page whose name was rebound to this "
                                            "machine is refused)")
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        given = (query.get("token") or [""])[0]
        if self.token is not None:
            sent = headers.get("authorization", "")
            sent = sent[len("bearer "):].strip() if sent.lower().startswith("bearer ") else ""
            cookie = SimpleCookie()
            try:
                cookie.load(headers.get("cookie", ""))
            except Exception:  # noqa: BLE001 - a malformed cookie header is no token
                cookie = SimpleCookie()
            candidate = sent or given or (cookie[COOKIE].value if COOKIE in cookie else "")
            if not hmac.compare_digest(candidate.encode("utf-8", "replace"), self.token.encode()):
                return await _refuse(send, 401, "this lorakit ui needs the token printed when it started: open the "
                                                "link `lorakit ui` printed (…/?token=…)")
            if given and method == "GET":  # the printed link: keep the token in a cookie, take it off the address
                rest = {k: v for k, v in query.items() if k != "token"}
                where = scope.get("path", "/") + ("?" + urlencode(rest, doseq=True) if rest else "")
                return await _redirect(send, where, self.token)
        if method in CHANGES:
            why = _cross_site(headers, host)
            if why:
                return await _refuse(send, 403, why)
        try:
            body = await _read_body(receive, headers, self.limit)
        except TooLarge:
            return await _refuse(send, 413, f"request body over {self.limit} bytes")
        except BadLength:
            return await _refuse(send, 400, f"Content-Length {headers.get('content-length')!r} is not a number")
        if body and method in CHANGES and headers.get("content-type", "").split(";")[0].strip() != "application/json":
            return await _refuse(send, 415, "send the request body as application/json")
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the client's disconnect, for streams

        return await self.app(scope, replay, send)


def _cross_site(headers: dict, host: str) -> str | None:
    """Why a state-changing request does not come from this server's own pages (None when it does, or when it comes
    from no browser at all: a script with the token)."""
    origin = headers.get("origin")
    if origin is not None:
        o = urlsplit(origin)
        if origin == "null" or o.netloc.lower() != host.strip().lower():
            return f"a request from {origin} to change something here is refused (only this server's own pages may)"
        return None
    site = headers.get("sec-fetch-site")
    if site is not None and site not in ("same-origin", "none"):
        return f"a {site} request to change something here is refused (only this server's own pages may)"
    return None


async def _read_body(receive, headers: dict, limit: int) -> bytes:
    """The whole request body, refused (TooLarge) as soon as it passes `limit` — by its Content-Length or by what
    arrives (a chunked body has none)."""
    try:
        declared = int(headers.get("content-length") or 0)
    except ValueError:
        raise BadLength from None
    if declared > limit:
        raise TooLarge
    chunks, size = [], 0
    while True:
        msg = await receive()
        if msg["type"] != "http.request":
            break
        part = msg.get("body", b"")
        size += len(part)
        if size > limit:
            raise TooLarge
        chunks.append(part)
        if not msg.get("more_body"):
            break
    return b"".join(chunks)


async def _refuse(send, status: int, message: str) -> None:
    body = json.dumps({"error": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"cache-control", b"no-store")]})
    await send({"type": "http.response.body", "body": body})


async def _redirect(send, where: str, token: str) -> None:
    cookie = f"{COOKIE}={token}; Path=/; HttpOnly; SameSite=Strict"
    await send({"type": "http.response.start", "status": 303,
                "headers": [(b"location", where.encode("latin-1", "replace")), (b"set-cookie", cookie.encode()),
                            (b"content-length", b"0"), (b"cache-control", b"no-store")]})
    await send({"type": "http.response.body", "body": b""})
