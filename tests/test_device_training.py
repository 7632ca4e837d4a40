"""Training on any device (issue 22): no host sync per micro-batch, one device setting, bf16 only,
and the CPU-only workarounds (gloo teardown, threads) kept to CPU runs.

No GPU is needed: a host read is counted where Python asks a tensor for a value, and the meta
device (which holds no values) proves that code never reads one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from types import SimpleNamespace

import pytest
import torch

from draftsmith.train.config import ConfigError, load_config
from draftsmith.train.core import dist
from draftsmith.train.core import run as run_module
from draftsmith.train.core.checkpoint import checkpoint_bytes
from draftsmith.train.core.config import TrainConfig
from draftsmith.train.core.run import TrainRun, device_mismatch
from draftsmith.train.core.stop import NonFiniteError
from draftsmith.train.errors import UsageError
from tests.test_eagle_recipe import base_args, write_records
from tests.test_faults_training import one_error_line

# What Python calls on a tensor to get a value on the host (each one waits for a GPU).
_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")


@contextlib.contextmanager
def host_reads():
    """Count the host reads of tensor values made inside the block."""
    count = {"n": 0}
    originals = {name: getattr(torch.Tensor, name) for name in _READS}

    def counting(fn):
        def read(self, *args, **kwargs):
            count["n"] += 1
            return fn(self, *args, **kwargs)

        return read

    for name, fn in originals.items():
        setattr(torch.Tensor, name, counting(fn))
    try:
        yield count
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)


def _run(tmp_path, **fields) -> TrainRun:
    cfg = TrainConfig(output_dir=tmp_path / "run", **fields)
    return TrainRun(cfg, recipe="eagle", kind="eagle3", outputs=["drafter"])


# --- 1. no host sync per micro-batch ---------------------------------------------------------


def test_watch_never_reads_and_step_ok_reads_once(tmp_path):
    with _run(tmp_path, on_nonfinite="skip") as run:
        with host_reads() as reads:
            for _ in range(4):  # 4 micro-batches of one optimizer step
                run.watch(torch.tensor(2.0) * 3)
            assert reads["n"] == 0
            assert run.step_ok(1, torch.tensor(0.5))
        assert reads["n"] == 1  # the step's one read: the agreed votes
        # One non-finite micro-batch fails the step, and the flag starts clean for the next one.
        run.watch(torch.tensor(float("nan")))
        run.watch(torch.tensor(1.0))
        assert not run.step_ok(2, torch.tensor(0.5))
        run.watch(torch.tensor(1.0))
        assert run.step_ok(3, torch.tensor(0.5))
        assert not run.step_ok(4, torch.tensor(float("inf")))  # a non-finite gradient norm
        assert run.state.skipped_nonfinite == 2
        run.cfg.on_nonfinite = "stop"
        run.watch(torch.tensor(float("-inf")))
        with pytest.raises(NonFiniteError, match="at step 5"):
            run.step_ok(5, torch.tensor(0.5))


def test_watch_works_on_a_device_it_cannot_read():
    run = object.__new__(TrainRun)  # only the flag: watch must not need anything else
    run._nonfinite = None
    for _ in range(3):
        run.watch(torch.empty((), device="meta"))
    assert run._nonfinite.device.type == "meta"


def test_any_rank_takes_device_tensors_and_reads_them_once():
    flags = [False, torch.tensor(True), torch.tensor([0.0, 3.0]), True, torch.tensor([0, 0])]
    with host_reads() as reads:
        assert dist.any_rank(flags, torch.device("cpu")) == [False, True, True, True, False]
    assert reads["n"] == 1
    with host_reads() as reads:  # plain votes of one process: nothing to read
        assert dist.any_rank([False, True], torch.device("cpu")) == [False, True]
    assert reads["n"] == 0


def _target_distribution_before(final_hidden, head, t2d, rows):
    """The former implementation (boolean masks; reads t2d's size on the host)."""
    with torch.no_grad():
        return _before(final_hidden, head, t2d, rows)


def _before(final_hidden, head, t2d, rows):
    b, t, _ = final_hidden.shape
    logits = head(final_hidden[rows][None]).float()
    a = logits.argmax(-1)
    p = torch.softmax(logits[..., t2d], dim=-1)
    full_p = p.new_zeros(b, t, int(t2d.sum()))
    full_a = a.new_full((b, t), -1)
    full_p[rows] = p[0]
    full_a[rows] = a[0]
    # A greedy token outside the draft vocab is -1: no draft can match it.
    return full_p, torch.where(t2d[full_a.clamp_min(0)], full_a, -1)


def test_target_distribution_gathers_the_draft_vocab_without_reading_it():
    from draftsmith.train.objectives.eagle_ttt import target_distribution

    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50, bias=False)
    hidden = torch.randn(2, 5, 8)
    t2d = torch.zeros(50, dtype=torch.bool)
    t2d[[1, 4, 7, 20, 33, 49]] = True
    vocab_ids = t2d.nonzero().flatten()  # arange(V_draft) + d2t, as the drafter holds it
    rows = torch.rand(2, 5) > 0.4
    want_p, want_a = _target_distribution_before(hidden, head, t2d, rows)
    for how in ({"t2d": t2d}, {"vocab_ids": vocab_ids}):
        p, a = target_distribution(hidden, head, rows=rows, **how)
        assert torch.equal(p, want_p) and torch.equal(a, want_a)
    # On the meta device any host read fails: the draft-vocab path has none.
    meta_head = torch.nn.Linear(8, 50, bias=False, device="meta")
    p, a = target_distribution(hidden.to("meta"), meta_head, vocab_ids=vocab_ids.to("meta"))
    assert p.shape == (2, 5, 6) and a.shape == (2, 5)


def _recorded(monkeypatch, module, name, sink, when=lambda *a, **k: True):
    real = getattr(module, name)

    def recording(*args, **kwargs):
        out = real(*args, **kwargs)
        if when(*args, **kwargs):
            sink.append(out)
        return out

    monkeypatch.setattr(module, name, recording)


def _window_means(values: list[dict[str, float]], size: int) -> list[dict[str, float]]:
    windows = [values[i : i + size] for i in range(0, len(values), size)]
    return [{k: sum(v[k] for v in w) / len(w) for k in w[0]} for w in windows]


def test_eagle_logs_the_window_means_of_its_micro_batch_metrics(
    tmp_path, tiny_target_dir, monkeypatch
):
    """The metrics summed on the device are the same means the recipe logged before."""
    import json

    import draftsmith.train.objectives.eagle_ttt as ttt
    from draftsmith.recipes.eagle import main as eagle

    seen: list = []
    _recorded(monkeypatch, ttt, "eagle3_ttt_loss", seen, lambda drafter, *a, **k: drafter.training)
    argv = base_args(tmp_path, tiny_target_dir, 3, eval_every=0, save_every=0, val_samples=2)
    assert eagle(argv) == 0  # 6 steps of 2 micro-batches, logged every 2 steps
    per_batch = [{k: float(v) for k, v in metrics.items()} for _, metrics in seen]
    assert len(per_batch) == 12
    log = json.loads((tmp_path / "run" / "training_metrics.json").read_text())["train_log"]
    assert [e["step"] for e in log] == [2, 4, 6]
    for entry, want in zip(log, _window_means(per_batch, 4), strict=True):
        for key, value in want.items():
            assert entry[f"train/{key}"] == pytest.approx(value, rel=1e-5, abs=1e-6), key
        assert entry["train/tokens_per_s"] > 0 and entry["train/grad_norm"] > 0


def test_distill_logs_the_window_means_of_its_micro_batch_metrics(
    tmp_path, tiny_target_dir, monkeypatch
):
    import json

    import draftsmith.recipes.distill as recipe

    seen: list = []
    _recorded(
        monkeypatch, recipe, "distill_batch_loss", seen, lambda *a, **k: torch.is_grad_enabled()
    )
    argv = [
        *("--target", str(tiny_target_dir), "--data", str(write_records(tmp_path / "d.jsonl"))),
        *("--output-dir", str(tmp_path / "run"), "--max-steps", "4", "--batch-size", "2"),
        *("--val-samples", "0", "--save-every", "0", "--no-progress", "--max-length", "96"),
        *("--log-every", "2", "--threads", "1"),
    ]
    assert recipe.main(argv) == 0
    per_batch = [
        {"loss": float(loss.detach()), "expected_acceptance": float(m["expected_acceptance"])}
        for loss, m in seen
    ]
    assert len(per_batch) == 4
    log = json.loads((tmp_path / "run" / "training_metrics.json").read_text())["train_log"]
    assert [e["step"] for e in log] == [2, 4]
    for entry, want in zip(log, _window_means(per_batch, 2), strict=True):
        for key, value in want.items():
            assert entry[f"train/{key}"] == pytest.approx(value, rel=1e-5, abs=1e-6), key
        assert entry["train/tokens_per_second"] > 0


# --- 2. explicit models and optimizers, not accelerate's private lists ------------------------


def test_the_run_knows_what_it_prepared(tmp_path):
    with _run(tmp_path) as run:
        model = torch.nn.Linear(4, 4)
        loader = torch.utils.data.DataLoader(list(range(4)), batch_size=2)
        model, opt, _ = run.prepare(model, torch.optim.AdamW(model.parameters()), loader)
        head = run.prepare(torch.nn.Linear(4, 2, bias=False))
        assert run.models == [model, head]
        assert run.optimizers == [opt]
        floats = 4 * 4 + 4 + 4 * 2
        trained = 4 * 4 + 4  # AdamW: two state tensors per trainable parameter
        assert checkpoint_bytes(run.models, run.optimizers) == (1 << 20) + 4 * (
            floats + 2 * trained
        )


# --- 3. CPU-only fixes stay on the CPU ---------------------------------------------------------


@pytest.fixture
def fake_group(monkeypatch):
    """A process group of 2 whose backend the test names; os._exit recorded, never taken."""
    calls: list = []
    size = {"n": 2}
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(dist, "_KEEP_ALIVE", [])
    monkeypatch.setattr(dist, "_GLOO_RUN", False, raising=False)
    monkeypatch.setattr(torch.distributed, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: size["n"])
    monkeypatch.setattr(torch.distributed, "destroy_process_group", lambda group=None: None)
    monkeypatch.setattr(os, "_exit", lambda code: calls.append(("os._exit", code)))
    monkeypatch.setattr(logging, "shutdown", lambda: calls.append(("logging.shutdown",)))

    def use(backend: str, world_size: int = 2) -> list:
        monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: backend)
        size["n"] = world_size
        return calls

    return use


@pytest.mark.parametrize("backend", ["gloo", "nccl", "mpi", "gloo-of-one"])
def test_the_gloo_teardown_workaround_applies_to_gloo_only(fake_group, monkeypatch, backend):
    calls = fake_group(backend.removesuffix("-of-one"), 1 if backend.endswith("one") else 2)
    models = object()
    dist.keep_alive(models)
    dist.teardown(None, ok=False)  # the group is destroyed before exit_process runs
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    code = dist.exit_process(3)
    kept = dist._KEEP_ALIVE
    if backend == "gloo":
        assert kept == [models]
        assert calls[-1] == ("os._exit", 3)
    else:  # the standard teardown (also for a gloo group of one): the code is returned
        assert code == 3
        assert kept == [] and calls == []


def test_exit_hooks_run_before_os_exit(fake_group, monkeypatch):
    calls = fake_group("gloo")
    fake_wandb = SimpleNamespace(
        run=object(), finish=lambda exit_code=0: calls.append(("wandb.finish", exit_code))
    )
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb)
    for name in ("stdout", "stderr"):
        stream = SimpleNamespace(flush=lambda name=name: calls.append((f"{name}.flush",)))
        monkeypatch.setattr(sys, name, stream)
    dist.exit_process(1)
    assert calls == [
        ("wandb.finish", 1),
        ("logging.shutdown",),
        ("stdout.flush",),
        ("stderr.flush",),
        ("os._exit", 1),
    ]


def test_a_second_signal_flushes_logs_before_exiting_at_once(fake_group, monkeypatch):
    import signal

    from draftsmith.train.core.stop import StopSignals

    calls = fake_group("nccl")  # any backend: this exit is the user's
    monkeypatch.setitem(sys.modules, "wandb", SimpleNamespace(run=object(), finish=calls.append))
    signals = StopSignals()
    signals._handle(signal.SIGINT, None)
    assert calls == []  # the first one only asks the loop to stop
    signals._handle(signal.SIGTERM, None)
    # No W&B finish here: it could wait for an upload, and the user asked to leave now.
    assert calls == [("logging.shutdown",), ("os._exit", 130)]


@pytest.mark.parametrize("fails", [False, True])
def test_trackers_finish_before_the_teardown_also_after_a_failure(tmp_path, monkeypatch, fails):
    calls: list = []
    real_teardown = run_module.teardown

    def teardown(accelerator, ok):
        calls.append(("teardown", ok))
        real_teardown(accelerator, ok)

    monkeypatch.setattr(run_module, "teardown", teardown)
    wandb_run = SimpleNamespace(finish=lambda exit_code=0: calls.append(("wandb", exit_code)))
    tracker = SimpleNamespace(
        name="wandb", tracker=wandb_run, finish=lambda: calls.append(("wandb", 0))
    )
    with contextlib.suppress(RuntimeError), _run(tmp_path) as run:
        run.accelerator.trackers.append(tracker)
        if fails:
            raise RuntimeError("the run failed")
    # A failed run's W&B run is marked failed (exit code 1), and finished before os._exit.
    assert calls == [("wandb", 1 if fails else 0), ("teardown", not fails)]


def _fake_gpu_processes(monkeypatch):
    """start_processes as on a GPU machine (accelerate itself stays on this CPU)."""
    real = run_module.start_processes

    def start(timeout_minutes, cpu=False):
        real(timeout_minutes, cpu=cpu)
        return SimpleNamespace(device=torch.device("cuda", 0), num_processes=1)

    monkeypatch.setattr(run_module, "start_processes", start)


def test_threads_apply_to_cpu_runs_only(tmp_path, monkeypatch, capsys):
    before = torch.get_num_threads()
    try:
        # Both runs in one process share accelerate's state: the same mixed precision for the
        # CPU and the stand-in GPU (whose `auto` would resolve otherwise).
        with _run(tmp_path, threads=before + 1, mixed_precision="no") as run:
            assert torch.get_num_threads() == before + 1
            assert not run.pin_memory
        torch.set_num_threads(before)
        _fake_gpu_processes(monkeypatch)
        with _run(
            tmp_path, threads=before + 1, overwrite=True, resume=False, mixed_precision="no"
        ) as run:
            assert torch.get_num_threads() == before
            assert run.pin_memory  # batches copied without waiting for the GPU
        assert "note: threads is for CPU runs" in capsys.readouterr().out
    finally:
        torch.set_num_threads(before)


# --- 4. one device setting ------------------------------------------------------------------


def test_device_is_checked_with_the_other_fields():
    with pytest.raises(ConfigError) as err:
        load_config(TrainConfig, overrides={"device": "gpu"})
    assert dict(err.value.problems)["device"].startswith("must be auto, cpu, cuda or cuda:N")
    assert load_config(TrainConfig, overrides={"device": "cuda:1"}).device == "cuda:1"
    assert load_config(TrainConfig).device == "auto"


@pytest.mark.parametrize(
    "want, got, problem",
    [
        ("auto", "cpu", None),
        ("auto", "cuda:1", None),
        ("cpu", "cpu", None),
        ("cuda", "cuda:1", None),
        ("cuda:1", "cuda:1", None),
        ("cuda:0", "cuda:1", "device: cuda:0 asked for, but the launcher gave this process cuda:1"),
        ("cuda", "cpu", "device: cuda asked for, but accelerate runs this process on cpu"),
        ("cpu", "cuda:0", "device: cpu asked for, but accelerate runs this process on cuda:0"),
    ],
)
def test_device_must_be_what_accelerate_gave(want, got, problem):
    found = device_mismatch(want, torch.device(got))
    if problem is None:
        assert found is None
    else:
        assert found.startswith(problem) and "\n" not in found


def test_device_cpu_forces_cpu_processes(tmp_path, monkeypatch):
    import accelerate

    asked: list = []
    real = accelerate.PartialState

    def state(cpu=False, **kwargs):
        asked.append(cpu)
        return real(cpu=cpu, **kwargs)

    monkeypatch.setattr(accelerate, "PartialState", state)
    with _run(tmp_path, device="cpu") as run:
        assert run.accelerator.device.type == "cpu"
    assert asked == [True]


def test_a_gpu_accelerate_did_not_give_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(run_module, "resolve_device", lambda spec: torch.device(spec))
    with pytest.raises(UsageError) as err:  # "cuda" passes the machine check; accelerate: CPU
        _run(tmp_path, device="cuda")
    assert str(err.value).startswith("device: cuda asked for, but accelerate runs this process")
    assert not (tmp_path / "run").exists()  # refused before any output


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_a_recipe_asked_for_a_missing_gpu_exits_2_naming_device(tmp_path, tiny_target_dir, capsys):
    from draftsmith.recipes.eagle import main as eagle

    assert eagle([*base_args(tmp_path, tiny_target_dir, 1), "--device", "cuda"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith("error: device: cuda asked for, but this machine has no usable CUDA")


# --- 5. mixed precision per device ------------------------------------------------------------


def test_fp16_is_refused_naming_mixed_precision(tmp_path, tiny_target_dir, capsys):
    with pytest.raises(ConfigError) as err:
        load_config(TrainConfig, overrides={"mixed_precision": "fp16"})
    assert "GradScaler" in dict(err.value.problems)["mixed_precision"]
    from draftsmith.recipes.eagle import main as eagle

    argv = [*base_args(tmp_path, tiny_target_dir, 1), "--mixed-precision", "fp16"]
    assert eagle(argv) == 2
    text = one_error_line(capsys.readouterr().err)
    assert "mixed_precision: fp16 needs a GradScaler" in text and "use bf16" in text
    assert not (tmp_path / "run").exists()


def test_bf16_autocasts_the_prepared_model_on_this_device(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    with _run(tmp_path, mixed_precision="bf16") as run:
        model = run.prepare(torch.nn.Linear(16, 16))
        with torch.no_grad():
            out = model(x)  # handed back in fp32 by accelerate, computed in bf16
            plain = run.accelerator.unwrap_model(model, keep_fp32_wrapper=False)(x)
    assert next(model.parameters()).dtype == torch.float32  # fp32 master weights
    assert torch.equal(out, out.bfloat16().float())  # every value a bf16 one
    assert not torch.equal(plain, plain.bfloat16().float())
