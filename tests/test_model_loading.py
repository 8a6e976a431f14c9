"""Config parsing (transformers 4.x and 5.x spellings), presets, safetensors loading
(single file, sharded index, broken checkpoints), dtypes, and the parallel layout's
shards and pipeline stages."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_models import HFModel, build, last_logits
from sarathi_rt import LLM, SamplingParams, ops
from sarathi_rt.ops.kv_cache import KVCache, KVCacheShape
from sarathi_rt.models import ModelConfig, ParallelLayout, PRESETS, hf_tensor_shapes, load_model
from sarathi_rt.models.llama import LlamaForCausalLM
from sarathi_rt.models.context import StepContext

LLAMA3_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
BASE = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> HFModel:
    return build("llama_gqa", tmp_path_factory.mktemp("hf"))


def test_config_reads_both_transformers_spellings() -> None:
    v4 = ModelConfig.from_hf_dict({**BASE, "model_type": "llama", "rope_theta": 500000.0,
                                   "rope_scaling": {"type": "llama3", **LLAMA3_ROPE}, "eos_token_id": [7, 9]})
    v5 = ModelConfig.from_hf_dict({**BASE, "architectures": ["LlamaForCausalLM"], "eos_token_id": [7, 9],
                                   "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3_ROPE}})
    assert v4.rope_theta == v5.rope_theta == 500000.0 and v4.eos_token_ids == (7, 9)
    assert v4.rope_scaling["factor"] == v5.rope_scaling["factor"] == 8.0 and v4.head_dim == 16
    default = ModelConfig.from_hf_dict({**BASE, "model_type": "llama", "rope_parameters": {"rope_type": "default"}})
    assert default.rope_scaling is None and default.rope_theta == 10000.0
    qwen = ModelConfig.from_hf_dict({**BASE, "model_type": "qwen2", "use_sliding_window": False,
                                     "sliding_window": 32})
    assert qwen.qkv_bias and not qwen.o_bias and qwen.sliding_window is None  # window unused
    mistral = ModelConfig.from_hf_dict({**BASE, "model_type": "mistral", "sliding_window": 64})
    # The attention kernels honour the window, so the context is the model's whole one.
    assert mistral.max_position_embeddings == 256 and mistral.layer_window(0) == 64
    assert ModelConfig.from_hf_dict(mistral.to_hf_dict()) == mistral
    assert ModelConfig.from_hf_dict(PRESETS["cpu-small"].to_hf_dict()) == PRESETS["cpu-small"]


@pytest.mark.parametrize("change, match", [
    ({"model_type": "gpt2"}, "model_type"), ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"), ({"hidden_size": 66}, "head_dim|hidden_size"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope_scaling"),
    ({"eos_token_id": 100}, "eos_token_ids"), ({"vocab_size": 0}, "vocab_size"),
    ({"sliding_window": 2.5, "use_sliding_window": True}, "sliding_window"),
    ({"sliding_window": 8, "use_sliding_window": True, "layer_types": ["full_attention"]}, "layer_types"),
    ({"sliding_window": 8, "use_sliding_window": True, "layer_types": ["local"] * 2}, "layer_types"),
    ({"attn_logit_softcapping": 0.0}, "attn_logit_softcapping"),
    ({"query_pre_attn_scalar": float("nan")}, "query_pre_attn_scalar"),
])
def test_unsupported_configs_are_rejected(change: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict({**BASE, "model_type": "llama", **change})


def test_attention_options_reach_every_layer() -> None:
    """Gemma-style alternating local and global layers, a soft cap and a scale of its own."""
    config = ModelConfig.from_hf_dict({**BASE, "model_type": "llama", "use_sliding_window": True, "sliding_window": 5,
                                       "layer_types": ["sliding_attention", "full_attention"],
                                       "attn_logit_softcapping": 50.0, "query_pre_attn_scalar": 64})
    assert [config.layer_window(i) for i in range(2)] == [5, 0] and config.attention_scale == 64 ** -0.5
    assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config
    model = LlamaForCausalLM(config)
    attention = [layer.self_attn for layer in model.layers.values()]
    assert [(a.window, a.softcap, a.scale) for a in attention] == [(5, 50.0, 0.125), (0, 50.0, 0.125)]
    plain = LlamaForCausalLM(ModelConfig.from_hf_dict({**BASE, "model_type": "llama"}))
    assert {(a.self_attn.window, a.self_attn.softcap, a.self_attn.scale) for a in plain.layers.values()} == {
        (0, 0.0, plain.config.head_dim ** -0.5)}


def test_presets() -> None:
    small = PRESETS["cpu-small"]
    assert (small.hidden_size, small.num_hidden_layers, small.num_attention_heads, small.num_key_value_heads,
            small.intermediate_size, small.vocab_size) == (512, 8, 8, 2, 1536, 32000)
    params = sum(torch.Size(shape).numel() for _, shape in hf_tensor_shapes(PRESETS["llama3-8b"]))
    assert params == 8_030_261_248  # Llama-3-8B
    a, b, c = load_model("tiny", seed=0), load_model("tiny", seed=0), load_model("tiny", seed=1)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb) and (name.endswith("norm.weight") or not torch.equal(pa, pc)), name


@pytest.mark.slow
def test_sharded_checkpoint_loads_like_a_single_file(hf: HFModel, tmp_path) -> None:
    sharded = tmp_path / "sharded"
    hf.model.save_pretrained(sharded, max_shard_size="40KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2 and not (sharded / "model.safetensors").exists()
    one, many = load_model(str(hf.path)), load_model(str(sharded))
    for (name, p), q in zip(one.named_parameters(), many.parameters()):
        assert torch.equal(p, q), name
    params = [SamplingParams(temperature=0.0, max_tokens=m) for m in hf.max_tokens]
    outs = LLM(str(sharded), num_kv_blocks=64, block_size=8).generate(hf.prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == hf.expected


def _copy_with(hf: HFModel, tmp_path, edit) -> str:
    path = tmp_path / "edited"
    shutil.copytree(hf.path, path)
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors")
    return str(path)


def test_broken_checkpoints_are_rejected(hf: HFModel, tmp_path) -> None:
    with pytest.raises(ValueError, match="lacks"):
        load_model(_copy_with(hf, tmp_path / "a", lambda t: t.pop("model.layers.1.self_attn.k_proj.weight")))
    with pytest.raises(ValueError, match="shape"):
        load_model(_copy_with(hf, tmp_path / "b", lambda t: t.update(
            {"model.norm.weight": torch.ones(65)})))
    with pytest.raises(ValueError, match="unexpected tensor"):
        load_model(_copy_with(hf, tmp_path / "c", lambda t: t.update({"vision.proj": torch.ones(2)})))
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text((hf.path / "config.json").read_text())
    with pytest.raises(ValueError, match="safetensors"):
        load_model(str(empty))
    with pytest.raises(ValueError, match="config.json"):
        load_model(str(tmp_path))
    truncated = _copy_with(hf, tmp_path / "d", lambda t: None)
    with open(f"{truncated}/model.safetensors", "r+b") as f:
        f.truncate(f.seek(0, 2) - 64)
    with pytest.raises(ValueError, match=r"model.safetensors is truncated: tensor '.*' ends past the end"):
        load_model(truncated)


@pytest.mark.parametrize("dtype, tolerance", [("bfloat16", 0.05), ("float16", 0.01)])
def test_half_precision_loading(hf: HFModel, dtype: str, tolerance: float, emulated_bf16: None) -> None:
    llm = LLM(str(hf.path), dtype=dtype, num_kv_blocks=16, block_size=8)
    worker = llm.engine.executor.worker
    assert worker.model.lm_head.dtype == worker.kv_cache.k[0].dtype == getattr(torch, dtype)
    prompt = hf.prompts[-1]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, logprobs=0))[0]
    ref = torch.log_softmax(last_logits(hf.model, prompt), dim=0)[out.token_ids[0]].item()
    assert abs(out.logprobs[0].logprob - ref) < tolerance * max(1.0, abs(ref))


def _context(positions: list[int], blocks: list[int], block_size: int) -> StepContext:
    pos = torch.tensor(positions)
    table = torch.tensor([blocks], dtype=torch.int32)
    cu_seqlens_q = torch.tensor([0, len(positions)], dtype=torch.int32)
    seqlens_k = torch.tensor([len(positions)], dtype=torch.int32)
    k_cache = torch.empty(len(blocks), block_size, 2, 16)  # the test model's KV heads and head_dim
    return StepContext(positions=pos, slot_mapping=table[0, pos // block_size].long() * block_size + pos % block_size,
                       cu_seqlens_q=cu_seqlens_q, seqlens_k=seqlens_k, block_tables=table,
                       logits_indices=torch.tensor([len(positions) - 1]),
                       attention_plan=ops.plan_attention(cu_seqlens_q, seqlens_k, table, k_cache, num_q_heads=4))


def test_pipeline_stages_chain_to_the_whole_model(hf: HFModel) -> None:
    prompt = hf.prompts[-2]
    blocks = -(-len(prompt) // 8)
    ctx = _context(list(range(len(prompt))), list(range(blocks)), 8)
    ids = torch.tensor(prompt)

    def stage(layout: ParallelLayout):
        model = load_model(str(hf.path), layout=layout)
        model.bind_kv_cache(KVCache(KVCacheShape(len(model.layers), 8, 2, 16), blocks))
        return model

    whole, first, last = stage(ParallelLayout()), stage(ParallelLayout(layer_end=1)), stage(ParallelLayout(layer_start=1))
    assert first.lm_head is None and last.embed_tokens is None and list(last.layers) == ["1"]
    expected = whole.compute_logits(*whole(ctx, input_ids=ids), ctx)
    got = last.compute_logits(*last(ctx, intermediate=first(ctx, input_ids=ids)), ctx)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="last pipeline stage"):
        first.compute_logits(*first(ctx, input_ids=ids), ctx)


def test_tensor_parallel_shards_slice_the_checkpoint(hf: HFModel) -> None:
    tensors = load_file(hf.path / "model.safetensors")
    layer = "model.layers.0."
    for rank in range(2):
        model = load_model(str(hf.path), layout=ParallelLayout(tp_rank=rank, tp_size=2))
        attn, mlp = model.layers["0"].self_attn, model.layers["0"].mlp
        q_rows, kv_rows, inter = slice(32 * rank, 32 * (rank + 1)), slice(16 * rank, 16 * (rank + 1)), \
            slice(64 * rank, 64 * (rank + 1))
        qkv = torch.cat([tensors[layer + f"self_attn.{p}_proj.weight"][r]
                         for p, r in (("q", q_rows), ("k", kv_rows), ("v", kv_rows))])
        assert torch.equal(attn.qkv_proj.weight, qkv) and (attn.num_heads, attn.num_kv_heads) == (2, 1)
        assert torch.equal(attn.o_proj.weight, tensors[layer + "self_attn.o_proj.weight"][:, q_rows])
        gate_up = torch.cat([tensors[layer + f"mlp.{p}_proj.weight"][inter] for p in ("gate", "up")])
        assert torch.equal(mlp.gate_up_proj.weight, gate_up)
        assert torch.equal(mlp.down_proj.weight, tensors[layer + "mlp.down_proj.weight"][:, inter])
        vocab = model.shard.vocab  # vocab-parallel embedding: this rank's rows
        assert torch.equal(model.embed_tokens, tensors["model.embed_tokens.weight"][vocab.start:vocab.stop])


@pytest.mark.parametrize("layout, match", [
    (dict(tp_size=3), "divisible"), (dict(tp_rank=2, tp_size=2), "tp_rank"),
    (dict(layer_start=1, layer_end=1), "layer_end"), (dict(layer_end=5), "num_hidden_layers"),
])
def test_invalid_layouts(hf: HFModel, layout: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        load_model(str(hf.path), layout=ParallelLayout(**layout))
