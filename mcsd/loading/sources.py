"""Where a model comes from, checked before anything is loaded.

A model source is a preset name, a local directory, a `.gguf` file or a
Hugging Face Hub id. What can be known about it without loading it is
checked here, so that the command line and the Python API name the same
problem in the same words and at once: a path that does not exist, a
directory that holds no saved model, a file that is not a checkpoint, a
safetensors file cut short, or a hub id that is neither cached nor reachable
(transformers would otherwise retry for most of a minute).

No torch or transformers here: the command line calls this before anything
heavy is imported.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
from pathlib import Path

from ..errors import ModelLoadError
from .presets import PRESETS


def is_local_path_syntax(source: str) -> bool:
    """"org/name" could be a hub id; "./x", "/x", "~/x", "a/b/c" or "x.gguf" can only be paths."""
    return source.endswith(".gguf") or source.startswith((".", "/", "~")) or source.count("/") > 1


def resolve_source(source: str, label: str = "model") -> tuple[str, dict]:
    """Map a source string to (path or hub id, extra from_pretrained kwargs); ModelLoadError for a
    path that cannot be a model, or for a hub id (named by `label`) that is neither cached nor
    reachable (`prepare_hub`, which also switches a cached one to offline loading)."""
    path = Path(source).expanduser()
    if source.endswith(".gguf"):
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {source}")
        return str(path.parent), {"gguf_file": path.name}
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{source} is a directory without config.json; not a saved model")
        return str(path), {}
    if path.exists():
        raise ModelLoadError(f"{source} is a file but not a .gguf checkpoint; pass a model directory or a .gguf file")
    if is_local_path_syntax(source):
        raise ModelLoadError(f"model path does not exist: {source}")
    if source not in PRESETS:
        prepare_hub([(label, source)])
    return source, {}


def is_hub_id(source: str) -> bool:
    """A source that can only be a Hugging Face Hub id (no preset, no path here)."""
    return source not in PRESETS and not is_local_path_syntax(source) and not Path(source).expanduser().exists()


def hub_cache() -> Path:
    """The local Hugging Face hub cache (huggingface_hub's own rule, without importing it)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def hub_reachable(timeout: float = 1.0) -> bool:
    """Whether the Hugging Face Hub answers a TCP connection within `timeout` seconds."""
    host = os.environ.get("HF_ENDPOINT", "https://huggingface.co").split("://")[-1].split("/")[0]
    try:
        socket.create_connection((host.split(":")[0], 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "TRUE", "YES", "ON")


def prepare_hub(ids: list[tuple[str, str]]) -> None:
    """Hub ids without a network: load from the local cache in offline mode (no retries), or stop at
    once when one is not cached.

    Args:
        ids: (label, hub id) pairs; the label names the id in the message ("--target", "target").
    Raises:
        ModelLoadError naming the first id that is neither cached nor reachable.
    """
    if not ids or _offline() or hub_reachable():
        return
    missing = [(label, repo) for label, repo in ids
               if not (hub_cache() / f"models--{repo.replace('/', '--')}").is_dir()]
    if missing:
        label, repo = missing[0]
        raise ModelLoadError(f"{label} {repo}: not a local path, not in the Hugging Face cache ({hub_cache()}), "
                             f"and the Hub cannot be reached; pass a local directory or .gguf file, or download "
                             f"it first")
    os.environ["HF_HUB_OFFLINE"] = "1"             # read when huggingface_hub is imported
    hub = sys.modules.get("huggingface_hub.constants")
    if hub is not None:                            # already imported: switch it there too
        hub.HF_HUB_OFFLINE = True


def check_safetensors(path: Path) -> None:
    """A safetensors file whose header is readable and whose tensors all lie inside the file;
    ModelLoadError naming the file otherwise (a copy cut short, a download that stopped)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError("shorter than its 8-byte header length")
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8:
                raise ValueError(f"its header claims {n} bytes, the file holds {size}")
            header = json.loads(f.read(n))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path} is not a readable safetensors file: {exc}") from None
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise ModelLoadError(f"{path} is cut short: its tensors need {8 + n + end} bytes, the file holds {size} "
                             f"(copy or download it again)")


def check_source(source: str, label: str = "target") -> None:
    """Everything about a model source that can be found without loading it (see the module
    docstring); a preset passes. Raises ModelLoadError naming `label` and the source."""
    if source in PRESETS:
        return
    head = Path(source).expanduser()
    if head.is_dir() and (head / "feature_head.json").is_file():     # mcsd's feature head: no config.json
        for weights in sorted(head.glob("*.safetensors")):
            check_safetensors(weights)
        return
    try:
        name, kw = resolve_source(source, label)
    except ModelLoadError as exc:
        raise ModelLoadError(exc if is_hub_id(source) else f"{label}: {exc}") from None
    folder = Path(name)
    if folder.is_dir() and "gguf_file" not in kw:     # a GGUF's folder may hold anything else: not its weights
        for weights in sorted(folder.glob("*.safetensors")):
            check_safetensors(weights)


def context_window(source: str) -> int | None:
    """The context window (max_position_embeddings) a model source declares, read without its weights:
    a preset's own figure, a directory's config.json, a .gguf file's header, a hub id's cached
    config.json; None where none can be read that cheaply (the window is then checked once the
    model has loaded)."""
    preset = PRESETS.get(source)
    if preset is not None:
        return preset.context_window
    path = Path(source).expanduser()
    if source.endswith(".gguf"):
        return _gguf_context_window(path) if path.is_file() else None
    config = path / "config.json" if path.is_dir() else None
    if config is None and is_hub_id(source):
        try:
            from huggingface_hub import try_to_load_from_cache
            found = try_to_load_from_cache(source, "config.json")
        except Exception:                              # no hub library, or a malformed id: not known here
            found = None
        config = Path(found) if isinstance(found, str) else None
    try:
        data = json.loads(config.read_text()) if config is not None else None
    except (OSError, ValueError):
        return None
    window = data.get("max_position_embeddings") if isinstance(data, dict) else None
    return window if isinstance(window, int) and not isinstance(window, bool) and window > 0 else None


def _gguf_context_window(path: Path) -> int | None:
    """`<architecture>.context_length` from a GGUF file's header, or None."""
    try:
        from gguf import GGUFReader
        reader = GGUFReader(str(path), "r")
        arch = reader.fields["general.architecture"]
        name = bytes(arch.parts[arch.data[0]]).decode()
        field = reader.fields[f"{name}.context_length"]
        return int(field.parts[field.data[0]][0])
    except Exception:                                  # not readable here: checked after loading
        return None
