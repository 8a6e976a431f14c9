"""Every flag is read by the backend the command runs, or refused naming it; there are
no second spellings; light commands stay torch-free."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sarathi_rt.cli import main


@pytest.mark.parametrize("argv, flag", [
    (["bench", "--simulate", "--model", "tiny"], "--model"),
    (["bench", "--simulate", "--threads", "2", "--dtype", "bfloat16"], "--dtype, --threads"),
    (["bench", "--simulate", "--worker-timeout", "2"], "--worker-timeout"),
    (["bench", "--hardware", "h100"], "--hardware"),
    (["bench", "--simulate", "--seed", "1", "--kv-memory-fraction", "0.5"], "--kv-memory-fraction"),
    (["bench", "--vocab-size", "100"], "--vocab-size"),
    (["bench", "--endpoint", "http://127.0.0.1:9/v1", "--token-budget", "64"], "--token-budget"),
    (["bench", "--endpoint", "http://127.0.0.1:9/v1", "--policy", "vllm"], "--policy"),
    (["bench", "--simulate", "--step-profile", "p.json", "--num-layers", "40"], "--num-layers"),
    (["capacity", "--simulate", "--tbt-slo", "0.1", "--device", "cuda"], "--device"),
    (["capacity", "--tbt-slo", "0.1", "--num-layers", "2"], "--num-layers"),
    (["bench", "--endpoint", "http://127.0.0.1:9/v1", "--qos-srpf-weight", "2"], "--qos-srpf-weight"),
])
def test_flag_the_backend_does_not_read_is_an_error(argv: list[str], flag: str, tmp_path) -> None:
    with pytest.raises(ValueError, match=f"^{flag} not used by"):
        main([*argv, "--out", str(tmp_path)])


def test_two_profiles_exclude_each_other(tmp_path) -> None:
    with pytest.raises(ValueError, match="--step-profile and --vidur-profile"):
        main(["bench", "--simulate", "--step-profile", "p.json", "--vidur-profile", "m.csv", "--out", str(tmp_path)])


@pytest.mark.parametrize("command", ["bench", "capacity", "deploy", "serve", "generate", "profile"])
@pytest.mark.parametrize("old", ["--tp", "--pipeline-stages", "--num-blocks", "--profile", "--adaptive-budget",
                                 "--prefix-caching"])
def test_no_second_spelling(command: str, old: str, capsys) -> None:
    """One spelling per flag: the old ones are unknown, not aliases."""
    argv = [command, old] + ([] if old in ("--adaptive-budget", "--prefix-caching") else ["1"])
    argv += ["--qps", "1", "--tbt-slo", "0.1"] if command == "deploy" else []
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["--help"],
    ["bench", "--simulate", "--num-requests", "8", "--qps", "4", "--policy", "sarathi"],
    ["capacity", "--simulate", "--tbt-slo", "0.2", "--num-requests", "8", "--policy", "sarathi", "--max-probes", "2"],
    pytest.param(["deploy", "--qps", "0.5", "--tbt-slo", "0.2", "--num-requests", "10", "--max-gpus", "1",
                  "--policy", "sarathi", "--token-budget", "512"], marks=pytest.mark.slow),  # ~10 s of simulation
])
def test_light_commands_do_not_import_torch(argv: list[str], tmp_path) -> None:
    out = [] if argv[0] in ("--help", "deploy") else ["--out", str(tmp_path)]
    code = ("import json, sys\nfrom sarathi_rt.cli import main\n"
            f"try:\n    main({[*argv, *out]!r})\nexcept SystemExit:\n    pass\n"
            "print(json.dumps({m: m in sys.modules for m in ('torch', 'matplotlib')}))")
    env_out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=tmp_path)
    assert json.loads(env_out.stdout.strip().splitlines()[-1])["torch"] is False


def test_default_budget_rule_with_a_tbt_slo(tmp_path, capsys) -> None:
    common = ["bench", "--simulate", "--policy", "sarathi", "--num-requests", "8", "--qps", "4", "--out", str(tmp_path)]
    assert main([*common, "--tbt-slo", "0.2"]) == 0
    assert "each step sized to the 200 ms SLO, at most 4096 tokens" in capsys.readouterr().out
    assert main([*common, "--tbt-slo", "0.2", "--budget-rule", "slo-static"]) == 0
    assert "token budget from the 200 ms SLO" in capsys.readouterr().out
    assert main([*common, "--tbt-slo", "0.2", "--token-budget", "256"]) == 0  # a given budget is the cap
    assert "each step sized to the 200 ms SLO, at most 256 tokens" in capsys.readouterr().out
    assert main([*common, "--tbt-slo", "0.2", "--token-budget", "256", "--budget-rule", "fixed"]) == 0
    assert "sarathi: token budget 256" in capsys.readouterr().out
    with pytest.raises(ValueError, match="--budget-rule adaptive needs --tbt-slo"):
        main([*common, "--budget-rule", "adaptive"])
    with pytest.raises(ValueError, match="--budget-tile is used only by --budget-rule slo-static"):
        main([*common, "--tbt-slo", "0.2", "--budget-tile", "64"])
    with pytest.raises(ValueError, match="slo-static derives the token budget"):
        main([*common, "--tbt-slo", "0.2", "--token-budget", "256", "--budget-rule", "slo-static"])


def _serve_options(monkeypatch, argv: list[str], code: int = 2) -> dict:
    """The options `serve argv` gives LLM (stopped before a model loads)."""
    pytest.importorskip("fastapi")
    import sarathi_rt.llm

    seen: dict = {}

    def fake_llm(**kwargs: object) -> None:
        seen.update(kwargs)
        raise ValueError("stop before loading a model")

    monkeypatch.setattr(sarathi_rt.llm, "LLM", fake_llm)
    assert main(["serve", "--model", "tiny", *argv]) == code
    return seen


@pytest.mark.parametrize("argv, budget, slo", [([], 128, None), (["--tbt-slo", "0.1"], 512, 0.1),
                                               (["--tbt-slo", "0.1", "--token-budget", "64"], 64, 0.1),
                                               (["--tbt-slo", "0.1", "--budget-rule", "fixed"], 128, None)])
def test_serve_takes_the_default_budget_rule(monkeypatch, argv: list[str], budget: int, slo: float | None) -> None:
    seen = _serve_options(monkeypatch, argv)
    assert (seen["token_budget"], seen["tbt_slo"]) == (budget, slo)


def test_serve_passes_every_engine_flag(monkeypatch) -> None:
    seen = _serve_options(monkeypatch, ["--block-size", "8", "--tile-size", "64", "--no-enable-prefix-caching",
                                        "--chunk-size", "32", "--max-num-seqs", "4", "--seed", "3",
                                        "--num-kv-blocks", "50", "--max-model-len", "96", "--watermark", "0.05",
                                        "--slo-margin", "0.2", "--qos-srpf-weight", "0.5",
                                        "--long-prefill-threshold", "48"])
    assert {k: seen[k] for k in ("block_size", "tile_size", "enable_prefix_caching", "chunk_size", "max_num_seqs",
                                 "seed", "num_kv_blocks", "max_model_len", "watermark", "slo_margin",
                                 "qos_srpf_weight", "long_prefill_threshold")} == \
        {"block_size": 8, "tile_size": 64, "enable_prefix_caching": False, "chunk_size": 32, "max_num_seqs": 4,
         "seed": 3, "num_kv_blocks": 50, "max_model_len": 96, "watermark": 0.05, "slo_margin": 0.2,
         "qos_srpf_weight": 0.5, "long_prefill_threshold": 48}
    assert _serve_options(monkeypatch, ["--tile-size", "auto"])["tile_size"] == "auto"
    assert "enable_prefix_caching" not in _serve_options(monkeypatch, [])  # the tree's default (on) applies


@pytest.mark.parametrize("argv, says", [
    (["--budget-rule", "adaptive"], "--budget-rule adaptive needs --tbt-slo"),
    (["--tbt-slo", "0.1", "--budget-tile", "64"], "--budget-tile is used only by"),
    (["--policy", "vllm", "--chunk-size", "64"], "chunk_size is not used by policy 'vllm'"),
    (["--policy", "orca", "--qos-policy", "deadline"], "qos_policy 'deadline' is not supported by policy 'orca'"),
    (["--policy", "vllm", "--tbt-slo", "0.1", "--budget-rule", "adaptive"], "not supported by policy 'vllm'"),
    (["--token-budget", "64", "--tile-size", "128"], "token_budget (64) is below one tile"),
    (["--watermark", "1.5"], "watermark must be in [0, 1), got 1.5"),
])
def test_serve_refuses_flags_that_do_not_apply(capsys, argv: list[str], says: str) -> None:
    """Contradictions are errors from the config tree itself, before a model loads."""
    pytest.importorskip("fastapi")
    assert main(["serve", "--model", "tiny", *argv]) == 2
    assert says in capsys.readouterr().err


def test_tile_size_flag_takes_an_int_or_auto(capsys) -> None:
    pytest.importorskip("fastapi")
    assert main(["serve", "--tile-size", "big"]) == 2
    assert "tile_size must be an int or 'auto', got 'big'" in capsys.readouterr().err


def test_serve_slo_static_budget_is_measured_on_the_engine(monkeypatch, capsys) -> None:
    pytest.importorskip("fastapi")
    import sarathi_rt.server

    built = {}

    def fake_http(server: object, *args: object) -> None:
        built["server"] = server
        raise ValueError("stop before serving")

    monkeypatch.setattr(sarathi_rt.server, "DrainingServer", fake_http)
    assert main(["serve", "--model", "tiny", "--num-kv-blocks", "256", "--block-size", "8", "--max-num-seqs", "4",
                 "--tbt-slo", "10", "--budget-rule", "slo-static", "--budget-tile", "16"]) == 2
    server = built["server"]
    config = server.llm.engine.config
    assert config.tbt_slo is None and config.token_budget == 128  # 10 s: the largest of 16..128 fits
    assert server.stats.tbt_target == 10
    assert "token budget from the 10000 ms SLO: 128" in capsys.readouterr().out


def test_serve_exits_non_zero_after_the_engine_failed(monkeypatch, capsys) -> None:
    """The server shuts down by itself once the engine has failed (DrainingServer); the
    command then says why and exits 1, so a supervisor restarts it."""
    pytest.importorskip("fastapi")
    import sarathi_rt.server

    class FailedHttp:
        def __init__(self, server: object, *args: object) -> None:
            self.server = server

        def run(self) -> None:
            self.server.llm.engine._fail(RuntimeError("worker rank 1 died"))  # type: ignore[attr-defined]

        @property
        def engine_failed(self) -> bool:
            return self.server.llm.engine.failure is not None  # type: ignore[attr-defined]

    monkeypatch.setattr(sarathi_rt.server, "DrainingServer", FailedHttp)
    assert main(["serve", "--model", "tiny", "--num-kv-blocks", "64", "--block-size", "8"]) == 1
    assert "error: the engine failed: worker rank 1 died" in capsys.readouterr().err
