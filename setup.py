"""Builds sarathi_rt._C with CMake + Ninja + pybind11.

Environment:
  SARATHI_RT_CUDA        auto (default: build CUDA sources when nvcc is found) | 0 | 1
  SARATHI_RT_CUDA_ARCHS  semicolon list of SM targets, default "80;90a": SASS for each,
                         plus PTX for the newest (compute_90), see README "Build options"
  SARATHI_RT_CUTLASS_DIR CUTLASS include dir; default: the nvidia-cutlass package's headers
  SARATHI_RT_BUILD_JOBS  parallel compile jobs (default: all cores)
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
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


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        import pybind11

        out_dir = Path(self.get_ext_fullpath(ext.name)).parent.resolve()
        cuda = os.environ.get("SARATHI_RT_CUDA", "auto")
        archs = os.environ.get("SARATHI_RT_CUDA_ARCHS", "80;90a")
        # A persistent build tree per configuration keeps rebuilds incremental,
        # also for `pip install -e .`, whose build_temp is a fresh temp dir.
        tag = f"py{sys.version_info.major}{sys.version_info.minor}-cuda{cuda}-{archs.replace(';', '_')}"
        build_dir = ROOT / "build" / tag
        build_dir.mkdir(parents=True, exist_ok=True)
        configure = [
            "cmake", "-S", str(ROOT), "-B", str(build_dir), "-G", "Ninja",
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DSARATHI_RT_CUDA={cuda}",
            f"-DSARATHI_RT_CUDA_ARCHS={archs}",
            f"-DSARATHI_RT_CUTLASS_DIR={cutlass_include_dir()}",
            f"-DSARATHI_RT_VERSION={self.distribution.get_version()}",
        ]
        subprocess.run(configure, check=True)
        jobs = os.environ.get("SARATHI_RT_BUILD_JOBS", str(os.cpu_count() or 1))
        subprocess.run(["cmake", "--build", str(build_dir), "-j", jobs], check=True)


setup(ext_modules=[CMakeExtension("sarathi_rt._C")], cmdclass={"build_ext": CMakeBuild})
