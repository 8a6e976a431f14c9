import shutil

import sarathi_rt


def test_build_info_fields() -> None:
    info = sarathi_rt.build_info()
    assert info["version"] == sarathi_rt.__version__
    assert isinstance(info["cuda_compiled"], bool)
    assert isinstance(info["openmp"], bool)
    assert all(isinstance(a, str) for a in info["cuda_archs"])
    if info["cuda_compiled"]:
        assert info["cuda_archs"], "a CUDA build must list its archs"
        assert info["cutlass_version"] and info["cutlass_version"][0].isdigit()


def test_ci_compiles_cuda_when_nvcc_is_present() -> None:
    """CI has nvcc: the CUDA sources must be compiled there so they never rot."""
    import os

    if os.environ.get("CI") and shutil.which("nvcc") and os.environ.get("SARATHI_RT_CUDA", "auto") != "0":
        assert sarathi_rt.build_info()["cuda_compiled"]
