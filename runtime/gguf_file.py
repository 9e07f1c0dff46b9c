"""A defensive GGUF reader: header and metadata parsed with every count checked
against the bytes that remain, tensor data left memory-mapped.

Why our own parser rather than `gguf.GGUFReader`: that reader trusts the counts
in the header, so a 43-byte file that claims an array of 2**63 strings makes it
loop (or allocate) forever.  Here no count is used before it is proven to fit in
the file, so hostile input fails fast with a `GGUFError` naming what is wrong.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types: id -> (name, struct format or None for compound).
_SCALARS = {
    0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
    6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8),
}
_NUMPY_OF = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
             6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4


class GGUFError(ValueError):
    """The file is not a valid GGUF file; the message says where and why."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]   # numpy order (rows first): GGUF's ne reversed
    ggml_type: int
    offset: int              # absolute byte offset in the file
    nbytes: int


class _Cursor:
    def __init__(self, buf, size: int):
        self.buf, self.size, self.pos = buf, size, 0

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise GGUFError(f"truncated GGUF: {what} needs {n} bytes at offset {self.pos}, "
                            f"file has {self.size}")

    def unpack(self, fmt: str, n: int, what: str):
        self.need(n, what)
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += n
        return v

    def u32(self, what): return self.unpack("<I", 4, what)
    def u64(self, what): return self.unpack("<Q", 8, what)

    def string(self, what: str) -> str:
        n = self.u64(what + " length")
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def count(self, what: str, min_item_bytes: int) -> int:
        """An element count, proven to fit in the rest of the file before use."""
        n = self.u64(what)
        if n * min_item_bytes > self.size - self.pos:
            raise GGUFError(f"corrupt GGUF: {what} claims {n} items at offset {self.pos - 8}, "
                            f"but only {self.size - self.pos} bytes remain")
        return n

    def _string_array(self, n: int, what: str) -> list[str]:
        # the hot path of opening a model (vocabularies of 50k-260k strings): kept lean
        buf, size, pos = self.buf, self.size, self.pos
        unpack = struct.Struct("<Q").unpack_from
        out = []
        append = out.append
        for i in range(n):
            if pos + 8 > size:
                self.pos = pos
                self.need(8, f"{what}[{i}] length")
            ln = unpack(buf, pos)[0]
            pos += 8
            if ln > size - pos:
                self.pos = pos
                self.need(ln, f"{what}[{i}]")
            append(str(buf[pos:pos + ln], "utf-8", "replace"))
            pos += ln
        self.pos = pos
        return out

    def value(self, vtype: int, what: str):
        if vtype in _SCALARS:
            fmt, n = _SCALARS[vtype]
            return self.unpack(fmt, n, what)
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            etype = self.u32(what + " element type")
            if etype in _SCALARS:
                width = _SCALARS[etype][1]
                n = self.count(what + " length", width)
                arr = np.frombuffer(self.buf, dtype=_NUMPY_OF[etype], count=n, offset=self.pos).copy()
                self.pos += n * width
                return arr
            if etype == _STRING:
                n = self.count(what + " length", 8)
                return self._string_array(n, what)
            if etype == _ARRAY:
                n = self.count(what + " length", 12)
                return [self.value(_ARRAY, f"{what}[{i}]") for i in range(n)]
            raise GGUFError(f"corrupt GGUF: {what} has unknown element type {etype}")
        raise GGUFError(f"corrupt GGUF: {what} has unknown value type {vtype}")


class GGUFFile:
    """Open a .gguf file: `.metadata` (dict), `.tensors` (name -> TensorInfo),
    and `.tensor_bytes(name)`, a read-only uint8 view into the memory map."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.exists():
            raise FileNotFoundError(f"model file not found: {self.path}")
        if self.path.is_dir():
            raise GGUFError(f"{self.path} is a folder, not a GGUF file")
        size = self.path.stat().st_size
        if size < 24:
            raise GGUFError(f"{self.path.name} is not a GGUF file ({size} bytes, too short)")
        with open(self.path, "rb") as f:
            self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.size = size
        self._buf = memoryview(self._mmap)
        try:
            self._parse()
        except struct.error as e:   # defensive: every read is bounds-checked first
            raise GGUFError(f"corrupt GGUF {self.path.name}: {e}") from None

    def _parse(self) -> None:
        c = _Cursor(self._buf, self.size)
        if bytes(self._buf[:4]) != GGUF_MAGIC:
            raise GGUFError(f"{self.path.name} is not a GGUF file (magic {bytes(self._buf[:4])!r})")
        c.pos = 4
        self.version = c.u32("version")
        if self.version not in (2, 3):
            raise GGUFError(f"unsupported GGUF version {self.version} (need 2 or 3)")
        n_tensors = c.count("tensor count", 24)   # name len + ndims + type + offset, at least
        n_kv = c.count("metadata count", 12)
        self.metadata: dict[str, object] = {}
        for i in range(n_kv):
            key = c.string(f"metadata key #{i}")
            vtype = c.u32(f"type of {key}")
            self.metadata[key] = c.value(vtype, key)
        align = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise GGUFError(f"corrupt GGUF: general.alignment={align!r} is not a power of two")
        raw = []
        for i in range(n_tensors):
            name = c.string(f"tensor #{i} name")
            ndims = c.u32(f"tensor {name} dims")
            if not 1 <= ndims <= _MAX_DIMS:
                raise GGUFError(f"corrupt GGUF: tensor {name} has {ndims} dimensions")
            ne = [c.u64(f"tensor {name} dim") for _ in range(ndims)]
            gtype = c.u32(f"tensor {name} type")
            off = c.u64(f"tensor {name} offset")
            raw.append((name, ne, gtype, off))
        data_start = (c.pos + align - 1) // align * align
        self.data_offset = data_start
        self.tensors: dict[str, TensorInfo] = {}
        from quant import tensor_nbytes   # the block table lives in quant/
        for name, ne, gtype, off in raw:
            if any(d == 0 or d > 1 << 40 for d in ne):
                raise GGUFError(f"corrupt GGUF: tensor {name} has shape {ne}")
            nbytes = tensor_nbytes(gtype, tuple(reversed(ne)), name)
            start = data_start + off
            if start + nbytes > self.size:
                raise GGUFError(f"truncated GGUF: tensor {name} needs bytes {start}..{start + nbytes}, "
                                f"file has {self.size}")
            self.tensors[name] = TensorInfo(name, tuple(int(d) for d in reversed(ne)), gtype, start, nbytes)

    def tensor_bytes(self, name: str) -> np.ndarray:
        t = self.tensors[name]
        return np.frombuffer(self._buf, dtype=np.uint8, count=t.nbytes, offset=t.offset)

    def get(self, key: str, default=None):
        return self.metadata.get(key, default)
