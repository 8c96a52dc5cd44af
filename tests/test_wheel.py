"""An installed mcsd runs the default pair: its wheel carries the models the default run reads.

The wheel is built from a copy of the checkout's sources and installed into a
folder of its own; the loader is then asked, from a fresh interpreter that
has only that folder (not the checkout) on its path, where the default
drafter and the decision models are.
"""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from mcsd.errors import ModelLoadError
from mcsd.loading.models import preset_draft_dir
from mcsd.loading.presets import DEFAULT_PRESET, PRESETS

ROOT = Path(__file__).resolve().parents[1]
PRESET = PRESETS[DEFAULT_PRESET]


def _shipped(folder: str) -> list[str]:
    """The files of one of the checkout's models/ folders, as wheel paths."""
    return sorted(f"mcsd/models/{folder}/{p.name}" for p in (ROOT / "models" / folder).iterdir() if p.is_file())


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in ("setup.py", "setup.cfg", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "mcsd", src / "mcsd", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (src / "models").symlink_to(ROOT / "models")          # 50 MB: read through, not copied
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(out), str(src)], check=True, capture_output=True, cwd=src)
    (built,) = out.glob("mcsd-*.whl")
    return built


def test_wheel_holds_the_default_drafter_and_the_decision_models(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert PRESET.default_drafter == "feature"
    for folder in (PRESET.feature_dir, "decision-models"):
        expected = _shipped(folder)
        assert expected and not set(expected) - names, f"{folder}: {sorted(set(expected) - names)}"
    assert "mcsd/forward/q4_kernel.c" in names
    # the standalone draft is not the default and stays in the checkout
    assert not any(n.startswith(f"mcsd/models/{PRESET.draft_dir}/") for n in names)


INSTALLED_CHECK = """
import json, sys
import mcsd
from mcsd.drafting.feature_draft import FeatureHead
from mcsd.drafting.policies import resolve_policy
from mcsd.drafting.policies.acceptance import AcceptanceModel, default_model_path
from mcsd.loading.models import preset_draft_dir
from mcsd.loading.presets import DEFAULT_PRESET, PRESETS
head_dir = preset_draft_dir(PRESETS[DEFAULT_PRESET])
FeatureHead.load(head_dir)
AcceptanceModel.load(default_model_path())
AcceptanceModel.load(head_dir / "acceptance.json")
print(json.dumps({"package": mcsd.__file__, "head": str(head_dir), "decision": str(default_model_path()),
                  "policy": resolve_policy("auto")}))
"""


def test_an_installed_wheel_finds_the_default_pairs_models(wheel, tmp_path):
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target",
                    str(site), str(wheel)], check=True, capture_output=True)
    env = {k: v for k, v in os.environ.items() if k not in ("MCSD_MODELS_DIR", "PYTHONPATH")}
    env["PYTHONPATH"] = str(site)
    run = subprocess.run([sys.executable, "-c", INSTALLED_CHECK], cwd=tmp_path, env=env,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert Path(found["package"]).is_relative_to(site)          # the installed copy, not the checkout
    assert Path(found["head"]) == site / "mcsd" / "models" / PRESET.feature_dir
    assert Path(found["decision"]) == site / "mcsd" / "models" / "decision-models" / "acceptance.json"
    assert found["policy"] == "learned"


def test_a_missing_default_drafter_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("MCSD_MODELS_DIR", str(tmp_path))
    with pytest.raises(ModelLoadError, match=r"the feature draft .* missing: expected feature_head\.json .*"
                                             r"MCSD_MODELS_DIR") as err:
        preset_draft_dir(PRESET)
    assert len(str(err.value).splitlines()) == 1
