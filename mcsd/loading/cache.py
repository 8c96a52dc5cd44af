"""Where mcsd keeps files: the per-user cache and the shipped models/ folder.

Everything mcsd writes (the downloaded GGUF, the converted target, device
profiles) goes under the cache through `cache_subdir` and `cache_writes`, so a
cache that cannot be written (read-only, immutable, inside /proc, a file) is
one error naming the path and what to do, raised before the work that would
fill it. Reading a cache that is already complete needs no write access.

No torch here: the command line reads these before anything heavy is imported.
"""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

from ..config import ConfigError


def cache_dir() -> Path:
    """Root of mcsd's per-user cache: $MCSD_CACHE, else ~/.cache/mcsd."""
    return Path(os.environ.get("MCSD_CACHE") or Path.home() / ".cache" / "mcsd").expanduser()


def models_dir() -> Path:
    """Where shipped artefacts live: $MCSD_MODELS_DIR; else mcsd/models, where a wheel puts
    the default run's models (setup.py); else the checkout's models/ folder."""
    env = os.environ.get("MCSD_MODELS_DIR")
    if env:
        return Path(env).expanduser()
    package = Path(__file__).resolve().parents[1]           # mcsd/loading/cache.py -> mcsd/
    installed = package / "models"
    return installed if installed.is_dir() else package.parent / "models"


@contextmanager
def cache_writes(path: Path):
    """Writes under the cache: an OSError inside becomes one ConfigError naming `path` and what to do."""
    try:
        yield
    except OSError as exc:
        where = exc.filename or path
        raise ConfigError(f"cannot write the mcsd cache {cache_dir()}: {exc.strerror or exc} ({where}); "
                          f"set MCSD_CACHE to a writable directory") from None


def umask() -> int:
    """This process's umask (read from /proc where it is there, else set and put back)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def shared_modes(path: Path) -> None:
    """Give `path` (a file, or a folder and everything in it) the modes a plain write would: 0666 and
    0777 less the umask. Temporary folders (mkdtemp) and safetensors files are made 0700 / 0600, and
    the cache keeps them under their final names after a rename; nothing in it is secret."""
    mask = umask()
    for entry in [path, *(path.rglob("*") if path.is_dir() else ())]:
        if not entry.is_symlink():
            entry.chmod((0o777 if entry.is_dir() else 0o666) & ~mask)


def cache_subdir(*parts: str) -> Path:
    """`cache_dir() / parts`, created when missing and checked writable (a file is made and removed).

    Raises:
        ConfigError: naming the path, when it cannot be created or written.
    """
    path = cache_dir().joinpath(*parts)
    with cache_writes(path):
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    return path
