"""What the core embeds for the GPU: SASS per listed SM plus PTX for the newest, and where
the GEMM planner's register counts come from."""
from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path

import pytest

import sarathi_rt
from sarathi_rt import _C


def test_build_info_lists_sass_and_ptx_targets() -> None:
    info = sarathi_rt.build_info()
    if not info["cuda_compiled"]:
        assert info["cuda_sass"] == [] and info["cuda_ptx"] == []
        assert info["gemm_registers"] == "defaults"
        return
    assert info["cuda_sass"] == [f"sm_{arch}" for arch in info["cuda_archs"]]
    newest = max(int(arch.rstrip("af")) for arch in info["cuda_archs"])
    assert info["cuda_ptx"] == [f"compute_{newest}"]
    assert info["gemm_registers"] == "ptxas"


def _fatbin_images(so: Path) -> list[tuple[str, int, bool]]:
    """(kind, SM, arch-specific) of every image in the module's .nv_fatbin section, read
    from nvcc's fatbinary headers (magic 0xBA55ED50; each image has a header whose u16 at 0
    is its kind, 1 = PTX and 2 = ELF/SASS, the u32 at 4 the header size, the u64 at 8 the
    payload size, the u32 at 28 the SM, and bit 20 of the u32 at 40 set for "a" targets)."""
    data = so.read_bytes()
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names = sections[shstrndx][4]
    fatbin = next(s for s in sections if data.startswith(b".nv_fatbin\0", names + s[0]))
    images, offset, end = [], fatbin[4], fatbin[4] + fatbin[5]
    while offset + 16 <= end:
        magic, _, header_size, size = struct.unpack_from("<IHHQ", data, offset)
        if magic != 0xBA55ED50:
            offset += 8  # fat binaries are 8-byte aligned, with padding between them
            continue
        entry = offset + header_size
        while entry < offset + header_size + size:
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", data, entry)
            sm, = struct.unpack_from("<I", data, entry + 28)
            flags, = struct.unpack_from("<I", data, entry + 40)
            images.append(({1: "ptx", 2: "sass"}.get(kind, str(kind)), sm, bool(flags & 0x100000)))
            entry += entry_header + payload
        offset += header_size + size
    return images


@pytest.mark.skipif(not sarathi_rt.build_info()["cuda_compiled"], reason="needs a CUDA build")
def test_every_kernel_object_embeds_that_sass_and_ptx() -> None:
    info = sarathi_rt.build_info()
    images = _fatbin_images(Path(_C.__file__))
    sass = {(sm, specific) for kind, sm, specific in images if kind == "sass"}
    ptx = [(sm, specific) for kind, sm, specific in images if kind == "ptx"]
    assert sass == {(int(a.rstrip("af")), a[-1] in "af") for a in info["cuda_archs"]}
    assert {(f"compute_{sm}", specific) for sm, specific in ptx} == {(info["cuda_ptx"][0], False)}
    # One PTX image per compiled CUDA source, next to its SASS images.
    assert len(ptx) * (len(sass) + 1) == len(images)


@pytest.mark.skipif(not sarathi_rt.build_info()["cuda_compiled"] or shutil.which("cuobjdump") is None,
                    reason="needs a CUDA build and cuobjdump")
def test_the_module_holds_that_ptx_and_sass() -> None:
    info = sarathi_rt.build_info()
    so = _C.__file__
    ptx = subprocess.run(["cuobjdump", "--list-ptx", so], capture_output=True, text=True, check=True).stdout
    elf = subprocess.run(["cuobjdump", "--list-elf", so], capture_output=True, text=True, check=True).stdout
    for target in info["cuda_ptx"]:
        assert f".{target.replace('compute_', 'sm_')}." in ptx, ptx
    for target in info["cuda_sass"]:
        assert f".{target}." in elf, elf
