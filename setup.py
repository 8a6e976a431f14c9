"""Builds sarathi_rt._C with CMake + Ninja + pybind11.

Environment:
  SARATHI_RT_CUDA        auto (default: build CUDA sources when nvcc is found) | 0 | 1
  SARATHI_RT_CUDA_ARCHS  semicolon list of SM targets, default "80;90a": SASS for each,
                         plus PTX for the newest (compute_90), see README "Build options"
  SARATHI_RT_CUTLASS_DIR CUTLASS include dir; default: the nvidia-cutlass package's headers
  SARATHI_RT_BUILD_JOBS  parallel compile jobs (default: all cores)
  SARATHI_RT_NVTX_DIR    directory holding nvtx3/nvToolsExt.h; default: the nvidia-nvtx
                         package's headers, else the CUDA toolkit's (none: no NVTX ranges)
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def cutlass_include_dir() -> str:
    explicit = os.environ.get("SARATHI_RT_CUTLASS_DIR")
    if explicit:
        return explicit
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or spec.origin is None:
        return ""
    include = Path(spec.origin).parent / "source" / "include"
    return str(include) if include.is_dir() else ""


def nvtx_include_dir() -> str:
    explicit = os.environ.get("SARATHI_RT_NVTX_DIR")
    if explicit:
        return explicit
    try:
        spec = importlib.util.find_spec("nvidia.nvtx")
    except ModuleNotFoundError:  # no `nvidia` namespace package at all
        return ""
    if spec is None:
        return ""
    for root in spec.submodule_search_locations or []:
        if (Path(root) / "include" / "nvtx3" / "nvToolsExt.h").is_file():
            return str(Path(root) / "include")
    return ""


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


def build_tools(pybind11_dir: str, cutlass_dir: str) -> dict[str, str]:
    """The programs and packages a configured CMake tree keeps absolute paths to."""
    tools = {"python": os.path.realpath(sys.executable), "pybind11": pybind11_dir, "cutlass": cutlass_dir}
    for name in ("cmake", "ninja"):
        path = shutil.which(name)
        if path is None:
            raise RuntimeError(f"{name} is not on PATH: pip install {name}")
        tools[name] = path
    return tools


def in_temporary_env(tools: dict[str, str]) -> bool:
    """True under pip's build isolation: some tool lives in a temp dir outside the running
    environment (pip deletes it after the build). A venv that itself sits in /tmp is not."""
    tmp, env = Path(tempfile.gettempdir()).resolve(), Path(sys.prefix).resolve()
    return any(p and Path(p).resolve().is_relative_to(tmp) and not Path(p).resolve().is_relative_to(env)
               for p in tools.values())


def reusable_tree(build_dir: Path, tools: dict[str, str]) -> Path:
    """The persistent tree, wiped unless it was configured by these same tools, all still
    present (a tree remembering a deleted ninja or pybind11 cannot rebuild)."""
    stamp = build_dir / "sarathi_rt_tools.json"
    if build_dir.exists():
        try:
            recorded = json.loads(stamp.read_text())
        except (OSError, ValueError):
            recorded = None
        if recorded != tools or not all(Path(p).exists() for p in recorded.values() if p):
            shutil.rmtree(build_dir)
    build_dir.mkdir(parents=True, exist_ok=True)
    stamp.write_text(json.dumps(tools))
    return build_dir


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        import pybind11

        out_dir = Path(self.get_ext_fullpath(ext.name)).parent.resolve()
        cuda = os.environ.get("SARATHI_RT_CUDA", "auto")
        archs = os.environ.get("SARATHI_RT_CUDA_ARCHS", "80;90a")
        cutlass = cutlass_include_dir()
        tools = build_tools(pybind11.get_cmake_dir(), cutlass)
        if in_temporary_env(tools):
            # pip's build isolation: a tree configured now would point at tools pip
            # deletes afterwards, so it is a throwaway one and build/ is left alone.
            with tempfile.TemporaryDirectory(prefix="sarathi_rt-cmake-") as tmp:
                self.cmake(Path(tmp), tools, out_dir, cuda, archs)
        else:
            # A persistent tree per configuration keeps rebuilds incremental, also for
            # `pip install --no-build-isolation` and `pip install -e .`.
            tag = f"py{sys.version_info.major}{sys.version_info.minor}-cuda{cuda}-{archs.replace(';', '_')}"
            self.cmake(reusable_tree(ROOT / "build" / tag, tools), tools, out_dir, cuda, archs)

    def cmake(self, build_dir: Path, tools: dict[str, str], out_dir: Path, cuda: str, archs: str) -> None:
        configure = [
            tools["cmake"], "-S", str(ROOT), "-B", str(build_dir), "-G", "Ninja",
            f"-DCMAKE_MAKE_PROGRAM={tools['ninja']}",
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={tools['pybind11']}",
            f"-DSARATHI_RT_CUDA={cuda}",
            f"-DSARATHI_RT_CUDA_ARCHS={archs}",
            f"-DSARATHI_RT_CUTLASS_DIR={tools['cutlass']}",
            f"-DSARATHI_RT_NVTX_DIR={nvtx_include_dir()}",
            f"-DSARATHI_RT_VERSION={self.distribution.get_version()}",
        ]
        subprocess.run(configure, check=True)
        jobs = os.environ.get("SARATHI_RT_BUILD_JOBS", str(os.cpu_count() or 1))
        subprocess.run([tools["cmake"], "--build", str(build_dir), "-j", jobs], check=True)


setup(ext_modules=[CMakeExtension("sarathi_rt._C")], cmdclass={"build_ext": CMakeBuild})
