"""Our short package names hold against a working folder that has its own `models/` or
`quant/` (where many people keep their GGUF files): `python -m runtime` run from there
imports Llamba's packages, not the user's folders."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _user_folder(tmp_path: Path) -> Path:
    for name in ("models", "quant"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "my-model.gguf").write_bytes(b"not a model")
    return tmp_path


def test_cli_runs_from_a_folder_with_models_dir(tmp_path, model_path):
    path = model_path("smollm2-135m")
    r = subprocess.run([sys.executable, "-m", "runtime", "info", str(path), "--json"], cwd=_user_folder(tmp_path),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["architecture"] == "llama"


def test_our_packages_win_over_the_working_folder(tmp_path):
    code = "import app, models, quant, runtime; print(models.__file__); print(quant.__file__)"
    r = subprocess.run([sys.executable, "-c", code], cwd=_user_folder(tmp_path), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(ROOT / "models" / "__init__.py"), str(ROOT / "quant" / "__init__.py")]
