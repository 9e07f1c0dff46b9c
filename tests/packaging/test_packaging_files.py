"""Fast checks of everything in packaging/ that can be checked without building
(the full build-and-install check is packaging/check-linux.sh, minutes long)."""
from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "packaging"


def _pyproject_version() -> str:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["version"]


def test_one_version_everywhere():
    import app
    import runtime
    v = _pyproject_version()
    assert runtime.__version__ == v
    assert app.__version__ == v
    out = subprocess.run([sys.executable, "-m", "runtime", "--version"], capture_output=True, text=True)
    assert out.stdout.strip() == f"llamba {v}"


def test_spec_and_entry_points_compile():
    for f in ("llamba.spec", "entry_app.py", "entry_cli.py", "hooks/rthook_llamba.py", "make_icon.py"):
        compile((PKG / f).read_text(), str(PKG / f), "exec")
    spec = (PKG / "llamba.spec").read_text()
    assert 'name="llamba"' in spec and 'name="llamba-cli"' in spec
    assert '"torch"' in spec, "test-only heavyweights must stay out of the installer"


def test_icons_are_real_images():
    assert (PKG / "llamba.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (PKG / "llamba.ico").read_bytes()[:4] == b"\x00\x00\x01\x00"


def test_desktop_entry():
    entry = (PKG / "linux" / "llamba.desktop").read_text()
    assert "Exec=/opt/llamba/llamba" in entry and "Icon=llamba" in entry and "Name=Llamba" in entry
    if shutil.which("desktop-file-validate"):
        res = subprocess.run(["desktop-file-validate", str(PKG / "linux" / "llamba.desktop")],
                             capture_output=True, text=True)
        assert res.returncode == 0 and "error" not in res.stdout.lower(), res.stdout


def test_deb_control_template():
    control = (PKG / "linux" / "control.in").read_text()
    for field in ("Package: llamba", "Version: @VERSION@", "Architecture: @ARCH@", "Depends:", "Description:"):
        assert field in control


def test_windows_installer_script():
    iss = (PKG / "windows" / "llamba.iss").read_text()
    assert "PrivilegesRequired=lowest" in iss            # per-user, no admin
    assert "{group}\\Llamba" in iss and "{autodesktop}\\Llamba" in iss
    assert "[UninstallDelete]" in iss and "{app}" in iss
    assert "dist\\pyinstaller\\llamba" in iss            # wraps the shared spec's output


def test_windows_workflow_yaml():
    yaml = pytest.importorskip("yaml")
    wf_path = ROOT / ".github" / "workflows" / "windows-installer.yml"
    wf = yaml.safe_load(wf_path.read_text())
    job = wf["jobs"]["build"]
    assert job["runs-on"] == "windows-latest"
    runs = " ".join(s.get("run", "") for s in job["steps"])
    assert "packaging/llamba.spec" in runs and "iscc" in runs
    assert any("upload-artifact" in s.get("uses", "") for s in job["steps"])
    if shutil.which("action-validator"):     # npm @action-validator/cli: the workflow schema
        res = subprocess.run(["action-validator", str(wf_path)], capture_output=True, text=True)
        assert res.returncode == 0, res.stdout
