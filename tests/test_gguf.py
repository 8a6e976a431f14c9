"""GGUF checkpoints: every supported tensor type dequantizes to the weights the file holds
(the same model saved as safetensors loads the same parameters, and generates what
transformers generates), config and tokenizer come from the metadata, tensor- and
pipeline-parallel shards read their slices, and bad files fail naming file and tensor."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from gguf_models import Q, write_model_gguf
from hf_models import greedy
from sarathi_rt import LLM, SamplingParams
from sarathi_rt.models.gguf_file import GGUFFile
from sarathi_rt.models import ParallelLayout, load_model, resolve_model

transformers = pytest.importorskip("transformers")
TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]
PROMPTS = [[5, 9, 200], [17] * 9, list(range(30, 70)), [260, 3, 99, 4, 4, 8, 150]]


def _hf_config(**overrides: object) -> object:
    kwargs = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=270, max_position_embeddings=128, rms_norm_eps=1e-5,
                  rope_theta=50000.0, tie_word_embeddings=True, initializer_range=0.2)
    return transformers.LlamaConfig(**{**kwargs, **overrides})


def _state(config: object, seed: int = 0) -> dict[str, np.ndarray]:
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).float()
    state = {k: v.numpy() for k, v in model.state_dict().items() if "rotary" not in k}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def _as_hf(config: object, stored: dict[str, np.ndarray], path) -> object:
    """The transformers model holding exactly the dequantized weights, saved as safetensors."""
    model = transformers.LlamaForCausalLM(config).float().eval()
    missing, _ = model.load_state_dict({k: torch.from_numpy(v) for k, v in stored.items()}, strict=False)
    assert all("lm_head" in k for k in missing)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def q4_1(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, object, object]:
    """(file, the same weights as a HF directory, that transformers model), untied lm_head."""
    root = tmp_path_factory.mktemp("gguf")
    config = _hf_config(tie_word_embeddings=False)
    stored = write_model_gguf(root / "m.gguf", config, _state(config), Q.Q4_1)
    return root / "m.gguf", root / "hf", _as_hf(config, stored, root / "hf")


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_each_type_loads_the_weights_the_file_holds(tmp_path, qtype: Q) -> None:
    config = _hf_config()
    stored = write_model_gguf(tmp_path / "m.gguf", config, _state(config), qtype)
    _as_hf(config, stored, tmp_path / "hf")
    ours, ref = load_model(str(tmp_path / "m.gguf")), load_model(str(tmp_path / "hf"))
    for (name, a), (_, b) in zip(ours.named_parameters(), ref.named_parameters()):
        assert torch.equal(a, b), f"{qtype.name}: {name} differs"
    # vocabulary, heads, eps (stored as float32), theta, tying, eos: all from the metadata
    got, want = (dataclasses.asdict(m.config) for m in (ours, ref))
    assert got.pop("rms_norm_eps") == pytest.approx(want.pop("rms_norm_eps"), rel=1e-6)
    got.pop("initializer_range"), want.pop("initializer_range")
    assert got == want


def test_qwen2_with_biases_and_no_permutation(tmp_path) -> None:
    config = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=270,
                                      max_position_embeddings=128, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).float()
    state = {k: v.numpy() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    stored = write_model_gguf(tmp_path / "q.gguf", config, state, Q.Q8_0, arch="qwen2")
    model.load_state_dict({k: torch.from_numpy(v) for k, v in stored.items()}, strict=False)
    model.save_pretrained(tmp_path / "hf")
    ours, ref = load_model(str(tmp_path / "q.gguf")), load_model(str(tmp_path / "hf"))
    assert ours.config.model_type == "qwen2" and ours.config.qkv_bias and not ours.config.o_bias
    for (name, a), (_, b) in zip(ours.named_parameters(), ref.named_parameters()):
        assert torch.equal(a, b), name


@pytest.mark.slow
def test_greedy_equals_transformers_on_the_same_weights(q4_1) -> None:
    path, _, hf = q4_1
    llm = LLM(str(path), num_kv_blocks=32, block_size=8, chunk_size=16, token_budget=32, max_num_seqs=8)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    assert [o.token_ids for o in outs] == [greedy(hf, p, 8) for p in PROMPTS]
    assert llm.tokenizer is not None and llm.tokenizer.encode("hello world") == [262, 267]


def test_transformers_reads_the_file_the_same_way(q4_1) -> None:
    """An independent reader (transformers' GGUF loader) of the same file agrees: the
    q/k un-permutation and the metadata mean the same thing to both."""
    pytest.importorskip("accelerate")
    path, _, hf = q4_1
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                               dtype=torch.float32).eval()
    for (name, a), b in zip(hf.state_dict().items(), theirs.state_dict().values()):
        assert torch.equal(a, b), name
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ours = LLM(str(path), num_kv_blocks=8).tokenizer
    for text in ("hello world", "hi there 42!", "<|im_start|>user\nhello<|im_end|>"):
        assert ours.encode(text) == tok.encode(text)


@pytest.mark.parametrize("layout", [dict(tp_rank=0, tp_size=2), dict(tp_rank=1, tp_size=2), dict(layer_start=1)])
def test_parallel_shards_read_their_slices(q4_1, layout: dict) -> None:
    path, hf_dir, _ = q4_1
    ours = load_model(str(path), layout=ParallelLayout(**layout))
    ref = load_model(str(hf_dir), layout=ParallelLayout(**layout))
    pairs = list(zip(ours.named_parameters(), ref.named_parameters()))
    assert pairs
    for (name, a), (_, b) in pairs:
        assert torch.equal(a, b), f"{layout}: {name} differs"


def test_bfloat16_compute_dtype(q4_1) -> None:
    path, hf_dir, _ = q4_1
    ours, ref = load_model(str(path), dtype="bfloat16"), load_model(str(hf_dir), dtype="bfloat16")
    assert all(torch.equal(a, b) and a.dtype == torch.bfloat16
               for a, b in zip(ours.parameters(), ref.parameters()))


def test_engine_on_a_gguf_takes_the_cpu_dtype_rule(q4_1, monkeypatch) -> None:
    """The engine's dtype rule (tests/test_cpu_dtype.py) applies to a GGUF model as to any:
    bfloat16 where the CPU has native BF16, float32 (and a fallback from bfloat16) elsewhere."""
    import sarathi_rt.config.tree

    path = str(q4_1[0])
    monkeypatch.setattr(sarathi_rt.config.tree, "cpu_flags", lambda: {"avx512_bf16"})
    with LLM(path, num_kv_blocks=8, block_size=8) as llm:
        model = llm.engine.executor.worker.model
        assert all(torch.equal(a, b) and a.dtype == torch.bfloat16
                   for a, b in zip(model.parameters(), load_model(path, dtype="bfloat16").parameters()))
    monkeypatch.setattr(sarathi_rt.config.tree, "cpu_flags", lambda: set())
    for dtype in (None, "bfloat16"):
        with LLM(path, dtype=dtype, num_kv_blocks=8, block_size=8) as llm:
            assert llm.engine.executor.worker.model.dtype == torch.float32


def test_truncated_file_names_file_and_tensor(q4_1, tmp_path) -> None:
    path = q4_1[0]
    data = path.read_bytes()
    last = list(GGUFFile(path).tensors)[-1]
    (tmp_path / "cut.gguf").write_bytes(data[:-100])
    with pytest.raises(ValueError, match=rf"cut\.gguf.*truncated.*{last}"):
        resolve_model(str(tmp_path / "cut.gguf"))
    (tmp_path / "head.gguf").write_bytes(data[:200])
    with pytest.raises(ValueError, match=r"head\.gguf.*truncated or corrupt"):
        resolve_model(str(tmp_path / "head.gguf"))
    (tmp_path / "junk.gguf").write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ValueError, match=r"junk\.gguf.*not a GGUF file"):
        LLM(str(tmp_path / "junk.gguf"))
    with pytest.raises(ValueError, match=r"absent\.gguf.*does not exist"):
        LLM(str(tmp_path / "absent.gguf"))


def test_unknown_architecture_is_named(tmp_path) -> None:
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "bert.gguf"), "bert")
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ValueError, match=r"bert\.gguf.*unsupported architecture 'bert'"):
        LLM(str(tmp_path / "bert.gguf"))


def test_unsupported_tensor_type_is_named(tmp_path) -> None:
    config = _hf_config()
    write_model_gguf(tmp_path / "k.gguf", config, _state(config), Q.Q8_0,
                     types={"model.layers.1.mlp.down_proj.weight": Q.Q4_K})
    with pytest.raises(ValueError, match=r"k\.gguf.*'blk\.1\.ffn_down\.weight' has type Q4_K"):
        load_model(str(tmp_path / "k.gguf"))


def test_tensor_with_no_place_is_named(tmp_path) -> None:
    config = _hf_config()
    state = _state(config)
    state["model.layers.0.self_attn.q_norm.weight"] = np.ones(16, np.float32)
    write_model_gguf(tmp_path / "extra.gguf", config, state, Q.F32)
    with pytest.raises(ValueError, match=r"extra\.gguf.*'blk\.0\.attn_q_norm\.weight' has no place"):
        load_model(str(tmp_path / "extra.gguf"))
