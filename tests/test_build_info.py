import re
from pathlib import Path

import sarathi_rt

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def test_build_info_fields() -> None:
    info = sarathi_rt.build_info()
    # The core is stamped with the project's version at build time: a stale build fails here.
    version = re.search(r'^version = "([^"]+)"', PYPROJECT.read_text(), flags=re.M).group(1)
    assert info["version"] == sarathi_rt.__version__ == version
    assert isinstance(info["cuda_compiled"], bool)
    assert isinstance(info["openmp"], bool)
    assert all(isinstance(a, str) for a in info["cuda_archs"])
    if info["cuda_compiled"]:
        assert info["cuda_archs"], "a CUDA build must list its archs"
        assert info["cutlass_version"] and info["cutlass_version"][0].isdigit()
