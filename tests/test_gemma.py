"""Native Gemma 2 and Gemma 3 text (models/families/gemma.py): greedy output token for token
as transformers' `generate` on the same small random checkpoints, natively and through the
transformers backend, under chunks that split prompts mid-window, prefix caching on and
off and mixed prefill+decode batches; logprobs as transformers' own logits; both config
spellings (transformers 4 and 5) read alike; what the native path cannot run is a named
error before any weight is read."""
from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch

from sarathi_rt import LLM, SamplingParams
from sarathi_rt.models import ModelConfig, resolve_model
from sarathi_rt.models.families.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM, GemmaRMSNorm
from sarathi_rt.models.families.transformers_backend import TransformersCausalLM

transformers = pytest.importorskip("transformers")

VOCAB = 256
WINDOW = 8
LAYERS = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=128,
             initializer_range=0.2, eos_token_id=2, bos_token_id=1, pad_token_id=0, sliding_window=WINDOW,
             layer_types=LAYERS)
# Small caps and a scale other than head_dim ** -0.5, so each changes the logits well past
# the tolerances below (at the default 50/30 random scores stay far below the caps).
CONFIGS = {
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(attn_logit_softcapping=2.0, final_logit_softcapping=3.0, query_pre_attn_scalar=8)),
    # Linear rope scaling on the global layers; the local ones keep their own base.
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(rope_scaling={"rope_type": "linear", "factor": 4.0}, rope_theta=50.0, rope_local_base_freq=5000.0)),
}
NATIVE = {"gemma2": Gemma2ForCausalLM, "gemma3": Gemma3ForCausalLM}
PROMPT_LENGTHS = [1, 5, 17, 40]  # 17 and 40 outrun the window
MAX_TOKENS = 6


def _build(root: Path, name: str) -> tuple[Path, object]:
    config_class, model_class, kwargs = CONFIGS[name]
    config = getattr(transformers, config_class)(**{**SHAPE, **kwargs})
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).float().eval()
    with torch.no_grad():  # transformers starts the (1 + w) norms at w = 0; make w count
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.normal_(0.0, 0.5)
    model.save_pretrained(root / name)
    return root / name, model


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in PROMPT_LENGTHS]


@torch.no_grad()
def _generate(model: object, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
                         pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
               ) -> tuple[str, Path, object, list[list[int]]]:
    """(name, path, the transformers model, its greedy tokens for _prompts(1))."""
    path, model = _build(tmp_path_factory.mktemp(request.param), request.param)
    return request.param, path, model, [_generate(model, p) for p in _prompts(1)]


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [out.token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("impl", ["auto", "transformers"])
def test_greedy_matches_transformers_generate(impl: str, checkpoint: tuple) -> None:
    """All prompts in one batch under a 16-token budget (prefill chunks ride with
    decodes). Chunks of 5 split the 8-token window mid-way, twice with prefix caching
    (the second run starts from cached blocks); chunks of 8 without it."""
    name, path, _, expected = checkpoint
    prompts = _prompts(1)
    for chunk, caching in ((5, True), (8, False)):
        with LLM(str(path), model_impl=impl, token_budget=16, chunk_size=chunk, dtype="float32",
                 enable_prefix_caching=caching) as llm:
            model = llm.engine.executor.worker.model
            assert type(model) is (NATIVE[name] if impl == "auto" else TransformersCausalLM)
            assert _greedy(llm, prompts) == expected
            assert any(m.num_prefill_tokens and m.num_decode_tokens for m in llm.engine.step_metrics)
            if caching:
                assert _greedy(llm, prompts) == expected
                assert llm.engine.prefix_cache_stats().hits > 0


@torch.no_grad()
def test_logprobs_match_transformers_logits(checkpoint: tuple) -> None:
    """Every prompt token's logprob (chunked, windows split) equals a float64 log-softmax
    of transformers' logits to 1e-4: tight enough that a missing soft cap, scale, rope
    base or (1 + w) would show, as greedy equality alone might not."""
    _, path, model, _ = checkpoint
    prompts = _prompts(2)[2:]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1, ignore_eos=True)
    with LLM(str(path), token_budget=16, chunk_size=5, dtype="float32", enable_prefix_caching=False) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        logits = model(torch.tensor([prompt])).logits[0].double()
        reference = torch.log_softmax(logits, dim=-1)
        for i in range(1, len(prompt)):
            assert out.prompt_logprobs[i].logprob == pytest.approx(float(reference[i - 1, prompt[i]]), abs=1e-4)


def test_the_norm_is_transformers_own_in_bfloat16() -> None:
    """(1 + w) in float32 and one rounding at the end: bit for bit transformers' norm, where
    our rms_norm kernel (a bfloat16 weight, the normalized row rounded first) is not."""
    torch.manual_seed(3)
    x = torch.randn(7, 3, 64).to(torch.bfloat16)
    ours = GemmaRMSNorm(64, 1e-6, torch.bfloat16, "cpu")
    theirs = transformers.models.gemma3.modeling_gemma3.Gemma3RMSNorm(64, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        theirs.weight.normal_(0.0, 0.5)
        ours.weight.copy_(theirs.weight)
    assert torch.equal(ours(x), theirs(x))


def _config_dir(root: Path, config: dict) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    return root


BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, eos_token_id=1)


def test_transformers_4_configs_read_as_transformers_5_writes_them(tmp_path: Path) -> None:
    """Checkpoints written before transformers 5 spell the rope per kind and the layer
    kinds differently, and leave Gemma's defaults out; both read as transformers reads them."""
    old3 = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", hidden_act="gelu_pytorch_tanh",
                rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0},
                sliding_window_pattern=3, sliding_window=512, **BASE)
    config = transformers.Gemma3TextConfig(**{k: v for k, v in old3.items() if k not in ("architectures",
                                                                                          "sliding_window_pattern")},
                                           layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2)
    new3 = {**config.to_dict(), "architectures": ["Gemma3ForCausalLM"]}
    old = resolve_model(_config_dir(tmp_path / "old3", old3)).config
    assert old == resolve_model(_config_dir(tmp_path / "new3", new3)).config
    assert old.layer_types == tuple(config.layer_types) and old.rope_local_theta == 1e4
    assert old.rope_scaling == {"rope_type": "linear", "factor": 8.0} and old.attn_logit_softcapping is None
    # Gemma 2 with the defaults of transformers' config class: 4096-token windows on every
    # other layer, soft caps 50 and 30, scale 256 ** -0.5, head_dim 256, tied head.
    gemma2 = resolve_model(_config_dir(tmp_path / "gemma2", dict(architectures=["Gemma2ForCausalLM"],
                                                                 model_type="gemma2", **BASE))).config
    hf2 = transformers.Gemma2Config(**BASE)
    assert gemma2.layer_types == tuple(hf2.layer_types) and gemma2.sliding_window == hf2.sliding_window
    assert (gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping) == (50.0, 30.0)
    assert gemma2.attention_scale == 256 ** -0.5 and gemma2.head_dim == 256 and gemma2.tie_word_embeddings
    assert ModelConfig.from_hf_dict(gemma2.to_hf_dict()) == gemma2


@pytest.mark.parametrize("name, change, error", [
    ("gemma3", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), r"rope_scaling type must be .*'yarn'"),
    ("gemma2", dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}),
     r"rope_scaling type must be .*'dynamic'"),
    ("gemma3", dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                     "sliding_attention": {"rope_type": "linear", "factor": 2.0}}),
     r"rope_parameters\['sliding_attention'\] must have rope_type 'default'"),
    ("gemma3", dict(use_bidirectional_attention=True), r"gemma3_text: use_bidirectional_attention=True"),
    ("gemma2", dict(hidden_activation="gelu"), r"gemma2: hidden_activation must be 'gelu_pytorch_tanh'"),
    ("gemma2", dict(sliding_window=0.5), r"sliding_window must be None or a positive int"),
])
def test_what_the_native_path_cannot_run_is_named(name: str, change: dict, error: str, tmp_path: Path) -> None:
    arch, model_type = {"gemma2": ("Gemma2ForCausalLM", "gemma2"),
                        "gemma3": ("Gemma3ForCausalLM", "gemma3_text")}[name]
    with pytest.raises(ValueError, match=error):
        resolve_model(_config_dir(tmp_path, dict(architectures=[arch], model_type=model_type, **BASE, **change)))


@pytest.mark.slow  # spawns worker processes
@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_tensor_and_pipeline_parallel_match_one_process(tp: int, pp: int, tmp_path: Path) -> None:
    """Heads, the MLP and the vocabulary split over two ranks (the logits capped per
    slice), or the layers over two stages (the stream handed on as (hidden, residual))."""
    path, model = _build(tmp_path, "gemma3")
    prompts = _prompts(4)
    expected = [_generate(model, p) for p in prompts]
    with LLM(str(path), tensor_parallel_size=tp, pipeline_parallel_size=pp, token_budget=16, chunk_size=5,
             dtype="float32") as llm:
        assert _greedy(llm, prompts) == expected


def test_embedding_scale_is_rounded_as_transformers_rounds_it() -> None:
    """sqrt(3072) = 55.43 is 55.5 in bfloat16, the factor transformers' Gemma multiplies by."""
    config = ModelConfig(vocab_size=8, hidden_size=3072, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, head_dim=16, model_type="gemma2")
    model = Gemma2ForCausalLM(config, torch.bfloat16)
    assert float(model.embed_scale) == 55.5 and not math.isclose(3072 ** 0.5, 55.5)
