"""A small client for OpenAI-compatible servers (vLLM, SGLang, TGI): ``data distill --endpoint``.

Standard library only (``http.client``, ``json``): no SDK to install or pin. What it does:

* **Start-up check** (:meth:`EndpointClient.connect`): ``GET /v1/models``. An unreachable server,
  a server that does not serve ``--model`` (its models are named), or one that serves several
  when none was asked for, is a one-line :class:`~draftsmith.train.errors.UsageError`.
* **Requests** (:meth:`EndpointClient.complete`, :meth:`EndpointClient.chat`): one non-streaming
  completion with the sampling settings of the HF path sent explicitly (vLLM otherwise fills
  unset ones from the model's ``generation_config.json``), the end-of-turn ids as
  ``stop_token_ids``, special tokens kept in the text, and ``return_token_ids`` so the answer's
  token ids come back (vLLM >= 0.10: ``choices[i].token_ids`` and ``prompt_token_ids``; servers
  without it return text only and the caller re-tokenizes it).
* **Retries**: HTTP 429/500/502/503/504, timeouts, and connection errors once the server has
  answered at least once, are retried with exponential back-off (``backoff * 2**n`` seconds,
  jittered, at most ``max_backoff``, a ``Retry-After`` header honoured), at most ``max_retries``
  times; then, or on any other HTTP error, :class:`EndpointError` (exit code 1) names the URL,
  the status and the server's own message.
* **Stopping**: :meth:`EndpointClient.abort` shuts the sockets of requests in flight and makes
  every later call raise :class:`Aborted`, so a killed or failed run does not wait for answers
  it will not use (vLLM aborts a request whose client disconnects).

An API key is sent as ``Authorization: Bearer`` when ``OPENAI_API_KEY`` is set (vLLM's
``--api-key``).
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import os
import random
import socket
import threading
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from ...heads.sampling import SamplingParams
from ..errors import RunError, UsageError

__all__ = [
    "TRANSIENT_STATUS",
    "Aborted",
    "Completion",
    "EndpointClient",
    "EndpointError",
    "ServerInfo",
    "request_seed",
]

#: HTTP statuses worth retrying: rate limit, and the server or a proxy in front of it failing.
TRANSIENT_STATUS = frozenset({429, 500, 502, 503, 504})


class EndpointError(RunError):
    """A request failed for good (a non-transient HTTP error, or retries exhausted): exit 1."""


class Aborted(Exception):
    """The client was aborted (:meth:`EndpointClient.abort`); internal to a stopping run."""


class _HTTPStatusError(Exception):
    def __init__(self, status: int, message: str, retry_after: float | None):
        super().__init__(f"HTTP {status}: {message}")
        self.status, self.message, self.retry_after = status, message, retry_after


@dataclass
class ServerInfo:
    """What the start-up check learned.

    Attributes:
        url: The API root used, ``<scheme>://<host>[:port][/prefix]/v1``.
        model: The model name requests carry.
        served: Every model the server listed (empty when it lists none).
        max_model_len: The server's context length (vLLM lists it), else ``None``.
    """

    url: str
    model: str
    served: list[str]
    max_model_len: int | None = None


@dataclass
class Completion:
    """One answer.

    Attributes:
        text: The text as the server returned it.
        token_ids: The generated ids, end-of-turn token included when generated, or ``None``
            when the server does not return ids.
        prompt_token_ids: The ids the server conditioned on (vLLM with ``return_token_ids``),
            else ``None``.
        finish_reason: ``"stop"`` or ``"length"`` (as the server says).
        stop_reason: The stop token id or string (vLLM), ``None`` for the model's own EOS.
        prompt_tokens: ``usage.prompt_tokens`` (``None`` when missing).
        completion_tokens: ``usage.completion_tokens`` (``None`` when missing).
    """

    text: str
    token_ids: list[int] | None
    prompt_token_ids: list[int] | None
    finish_reason: str | None
    stop_reason: int | str | None
    prompt_tokens: int | None
    completion_tokens: int | None


def request_seed(*key: object) -> int:
    """A per-request sampling seed that depends only on ``key``, e.g. ``(seed, id, turn)``.

    The same hashing as the HF path's per-record generators, so a record's sampled answer does
    not depend on the order requests run in (vLLM seeds each request's sampler with it).
    """
    digest = hashlib.sha256("\0".join(str(k) for k in key).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _error_message(data: bytes) -> str:
    """The server's own words from an error body: vLLM, OpenAI, TGI and FastAPI shapes."""
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return _one_line(data.decode("utf-8", "replace")) or "(empty body)"
    if isinstance(obj, Mapping):
        err = obj.get("error", obj)
        if isinstance(err, Mapping):
            return _one_line(str(err.get("message") or err.get("detail") or err))
        if isinstance(err, str):
            return _one_line(err)
        if "detail" in obj:
            return _one_line(str(obj["detail"]))
    return _one_line(str(obj))


class EndpointClient:
    """Thread-safe client of one OpenAI-compatible server (one connection per request).

    Args:
        url: The server, with or without the ``/v1`` suffix (``http://127.0.0.1:8000``).
        timeout: Seconds one request may take (connect, generation, response).
        max_retries: Retries of one request after a transient failure (0 = none).
        backoff: First retry delay in seconds; doubled on each further retry.
        max_backoff: Longest delay between two tries.
        api_key: Sent as a bearer token; default ``$OPENAI_API_KEY`` when set.

    Raises:
        UsageError: ``url`` is not an ``http(s)://host[:port]`` URL.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 600.0,
        max_retries: int = 5,
        backoff: float = 0.5,
        max_backoff: float = 30.0,
        api_key: str | None = None,
    ):
        parts = urlsplit(url.strip())
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UsageError(
                f"endpoint: {url!r} is not an http(s) URL (e.g. http://127.0.0.1:8000)"
            )
        try:
            port = parts.port
        except ValueError as exc:
            raise UsageError(f"endpoint: {url!r}: {exc}") from exc
        prefix = parts.path.rstrip("/")
        prefix = prefix.removesuffix("/v1")
        self.scheme, self.host, self.port = parts.scheme, parts.hostname, port
        self.prefix = prefix + "/v1"
        netloc = f"{self.host}:{port}" if port else self.host
        self.url = f"{self.scheme}://{netloc}{self.prefix}"
        self.timeout, self.max_retries = timeout, max_retries
        self.backoff, self.max_backoff = backoff, max_backoff
        self.api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        self.retries = 0  # transient failures retried, over the client's life
        self._answered = False  # whether the server has answered once (see _transient)
        self._lock = threading.Lock()
        self._active: set[http.client.HTTPConnection] = set()
        self._stop = threading.Event()

    # ------------------------------------------------------------------------------------------
    # Start-up

    def connect(self, model: str | None) -> ServerInfo:
        """Check the server answers and serves ``model`` (or exactly one model, when ``None``).

        Raises:
            UsageError: The server cannot be reached, refuses the request (e.g. a key is
                needed), is not OpenAI-compatible, does not serve ``model``, or serves several
                and ``model`` is ``None``. One line naming the URL.
        """
        try:
            listing = self._request("GET", "/models", None)
        except _HTTPStatusError as exc:
            if exc.status == 404 and model:
                # No model listing (some proxies): trust the name given.
                return ServerInfo(self.url, model, [], None)
            hint = " (set OPENAI_API_KEY)" if exc.status in (401, 403) else ""
            raise UsageError(
                f"endpoint: {self.url}/models answered HTTP {exc.status}: {exc.message}{hint}"
                + ("" if model or exc.status != 404 else "; pass --model")
            ) from None
        except EndpointError as exc:
            raise UsageError(f"endpoint: {exc}") from None
        cards = listing.get("data") if isinstance(listing, Mapping) else None
        if not isinstance(cards, list) or not all(
            isinstance(c, Mapping) and isinstance(c.get("id"), str) for c in cards
        ):
            raise UsageError(
                f"endpoint: {self.url}/models did not answer an OpenAI model list (is it an "
                "OpenAI-compatible server?)"
            )
        served = [c["id"] for c in cards]
        if model is None:
            if len(served) != 1:
                what = ", ".join(served) if served else "no model"
                raise UsageError(f"endpoint: {self.url} serves {what}; pass --model to choose one")
            model = served[0]
        elif model not in served:
            raise UsageError(
                f"endpoint: {self.url} does not serve model {model!r}; it serves "
                f"{', '.join(repr(s) for s in served) or 'nothing'} (pass one as --model)"
            )
        card = cards[served.index(model)]
        max_len = card.get("max_model_len")
        return ServerInfo(self.url, model, served, max_len if isinstance(max_len, int) else None)

    # ------------------------------------------------------------------------------------------
    # Generation

    def complete(
        self,
        model: str,
        prompt_ids: Sequence[int],
        *,
        max_new_tokens: int,
        sampling: SamplingParams,
        stop_token_ids: Collection[int],
        seed: int | None,
    ) -> Completion:
        """``POST /v1/completions`` with token ids as the prompt (the server never templates)."""
        body = {"model": model, "prompt": [int(t) for t in prompt_ids]}
        body.update(self._params(max_new_tokens, sampling, stop_token_ids, seed))
        out = self._request("POST", "/completions", body)
        choice = self._choice(out, "/completions")
        return self._completion(out, choice, choice.get("text"), choice.get("prompt_token_ids"))

    def chat(
        self,
        model: str,
        messages: Sequence[Mapping[str, str]],
        *,
        max_new_tokens: int,
        sampling: SamplingParams,
        stop_token_ids: Collection[int],
        seed: int | None,
    ) -> Completion:
        """``POST /v1/chat/completions``: the server renders ``messages`` with its template."""
        body = {
            "model": model,
            "messages": [{"role": m["role"], "content": m["content"]} for m in messages],
        }
        body.update(self._params(max_new_tokens, sampling, stop_token_ids, seed))
        out = self._request("POST", "/chat/completions", body)
        choice = self._choice(out, "/chat/completions")
        message = choice.get("message")
        text = message.get("content") if isinstance(message, Mapping) else None
        return self._completion(out, choice, text, out.get("prompt_token_ids"))

    @staticmethod
    def _params(
        max_new_tokens: int,
        sampling: SamplingParams,
        stop_token_ids: Collection[int],
        seed: int | None,
    ) -> dict[str, Any]:
        params: dict[str, Any] = {
            "max_tokens": max_new_tokens,
            "n": 1,
            "stream": False,
            # Every sampling knob explicitly: vLLM fills unset ones from the model's
            # generation_config.json, which would make the answers differ from the HF path.
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            # -1 = off for both vLLM and SGLang (SGLang refuses 0).
            "top_k": sampling.top_k if sampling.top_k > 0 else -1,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "stop_token_ids": sorted(int(t) for t in stop_token_ids),
            # The HF path decodes with special tokens kept; ask for the same text.
            "skip_special_tokens": False,
            "spaces_between_special_tokens": False,
            "return_token_ids": True,
        }
        if seed is not None and not sampling.greedy:
            params["seed"] = seed
        return params

    def _choice(self, out: Any, path: str) -> Mapping[str, Any]:
        choices = out.get("choices") if isinstance(out, Mapping) else None
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], Mapping):
            raise EndpointError(f"{self.url}{path} answered without choices: {_one_line(out)}")
        return choices[0]

    @staticmethod
    def _completion(
        out: Mapping[str, Any], choice: Mapping[str, Any], text: Any, prompt_ids: Any
    ) -> Completion:
        usage = out.get("usage") if isinstance(out.get("usage"), Mapping) else {}
        ids = choice.get("token_ids")
        return Completion(
            text=text if isinstance(text, str) else "",
            token_ids=[int(t) for t in ids] if isinstance(ids, list) else None,
            prompt_token_ids=[int(t) for t in prompt_ids] if isinstance(prompt_ids, list) else None,
            finish_reason=choice.get("finish_reason"),
            stop_reason=choice.get("stop_reason"),
            prompt_tokens=usage.get("prompt_tokens"),
            completion_tokens=usage.get("completion_tokens"),
        )

    # ------------------------------------------------------------------------------------------
    # Transport

    def abort(self) -> None:
        """Stop: requests in flight fail at once, later ones raise :class:`Aborted`."""
        self._stop.set()
        with self._lock:
            conns = list(self._active)
        for conn in conns:
            sock = conn.sock
            if sock is not None:
                with contextlib.suppress(OSError):  # already closed
                    sock.shutdown(socket.SHUT_RDWR)

    def _request(self, method: str, path: str, body: Any) -> Any:
        """One JSON request with the retry policy (see the module docstring)."""
        attempt = 0
        while True:
            if self._stop.is_set():
                raise Aborted
            try:
                result = self._once(method, path, body)
                self._answered = True
                return result
            except _HTTPStatusError as exc:
                if exc.status not in TRANSIENT_STATUS:
                    if path == "/models":
                        raise
                    raise EndpointError(
                        f"{self.url}{path} answered HTTP {exc.status}: {exc.message}"
                    ) from None
                error, wait = exc, exc.retry_after
            except (OSError, http.client.HTTPException) as exc:
                if self._stop.is_set():
                    raise Aborted from None
                if not self._answered:
                    raise EndpointError(
                        f"cannot reach an OpenAI-compatible server at {self.url} "
                        f"({_one_line(str(exc) or type(exc).__name__)}); is it running? "
                        "check --endpoint"
                    ) from None
                error, wait = exc, None
            if attempt >= self.max_retries:
                raise EndpointError(
                    f"{self.url}{path} failed after {attempt} "
                    f"{'retry' if attempt == 1 else 'retries'}: "
                    f"{_one_line(str(error) or type(error).__name__)}"
                ) from None
            delay = min(self.max_backoff, self.backoff * 2**attempt) * random.uniform(0.75, 1.0)
            if wait is not None:
                delay = max(delay, min(wait, self.max_backoff))
            attempt += 1
            with self._lock:
                self.retries += 1
            if self._stop.wait(delay):
                raise Aborted

    def _once(self, method: str, path: str, body: Any) -> Any:
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        conn = cls(self.host, self.port, timeout=self.timeout)
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        with self._lock:
            self._active.add(conn)
        try:
            conn.request(method, self.prefix + path, body=data, headers=headers)
            resp = conn.getresponse()
            payload = resp.read()
        finally:
            with self._lock:
                self._active.discard(conn)
            conn.close()
        if resp.status >= 400:
            retry_after = None
            with contextlib.suppress(ValueError):  # absent, or an HTTP date: ignored
                retry_after = float(resp.getheader("Retry-After") or "")
            raise _HTTPStatusError(resp.status, _error_message(payload), retry_after)
        try:
            return json.loads(payload)
        except (ValueError, UnicodeDecodeError):
            raise EndpointError(
                f"{self.url}{path} answered HTTP {resp.status} with a body that is not JSON: "
                f"{_one_line(payload.decode('utf-8', 'replace'), 120)}"
            ) from None
