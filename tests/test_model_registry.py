"""The model registry: every registered architecture resolves from its checkpoint's own
words, an unknown one is a named error, a new LLaMA-shaped family is one registration
(shown with a throwaway one, checked against transformers), the model an engine starts
is resolved once, and the model's timed regions are what the step split times."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from hf_models import greedy
from sarathi_rt import LLM, SamplingParams
from sarathi_rt.engine import EngineConfig, LLMEngine
from sarathi_rt.models import (Family, LlamaForCausalLM, ModelConfig, ResolvedModel, available_architectures,
                               load_model, register_family, registry, resolve_model)
from sarathi_rt.models.registry import family_for_gguf, family_for_hf

transformers = pytest.importorskip("transformers")

SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
# HF architecture -> (its transformers config class, the family it is)
BUILT_IN = {"LlamaForCausalLM": ("LlamaConfig", "llama"), "MistralForCausalLM": ("MistralConfig", "mistral"),
            "Qwen2ForCausalLM": ("Qwen2Config", "qwen2"), "Qwen3ForCausalLM": ("Qwen3Config", "qwen3"),
            "Gemma2ForCausalLM": ("Gemma2Config", "gemma2"), "Gemma3ForCausalLM": ("Gemma3TextConfig", "gemma3_text")}


class ToyForCausalLM(LlamaForCausalLM):
    """A family of the LLaMA layout under its own class, so a test sees which class was built."""


@pytest.fixture
def toy_family(monkeypatch: pytest.MonkeyPatch) -> Family:
    """A throwaway family registered for one test (the registry is restored after it)."""
    monkeypatch.setattr(registry, "_FAMILIES", dict(registry._FAMILIES))
    return register_family(Family(name="toy_llama", architectures=("ToyLlamaForCausalLM",),
                                  model_class=ToyForCausalLM))


def test_the_built_in_families_are_registered() -> None:
    assert available_architectures() == sorted(BUILT_IN)
    assert family_for_gguf("llama").name == "llama" and family_for_gguf("qwen2").name == "qwen2"
    assert family_for_gguf("qwen3").name == "qwen3"
    assert family_for_gguf("llama").gguf_rope_permuted
    assert not family_for_gguf("qwen2").gguf_rope_permuted and not family_for_gguf("qwen3").gguf_rope_permuted


@pytest.mark.parametrize("architecture", sorted(BUILT_IN))
def test_each_registered_architecture_resolves(architecture: str, tmp_path: Path) -> None:
    config_class, family = BUILT_IN[architecture]
    getattr(transformers, config_class)(architectures=[architecture], **SHAPE).save_pretrained(tmp_path)
    resolved = resolve_model(tmp_path)
    assert resolved.family.name == resolved.config.model_type == family and resolved.path == tmp_path
    # Either word alone names the family; the config written back names the architecture.
    assert family_for_hf([architecture], None).name == family_for_hf(None, family).name == family
    assert resolved.config.to_hf_dict()["architectures"] == [architecture]


def test_an_unknown_architecture_is_a_named_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*LlamaForCausalLM.*MistralForCausalLM.*Qwen2ForCausalLM.*Qwen3ForCausalLM"):
        ModelConfig.from_hf_dict({**SHAPE, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    # From a checkpoint directory, an architecture no native family runs goes to the
    # transformers backend (tests/test_hf_backend.py), and "native" refuses it by name.
    (tmp_path / "config.json").write_text(json.dumps({**SHAPE, "architectures": ["FalconForCausalLM"],
                                                       "model_type": "falcon"}))
    with pytest.raises(ValueError, match=r"FalconForCausalLM.*LlamaForCausalLM"):
        resolve_model(tmp_path, model_impl="native")
    with pytest.raises(ValueError, match=r"FalconForCausalLM computes attention in its own code"):
        resolve_model(tmp_path)
    with pytest.raises(ValueError, match=r"unsupported architecture 'bert'.*\['llama', 'qwen2', 'qwen3'\]"):
        family_for_gguf("bert")
    with pytest.raises(ValueError,
                       match=r"model_type must be one of \['gemma2', 'gemma3_text', 'llama', 'mistral', 'qwen2', "
                             r"'qwen3', 'transformers'\], got 'gpt2'"):
        ModelConfig(**SHAPE, model_type="gpt2")


def test_a_family_registers_once(toy_family: Family) -> None:
    with pytest.raises(ValueError, match=r"\['ToyLlamaForCausalLM'\] already registered by family 'toy_llama'"):
        register_family(Family(name="toy2", architectures=("ToyLlamaForCausalLM",), model_class=ToyForCausalLM))
    with pytest.raises(ValueError, match=r"\['llama'\] already registered by family 'llama'"):
        register_family(Family(name="toy3", architectures=("Toy3",), model_class=ToyForCausalLM,
                               gguf_architecture="llama"))


def test_a_new_llama_shaped_family_loads_and_matches_transformers(toy_family: Family, tmp_path: Path) -> None:
    config = transformers.LlamaConfig(initializer_range=0.2, rms_norm_eps=1e-6, **SHAPE)
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(config).float().eval()
    reference.save_pretrained(tmp_path)
    # The checkpoint names the new architecture (save_pretrained writes the class it saved).
    hf_config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf_config, "architectures": ["ToyLlamaForCausalLM"],
                                                      "model_type": "toy_llama"}))
    resolved = resolve_model(tmp_path)
    assert resolved.family is toy_family and resolved.config.to_hf_dict()["architectures"] == ["ToyLlamaForCausalLM"]
    assert isinstance(load_model(resolved), ToyForCausalLM)
    rng = random.Random(0)
    prompts = [[rng.randrange(4, SHAPE["vocab_size"]) for _ in range(n)] for n in (3, 9, 17)]
    with LLM(str(tmp_path), max_num_seqs=4, num_kv_blocks=32) as llm:
        assert isinstance(llm.engine.executor.worker.model, ToyForCausalLM)
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6),
                               use_tqdm=False)
    assert [o.token_ids for o in outputs] == [greedy(reference, p, 6) for p in prompts]


def test_an_engine_resolves_its_model_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import sarathi_rt.models as models

    looked_up: list[str] = []
    real = models.resolve_model_path

    def counting(model: str | Path) -> Path | None:
        looked_up.append(str(model))
        return real(model)

    monkeypatch.setattr(models, "resolve_model_path", counting)
    engine = LLMEngine(EngineConfig(model="tiny", token_budget=64))
    assert looked_up == ["tiny"]
    assert isinstance(engine.model, ResolvedModel) and engine.model.path is None
    assert engine.executor.worker.model.config is engine.model_config  # the worker got the engine's


def test_llm_reads_a_checkpoint_config_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE)).save_pretrained(tmp_path)
    reads: list[Path] = []
    real = ModelConfig.from_pretrained.__func__

    def counting(cls: type[ModelConfig], path: str | Path, **options: object) -> ModelConfig:
        reads.append(Path(path))
        return real(cls, path, **options)

    monkeypatch.setattr(ModelConfig, "from_pretrained", classmethod(counting))
    with LLM(str(tmp_path), num_kv_blocks=8):
        pass
    assert reads == [tmp_path]


def test_resolved_model_survives_pickling() -> None:
    import pickle

    resolved = resolve_model("llama3-8b")  # its rope_scaling dict included
    assert pickle.loads(pickle.dumps(resolved)) == resolved


def test_timed_regions_cover_every_gemm_and_attention_block() -> None:
    model = load_model("tiny")
    regions = list(model.timed_regions())
    layers = model.config.num_hidden_layers
    # Per layer: qkv, o, gate_up and down projections, and the attention block around two of them.
    assert sum(kind == "linear" for kind, _ in regions) == 4 * layers
    assert sum(kind == "attention" for kind, _ in regions) == layers
    assert {kind for kind, _ in regions} == {"linear", "attention"}
