"""A small client for OpenAI-compatible servers (vLLM, SGLang, TGI): ``data distill --endpoint``.

Built on ``httpx`` (pooled keep-alive connections, timeouts) and ``tenacity`` (the retry
policy) rather than an OpenAI SDK, whose retries and model checks would hide the errors below.
What it does:

* **Start-up check** (:meth:`EndpointClient.connect`): ``GET /v1/models``. An unreachable server,
  a server that does not serve ``--model`` (its models are named), or one that serves several
  when none was asked for, is a one-line :class:`~draftsmith.train.errors.UsageError`.
* **Requests** (:meth:`EndpointClient.complete`, :meth:`EndpointClient.chat`): one non-streaming
  completion with the sampling settings of the HF path sent explicitly (vLLM otherwise fills
  unset ones from the model's ``generation_config.json``), the end-of-turn ids as
  ``stop_token_ids``, special tokens kept in the text, and ``return_token_ids`` so the answer's
  token ids come back (vLLM >= 0.10: ``choices[i].token_ids`` and ``prompt_token_ids``; servers
  without it return text only and the caller re-tokenizes it).
* **Retries**: HTTP 408, 429 and 5xx, timeouts, and connection errors once the server has
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
import functools
import hashlib
import json
import os
import random
import socket
import ssl
import threading
import weakref
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
import tenacity

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

#: HTTP statuses worth retrying: request timeout, rate limit, and the server or a proxy in front
#: of it failing. Every other 4xx is the request's own fault and would fail again.
TRANSIENT_STATUS = frozenset({408, 429, *range(500, 600)})

#: httpcore trace events whose ``return_value`` is a new network stream (plain, then TLS).
_STREAM_EVENTS = frozenset({"connection.connect_tcp.complete", "connection.start_tls.complete"})


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


def _transient(exc: BaseException) -> bool:
    """Whether a failed try is worth another (``_attempt`` already turned the rest final)."""
    if isinstance(exc, _HTTPStatusError):
        return exc.status in TRANSIENT_STATUS
    return isinstance(exc, httpx.TransportError)


def _shut(sock: socket.socket) -> None:
    """Shut ``sock`` down: unlike ``close``, this wakes a thread blocked reading it."""
    with contextlib.suppress(OSError):  # already closed, or detached by the TLS wrapper
        sock.shutdown(socket.SHUT_RDWR)


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
    """Thread-safe client of one OpenAI-compatible server (pooled keep-alive connections).

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
        host = f"[{self.host}]" if ":" in self.host else self.host  # IPv6 literal
        netloc = f"{host}:{port}" if port else host
        self.url = f"{self.scheme}://{netloc}{self.prefix}"
        self.timeout, self.max_retries = timeout, max_retries
        self.backoff, self.max_backoff = backoff, max_backoff
        self.api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        self.retries = 0  # transient failures retried, over the client's life
        self._answered = False  # whether the server has answered once (see _attempt)
        self._lock = threading.Lock()
        # Every socket the pool opened (weakly: the pool drops closed ones), for abort().
        self._sockets: weakref.WeakSet[socket.socket] = weakref.WeakSet()
        self._stop = threading.Event()
        self._http = httpx.Client(
            timeout=httpx.Timeout(timeout),
            # No cap: --concurrency bounds the requests in flight, and a capped pool would
            # queue the rest behind it; idle ones are kept so every worker reuses its own.
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
            # Proxy variables are not for a (mostly local) inference server, and TLS checks
            # use the system's CAs, as the standard library does.
            trust_env=False,
            verify=ssl.create_default_context(),
        )

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
            socks = list(self._sockets)
        for sock in socks:
            _shut(sock)

    def close(self) -> None:
        """Close the pooled connections; the client must not be used afterwards."""
        self._http.close()

    def _trace(self, event: str, info: dict[str, Any]) -> None:
        """httpcore's trace hook: note each new socket, so :meth:`abort` can reach it."""
        if event not in _STREAM_EVENTS:
            return
        sock = info["return_value"].get_extra_info("socket")
        if sock is None:
            return
        with self._lock:
            self._sockets.add(sock)
        if self._stop.is_set():  # opened while abort() ran: it may have missed this one
            _shut(sock)

    def _request(self, method: str, path: str, body: Any) -> Any:
        """One JSON request with the retry policy (see the module docstring)."""
        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(self.max_retries + 1),
            wait=self._wait,
            retry=tenacity.retry_if_exception(_transient),
            sleep=self._sleep,
            before_sleep=self._count_retry,
            retry_error_callback=functools.partial(self._give_up, path),
        )
        return retrying(self._attempt, method, path, body)

    def _attempt(self, method: str, path: str, body: Any) -> Any:
        """One try; raises what is final as such, and leaves what is transient to retry."""
        if self._stop.is_set():
            raise Aborted
        try:
            result = self._once(method, path, body)
        except _HTTPStatusError as exc:
            if exc.status in TRANSIENT_STATUS or path == "/models":  # connect() words its own
                raise
            raise EndpointError(
                f"{self.url}{path} answered HTTP {exc.status}: {exc.message}"
            ) from None
        except httpx.TransportError as exc:
            if self._stop.is_set():
                raise Aborted from None
            if not self._answered:
                # Never answered: a wrong URL or a server not up, not a hiccup worth waiting.
                raise EndpointError(
                    f"cannot reach an OpenAI-compatible server at {self.url} "
                    f"({_one_line(str(exc) or type(exc).__name__)}); is it running? "
                    "check --endpoint"
                ) from None
            raise
        self._answered = True
        return result

    def _wait(self, state: tenacity.RetryCallState) -> float:
        """The delay before the next try, in seconds.

        Exponential back-off jittered down to 75%, so clients rate-limited together spread out;
        at least the server's ``Retry-After``; both capped at ``max_backoff``.
        """
        exponential = tenacity.wait_exponential(multiplier=self.backoff, max=self.max_backoff)
        delay = exponential(state) * random.uniform(0.75, 1.0)
        error = state.outcome.exception() if state.outcome else None
        if isinstance(error, _HTTPStatusError) and error.retry_after is not None:
            delay = max(delay, min(error.retry_after, self.max_backoff))
        return delay

    def _sleep(self, delay: float) -> None:
        if self._stop.wait(delay):  # abort() ends the wait at once
            raise Aborted

    def _count_retry(self, state: tenacity.RetryCallState) -> None:
        with self._lock:
            self.retries += 1

    def _give_up(self, path: str, state: tenacity.RetryCallState) -> Any:
        """Retries exhausted: one error naming the URL, the tries and the last failure."""
        error = state.outcome.exception() if state.outcome else None
        n = state.attempt_number - 1
        raise EndpointError(
            f"{self.url}{path} failed after {n} {'retry' if n == 1 else 'retries'}: "
            f"{_one_line(str(error) or type(error).__name__)}"
        ) from None

    def _once(self, method: str, path: str, body: Any) -> Any:
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        resp = self._http.request(
            method,
            self.url + path,
            content=data,
            headers=headers,
            extensions={"trace": self._trace},
        )
        payload = resp.content
        if resp.status_code >= 400:
            retry_after = None
            with contextlib.suppress(ValueError):  # absent, or an HTTP date: ignored
                retry_after = float(resp.headers.get("Retry-After") or "")
            raise _HTTPStatusError(resp.status_code, _error_message(payload), retry_after)
        try:
            return json.loads(payload)
        except (ValueError, UnicodeDecodeError):
            raise EndpointError(
                f"{self.url}{path} answered HTTP {resp.status_code} with a body that is not JSON: "
                f"{_one_line(payload.decode('utf-8', 'replace'), 120)}"
            ) from None
