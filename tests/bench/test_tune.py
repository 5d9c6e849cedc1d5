"""`blockspec tune` on the tiny random Qwen3 + DFlash drafter: it sweeps k, picks one, and prints a
--speculative-config that `serve` accepts."""

from __future__ import annotations

import json

from blockspec.bench.prompts import load_prompt_sets
from blockspec.bench.tune import EngineSweep, TuneSettings
from blockspec.cli import build_parser, main
from blockspec.engine.sampling_params import SamplingParams


def test_tune_picks_k_and_serve_accepts_the_config(tiny_models, tiny_drafter, tmp_path, capsys):
    model = str(tiny_models["qwen3"])
    rc = main(["tune", "--model", model, "--draft", str(tiny_drafter), "--k", "2,4,20", "--prompts", "code:1,prose:1",
               "--max-tokens", "12", "--runs", "2", "--warmup", "1", "--device", "cpu", "--out", str(tmp_path),
               "--json"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    assert sorted({(p["method"], p["k"]) for p in data["points"]}) == [("ar", 0), ("dflash", 2), ("dflash", 4)]
    assert any("k 20 skipped" in n for n in data["notes"])
    for p in data["points"]:
        assert p["tok_s"] > 0 and p["requests"] == 2
        assert 1.0 <= p["tau"] <= p["k"] + 1
        assert len(p["acceptance_per_position"]) == p["k"]
        if p["k"] == 0:
            assert p["tau"] == 1.0 and p["speedup"] == 1.0
    assert set(data["best_per_class"]) == {"code", "prose"}
    assert data["best"]["k"] in (0, 2, 4) and data["best_speculative"] in ({"method": "dflash", "k": 2},
                                                                            {"method": "dflash", "k": 4})
    config = data["speculative_config"]
    k = json.loads(config)["num_speculative_tokens"]
    assert k == data["best_speculative"]["k"]
    for name in ("tune.json", "tune.md", "tok_s_vs_k.png"):
        assert (tmp_path / name).stat().st_size > 100
    assert "--speculative-config" in (tmp_path / "tune.md").read_text()

    # `serve` takes the printed flag as is and builds an engine at that k.
    from blockspec.engine.engine import Engine
    from blockspec.server.args import build_engine_config

    args = build_parser().parse_args(["serve", model, "--speculative-config", config, "--device", "cpu",
                                      "--max-model-len", "256"])
    engine = Engine(build_engine_config(args))
    assert engine.num_speculative_tokens == k and engine.runner.proposer is not None


def test_tune_without_drafter_reports_the_baseline_only(tiny_models, tmp_path, capsys):
    rc = main(["tune", "--model", str(tiny_models["qwen3"]), "--prompts", "json:1", "--max-tokens", "6", "--runs", "1",
               "--warmup", "0", "--device", "cpu", "--out", str(tmp_path), "--quiet"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "no drafter given" in text and "autoregressive baseline" in text and "--speculative-config" not in text
    data = json.loads((tmp_path / "tune.json").read_text())
    assert [(p["method"], p["k"]) for p in data["points"]] == [("ar", 0)] and data["speculative_config"] is None


def test_switching_k_keeps_greedy_output_identical(tiny_models, tiny_drafter):
    """tune switches k on one engine; greedy output must not depend on k (k = 0 drops the drafter)."""
    sweep = EngineSweep(TuneSettings(model=str(tiny_models["qwen3"]), draft=str(tiny_drafter), max_tokens=20,
                                     device="cpu"), max_k=6)
    prompt = load_prompt_sets("reasoning:1")["reasoning"][0]
    outputs = {}
    for k in (0, 6, 3, 0):
        sweep.use_k(k)
        assert (sweep.engine.runner.proposer is None) == (k == 0)
        sweep.engine.add_request(f"r{k}", sweep.text(prompt), SamplingParams(max_tokens=20, temperature=0))
        while sweep.engine.has_unfinished_requests():
            for out in sweep.engine.step():
                if out.finished:
                    outputs.setdefault(k, []).append(out.token_ids)
    assert outputs[0][0] == outputs[6][0] == outputs[3][0] == outputs[0][1]


def test_tune_sweeps_mtp_n_and_prints_an_mtp_config(tmp_path, capsys):
    """--method mtp: the target's own MTP head, its N swept as k beside the k = 0 baseline."""
    from tests.tiny_hybrid import save_tiny_hybrid
    from tests.tiny_mtp import add_mtp_head

    model = save_tiny_hybrid(tmp_path / "qwen3_5", "qwen3_5", num_layers=2)
    add_mtp_head(model, "qwen3_5")
    rc = main(["tune", "--model", str(model), "--method", "mtp", "--k", "1,3", "--prompts", "code:1",
               "--max-tokens", "8", "--runs", "1", "--warmup", "0", "--device", "cpu", "--out", str(tmp_path / "out"),
               "--json"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    assert sorted({(p["method"], p["k"]) for p in data["points"]}) == [("ar", 0), ("mtp", 1), ("mtp", 3)]
    assert all(len(p["acceptance_per_position"]) == p["k"] for p in data["points"])
    config = json.loads(data["speculative_config"])
    assert config == {"method": "mtp", "num_speculative_tokens": data["best_speculative"]["k"]}


def test_tune_runs_deterministic_in_process_and_refuses_it_against_a_server(tiny_models, tmp_path, capsys):
    rc = main(["tune", "--model", str(tiny_models["llama"]), "--k", "0", "--prompts", "code:1", "--max-tokens", "6",
               "--runs", "1", "--warmup", "0", "--device", "cpu", "--deterministic", "--out", str(tmp_path), "--json"])
    assert rc == 0
    assert json.loads(capsys.readouterr().out)["settings"]["deterministic"] is True
    rc = main(["tune", "--base-url", "http://127.0.0.1:9", "--k", "0", "--deterministic", "--out", str(tmp_path)])
    assert rc == 2 and "serve --deterministic" in capsys.readouterr().err
