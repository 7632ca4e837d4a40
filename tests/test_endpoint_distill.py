"""``data distill --endpoint``: self-distillation through an OpenAI-compatible server.

An in-process fake server (``http.server`` in a thread) answers ``/v1/models``,
``/v1/completions`` (token-id prompts) and ``/v1/chat/completions`` like vLLM does -- generated
ids in ``choices[0].token_ids`` with the stop token kept, ``prompt_token_ids``, ``usage`` --
either from a tiny random model (plain greedy/sampled decoding of the prompt) or from a canned
rule. It can fail requests on demand (an HTTP status, or a connection closed without an
answer) and delay answers so concurrent requests finish out of order.
"""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from draftsmith.heads.sampling import SamplingParams
from draftsmith.train.data.chat import chat_token_ids
from draftsmith.train.data.records import load_records
from draftsmith.train.datagen.distill_command import main_distill
from draftsmith.train.datagen.endpoint import Aborted, EndpointClient, EndpointError
from draftsmith.train.datagen.endpoint_distill import endpoint_distill
from draftsmith.train.datagen.self_distill import DistillError, self_distill
from draftsmith.train.datagen.vllm_server import free_port
from draftsmith.train.decoding.speculative import generate
from draftsmith.train.errors import UsageError
from tests.conftest import byte_tokenizer, tiny_llama

MAX_NEW = 8
PROMPTS = [
    "hi",
    "What is the capital of France?",
    "Write a haiku about the sea, please, and make it rhyme.",
    "2 + 2 = ?",
    "x",
    "Tell me a story.",
    "Explain recursion in one sentence, as if to a five-year-old child.",
]


# --------------------------------------------------------------------------------------------
# The fake server
# --------------------------------------------------------------------------------------------


class FakeServer:
    """An OpenAI-compatible server answering from ``rule(prompt_ids, body) -> (ids, reason)``.

    Attributes:
        fail: What the next POSTs do instead of answering: an HTTP status, a ``(status,
            headers)`` pair, or ``"reset"`` (close the connection without an answer); popped
            one per request.
        token_ids: Return generated/prompt ids (vLLM's ``return_token_ids``); False = text only.
        requested, answered: Prompt ids in the order requests arrived / answers were sent.
    """

    def __init__(self, tok, rule, *, models=("tiny",), max_model_len=1024, delay=None):
        self.tok, self.rule, self.models = tok, rule, list(models)
        self.max_model_len, self.delay = max_model_len, delay
        self.fail: list[int | str | tuple[int, dict[str, str]]] = []
        self.token_ids = True
        self.requested: list[tuple[int, ...]] = []
        self.answered: list[tuple[int, ...]] = []
        self.bodies: list[dict] = []
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _send(self, status, obj, headers=()):
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for name, value in dict(headers).items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path != "/v1/models":
                    return self._send(404, {"error": {"message": "no route"}})
                cards = [{"id": m, "max_model_len": fake.max_model_len} for m in fake.models]
                self._send(200, {"object": "list", "data": cards})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    fault = fake.fail.pop(0) if fake.fail else None
                    fake.bodies.append(body)
                if fault == "reset":
                    self.close_connection = True
                    return  # no answer at all: the client sees the connection closed
                if fault is not None:
                    status, headers = fault if isinstance(fault, tuple) else (fault, {})
                    err = {"error": {"message": f"fault {status}"}}
                    return self._send(status, err, headers)
                if body.get("model") not in fake.models:
                    msg = f"The model `{body.get('model')}` does not exist."
                    return self._send(404, {"error": {"message": msg}})
                chat = self.path == "/v1/chat/completions"
                if chat:
                    ids = chat_token_ids(fake.tok, body["messages"], add_generation_prompt=True)
                elif self.path == "/v1/completions":
                    ids = list(body["prompt"])
                else:
                    return self._send(404, {"error": {"message": "no route"}})
                with fake.lock:
                    fake.requested.append(tuple(ids))
                if fake.delay is not None:
                    time.sleep(fake.delay(ids))
                tokens, reason = fake.rule(ids, body)
                text = fake.tok.decode(tokens, skip_special_tokens=True)
                choice = {"index": 0, "finish_reason": reason, "stop_reason": None}
                if chat:
                    choice["message"] = {"role": "assistant", "content": text}
                else:
                    choice["text"] = text
                out = {
                    "choices": [choice],
                    "usage": {"prompt_tokens": len(ids), "completion_tokens": len(tokens)},
                }
                if fake.token_ids and body.get("return_token_ids"):
                    choice["token_ids"] = tokens
                    if chat:
                        out["prompt_token_ids"] = ids
                    else:
                        choice["prompt_token_ids"] = ids
                with fake.lock:
                    fake.answered.append(tuple(ids))
                self._send(200, out)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> FakeServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def model_rule(model, tok):
    """Answer as the model's plain decoding of the prompt would (greedy, or seeded sampling)."""
    lock = threading.Lock()

    def rule(ids, body):
        eos = {tok.eos_token_id, *body.get("stop_token_ids", [])}
        sampling = SamplingParams(body["temperature"], max(body["top_k"], 0), body["top_p"])
        gen = None if sampling.greedy else torch.Generator().manual_seed(body["seed"])
        with lock:
            out = generate(
                model,
                ids,
                None,
                max_new_tokens=body["max_tokens"],
                sampling=sampling,
                eos_token_id=eos,
                generator=gen,
            )
        return out.tokens, "stop" if out.stop_reason == "eos" else "length"

    return rule


def out_of_order(ids) -> float:
    """A delay that makes some later requests finish before earlier ones."""
    return 0.02 * (len(ids) % 7)  # 0-120 ms: beyond scheduling jitter


# --------------------------------------------------------------------------------------------
# Fixtures and helpers
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    """Tiny random target whose second EOS id ends some answers early (as in
    test_self_distill), so answers of both stop reasons occur."""
    m = tiny_llama(vocab_size=len(tok), init_std=0.1)
    m.generation_config.eos_token_id = [tok.eos_token_id]
    ids = chat_token_ids(tok, [{"role": "user", "content": PROMPTS[1]}], add_generation_prompt=True)
    out = generate(m, ids, None, max_new_tokens=MAX_NEW).tokens
    m.generation_config.eos_token_id = [tok.eos_token_id, out[3]]
    return m


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def alpaca_rows(n: int = len(PROMPTS)) -> list[dict]:
    return [
        {"id": i, "instruction": PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)), "input": ""}
        for i in range(n)
    ]


MULTI_TURN = {
    "id": "m2",
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "OLD"},
        {"role": "user", "content": "two"},
        {"role": "assistant", "content": "OLD"},
    ],
}


def by_id(path: Path) -> dict:
    return {json.loads(x)["id"]: json.loads(x) for x in path.read_text().splitlines()}


def run(fake, tok, model, convs, out, **kw):
    client = EndpointClient(fake.url, backoff=0.01, max_retries=kw.pop("max_retries", 5))
    server = client.connect(None)
    kw = {
        "max_new_tokens": MAX_NEW,
        "concurrency": 4,
        "progress": False,
        "eos_token_ids": model.generation_config.eos_token_id,
        **kw,
    }
    return endpoint_distill(client, server, tok, convs, out, **kw)


# --------------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("template", ["ours", "server"])
def test_records_equal_the_hf_paths(tmp_path, tok, model, template):
    rows = [*alpaca_rows(), MULTI_TURN]
    (tmp_path / "in").mkdir()
    write_jsonl(tmp_path / "in" / "a.jsonl", rows[:-1])
    write_jsonl(tmp_path / "in" / "b.jsonl", rows[-1:])  # shapes are detected per file
    convs, _ = load_records(tmp_path / "in")
    hf = tmp_path / "hf.jsonl"
    hf_stats = self_distill(model, tok, convs, hf, max_new_tokens=MAX_NEW, progress=False)
    with FakeServer(tok, model_rule(model, tok), delay=out_of_order) as fake:
        out = tmp_path / "ep.jsonl"
        stats = run(fake, tok, model, convs, out, template=template)
    assert by_id(out) == by_id(hf)
    # Both stop reasons occurred, so the stop-token handling was exercised.
    assert 0 < stats.truncated < len(rows)
    assert stats.written == len(rows) and stats.retries == 0
    # Token counts are the HF path's: the stop token counts as generated in both.
    assert stats.generated_tokens == hf_stats.generated_tokens
    assert stats.prompt_tokens == hf_stats.prompt_tokens
    assert stats.unchecked_turns == 0
    # Written in selection order, whatever order the answers came in.
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == [r["id"] for r in rows]
    meta = json.loads(out.with_name("ep.jsonl.meta").read_text())
    assert meta["complete"] is True
    assert meta["settings"]["backend"] == "endpoint"
    assert meta["settings"]["template_mode"] == template
    assert meta["settings"]["model"] == "tiny"
    assert meta["server"]["returns_token_ids"] is True
    wire = {"ours": "prompt", "server": "messages"}[template]
    assert all(wire in b for b in fake.bodies)
    # The stop ids sent are the target's end-of-turn ids.
    assert set(fake.bodies[0]["stop_token_ids"]) == {
        tok.eos_token_id,
        *model.generation_config.eos_token_id,
    }


def test_sampled_answers_are_seeded_per_record(tmp_path, tok, model):
    convs, _ = load_records(write_jsonl(tmp_path / "in.jsonl", alpaca_rows(6)))
    sampling = SamplingParams(temperature=1.0, top_p=0.95)
    files = []
    with FakeServer(tok, model_rule(model, tok), delay=out_of_order) as fake:
        for name, seed, conc in (("a", 1, 4), ("b", 1, 1), ("c", 2, 4)):
            out = tmp_path / f"{name}.jsonl"
            run(fake, tok, model, convs, out, sampling=sampling, seed=seed, concurrency=conc)
            files.append(out.read_bytes())
    assert files[0] == files[1]  # another concurrency: same answers
    assert files[0] != files[2]  # another seed: other answers
    assert all(b["temperature"] == 1.0 and b["top_p"] == 0.95 for b in fake.bodies)
    # One seed per record and turn: runs a and b sent the same 6, run c 6 others.
    assert len(fake.bodies) == 18 and len({b["seed"] for b in fake.bodies}) == 12


def test_token_mismatches_are_counted(tmp_path, tok, model):
    # "é" is two byte tokens; its first alone decodes to U+FFFD, which re-tokenizes to three
    # other bytes: the stored text cannot give back the generated id.
    cut = tok.encode("é", add_special_tokens=False)[:1]
    clean = tok.encode("Hello there.", add_special_tokens=False)

    def rule(ids, body):
        text = tok.decode(ids)
        return (cut, "length") if "capital" in text else ([*clean, tok.eos_token_id], "stop")

    convs, _ = load_records(write_jsonl(tmp_path / "in.jsonl", alpaca_rows(3)))
    with FakeServer(tok, rule) as fake:
        stats = run(fake, tok, model, convs, tmp_path / "o.jsonl")
        assert stats.token_mismatches == 1 and stats.truncated == 1
        assert by_id(tmp_path / "o.jsonl")[0]["output"] == "Hello there."
        # A server that returns text only: nothing to check, counted as unchecked.
        fake.token_ids = False
        stats = run(fake, tok, model, convs, tmp_path / "t.jsonl")
        assert stats.unchecked_turns == 3 and stats.token_mismatches == 0
        assert by_id(tmp_path / "t.jsonl")[0]["output"] == "Hello there."


def test_prompt_too_long_is_skipped(tmp_path, tok, model):
    convs, _ = load_records(write_jsonl(tmp_path / "in.jsonl", alpaca_rows(3)))
    with FakeServer(tok, model_rule(model, tok), max_model_len=40) as fake:
        stats = run(fake, tok, model, convs, tmp_path / "o.jsonl")
    # "hi" (id 0) fits in 40 tokens with 8 new ones; the two longer prompts do not.
    assert stats.skipped == {"prompt too long": 2} and stats.written == 1
    assert list(by_id(tmp_path / "o.jsonl")) == [0]


# --------------------------------------------------------------------------------------------
# Resume
# --------------------------------------------------------------------------------------------


class Kill(Exception):
    pass


def test_kill_and_resume_has_no_duplicates_or_gaps(tmp_path, tok, model):
    convs, _ = load_records(write_jsonl(tmp_path / "in.jsonl", alpaca_rows(14)))
    with FakeServer(tok, model_rule(model, tok), delay=out_of_order) as fake:
        full = tmp_path / "full.jsonl"
        run(fake, tok, model, convs, full)
        reference = full.read_bytes()
        # Concurrent answers really came back out of order.
        assert fake.answered != fake.requested

        out = tmp_path / "killed.jsonl"

        def kill(written: int) -> None:
            if written >= 3:
                raise Kill

        with pytest.raises(Kill):
            run(fake, tok, model, convs, out, on_write=kill)
        kept = len(out.read_bytes().splitlines())
        assert 3 <= kept < 14
        stats = run(fake, tok, model, convs, out)
        assert stats.already_done == kept and stats.written == 14 - kept
        assert out.read_bytes() == reference

        # A kill during a write: the file ends inside a line.
        lines = reference.splitlines(keepends=True)
        cut = tmp_path / "cut.jsonl"
        cut.write_bytes(b"".join(lines[:5]) + lines[5][:20])
        shutil.copy(full.with_name("full.jsonl.meta"), cut.with_name("cut.jsonl.meta"))
        stats = run(fake, tok, model, convs, cut, concurrency=2)
        assert stats.discarded_partial_line and stats.already_done == 5
        assert cut.read_bytes() == reference

        # Nothing left to do: untouched.
        stats = run(fake, tok, model, convs, full)
        assert stats.written == 0 and full.read_bytes() == reference

        # Other answer-changing settings are refused, and so is the HF path on this output.
        with pytest.raises(DistillError, match="max_new_tokens: 8 in the existing output, 9"):
            run(fake, tok, model, convs, full, max_new_tokens=9)
        with pytest.raises(DistillError, match="template_mode"):
            run(fake, tok, model, convs, full, template="server")
    with pytest.raises(DistillError, match="endpoint"):
        self_distill(model, tok, convs, full, max_new_tokens=MAX_NEW, progress=False)
    ids = [json.loads(x)["id"] for x in reference.splitlines()]
    assert ids == list(range(14))


# --------------------------------------------------------------------------------------------
# Failures
# --------------------------------------------------------------------------------------------


def test_transient_errors_are_retried(tmp_path, tok, model):
    convs, _ = load_records(write_jsonl(tmp_path / "in.jsonl", alpaca_rows(3)))
    with FakeServer(tok, model_rule(model, tok)) as fake:
        ref = tmp_path / "ref.jsonl"
        run(fake, tok, model, convs, ref)
        # 503 twice, then a connection closed without an answer (after the first success).
        fake.fail = [503, 503, "reset", 429]
        out = tmp_path / "o.jsonl"
        stats = run(fake, tok, model, convs, out, concurrency=1)
        assert stats.retries == 4 and stats.written == 3
        assert out.read_bytes() == ref.read_bytes()

        # Retries are bounded: then one error naming the URL, the status and the tries.
        fake.fail = [503] * 10
        with pytest.raises(
            EndpointError, match=r"/v1/completions failed after 2 retries: HTTP 503"
        ):
            run(fake, tok, model, convs, tmp_path / "x.jsonl", concurrency=1, max_retries=2)
    # A non-transient error is not retried; the server's message is passed on. A fresh server:
    # a request of the failed run above may still be in flight and would take the 400 instead.
    with FakeServer(tok, model_rule(model, tok)) as fake:
        fake.fail = [400]
        with pytest.raises(EndpointError, match="answered HTTP 400: fault 400"):
            run(fake, tok, model, convs, tmp_path / "y.jsonl", concurrency=1)
    # The failed runs are resumable: they kept only complete records.
    assert not (tmp_path / "y.jsonl").read_bytes()


def echo_rule(ids, body):
    """A canned answer: the first prompt id, then the end of turn."""
    return [ids[0], 0], "stop"


def complete(client: EndpointClient):
    return client.complete(
        "tiny",
        [1, 2, 3],
        max_new_tokens=4,
        sampling=SamplingParams(0.0, 0, 1.0),
        stop_token_ids=[0],
        seed=None,
    )


def test_retry_after_is_honoured_up_to_max_backoff(tok):
    with FakeServer(tok, echo_rule) as fake:
        client = EndpointClient(fake.url, backoff=0.001, max_backoff=0.3)
        client.connect("tiny")
        # 408 is retried like 429 and 5xx; an over-long Retry-After is cut to max_backoff.
        fake.fail = [(429, {"Retry-After": "0.2"}), 408, (503, {"Retry-After": "60"})]
        t0 = time.perf_counter()
        assert complete(client).token_ids == [1, 0]
        elapsed = time.perf_counter() - t0
        assert client.retries == 3
        assert 0.5 <= elapsed < 5.0  # 0.2 s + ~0 s + 0.3 s of back-off
        # Any other 4xx is final at once, with the server's message.
        fake.fail = [422]
        with pytest.raises(EndpointError, match=r"/v1/completions answered HTTP 422: fault 422"):
            complete(client)
        assert client.retries == 3


def test_abort_ends_requests_in_flight_at_once(tok):
    with FakeServer(tok, echo_rule, delay=lambda ids: 30.0) as fake:
        client = EndpointClient(fake.url)
        client.connect("tiny")
        errors: list[BaseException] = []

        def call():
            try:
                complete(client)
            except BaseException as exc:  # handed to the test thread
                errors.append(exc)

        worker = threading.Thread(target=call)
        worker.start()
        deadline = time.monotonic() + 10
        while not fake.requested and time.monotonic() < deadline:
            time.sleep(0.01)
        assert fake.requested  # the request is in flight, its answer 30 s away
        client.abort()
        worker.join(timeout=5)
        assert not worker.is_alive()
        assert len(errors) == 1 and isinstance(errors[0], Aborted)
        with pytest.raises(Aborted):
            complete(client)


def test_connect_names_the_url_and_the_models(tok):
    with FakeServer(tok, None, models=("a", "b")) as fake:
        client = EndpointClient(fake.url + "/v1/")
        assert client.url == fake.url + "/v1"
        assert client.connect("b").model == "b"
        with pytest.raises(UsageError, match=r"serves a, b; pass --model"):
            client.connect(None)
        with pytest.raises(UsageError, match=r"does not serve model 'c'; it serves 'a', 'b'"):
            client.connect("c")
    with pytest.raises(UsageError, match="not an http"):
        EndpointClient("localhost:8000")


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


@pytest.fixture
def served(tiny_target_dir):
    """The fake server answering with the tiny target saved in ``tiny_target_dir``."""
    from draftsmith.train.target_model.load import load_target

    model, tok = load_target(tiny_target_dir, quiet=True)
    with FakeServer(tok, model_rule(model, tok), models=("tiny",), delay=out_of_order) as fake:
        yield fake


def cli_args(tmp_path, target_dir, url, *extra):
    src = write_jsonl(tmp_path / "alpaca.jsonl", alpaca_rows(12))
    return [
        "--input",
        str(src),
        "--target",
        str(target_dir),
        "--endpoint",
        url,
        "--max-new-tokens",
        "4",
        "--no-progress",
        *extra,
    ]


def test_cli_template_modes_write_the_same_records(tmp_path, tiny_target_dir, served, capsys):
    ours = tmp_path / "ours.jsonl"
    args = cli_args(tmp_path, tiny_target_dir, served.url, "--concurrency", "3")
    assert main_distill([*args, "--output", str(ours)]) == 0
    cap = capsys.readouterr()
    assert f"endpoint: {served.url}/v1, model 'tiny'" in cap.err
    assert f"{ours}: 11 of 11 records complete" in cap.out
    # The tiny random target emits byte tokens that are not valid UTF-8, so some turns do not
    # survive decode + re-tokenize; the summary says how many.
    assert re.search(r"\n\d+ of 11 generated turns did not re-tokenize", cap.out)
    server = tmp_path / "server.jsonl"
    assert main_distill([*args, "--output", str(server), "--template", "server"]) == 0
    assert by_id(server) == by_id(ours)
    assert sorted(by_id(ours)) == [i for i in range(12) if i % 10 != 9]  # held-out id 9 skipped
    meta = json.loads(server.with_name("server.jsonl.meta").read_text())
    assert meta["settings"]["template_mode"] == "server"
    assert meta["settings"]["concurrency"] == 3
    # Resume: nothing to do.
    assert main_distill([*args, "--output", str(ours)]) == 0
    assert "0 written now, 11 already there" in capsys.readouterr().out


def error_line(capsys) -> str:
    """The one ``error:`` line of a failed command; the input summary lines come before it."""
    err = capsys.readouterr().err.splitlines()
    assert err and err[-1].startswith("error: ")
    assert sum(line.startswith("error") for line in err) == 1
    return err[-1]


def test_cli_errors_are_one_line(tmp_path, tiny_target_dir, served, capsys):
    out = str(tmp_path / "o.jsonl")
    args = cli_args(tmp_path, tiny_target_dir, served.url, "--output", out)
    assert main_distill([*args, "--model", "nope"]) == 2
    err = error_line(capsys)
    assert f"{served.url}/v1" in err and "'nope'" in err and "'tiny'" in err

    dead = f"http://127.0.0.1:{free_port()}"
    assert main_distill(cli_args(tmp_path, tiny_target_dir, dead, "--output", out)) == 2
    assert f"cannot reach an OpenAI-compatible server at {dead}/v1" in error_line(capsys)

    # Endpoint-only options without --endpoint name their field.
    assert main_distill(["--output", out, "--model", "x", "--template", "server"]) == 2
    err = capsys.readouterr().err
    assert "model: only with --endpoint" in err and "template: only with --endpoint" in err
