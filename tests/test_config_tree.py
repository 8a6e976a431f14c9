"""One config tree: every field declared once with its help, the same flags in every
command that runs an engine, one budget rule through every entry point, and bad values
named the same from LLM(...), the command line and a config file."""
from __future__ import annotations

import argparse
import dataclasses
import json
import random

import pytest

from sarathi_rt.cli import main
from sarathi_rt.commands import bench, capacity, generate, profile, serve
from sarathi_rt.commands._serving import fill_defaults, policy_budget
from sarathi_rt.config import SECTIONS, EngineConfig, SchedulerConfig
from sarathi_rt.config.flags import add_config_flags, flag_name
from sarathi_rt.config.tree import field_names
from sarathi_rt.utils.options import FLAG, HELP

COMMANDS = {"serve": serve, "bench": bench, "capacity": capacity, "profile": profile, "generate": generate}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    for module in COMMANDS.values():
        module.add_parser(sub)
    return parser


def _config_actions(parser: argparse.ArgumentParser) -> dict[str, tuple[str, str | None, object]]:
    """The config flags of a parser: flag -> (its group's title, help, default)."""
    names = {flag_name(n) for n in field_names(*SECTIONS)} | {"--no-" + flag_name(n)[2:] for n in field_names(*SECTIONS)}
    out = {}
    for group in parser._action_groups:
        for action in group._group_actions:
            for option in action.option_strings:
                if option in names:
                    out[option] = (group.title, action.help, action.default)
    return out


def test_every_field_has_help_and_a_flag() -> None:
    for section in SECTIONS:
        for f in dataclasses.fields(section):
            assert len(f.metadata[HELP]) > 10, f.name
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    flags = _config_actions(parser)
    expected = {flag_name(f.name) for s in SECTIONS for f in dataclasses.fields(s) if f.metadata[FLAG]}
    assert expected <= set(flags)
    assert {"--long-prefill-threshold", "--watermark", "--slo-margin", "--qos-srpf-weight"} <= set(flags)


def test_every_command_has_the_same_config_flags_in_the_same_groups() -> None:
    parser = _parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    seen = {name: _config_actions(subparsers.choices[name]) for name in COMMANDS}
    reference = seen["serve"]
    assert len(reference) >= 25
    for name, flags in seen.items():
        assert flags == reference, name
        assert all(default is None for _, _, default in flags.values()), name  # the tree's default applies


def test_help_lists_the_same_groups(capsys) -> None:
    titles = []
    for command in ("serve", "bench"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        out = capsys.readouterr().out
        titles.append([line for line in out.splitlines() if line and not line.startswith(" ") and "(" in line
                       and line.endswith("):")])
    assert titles[0] and all(t in titles[1] for t in titles[0])


GRID = [(None, None), (256, None), (None, 0.1), (128, 0.1), (1024, 0.05)]


@pytest.mark.parametrize("token_budget, tbt_slo", GRID)
def test_one_budget_rule_through_every_entry_point(token_budget: int | None, tbt_slo: float | None) -> None:
    """The same flags give the same (token budget, adaptive SLO) in LLM/EngineConfig,
    serve, bench and capacity on the same device."""
    options = {"token_budget": token_budget, "tbt_slo": tbt_slo}
    config = EngineConfig(model="tiny", **{k: v for k, v in options.items() if v is not None})
    expected = (config.token_budget, config.tbt_slo)
    argv = ["--model", "tiny"] + (["--token-budget", str(token_budget)] if token_budget else []) + \
        (["--tbt-slo", str(tbt_slo)] if tbt_slo else [])
    parser = _parser()
    served, _ = serve.engine_options(parser.parse_args(["serve", *argv]))
    assert (served["token_budget"], served["tbt_slo"]) == expected
    for command in ("bench", "capacity"):
        args = parser.parse_args([command, *argv, "--policy", "sarathi"])
        fill_defaults(args, num_requests=(4, 4), length_scale=(1.0, 1.0))
        budget = policy_budget(args, "sarathi")
        assert (budget.token_budget, budget.tbt_slo) == expected, command


def test_the_budget_rule_is_the_documented_one() -> None:
    assert EngineConfig(model="tiny").token_budget == 128  # a CPU
    assert (EngineConfig(model="tiny", tbt_slo=0.1).token_budget, EngineConfig(model="tiny", tbt_slo=0.1).tbt_slo) \
        == (512, 0.1)
    assert EngineConfig(model="tiny", token_budget=64).max_num_seqs == 64  # a step carries every decode
    assert EngineConfig(model="tiny", policy="vllm", tbt_slo=None).token_budget == 128
    # A bare scheduler config is the simulator's, which models a GPU.
    assert SchedulerConfig().token_budget == 512 and SchedulerConfig(tbt_slo=0.1).token_budget == 4096


def test_cuda_defaults_resolve_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    config = EngineConfig(model="tiny", device="cuda", tbt_slo=0.1)
    assert config.dtype is torch.bfloat16 and config.token_budget == 4096
    assert EngineConfig(model="tiny", device="cuda").token_budget == 512


# Every field's bad value, and the message naming it.
BAD = [("token_budget", 0, "token_budget must be a positive int, got 0"),
       ("chunk_size", -1, "chunk_size must be a positive int, got -1"),
       ("max_num_seqs", 1.5, "max_num_seqs must be a positive int, got 1.5"),
       ("block_size", 0, "block_size must be a positive int, got 0"),
       ("num_kv_blocks", 0, "num_kv_blocks must be a positive int, got 0"),
       ("kv_memory_fraction", 1.5, "kv_memory_fraction must be in (0, 1], got 1.5"),
       ("watermark", 1.0, "watermark must be in [0, 1), got 1.0"),
       ("tbt_slo", -0.1, "tbt_slo must be a positive finite number of seconds, got -0.1"),
       ("slo_margin", 1.0, "slo_margin must be in [0, 1), got 1.0"),
       ("qos_srpf_weight", -1.0, "qos_srpf_weight must be a finite number >= 0, got -1.0"),
       ("long_prefill_threshold", 0, "long_prefill_threshold must be a positive int, got 0"),
       ("tensor_parallel_size", 0, "tensor_parallel_size must be a positive int, got 0"),
       ("worker_timeout", 0.0, "worker_timeout must be a positive finite number of seconds, got 0.0"),
       ("seed", -1, "seed must be an int >= 0, got -1"),
       ("threads", 0, "threads must be a positive int, got 0"),
       ("max_model_len", 0, "max_model_len must be a positive int, got 0"),
       ("policy", "fifo", "policy must be one of"),
       ("qos_policy", "edf", "qos_policy must be one of"),
       ("device", "tpu", "device must be 'cpu' or 'cuda[:N]', got 'tpu'")]


@pytest.mark.parametrize("name, value, message", BAD)
def test_bad_values_are_named_the_same_everywhere(name: str, value: object, message: str, tmp_path,
                                                  capsys) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        EngineConfig(model="tiny", **{name: value})
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model": "tiny", name: value}))
    pytest.importorskip("fastapi")
    assert main(["serve", "--config", str(path)]) == 2
    assert message in capsys.readouterr().err
    if name not in ("max_num_seqs", "qos_policy"):  # argparse refuses these by their type and choices
        assert main(["serve", "--model", "tiny", flag_name(name), str(value)]) == 2
        assert message in capsys.readouterr().err


@pytest.mark.parametrize("options, message", [
    ({"policy": "vllm", "chunk_size": 32}, "chunk_size is not used by policy 'vllm'"),
    ({"policy": "orca", "long_prefill_threshold": 64}, "long_prefill_threshold is not used by policy 'orca'"),
    ({"policy": "vllm", "tbt_slo": 0.1}, "tbt_slo (the adaptive token budget) is not supported by policy 'vllm'"),
    ({"policy": "vllm", "qos_classes": {"a": {"ttft": 1, "tbt": 0.1}}, "default_qos": "a", "qos_policy": "deadline"},
     "qos_policy 'deadline' is not supported by policy 'vllm'"),
    ({"slo_margin": 0.2}, "slo_margin is used only where steps are sized in seconds"),
    ({"qos_srpf_weight": 2.0}, "qos_srpf_weight orders the deadline policy"),
    ({"token_budget": 64, "tile_size": 128}, "token_budget (64) is below one tile"),
    ({"token_budget": 64, "chunk_size": 128}, "chunk_size (128) must not exceed token_budget (64)"),
])
def test_contradictions_are_errors_never_rewrites(options: dict, message: str, tmp_path) -> None:
    """The same from LLM's keywords (EngineConfig), a bare SchedulerConfig and bench."""
    escaped = message.replace("(", r"\(").replace(")", r"\)")
    with pytest.raises(ValueError, match=escaped):
        EngineConfig(model="tiny", **options)
    with pytest.raises(ValueError, match=escaped):
        SchedulerConfig(**options)
    # bench takes classes with a mix, and reads --tbt-slo as goodput's target under any policy.
    if "qos_classes" not in options and "tbt_slo" not in options:
        argv = [part for name, value in options.items() for part in (flag_name(name), str(value))]
        with pytest.raises(ValueError):
            main(["bench", "--simulate", *argv, "--out", str(tmp_path)])


def test_config_file_and_flags(tmp_path, monkeypatch) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"model": "tiny", "token_budget": 64, "watermark": 0.05}))
    args = _parser().parse_args(["serve", "--config", str(path), "--token-budget", "32"])
    options, _ = serve.engine_options(args)
    assert options["token_budget"] == 32 and options["watermark"] == 0.05  # the flag wins over the file
    path.write_text(json.dumps({"model": "tiny", "token_budjet": 64}))
    with pytest.raises(ValueError, match=r"unknown config fields \['token_budjet'\]"):
        serve.engine_options(_parser().parse_args(["serve", "--config", str(path)]))


@pytest.mark.parametrize("seed", range(20))
def test_random_valid_configs_round_trip_into_the_scheduler(seed: int) -> None:
    """Any valid combination builds, and the scheduler gets exactly the tree's settings."""
    rng = random.Random(seed)
    policy = rng.choice(["sarathi", "vllm", "orca", "request_level", "decode_maximal"])
    from sarathi_rt.scheduler import get_policy

    cls = get_policy(policy)
    budget = rng.choice([None, 64, 128, 512])
    options: dict[str, object] = {"policy": policy, "token_budget": budget,
                                  "watermark": rng.choice([0.0, 0.01, 0.2]),
                                  "enable_prefix_caching": rng.random() < 0.5, "block_size": rng.choice([8, 16])}
    if cls.chunked and rng.random() < 0.5:
        options["chunk_size"] = 32
    if cls.adaptive:
        options |= {"tbt_slo": rng.choice([None, 0.05]), "long_prefill_threshold": rng.choice([None, 48])}
        if rng.random() < 0.5:
            options |= {"qos_classes": {"chat": {"ttft": 1.0, "tbt": 0.1}}, "default_qos": "chat",
                        "qos_srpf_weight": rng.choice([0.0, 2.0])}
        if options["tbt_slo"] is not None or "qos_classes" in options:
            options["slo_margin"] = rng.choice([None, 0.2])
    config = EngineConfig(model="tiny", **options)
    sched = config.scheduler_config(num_blocks=100, tile_size=None)
    for name in field_names(*SECTIONS) & {f.name for f in dataclasses.fields(SchedulerConfig)} - {"tile_size",
                                                                                                    "qos_classes"}:
        assert getattr(sched, name) == getattr(config, name), name
    assert sched.num_blocks == 100 and sched.max_num_seqs <= sched.token_budget or not cls.chunked


def test_the_configuration_page_is_the_trees() -> None:
    """docs/configuration.md is generated: `python -m sarathi_rt.config.reference`."""
    from pathlib import Path

    from sarathi_rt.config.reference import render

    page = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
    assert page.read_text() == render(), "run: python -m sarathi_rt.config.reference"


def test_the_nsys_command_resolves_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/profiling.md's nsys command, `sarathi-rt bench --device cuda --policy
    sarathi,vllm --num-requests 8`, gives every policy a config the CUDA kernels take
    (bf16 on SM 9.0, the GPU's budget), resolved here without a GPU."""
    import torch

    from sarathi_rt.commands._serving import policy_options, workload_config
    from sarathi_rt.workloads import make_workload

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    args = _parser().parse_args(["bench", "--device", "cuda", "--policy", "sarathi,vllm", "--num-requests", "8"])
    fill_defaults(args, qps=(0.75, 1.5), num_requests=(12, 1000), length_scale=(1 / 8, 1.0))
    workload = make_workload(workload_config(args, args.qps, 8192))
    for policy in ("sarathi", "vllm"):
        config = EngineConfig(**policy_options(args, policy, workload))
        assert config.dtype is torch.bfloat16 and config.device.type == "cuda"
        assert config.token_budget >= 512
