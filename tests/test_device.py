"""The device setting and the rules that keep the code GPU-correct, pinned on the CPU.

No GPU here: the CUDA side is checked through what the code asks of torch (a synchronize, a
generator's device, a refused ``cuda``), the meta device, and static rules over the source:

* no device-less ``torch.Generator()`` in library code (a CPU generator cannot feed a CUDA
  ``torch.rand``/``torch.multinomial``);
* no host sync (``.item()``, ``float(t)``, ``int(t)``; in ``generate`` also ``.tolist()``) in the
  recipes' per-micro-batch bodies or in ``generate``'s per-step body, unless the line carries a
  ``# sync:`` comment saying why;
* accelerate's private state is touched in one compatibility module only.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

from draftsmith.train.device import (
    DeviceTimer,
    IntervalTimer,
    device_facts,
    device_problem,
    make_generator,
    resolve_device,
)
from draftsmith.train.errors import UsageError

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = [ROOT / "train", ROOT / "heads", ROOT / "recipes"]
RECIPES = ["eagle.py", "distill.py", "medusa.py"]


# --- the setting ------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["auto", "cpu", "cuda", "cuda:0", "cuda:3"])
def test_device_spellings_accepted(spec):
    assert device_problem(spec) is None


@pytest.mark.parametrize("spec", ["gpu", "cuda:", "cuda:x", "CPU", "", "cuda:0:1", 3])
def test_device_misspellings_named(spec):
    assert "auto, cpu, cuda or cuda:N" in device_problem(spec)
    with pytest.raises(UsageError, match=r"^device: must be"):
        resolve_device(spec)


def test_auto_and_cpu_resolve_to_the_cpu_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device(None) == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")


def test_auto_means_cuda_when_present(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(UsageError, match=r"^device: cuda:2 .* 2 CUDA GPU\(s\)"):
        resolve_device("cuda:2")


def test_cuda_refused_in_one_line_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UsageError) as info:
        resolve_device("cuda", field="device")
    message = str(info.value)
    assert message.startswith("device: cuda asked for") and "\n" not in message


def test_run_info_records_the_device_used_not_the_one_present(monkeypatch):
    """Finding 1: ``"device": "cuda"`` was recorded whenever CUDA merely existed."""
    from draftsmith.train.runinfo import run_info

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    machine = run_info()["machine"]
    assert "device" not in machine and machine["cuda_available"] is True
    machine = run_info(torch.device("cpu"))["machine"]
    assert machine["device"] == "cpu" and machine["device_type"] == "cpu"
    assert "gpu_name" not in machine


def test_device_facts_of_a_gpu(monkeypatch):
    class Props:
        name = "NVIDIA H200"
        total_memory = 141 * 2**30

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    facts = device_facts(torch.device("cuda", 1))
    assert facts["device"] == "cuda:1" and facts["gpu_name"] == "NVIDIA H200"
    assert facts["gpu_count"] == 8 and facts["gpu_memory_gib"] == 141.0
    assert "cuda_version" in facts


# --- timer and generators ---------------------------------------------------------------------


def test_timer_synchronizes_a_gpu_before_each_read(monkeypatch):
    """Finding 3: clocks were read while the GPU still ran the work being timed."""
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    timer = DeviceTimer(torch.device("cuda", 0))
    timer.now()
    timer.now()
    assert calls == [torch.device("cuda", 0)] * 2
    calls.clear()
    DeviceTimer("cpu").now()
    DeviceTimer(torch.device("meta")).now()
    assert calls == []


def test_generate_times_with_the_device_timer(target, monkeypatch):
    """The loop reads the synchronizing device timer of the target's device at the prompt's
    start and end only; each draft (start, propose, accept) is an interval of the target
    device's IntervalTimer, read once (issue 51: four synchronizes a step tilted the race)."""
    from draftsmith.heads.ngram import NGramDrafter
    from draftsmith.train.decoding import speculative

    made, intervals = [], []

    class CountingTimer(DeviceTimer):
        def __init__(self, device):
            super().__init__(device)
            made.append(self)
            self.reads = 0

        def now(self):
            self.reads += 1
            return super().now()

    class CountingIntervals(IntervalTimer):
        def __init__(self, device):
            super().__init__(device)
            intervals.append(self)
            self.starts = self.totals = 0

        def start(self):
            self.starts += 1
            return super().start()

        def total(self):
            self.totals += 1
            return super().total()

    monkeypatch.setattr(speculative, "DeviceTimer", CountingTimer)
    monkeypatch.setattr(speculative, "IntervalTimer", CountingIntervals)
    out = speculative.generate(target, [1, 2, 3, 1, 2], NGramDrafter(), k=3, max_new_tokens=8)
    assert len(made) == 1 and made[0].device == target.device
    assert made[0].reads == 2  # start and end: no synchronized read inside a step
    drafting, prefill = intervals
    steps = out.target_forwards - 1  # the prefill is the first forward
    assert steps >= 2 and 1 + steps <= drafting.starts <= 1 + 2 * steps
    assert prefill.starts == 1 and drafting.totals == prefill.totals == 1
    assert 0 < out.draft_time < out.wall_time and 0 < out.prefill_time < out.wall_time


def test_generators_live_on_the_device_they_feed():
    gen = make_generator("cpu", 5)
    assert gen.device == torch.device("cpu") and gen.initial_seed() == 5
    a = torch.rand(4, generator=make_generator("cpu", 1))
    b = torch.rand(4, generator=make_generator(torch.device("cpu"), 1))
    assert torch.equal(a, b)


def test_evaluate_makes_its_generators_on_the_target_device(tiny_target_dir, tmp_path, monkeypatch):
    """Finding 2: sampled evaluation handed CPU generators to the target's device; now each
    generator is made on the device the target runs on, and a seed reproduces the outputs."""
    from draftsmith.recipes import evaluate

    devices = []
    real = evaluate.make_generator

    def spy(device, seed=None):
        devices.append(torch.device(device))
        return real(device, seed)

    monkeypatch.setattr(evaluate, "make_generator", spy)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello there"}\n{"prompt": "what now"}\n')
    outs = []
    for i in range(2):
        out = tmp_path / f"r{i}.json"
        argv = ["--target", str(tiny_target_dir), "--prompts", str(prompts), "--device", "cpu"]
        argv += ["--drafter", "ngram", "--temperature", "0.9", "--seed", "7", "--k", "2"]
        argv += ["--max-new-tokens", "12", "--no-reference-plain", "--out", str(out)]
        assert evaluate.main(argv) == 0
        outs.append(json.loads(out.read_text()))
    assert devices and set(devices) == {torch.device("cpu")}
    ids = [[p["output_ids"] for p in o["per_prompt"]] for o in outs]
    assert ids[0] == ids[1]
    assert outs[0]["machine"]["device"] == "cpu"


def test_evaluate_device_flag(tiny_target_dir, capsys):
    from draftsmith.recipes import evaluate

    # A misspelling is a config problem: reported with any others, one line per field.
    assert evaluate.main(["--device", "gpu7", "--drafter", "ngram"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("error:") and err[1:] == [
        "  device: must be auto, cpu, cuda or cuda:N (N = 0, 1, ...), got 'gpu7'"
    ]
    if not torch.cuda.is_available():
        assert evaluate.main(["--target", str(tiny_target_dir), "--device", "cuda"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: device: cuda asked for")


# --- static rules -----------------------------------------------------------------------------


def _library_files() -> list[Path]:
    return sorted(p for root in LIBRARY for p in root.rglob("*.py"))


def test_no_device_less_generators_in_library_code():
    """``torch.Generator()`` makes a CPU generator: it must name the device it feeds."""
    bad = []
    for path in _library_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "Generator"
                and not node.args
                and not any(kw.arg == "device" for kw in node.keywords)
            ):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not bad, f"torch.Generator() without a device: {bad}"


def _syncs(nodes: list[ast.stmt], lines: list[str], *, tolist: bool) -> list[int]:
    """Line numbers of unmarked host syncs in these statements (nested bodies included)."""
    found = []
    for stmt in nodes:
        for node in ast.walk(stmt):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            sync = isinstance(func, ast.Name) and func.id in ("float", "int", "bool")
            sync |= isinstance(func, ast.Attribute) and func.attr == "item"
            sync |= tolist and isinstance(func, ast.Attribute) and func.attr == "tolist"
            # int(...) of a literal or of len(...) is host arithmetic, not a sync.
            if sync and isinstance(func, ast.Name) and node.args:
                arg = node.args[0]
                literal = isinstance(arg, ast.Constant)
                host = isinstance(arg, ast.Call) and getattr(arg.func, "id", "") == "len"
                sync = not (literal or host)
            if sync and "# sync:" not in lines[node.lineno - 1]:
                found.append(node.lineno)
    return found


def _micro_batch_bodies(tree: ast.AST) -> list[list[ast.stmt]]:
    """The per-micro-batch part of each ``for batch in run.position.batches_of_epoch(...)``
    loop: its statements up to ``if not accelerator.sync_gradients: continue``."""
    bodies = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.For)
            and isinstance(node.iter, ast.Call)
            and isinstance(node.iter.func, ast.Attribute)
            and node.iter.func.attr == "batches_of_epoch"
        ):
            body = []
            for stmt in node.body:
                if isinstance(stmt, ast.If) and "sync_gradients" in ast.unparse(stmt.test):
                    break
                body.append(stmt)
            bodies.append(body)
    return bodies


@pytest.mark.parametrize("recipe", RECIPES)
def test_no_host_syncs_per_micro_batch(recipe):
    """Finding 5: a sync per metric per micro-batch stalls a GPU; metrics stay on the device
    and are read once per log interval."""
    path = ROOT / "recipes" / recipe
    text = path.read_text()
    bodies = _micro_batch_bodies(ast.parse(text))
    assert bodies, f"{recipe}: no `for batch in run.position.batches_of_epoch(...)` loop found"
    bad = [n for body in bodies for n in _syncs(body, text.splitlines(), tolist=False)]
    assert not bad, f"{recipe}: host syncs in the per-micro-batch body at lines {bad}"


def test_generate_reads_the_device_once_per_step_at_marked_lines():
    path = ROOT / "train" / "decoding" / "speculative.py"
    text = path.read_text()
    tree = ast.parse(text)
    gen = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "generate")
    loops = [n for n in ast.walk(gen) if isinstance(n, ast.While)]
    assert len(loops) == 1
    bad = _syncs(loops[0].body, text.splitlines(), tolist=True)
    assert not bad, f"generate: unmarked host syncs in the per-step body at lines {bad}"
    marked = [ln for ln in text.splitlines()[loops[0].lineno :] if "# sync:" in ln]
    assert 1 <= len(marked) <= 3  # the tree's shape, and the step's outcome (chain or tree)


def test_accelerate_private_state_only_in_the_compat_module():
    """Finding 6: private accelerate attributes break on a minor release; one module holds
    them, and its own test names the attribute that changed."""
    private = ("_shared_state", "_reset_state", "._models", "._optimizers")
    compat = ROOT / "train" / "core" / "accelerate_compat.py"
    bad = []
    for path in _library_files():
        if path == compat:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if any(name in line for name in private):
                bad.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not bad, "private accelerate state outside train/core/accelerate_compat.py:\n" + (
        "\n".join(bad)
    )
