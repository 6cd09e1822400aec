"""HTTP to one OCI registry: requests that answer its auth challenges, credentials sent only
where they belong, and answers read only up to a size.

Where the credentials (``PAGODA_REGISTRY_USERNAME`` / ``PAGODA_REGISTRY_PASSWORD``, for the registry
``PAGODA_REGISTRY_HOST`` names when it is set) go, as docker and oras decide it:

- The registry's own origin (the scheme, host and port the reference named) gets the
  ``Authorization`` header: basic credentials, or the bearer token they bought.
- A bearer challenge's token realm gets them as basic auth when it is that same origin or an
  ``https`` URL. A plain-http realm elsewhere (another host, or another port of the same host) is
  asked for an anonymous token instead: on plain http anyone on the path reads what is sent.
- Any other origin gets nothing. A redirect there (a blob served by a CDN, as Docker Hub's and
  Ollama's registries do) is followed without the header (httpx drops it on a cross-origin
  redirect); an upload ``Location`` there is sent to without it; and a 401 from such a host is an
  error, never a reason to send it the credentials. Following costs no integrity: every blob's
  digest is checked as it arrives.

Sizes: a manifest is read up to 4 MiB (``manifests.MAX_MANIFEST_BYTES``, what the OCI distribution
spec lets registries refuse beyond), streaming, and refused past it; any other answer's body (a
token, an error) up to 1 MiB.
"""

from __future__ import annotations

import base64
import json
import logging
import re

import httpx

from pagoda import envs

logger = logging.getLogger(__name__)

MAX_ANSWER_BYTES = 1 << 20  # a token, an error message, an upload's reply


class RegistryError(RuntimeError):
    pass


def credentials_from_env(host: str) -> tuple[str, str] | None:
    """``PAGODA_REGISTRY_USERNAME`` / ``PAGODA_REGISTRY_PASSWORD``, for ``host`` (``host:port``):
    with ``PAGODA_REGISTRY_HOST`` set, only for that registry (as ``docker login HOST`` scopes
    them), so pulling from another registry sends them nowhere."""
    user, password, scope = envs.PAGODA_REGISTRY_USERNAME, envs.PAGODA_REGISTRY_PASSWORD, envs.PAGODA_REGISTRY_HOST
    if not user or (scope and scope != host):
        return None
    return user, password or ""


def parse_challenge(header: str) -> tuple[str, dict[str, str]]:
    scheme, _, rest = header.strip().partition(" ")
    return scheme.lower(), dict(re.findall(r'(\w+)="([^"]*)"', rest))


def origin(url: httpx.URL) -> tuple[str, str, int | None]:
    """(scheme, host, port) with the scheme's default port filled in."""
    return url.scheme, url.host, url.port or {"http": 80, "https": 443}.get(url.scheme)


def read_capped(response: httpx.Response, limit: int, what: str) -> bytes:
    """The body of a streamed response, refused (RegistryError) once it passes ``limit`` bytes:
    a declared ``Content-Length`` over it is refused before reading anything."""
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise RegistryError(f"{what}: the answer is {int(declared)} bytes, over the {limit}-byte limit: refused")
    body = bytearray()
    for chunk in response.iter_bytes():
        body += chunk
        if len(body) > limit:
            raise RegistryError(f"{what}: the answer runs past the {limit}-byte limit: refused")
    return bytes(body)


class RegistryHTTP:
    """An httpx client bound to one registry origin, holding the Authorization that last worked."""

    def __init__(self, host: str, base: str, credentials: tuple[str, str] | None, timeout: float,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.host = host
        self.base = httpx.URL(base)
        self.credentials = credentials
        self.client = httpx.Client(timeout=httpx.Timeout(timeout, connect=10.0), transport=transport)
        self.authorization: str | None = None  # the header value that last worked

    def close(self) -> None:
        self.client.close()

    def is_registry(self, url: httpx.URL) -> bool:
        return origin(url) == origin(self.base)

    def request(self, method: str, url: str | httpx.URL, *, stream: bool = False, follow: bool = False,
                **kwargs) -> httpx.Response:
        """One request, answering at most one auth challenge (and once more for a token that
        expired); a transport failure becomes RegistryError. Without ``stream`` the body is read,
        up to ``MAX_ANSWER_BYTES``."""
        url = self.base.join(str(url))
        for attempt in range(3):
            headers = dict(kwargs.get("headers") or {})
            if self.authorization and self.is_registry(url) and "authorization" not in {k.lower() for k in headers}:
                headers["Authorization"] = self.authorization
            request = self.client.build_request(method, url, **{**kwargs, "headers": headers})
            try:
                response = self.client.send(request, stream=True, follow_redirects=follow)
            except httpx.TransportError as e:
                raise RegistryError(f"{method} {url}: {type(e).__name__}: {e}") from e
            if response.status_code != 401 or attempt == 2:
                return response if stream else self._buffered(response, f"{method} {url}")
            challenge = response.headers.get("www-authenticate", "")
            response.close()
            self._answer(challenge, response.url)
        raise AssertionError("unreachable")

    def _buffered(self, response: httpx.Response, what: str) -> httpx.Response:
        """``response`` with its body read (at most ``MAX_ANSWER_BYTES``) and the stream closed."""
        try:
            body = read_capped(response, MAX_ANSWER_BYTES, what)
        except httpx.TransportError as e:
            raise RegistryError(f"{what}: {type(e).__name__}: {e}") from e
        finally:
            response.close()
        # iter_bytes decoded the body: drop the headers that describe the encoded one
        headers = [(k, v) for k, v in response.headers.multi_items()
                   if k.lower() not in ("content-encoding", "content-length", "transfer-encoding")]
        return httpx.Response(response.status_code, headers=headers, content=body, request=response.request)

    def _answer(self, challenge: str, url: httpx.URL) -> None:
        if not self.is_registry(url):  # a redirect's target: the credentials are not for it
            raise RegistryError(f"{url.host}:{url.port or ''} (where {self.host} redirected) wants credentials; "
                                f"they are only sent to {self.base}: refused")
        scheme, params = parse_challenge(challenge)
        if scheme == "basic":
            if not self.credentials:
                raise RegistryError(f"{self.host} wants a user name and password (basic auth): set "
                                    "PAGODA_REGISTRY_USERNAME and PAGODA_REGISTRY_PASSWORD")
            token = base64.b64encode(f"{self.credentials[0]}:{self.credentials[1]}".encode()).decode()
            value = f"Basic {token}"
        elif scheme == "bearer":
            value = f"Bearer {self._fetch_token(params)}"
        else:
            raise RegistryError(f"{url}: 401 unauthorized, with an auth scheme pagoda does not speak: {challenge!r}")
        if value == self.authorization:
            raise RegistryError(f"{url}: 401 unauthorized: the registry refused the credentials")
        self.authorization = value

    def _realm_gets_credentials(self, realm: httpx.URL) -> bool:
        return realm.scheme == "https" or self.is_registry(realm)

    def _fetch_token(self, params: dict[str, str]) -> str:
        realm = params.get("realm")
        if not realm:
            raise RegistryError(f"{self.host}: a bearer challenge without a realm")
        try:
            realm_url = httpx.URL(realm)
        except httpx.InvalidURL as e:
            raise RegistryError(f"{self.host}: bearer realm {realm!r} is not a URL: {e}") from None
        query = {k: v for k, v in params.items() if k in ("service", "scope") and v}
        auth, withheld = None, ""
        if self.credentials and self._realm_gets_credentials(realm_url):
            auth = httpx.BasicAuth(*self.credentials)
        elif self.credentials:
            withheld = f" (asked anonymously: credentials go to a token realm only over https or on {self.base})"
            logger.warning("token realm %s is plain http on another origin than %s: asking for an anonymous token",
                           realm, self.base)
        try:
            with self.client.stream("GET", realm_url, params=query, auth=auth) as response:
                body = read_capped(response, MAX_ANSWER_BYTES, f"token request to {realm}")
        except httpx.TransportError as e:
            raise RegistryError(f"token request to {realm}: {type(e).__name__}: {e}") from e
        if response.status_code != 200:
            raise RegistryError(f"token request to {realm} answered {response.status_code}{withheld}: "
                                f"{body[:200].decode(errors='replace')}")
        try:
            answer = json.loads(body)
            return answer.get("token") or answer["access_token"]
        except (ValueError, KeyError, AttributeError):
            raise RegistryError(f"token request to {realm}: no token in the answer") from None


def check(response: httpx.Response, what: str, *ok: int) -> httpx.Response:
    """``response`` if its status is one of ``ok``, else RegistryError with the start of its body."""
    if response.status_code in ok:
        return response
    try:  # a buffered answer's body, or the start of a streamed one's
        body = response.content if response.is_stream_consumed else read_capped(response, MAX_ANSWER_BYTES, what)
        detail = " ".join(body[:300].decode(errors="replace").split())
    except (RegistryError, httpx.HTTPError, httpx.StreamError):
        detail = ""
    raise RegistryError(f"{what}: HTTP {response.status_code} {detail}".strip())
