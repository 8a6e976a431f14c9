"""Sharding without processes: which slice of each checkpoint tensor a (tensor rank,
pipeline stage) loads, the rank topology, stage splits, and the bubble arithmetic."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from sarathi_rt.engine.distributed import Topology
from sarathi_rt.measure.metrics import StageMetrics, pipeline_wait
from sarathi_rt.models import ParallelLayout, load_model, resolve_model
from sarathi_rt.models.parallel import stage_layers

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=101,
                                      tie_word_embeddings=request.param, max_position_embeddings=64)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("layout")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path, load_file(str(path / "model.safetensors"))


def test_rank_loads_only_its_shard(checkpoint) -> None:
    path, full = checkpoint
    config = resolve_model(path).config
    topo = Topology(2, 2)
    for rank in range(topo.world_size):
        model = load_model(path, layout=topo.layout(rank, config))
        tp, stage = topo.tp_rank(rank), topo.stage(rank)
        assert list(model.layers) == [str(i) for i in range(2 * stage, 2 * stage + 2)]
        vocab = slice(51 * tp, min(51 * (tp + 1), 101))  # ceil(101 / 2) = 51 rows per rank
        if stage == 0:
            assert torch.equal(model.embed_tokens, full["model.embed_tokens.weight"][vocab])
        else:
            lm = full.get("lm_head.weight", full["model.embed_tokens.weight"])
            assert torch.equal(model.lm_head, lm[vocab])
        assert (model.norm is None) == (stage == 0)
        layer = model.layers[str(2 * stage)]
        p = f"model.layers.{2 * stage}."
        q, kv = slice(16 * tp, 16 * (tp + 1)), slice(8 * tp, 8 * (tp + 1))  # 2 of 4 heads, 1 of 2 KV heads
        qkv = layer.self_attn.qkv_proj.weight
        assert torch.equal(qkv[:16], full[p + "self_attn.q_proj.weight"][q])
        assert torch.equal(qkv[16:24], full[p + "self_attn.k_proj.weight"][kv])
        assert torch.equal(qkv[24:], full[p + "self_attn.v_proj.weight"][kv])
        assert torch.equal(layer.self_attn.o_proj.weight, full[p + "self_attn.o_proj.weight"][:, q])
        inter = slice(24 * tp, 24 * (tp + 1))
        assert torch.equal(layer.mlp.gate_up_proj.weight[24:], full[p + "mlp.up_proj.weight"][inter])
        assert torch.equal(layer.mlp.down_proj.weight, full[p + "mlp.down_proj.weight"][:, inter])


def test_topology_and_stages() -> None:
    topo = Topology(2, 3)
    assert [topo.stage(r) for r in range(6)] == [0, 0, 1, 1, 2, 2]
    assert [topo.tp_rank(r) for r in range(6)] == [0, 1, 0, 1, 0, 1]
    assert topo.stage_ranks(2) == [4, 5]
    assert topo.describe(3) == "rank 3 (pipeline stage 1, tensor rank 1)"
    assert [stage_layers(8, 4, s) for s in range(4)] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    with pytest.raises(ValueError, match=r"pipeline_parallel_size \(3\) must divide num_hidden_layers \(8\)"):
        stage_layers(8, 3, 0)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive int"):
        Topology(0, 1)
    with pytest.raises(ValueError, match=r"tp_size \(3\)"):
        ParallelLayout(tp_rank=0, tp_size=3).bind(resolve_model("tiny").config)


def test_pipeline_wait_counts_only_waits_for_a_busy_stage() -> None:
    # Stage 0 runs 0..2; stage 1 was busy until 3 (idle_since = start - idle = 3), so the
    # micro-batch waited 1s; stage 2 was free at 4 and got it at 4.5: no wait there.
    stages = [StageMetrics(7, 0, 0.0, 2.0, 0.0), StageMetrics(7, 1, 3.0, 1.5, 0.0),
              StageMetrics(7, 2, 4.5, 1.0, 0.5)]
    assert pipeline_wait(stages) == pytest.approx(1.0)
    assert pipeline_wait(stages[:1]) == 0.0


def test_kv_heads_replicate_when_ranks_outnumber_them(checkpoint) -> None:
    """TP=4 over 2 KV heads: ranks 0-1 hold KV head 0, ranks 2-3 KV head 1, each next to
    the query head that reads it (query head h uses KV head h // 2)."""
    path, full = checkpoint
    config = resolve_model(path).config
    topo = Topology(4, 1)
    topo.check(config)
    p = "model.layers.0."
    for rank in range(4):
        attn = load_model(path, layout=topo.layout(rank, config)).layers["0"].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (1, 1)
        kv = slice(8 * (rank // 2), 8 * (rank // 2 + 1))
        qkv = attn.qkv_proj.weight
        assert torch.equal(qkv[:8], full[p + "self_attn.q_proj.weight"][8 * rank:8 * (rank + 1)])
        assert torch.equal(qkv[8:16], full[p + "self_attn.k_proj.weight"][kv])
        assert torch.equal(qkv[16:], full[p + "self_attn.v_proj.weight"][kv])
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(3\) must divide num_key_value_heads \(2\) "
                                         r"or be a multiple of it"):
        Topology(3, 1).check(replace(config, num_attention_heads=6, head_dim=8))
    with pytest.raises(ValueError, match=r"num_key_value_heads \(2\) must divide or be a multiple of tp_size \(3\)"):
        ParallelLayout(tp_rank=0, tp_size=3).bind(replace(config, num_attention_heads=6, head_dim=8,
                                                          intermediate_size=48))
