"""A small stdlib client of the server (the CLI's register / list / unregister / metrics, and the demo's traffic).
Applications generate through any OpenAI client instead."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from urllib.parse import quote

DEFAULT_URL = "http://127.0.0.1:8000"
URL_ENV = "ADAPTER_MANAGER_URL"
TOKEN_ENV = "ADAPTER_MANAGER_ADMIN_TOKEN"


class ServerError(Exception):
    """The server answered with an error (``status`` >= 400) or could not be reached (``status`` 0)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}" if status else message)
        self.status = status
        self.message = message


class ServerClient:
    """Talks to one server; `url` defaults to $ADAPTER_MANAGER_URL, the token to $ADAPTER_MANAGER_ADMIN_TOKEN."""

    def __init__(self, url: str | None = None, token: str | None = None, timeout: float = 300.0) -> None:
        self.url = (url or os.environ.get(URL_ENV) or DEFAULT_URL).rstrip("/")
        token = token or os.environ.get(TOKEN_ENV)
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout = timeout
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through a proxy

    def register(self, ref: str, adapter_id: str | None = None, revision: str | None = None, pin: bool = False) -> dict:
        body = {"ref": ref, "id": adapter_id, "revision": revision, "pin": pin}
        return self._call("POST", "/v1/adapters", body={k: v for k, v in body.items() if v is not None})

    def adapters(self) -> list[dict]:
        return self._call("GET", "/v1/adapters")["data"]

    def adapter(self, adapter_id: str) -> dict:
        return self._call("GET", f"/v1/adapters/{_path(adapter_id)}")

    def unregister(self, adapter_id: str) -> dict:
        return self._call("DELETE", f"/v1/adapters/{_path(adapter_id)}")

    def pin(self, adapter_id: str) -> dict:
        return self._call("POST", f"/v1/adapters/{_path(adapter_id)}/pin")

    def unpin(self, adapter_id: str) -> dict:
        return self._call("POST", f"/v1/adapters/{_path(adapter_id)}/unpin")

    def swaps(self) -> dict:
        return self._call("GET", "/v1/metrics/swaps")

    def prometheus(self) -> str:
        return self._call("GET", "/metrics", text=True)

    def health(self) -> dict:
        return self._call("GET", "/health")

    def complete(self, model: str, prompt: str, max_tokens: int = 16, **fields: object) -> dict:
        """POST /v1/completions (non-streaming)."""
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, **fields}
        return self._call("POST", "/v1/completions", body=body)

    def close(self) -> None:
        self._opener.close()

    def __enter__(self) -> ServerClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _call(self, method: str, path: str, text: bool = False, body: dict | None = None):
        data = None if body is None else json.dumps(body).encode()
        headers = {**self._headers, **({"Content-Type": "application/json"} if data is not None else {})}
        request = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
        try:
            with self._opener.open(request, timeout=self._timeout) as response:
                answer = response.read().decode()
        except urllib.error.HTTPError as err:
            raise ServerError(err.code, _message(err.read().decode(errors="replace"))) from err
        except (urllib.error.URLError, OSError) as err:
            raise ServerError(0, f"cannot reach the server at {self.url}: {err}") from err
        return answer if text else json.loads(answer)


def _message(body: str) -> str:
    """The OpenAI-shaped error's message, else the raw body."""
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body


def _path(adapter_id: str) -> str:
    """Ids keep their '/' (the server's routes take them as paths); anything else odd is escaped."""
    return quote(adapter_id, safe="/@:")
