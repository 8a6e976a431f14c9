"""Qwen3 natively (models/families/qwen3.py: the LLaMA layout with per-head q/k RMSNorm
before rotary, head_dim from the config, optional sliding-window layers): greedy output
token for token as transformers' `generate` on the same weights, natively and through
the transformers backend, under chunks that split prompts mid-window, prefix caching on
and off, and mixed batches; the sliding layers as transformers picks them; GGUF files of
llama.cpp's "qwen3" architecture and tensor-parallel shards load the same weights; a
config the core cannot run is a named error before any weight is read."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from gguf_models import Q, write_model_gguf
from hf_models import greedy
from sarathi_rt import LLM, SamplingParams
from sarathi_rt.models import LlamaForCausalLM, ModelConfig, ParallelLayout, load_model, resolve_model
from sarathi_rt.models.families.transformers_backend import TransformersCausalLM

transformers = pytest.importorskip("transformers")

VOCAB = 256
# head_dim 32 != hidden / heads (16), as Qwen3 checkpoints set it. Initialised wide
# (std 0.2) so greedy choices are decided by clear margins, not by float32 rounding.
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, vocab_size=VOCAB, max_position_embeddings=128,
             initializer_range=0.2, rms_norm_eps=1e-6, eos_token_id=2, bos_token_id=1, pad_token_id=0)
CASES = {
    # Untied head, biased q/k/v/o (attention_bias covers all four in Qwen3).
    "biased": dict(attention_bias=True),
    # Tied embeddings; layer 0 attends fully, layers 1 and 2 through an 8-key window,
    # shorter than most prompts, so 5-token chunks split them mid-window. Three layers
    # initialised wider still: at this size the window must change the greedy tokens
    # (3 of the 4 prompts' continuations differ without it), or equality would not show it.
    "window_tied": dict(tie_word_embeddings=True, use_sliding_window=True, sliding_window=8, max_window_layers=1,
                        num_hidden_layers=3, initializer_range=0.5),
}
PROMPTS = [[random.Random(7 + n).randrange(3, VOCAB) for _ in range(n)] for n in (1, 5, 17, 40)]
MAX_TOKENS = 6


def _save(path: Path, **kwargs: object) -> object:
    """A random Qwen3 saved to `path`, its norm weights drawn too (HF starts them at 1,
    which would hide q_norm and k_norm swapped or left out)."""
    config = transformers.Qwen3Config(**{**SHAPE, **kwargs})
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return model


def _greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """The engine's greedy continuations, stopping at eos as transformers' do (`greedy`)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return [out.token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, object, list[list[int]]]]:
    """case -> (checkpoint, the transformers model, its greedy continuations of PROMPTS)."""
    root = tmp_path_factory.mktemp("qwen3")
    built = {}
    for case, kwargs in CASES.items():
        model = _save(root / case, **kwargs)
        built[case] = (root / case, model, [greedy(model, p, MAX_TOKENS) for p in PROMPTS])
    return built


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-cache", "prefix-cache"])
@pytest.mark.parametrize("impl", ["native", "transformers"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_matches_transformers_generate(models, case: str, impl: str, prefix_caching: bool) -> None:
    """Prompts of 1-40 tokens in one batch, in chunks of 5 under a budget of 16 (prefill
    chunks ride with decodes); with prefix caching the batch runs again from cached blocks."""
    path, _, expected = models[case]
    with LLM(str(path), model_impl=impl, token_budget=16, chunk_size=5, dtype="float32",
             enable_prefix_caching=prefix_caching) as llm:
        model = llm.engine.executor.worker.model
        assert isinstance(model, TransformersCausalLM if impl == "transformers" else LlamaForCausalLM)
        assert _greedy(llm, PROMPTS) == expected
        if prefix_caching:
            assert _greedy(llm, PROMPTS) == expected
            assert llm.engine.prefix_cache_stats().hits > 0


def test_auto_runs_qwen3_natively_with_its_norms_and_windows(models) -> None:
    path, hf, _ = models["window_tied"]
    resolved = resolve_model(path)
    assert resolved.family.name == "qwen3" and resolved.config.qk_norm
    model = load_model(resolved)
    assert type(model) is LlamaForCausalLM
    hf_layers = hf.model.layers
    for layer, theirs in zip(model.layers.values(), hf_layers, strict=True):
        attn = layer.self_attn
        assert torch.equal(attn.q_norm.weight, theirs.self_attn.q_norm.weight)
        assert torch.equal(attn.k_norm.weight, theirs.self_attn.k_norm.weight)
        assert attn.window == (theirs.self_attn.sliding_window or 0)
        assert attn.scale == theirs.self_attn.scaling
    assert [layer.self_attn.window for layer in model.layers.values()] == [0, 8, 8]
    assert model.lm_head is model.embed_tokens  # tied
    assert resolve_model(path, model_impl="transformers").family.name == "transformers"
    # The LLaMA layout itself carries no q/k norm.
    llama = ModelConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2)
    assert LlamaForCausalLM(llama).layers["0"].self_attn.q_norm is None


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
@pytest.mark.parametrize("fields", [
    dict(use_sliding_window=True, sliding_window=16),  # max_window_layers left out: HF's default 28
    dict(use_sliding_window=True, sliding_window=16, max_window_layers=30),
    dict(use_sliding_window=True, sliding_window=16, max_window_layers=1),
    dict(use_sliding_window=False, sliding_window=16, max_window_layers=1),
    dict(use_sliding_window=True, sliding_window=16,
         layer_types=["full_attention", "sliding_attention"] * 16),
], ids=["default-layers", "past-the-end", "from-1", "off", "layer-types"])
def test_sliding_layers_are_the_ones_transformers_picks(family: str, fields: dict) -> None:
    shape = {k: v for k, v in SHAPE.items() if k != "head_dim"}
    d = {**shape, "num_hidden_layers": 32, "architectures": [f"{family.capitalize()}ForCausalLM"],
         "model_type": family, **fields}
    theirs = getattr(transformers, f"{family.capitalize()}Config")(**d)
    ours = ModelConfig.from_hf_dict(d)
    want = [theirs.sliding_window if kind == "sliding_attention" and theirs.sliding_window else 0
            for kind in theirs.layer_types]
    assert [ours.layer_window(i) for i in range(32)] == want
    assert [ModelConfig.from_hf_dict(ours.to_hf_dict()).layer_window(i) for i in range(32)] == want


def test_gguf_of_qwen3_loads_the_weights_the_file_holds(tmp_path: Path) -> None:
    """llama.cpp's "qwen3" layout: q/k rows in HF order, attn_q_norm / attn_k_norm, head_dim
    from attention.key_length."""
    config = transformers.Qwen3Config(**{**SHAPE, **CASES["biased"]})
    state = {k: v.numpy() for k, v in _save(tmp_path / "src", **CASES["biased"]).state_dict().items()}
    stored = write_model_gguf(tmp_path / "q.gguf", config, state, Q.Q8_0, arch="qwen3")
    model = transformers.Qwen3ForCausalLM(config).float().eval()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in stored.items()})
    model.save_pretrained(tmp_path / "hf")
    ours, ref = load_model(str(tmp_path / "q.gguf")), load_model(str(tmp_path / "hf"))
    assert ours.config.model_type == "qwen3" and ours.config.head_dim == 32 and ours.config.qkv_bias
    names = [name for name, _ in ours.named_parameters()]
    assert "layers.1.self_attn.k_norm.weight" in names
    for (name, a), (_, b) in zip(ours.named_parameters(), ref.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    with LLM(str(tmp_path / "q.gguf"), token_budget=16, chunk_size=8, dtype="float32") as llm:
        assert _greedy(llm, PROMPTS[1:3]) == [greedy(model, p, MAX_TOKENS) for p in PROMPTS[1:3]]


@pytest.mark.parametrize("rank", [0, 1])
def test_tensor_parallel_ranks_hold_the_whole_norm_and_their_heads(models, rank: int) -> None:
    path, hf, _ = models["biased"]
    shard = load_model(str(path), layout=ParallelLayout(tp_rank=rank, tp_size=2))
    attn, theirs = shard.layers["0"].self_attn, hf.model.layers[0].self_attn
    assert torch.equal(attn.q_norm.weight, theirs.q_norm.weight)
    assert torch.equal(attn.k_norm.weight, theirs.k_norm.weight)
    q_rows = slice(rank * 2 * 32, (rank + 1) * 2 * 32)  # 2 of the 4 query heads
    k_rows = slice(rank * 32, (rank + 1) * 32)  # 1 of the 2 KV heads
    assert torch.equal(attn.qkv_proj.weight[:64], theirs.q_proj.weight[q_rows])
    assert torch.equal(attn.qkv_proj.weight[64:96], theirs.k_proj.weight[k_rows])


@pytest.mark.slow  # spawns two gloo workers
def test_tensor_parallel_greedy_matches_transformers(models) -> None:
    path, _, expected = models["window_tied"]
    with LLM(str(path), tensor_parallel_size=2, token_budget=16, chunk_size=8, dtype="float32") as llm:
        assert _greedy(llm, PROMPTS) == expected


@pytest.mark.parametrize("head_dim, error", [
    (33, r"head_dim must be a positive even int, got 33"),
    (320, r"Unsupported head_dim: 320 \(the CPU kernel takes up to 256\)"),
])
def test_a_config_the_core_cannot_run_is_named_before_any_weight(head_dim: int, error: str,
                                                                 tmp_path: Path) -> None:
    """Only config.json is written (by hand: transformers refuses an odd head_dim itself),
    so the error must come before the weights are looked for."""
    transformers.Qwen3Config(**SHAPE, architectures=["Qwen3ForCausalLM"]).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "head_dim": head_dim}))
    with pytest.raises(ValueError, match=error):
        load_model(resolve_model(tmp_path))
    with pytest.raises(ValueError, match=error):
        LLM(str(tmp_path), dtype="float32")
