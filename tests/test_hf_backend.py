"""The transformers backend (models/families/transformers_backend.py): architectures with
no native family run through transformers' own layers with our paged attention, token
for token as transformers' `generate` on the same weights, under chunked prefill, hybrid
batches, prefix caching and every policy; LLaMA forced through it matches the native
path; what it cannot run is a named error before any weight is read."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from sarathi_rt import LLM, SamplingParams
from sarathi_rt.models import ParallelLayout, load_model, resolve_model
from sarathi_rt.models.families.transformers_backend import TransformersCausalLM
from sarathi_rt.models.hf_linear import StackedLinear
from sarathi_rt.models.registry import has_native_family
from sarathi_rt.scheduler.registry import available_policies, get_policy

transformers = pytest.importorskip("transformers")

VOCAB = 256
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128, initializer_range=0.2,
             eos_token_id=2, bos_token_id=1, pad_token_id=0)
# name -> (config class, model class, what sets it apart). Initialised wide (std 0.2) so
# greedy choices are decided by clear margins, not by float32 rounding.
ARCHITECTURES: dict[str, tuple[str, str, dict]] = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),  # q/k norms, head_dim != hidden / heads
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),  # fused qkv and gate_up
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),  # norms after attention and MLP, q/k norms
    "granite": ("GraniteConfig", "GraniteForCausalLM",  # scaled attention, residuals, embeddings, logits
                dict(attention_multiplier=0.2, residual_multiplier=0.5, embedding_multiplier=3.0,
                     logits_scaling=2.0)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(rotary_pct=0.5)),  # partial rotary, MHA, LayerNorm
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=16)),  # scaled embeddings, GeLU, (1 + w) norms
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48)),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(sliding_window=None)),  # biases, GeLU MLP
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(logit_scale=0.5)),  # parallel blocks, interleaved rope
    # Learned absolute positions, read from our position_ids.
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=64, n_layer=2, n_head=4, n_positions=128)),
    "opt": ("OPTConfig", "OPTForCausalLM", dict(ffn_dim=128, word_embed_proj_dim=64)),  # offset positions
    "gptj": ("GPTJConfig", "GPTJForCausalLM", dict(n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=128)),
    "phi": ("PhiConfig", "PhiForCausalLM", {}),  # parallel attention and MLP, partial rotary
    # Sliding windows (Olmo3, Gemma 2 and 3 alternate them with full layers) shorter than the
    # longer prompts, so chunks split them mid-window; Gemma 2 soft-caps its attention logits.
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", dict(sliding_window=12)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",  # attention and final logit soft-capping
               dict(attn_logit_softcapping=20.0, final_logit_softcapping=30.0, sliding_window=12, head_dim=16)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(sliding_window=12, head_dim=16)),  # query_pre_attn_scalar
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
}


def _save(root: Path, name: str, config_class: str, model_class: str, kwargs: dict) -> object:
    config = getattr(transformers, config_class)(**{**SHAPE, **kwargs})
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).float().eval()
    model.save_pretrained(root / name)
    return model


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


@torch.no_grad()
def _generate(model: object, prompt: list[int], max_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                         pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def _greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [out.token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


# The quick lane runs these; the rest of ARCHITECTURES run in the slow lane.
QUICK = {"qwen3", "phi3", "olmo2", "granite", "gpt_neox", "gemma", "mixtral", "qwen2_moe", "gemma2"}


@pytest.mark.parametrize("name", [n if n in QUICK else pytest.param(n, marks=pytest.mark.slow)
                                  for n in sorted(ARCHITECTURES)])
def test_greedy_matches_transformers_generate(name: str, tmp_path: Path) -> None:
    """Prompts of 1-40 tokens in one batch, split into chunks of 8 under a budget of 16
    (so prefill chunks ride with decodes), run twice with prefix caching on: the second
    run starts from cached blocks. An architecture with a native family (Qwen3, Gemma 2
    and 3) is forced through the backend here; its own tests compare the two paths."""
    model = _save(tmp_path, name, *ARCHITECTURES[name])
    impl = "transformers" if has_native_family([ARCHITECTURES[name][1]], None) else "auto"
    resolved = resolve_model(tmp_path / name, model_impl=impl)
    assert resolved.family.name == "transformers"
    prompts = _prompts(1, [1, 5, 17, 40])
    expected = [_generate(model, p, 6) for p in prompts]
    with LLM(str(tmp_path / name), model_impl=impl, token_budget=16, chunk_size=8, dtype="float32",
             enable_prefix_caching=True) as llm:
        assert isinstance(llm.engine.executor.worker.model, TransformersCausalLM)
        assert _greedy(llm, prompts, 6) == expected
        assert _greedy(llm, prompts, 6) == expected
        assert llm.engine.prefix_cache_stats().hits > 0


def test_windows_and_soft_caps_reach_the_op(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemma 2's local layer runs with its window and its plan, its global one with
    neither, both with the soft cap (random tiny weights keep scores far below the cap,
    so greedy equality alone would not see it missing)."""
    from sarathi_rt.models.families import transformers_backend

    seen: list[tuple[int, float, int]] = []
    real = transformers_backend.run_attention

    def spy(plan: object, *args: object, **kwargs: object) -> None:
        seen.append((kwargs["window"], kwargs["softcap"], plan.window))  # type: ignore[attr-defined]
        real(plan, *args, **kwargs)

    monkeypatch.setattr(transformers_backend, "run_attention", spy)
    _save(tmp_path, "gemma2", *ARCHITECTURES["gemma2"])
    with LLM(str(tmp_path / "gemma2"), model_impl="transformers", token_budget=16, chunk_size=8,
             dtype="float32") as llm:
        _greedy(llm, _prompts(3, [20]), 2)
    assert set(seen) == {(12, 20.0, 12), (0, 20.0, 0)}


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    root = tmp_path_factory.mktemp("llama")
    return root / "llama", _save(root, "llama", "LlamaConfig", "LlamaForCausalLM", {})


@pytest.mark.parametrize("policy", available_policies())
def test_llama_through_the_backend_matches_native_under_every_policy(policy: str, llama: tuple[Path, object]) -> None:
    path, model = llama
    prompts = _prompts(2, [3, 9, 30])
    expected = [_generate(model, p, 5) for p in prompts]
    kw = dict(policy=policy, token_budget=48, chunk_size=8 if get_policy(policy).chunked else None,
              dtype="float32", enable_prefix_caching=False)
    with LLM(str(path), model_impl="transformers", **kw) as backend, LLM(str(path), **kw) as native:
        assert isinstance(backend.engine.executor.worker.model, TransformersCausalLM)
        assert not isinstance(native.engine.executor.worker.model, TransformersCausalLM)
        assert _greedy(backend, prompts, 5) == _greedy(native, prompts, 5) == expected


def test_sampling_n_and_logprobs_match_native(llama: tuple[Path, object]) -> None:
    """Seeded samples (n=2) and logprobs, prompt logprobs included, as the native path
    computes them from its own layers."""
    path, _ = llama
    prompts = _prompts(3, [4, 21])
    params = SamplingParams(max_tokens=5, temperature=0.8, seed=7, n=2, logprobs=2, prompt_logprobs=1)
    kw = dict(token_budget=16, chunk_size=8, dtype="float32")
    with LLM(str(path), model_impl="transformers", **kw) as backend, LLM(str(path), **kw) as native:
        got, want = backend.generate(prompts, params, use_tqdm=False), native.generate(prompts, params, use_tqdm=False)
    def close(x: object, y: object) -> None:
        assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
        assert [t for t, _ in x.top] == [t for t, _ in y.top]
        assert [p for _, p in x.top] == pytest.approx([p for _, p in y.top], abs=1e-4)

    for a, b in zip(got, want):
        assert len(a.samples) == 2
        assert [s.token_ids for s in a.samples] == [s.token_ids for s in b.samples]
        for sa, sb in zip(a.samples, b.samples):
            for x, y in zip(sa.logprobs, sb.logprobs, strict=True):
                close(x, y)
        assert a.prompt_logprobs[0] is None
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):
            close(x, y)


def test_timed_regions_are_the_linears_and_the_attention_modules(llama: tuple[Path, object]) -> None:
    model = load_model(resolve_model(llama[0], model_impl="transformers"))
    regions = [category for category, _ in model.timed_regions()]
    # Per layer q, k, v, o, gate, up, down; then lm_head.
    assert regions.count("attention") == 2 and regions.count("linear") == 2 * 7 + 1


def test_sibling_projections_share_one_product_and_one_weight(llama: tuple[Path, object]) -> None:
    """q/k/v and gate/up run as one stacked GEMM whose weight is their only storage; a
    member called with another input than its siblings' still returns its own product,
    and every linear layer gives the same rows whatever else shares the call (the
    batch invariance of ops.linear on the CPU)."""
    path, reference = llama
    hf = load_model(resolve_model(path, model_impl="transformers")).hf
    attn, mlp = hf.model.layers[0].self_attn, hf.model.layers[0].mlp
    for members in ((attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)):
        assert all(isinstance(m, StackedLinear) for m in members)
        assert len({m.weight.untyped_storage().data_ptr() for m in members}) == 1
    ref = reference.model.layers[0].self_attn
    x, y = torch.randn(1, 5, 64), torch.randn(1, 3, 64)
    with torch.inference_mode():
        q, k = attn.q_proj(x), attn.k_proj(y)  # k's input is not q's: k computes its own
        assert torch.allclose(q, ref.q_proj(x), atol=1e-5) and torch.allclose(k, ref.k_proj(y), atol=1e-5)
        v_alone = attn.v_proj(x[:, :1])
        assert torch.equal(attn.v_proj(x)[:, :1], v_alone)
        assert torch.equal(hf.lm_head(x)[:, :1], hf.lm_head(x[:, :1]))


def test_code_shipped_with_the_checkpoint_runs_only_when_trusted(tmp_path: Path) -> None:
    path = tmp_path / "remote"
    path.mkdir()
    (path / "configuration_toy.py").write_text(
        "from transformers import LlamaConfig\n\n\nclass ToyConfig(LlamaConfig):\n    model_type = 'toy_remote'\n")
    (path / "modeling_toy.py").write_text(
        "from transformers import LlamaForCausalLM\n\nfrom .configuration_toy import ToyConfig\n\n\n"
        "class ToyForCausalLM(LlamaForCausalLM):\n    config_class = ToyConfig\n")
    model = _save(tmp_path, "remote", "LlamaConfig", "LlamaForCausalLM", {})
    config = json.loads((path / "config.json").read_text())
    config.update(architectures=["ToyForCausalLM"], model_type="toy_remote",
                  auto_map={"AutoConfig": "configuration_toy.ToyConfig",
                            "AutoModelForCausalLM": "modeling_toy.ToyForCausalLM"})
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"'ToyForCausalLM' needs the modelling code.*trust_remote_code=True"):
        LLM(str(path), dtype="float32")
    prompts = _prompts(4, [6, 13])
    with LLM(str(path), dtype="float32", trust_remote_code=True, token_budget=16, chunk_size=8) as llm:
        assert _greedy(llm, prompts, 4) == [_generate(model, p, 4) for p in prompts]


def _write_config(path: Path, config: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("config, error", [
    ({"model_type": "olmo2", **SHAPE}, r"names no `architectures`"),
    ({"architectures": ["NoSuchForCausalLM"], "model_type": "olmo2", **SHAPE},
     r"'NoSuchForCausalLM' is unknown to transformers .* ships no AutoModelForCausalLM code"),
    ({"architectures": ["NoSuchForCausalLM"], "model_type": "no_such_type"}, r"transformers cannot read"),
    ({"architectures": ["BertForMaskedLM"], "model_type": "bert"}, r"'BertForMaskedLM' is not a causal language"),
    ({"architectures": ["T5ForConditionalGeneration"], "model_type": "t5"}, r"encoder-decoder"),
    ({"architectures": ["BartForConditionalGeneration"], "model_type": "bart"}, r"encoder-decoder"),
    ({"architectures": ["StableLmForCausalLM"], "model_type": "stablelm", **SHAPE},
     r"StableLmForCausalLM computes attention in its own code"),
    ({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", **SHAPE},
     r"values and keys differ in head size \(multi-head latent attention\)"),
    ({"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "num_local_experts": 4, **SHAPE},
     r"GptOssForCausalLM adds attention sinks"),
    ({"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "use_bidirectional_attention": True,
      **SHAPE}, r"Gemma3ForCausalLM attends bidirectionally"),
])
def test_what_the_backend_cannot_run_is_named(config: dict, error: str, tmp_path: Path) -> None:
    # Forced: Gemma 3 has a native family, which refuses it in its own words (tests/test_gemma.py).
    with pytest.raises(ValueError, match=error):
        resolve_model(_write_config(tmp_path / "m", config), model_impl="transformers")


# Models whose layers keep state outside the KV cache (or attend in their own code):
# each is refused from its config alone.
STATEFUL = {"MambaForCausalLM": "mamba", "FalconMambaForCausalLM": "falcon_mamba", "JambaForCausalLM": "jamba",
            "BambaForCausalLM": "bamba", "Lfm2ForCausalLM": "lfm2", "GraniteMoeHybridForCausalLM": "granitemoehybrid",
            "RecurrentGemmaForCausalLM": "recurrent_gemma", "ZambaForCausalLM": "zamba",
            "Qwen3NextForCausalLM": "qwen3_next"}


@pytest.mark.parametrize("architecture", sorted(STATEFUL))
def test_models_with_state_outside_the_kv_cache_are_refused(architecture: str, tmp_path: Path) -> None:
    # Lfm2 would make every layer attention at this depth: give it its convolutions.
    layers = dict(full_attn_idxs=[1, 3]) if architecture == "Lfm2ForCausalLM" else {}
    config = transformers.AutoConfig.for_model(STATEFUL[architecture], architectures=[architecture],
                                               vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, **layers)
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=rf"{architecture} .*(state outside the KV cache|its own code)"):
        resolve_model(tmp_path)


def test_a_sliding_window_is_planned_and_parallelism_is_refused(llama: tuple[Path, object],
                                                                  tmp_path: Path) -> None:
    config = transformers.MistralConfig(**{**SHAPE, "sliding_window": 24, "architectures": ["MistralForCausalLM"]})
    config.save_pretrained(tmp_path)
    resolved = resolve_model(tmp_path, model_impl="transformers")
    assert resolved.config.max_position_embeddings == config.max_position_embeddings  # the window is the op's
    assert [resolved.config.layer_window(i) for i in range(config.num_hidden_layers)] == [24] * config.num_hidden_layers
    assert resolve_model(tmp_path).config.model_type == "mistral"  # natively, unless forced
    with pytest.raises(ValueError, match="no tensor or pipeline parallelism"):
        TransformersCausalLM(resolved.config, layout=ParallelLayout(tp_rank=0, tp_size=2))
    with pytest.raises(ValueError, match="model_impl must be one of"):
        resolve_model(llama[0], model_impl="vllm")
    with pytest.raises(ValueError, match="model_impl='transformers' runs HF model directories only"):
        resolve_model("tiny", model_impl="transformers")


# Loads a checkpoint in bfloat16 (so every weight is converted, not memory-mapped) while
# a thread samples the process's anonymous memory; prints (weights, peak growth, final
# growth) in MiB, growth counted from after a tiny model of the same kind was loaded.
_PEAK_PROBE = """
import json, sys, threading, time
import torch
from sarathi_rt.models import load_model, resolve_model

def anon():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon")) / 1024

load_model(resolve_model(sys.argv[2], model_impl="transformers"), dtype="bfloat16")  # a tiny one first: imports and one-off set-up are not weights
start, peak, done = anon(), [0.0], threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], anon())
        time.sleep(0.001)
thread = threading.Thread(target=sample)
thread.start()
model = load_model(resolve_model(sys.argv[1], model_impl="transformers"), dtype="bfloat16")
done.set()
thread.join()
weights = sum(p.numel() * p.element_size() for p in model.hf.parameters()) / 2**20
print(json.dumps([weights, peak[0] - start, anon() - start]))
"""


@pytest.mark.slow  # writes and loads a 200 MiB checkpoint
@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads RssAnon from /proc")
def test_weights_are_loaded_without_a_second_copy(tmp_path: Path) -> None:
    import subprocess
    import sys

    config = transformers.Qwen3Config(hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
                                      num_attention_heads=8, num_key_value_heads=4, vocab_size=32000,
                                      architectures=["Qwen3ForCausalLM"])
    transformers.Qwen3ForCausalLM(config).save_pretrained(tmp_path / "big")
    _save(tmp_path, "tiny", "Qwen3Config", "Qwen3ForCausalLM", {})
    out = subprocess.run([sys.executable, "-c", _PEAK_PROBE, str(tmp_path / "big"), str(tmp_path / "tiny")],
                         check=True, capture_output=True, text=True).stdout
    weights, peak, final = json.loads(out.strip().splitlines()[-1])
    # Nothing held during the load is let go after it: no transient float32 or second copy.
    assert peak - final < 0.1 * weights + 16, (weights, peak, final)
    assert final < 1.5 * weights, (weights, peak, final)


def test_a_head_dim_the_kernel_cannot_run_is_named_before_any_weight(tmp_path: Path) -> None:
    """Through the backend as natively: only config.json exists, so the error comes before
    transformers builds (or the loader looks for) a weight."""
    config = {"architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2", **SHAPE, "head_dim": 320}
    with pytest.raises(ValueError, match=r"Unsupported head_dim: 320 \(the CPU kernel takes up to 256\)"):
        LLM(str(_write_config(tmp_path / "m", config)), dtype="float32")
