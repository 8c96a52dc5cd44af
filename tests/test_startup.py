"""What a person sees and waits for: quick paths import nothing heavy, ready models load without
bars, the one-time conversion reports each stage, and progress bars appear only in a terminal."""

import json
import os
import subprocess
import sys

import pytest

from mcsd.drafting.pair import load_model
from mcsd.loading.models import _cache_is_valid, convert_gguf

BAR_SWITCHES = ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS")


def _env():
    """This environment without any progress-bar switch a developer may have set."""
    return {k: v for k, v in os.environ.items() if k not in BAR_SWITCHES}


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=300)


def test_list_models_help_argument_errors_and_import_load_no_torch():
    proc = _python("import sys, mcsd\n"
                   "from mcsd.cli import main\n"
                   "main(['--list-models']); main(['--help']); main(['--tree', '2', '--dtype', 'int8'])\n"
                   "print(sorted(m for m in ('torch', 'transformers', 'sklearn') if m in sys.modules))\n"
                   "print(mcsd.TreeDecoder.__name__)")
    assert proc.returncode == 0, proc.stderr
    heavy, lazily = proc.stdout.strip().splitlines()[-2:]
    assert heavy == "[]" and lazily == "TreeDecoder"            # the package's names still resolve on use


def test_a_ready_model_loads_without_bars(model_dirs, capsys):
    from transformers.utils import logging as hf_logging
    before = hf_logging.is_progress_bar_enabled()
    load_model(str(model_dirs / "target"), "float32")
    assert "Loading weights" not in capsys.readouterr().err
    assert hf_logging.is_progress_bar_enabled() == before       # the caller's setting is put back


def test_conversion_prints_a_line_per_stage(gguf_file, tmp_path, capsys):
    out = convert_gguf(gguf_file, tmp_path / "converted")
    err = capsys.readouterr().err
    stages = [line for line in err.splitlines() if line.startswith("mcsd: ")]
    assert [s.split("...")[0] for s in stages if s.endswith("...")] == [
        "mcsd: reading the tokenizer", "mcsd: de-quantising the weights to float32", "mcsd: writing safetensors"]
    assert sum("done in" in s for s in stages) == 3 and "mcsd: converted in" in err
    assert "Loading weights" not in err and "Writing model shards" not in err   # stderr is not a terminal here
    assert _cache_is_valid(out)


def _cli(gguf_file):
    return [sys.executable, "-m", "mcsd.cli", "--target", str(gguf_file), "--baseline", "--dtype", "float32",
            "--prompt", "ABC", "--max-new-tokens", "3", "--json"]


def test_off_a_terminal_the_cli_prints_no_bars(gguf_file):
    proc = subprocess.run(_cli(gguf_file), capture_output=True, text=True, env=_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)["tokens"]) == 3
    assert "it/s" not in proc.stderr and "\r" not in proc.stderr and "%|" not in proc.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pseudo-terminal test written for Linux")
def test_in_a_terminal_only_the_one_time_work_shows_bars(gguf_file):
    """A .gguf target is de-quantised on every load: that bar shows in a terminal; loading bars do not."""
    import fcntl
    import pty
    import struct
    import termios
    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen(_cli(gguf_file), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=secondary, env=_env())
    os.close(secondary)
    seen = b""
    while True:
        try:
            chunk = os.read(primary, 4096)
        except OSError:                      # EIO: the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    os.close(primary)
    assert proc.wait(timeout=300) == 0
    text = seen.decode(errors="replace")
    assert "Converting and de-quantizing GGUF tensors" in text and "it/s" in text
    assert "Loading weights" not in text
