"""A GGUF file: its metadata and where each tensor's bytes lie, parsed straight from a
memory map (GGUF v2/v3, little-endian). The `gguf` package's reader builds a numpy view
per array element, which takes seconds on a 49k-token vocabulary; this reads the same
header in a fraction of that. Dequantizing stays with the `gguf` package. No torch here:
the tokenizer uses this too. Errors name the file, and the key or tensor at fault."""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = b"GGUF"
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_MISSING = object()


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (rows first): GGUF lists dimensions innermost first
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset of the data in the file
    nbytes: int

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (quantization blocks never cross rows)."""
        block, size = GGML_QUANT_SIZES[self.qtype]
        return self.shape[-1] // block * size


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("Q")
        if self.pos + n > len(self.buf):
            raise struct.error("string runs past the end of the file")
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.scalar("I"), self.scalar("Q")
            if item in _SCALARS and item != 7:
                dtype = np.dtype("<" + _SCALARS[item])
                end = self.pos + count * dtype.itemsize
                if end > len(self.buf):
                    raise struct.error("array runs past the end of the file")
                values = np.frombuffer(self.buf, dtype, count, self.pos).tolist()
                self.pos = end
                return values
            return [self.value(item) for _ in range(count)]
        raise ValueError(f"unknown metadata value type {kind}")


class GGUFFile:
    """Open `path`: parse the header, metadata and tensor table; map the data lazily."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ValueError(f"GGUF file {str(self.path)!r} does not exist")
        size = self.path.stat().st_size
        if size < 24:
            raise ValueError(f"{self.name!r} is not a GGUF file: {size} bytes is shorter than the header")
        self.data = np.memmap(self.path, dtype=np.uint8, mode="r")
        cur = _Cursor(memoryview(self.data))
        if bytes(self.data[:4]) != _MAGIC:
            raise ValueError(f"{self.name!r} is not a GGUF file (magic {bytes(self.data[:4])!r}, expected b'GGUF')")
        key = "<header>"
        try:
            cur.pos = 4
            version, n_tensors, n_kv = cur.scalar("I"), cur.scalar("Q"), cur.scalar("Q")
            if version not in (2, 3):
                raise ValueError(f"GGUF version {version} (sarathi_rt reads versions 2 and 3, little-endian)")
            self.metadata: dict[str, Any] = {}
            for _ in range(n_kv):
                key = cur.string()
                self.metadata[key] = cur.value(cur.scalar("I"))
            raw_tensors = []
            for _ in range(n_tensors):
                key = cur.string()
                dims = [cur.scalar("Q") for _ in range(cur.scalar("I"))]
                raw_tensors.append((key, tuple(reversed(dims)), cur.scalar("I"), cur.scalar("Q")))
        except struct.error as exc:
            raise ValueError(f"{self.name!r} is truncated or corrupt: reading {key!r} failed ({exc})") from None
        except ValueError as exc:
            raise ValueError(f"{self.name!r}: {key!r}: {exc}") from None
        alignment = self.metadata.get("general.alignment", 32)
        start = -(-cur.pos // alignment) * alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, kind, offset in raw_tensors:
            self.tensors[name] = self._tensor_info(name, shape, kind, start + offset, size)

    @property
    def name(self) -> str:
        return str(self.path)

    def _tensor_info(self, name: str, shape: tuple[int, ...], kind: int, offset: int, size: int) -> TensorInfo:
        try:
            qtype = GGMLQuantizationType(kind)
        except ValueError:
            raise ValueError(f"{self.name!r}: tensor {name!r} has unknown GGML type {kind}") from None
        block, type_size = GGML_QUANT_SIZES[qtype]
        if not shape or shape[-1] % block:
            raise ValueError(f"{self.name!r}: tensor {name!r} of shape {shape} does not split into "
                             f"{qtype.name} blocks of {block}")
        nbytes = math.prod(shape) // block * type_size
        if offset + nbytes > size:
            raise ValueError(f"{self.name!r} is truncated: tensor {name!r} needs bytes up to {offset + nbytes} "
                             f"but the file has {size}")
        return TensorInfo(name, shape, qtype, offset, nbytes)

    def get(self, key: str, default: Any = _MISSING) -> Any:
        """The value under `key`; `default` when absent, else a ValueError naming the key."""
        if key in self.metadata:
            return self.metadata[key]
        if default is _MISSING:
            raise ValueError(f"GGUF file {self.name!r} lacks the metadata key {key!r}")
        return default

    def rows(self, name: str) -> np.ndarray:
        """The tensor's raw bytes as [rows, row_bytes] (a view of the memory map)."""
        info = self.tensors[name]
        rows = info.nbytes // info.row_bytes
        return self.data[info.offset:info.offset + info.nbytes].reshape(rows, info.row_bytes)


@lru_cache(maxsize=4)
def _open_cached(path: str, size: int, mtime_ns: int) -> GGUFFile:
    return GGUFFile(path)


def open_gguf(path: str | Path) -> GGUFFile:
    """GGUFFile(path), parsed once per process while the file is unchanged (the config,
    the weights and the tokenizer all read the same header)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"GGUF file {str(path)!r} does not exist")
    stat = path.stat()
    return _open_cached(str(path.resolve()), stat.st_size, stat.st_mtime_ns)
