"""`blockspec tune` on tiny random targets: it sweeps DFlash's k and MTP's N (alone or in one run against one
baseline), picks the best, and prints a --speculative-config that `serve` accepts."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from blockspec.bench.prompts import load_prompt_sets
from blockspec.bench.tune import EngineSweep, TuneSettings, merge_points, method_list
from blockspec.bench.tune_report import choose, format_tune_table, speculative_config
from blockspec.cli import build_parser, main
from blockspec.config import SpeculativeConfig
from blockspec.engine.engine import Engine
from blockspec.engine.sampling_params import SamplingParams
from blockspec.server.args import build_engine_config


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


# ---- DFlash's k and MTP's N in one run ----------------------------------------------------------------

@pytest.fixture(scope="module")
def mtp_target(tmp_path_factory) -> dict[str, Path]:
    """A tiny Qwen3.5 hybrid with an MTP head, and a random DFlash drafter for it."""
    from transformers import AutoConfig

    from tests.conftest import save_tiny_drafter
    from tests.tiny_hybrid import save_tiny_hybrid
    from tests.tiny_mtp import add_mtp_head

    root = tmp_path_factory.mktemp("tune_mtp")
    model = save_tiny_hybrid(root / "qwen3_5", "qwen3_5", num_layers=2)
    add_mtp_head(model, "qwen3_5")
    draft = save_tiny_drafter(root / "draft", AutoConfig.from_pretrained(model).text_config, block_size=8,
                              target_layer_ids=[0, 1])
    return {"model": model, "draft": draft}


def _tune(capsys, *argv: str) -> dict:
    assert main(["tune", *argv, "--prompts", "code:1,prose:1", "--max-tokens", "8", "--runs", "1", "--warmup", "0",
                 "--device", "cpu", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_tune_sweeps_dflash_k_and_mtp_n_in_one_table(mtp_target, tmp_path, capsys):
    model, draft = str(mtp_target["model"]), str(mtp_target["draft"])
    data = _tune(capsys, "--model", model, "--draft", draft, "--method", "dflash,qwen3_5_mtp", "--k", "2,3,9",
                 "--n", "1,2", "--out", str(tmp_path))
    assert data["methods"] == ["dflash", "mtp"]
    assert [(s["method"], s["k"]) for s in data["summary"]] == [("ar", 0), ("dflash", 2), ("dflash", 3),
                                                                 ("mtp", 1), ("mtp", 2)]
    assert any("k 9 skipped" in n for n in data["notes"])
    base = {p["prompt_class"]: p["tok_s"] for p in data["points"] if p["method"] == "ar"}
    assert sorted(base) == ["code", "prose"]  # one baseline, measured once, for both methods
    assert len(data["points"]) == 5 * 2
    for p in data["points"]:
        assert len(p["acceptance_per_position"]) == p["k"] and 1.0 <= p["tau"] <= p["k"] + 1
        assert p["speedup"] == pytest.approx(p["tok_s"] / base[p["prompt_class"]])
        assert (p.get("draft") == draft) == (p["method"] == "dflash")

    table = format_tune_table(data)
    header = table.splitlines()[1]
    assert "method" in header and "k or N" in header
    assert sum(line.split()[0] in ("ar", "dflash", "mtp") for line in table.splitlines()) >= 5
    assert "dflash" in (tmp_path / "tune.md").read_text() and "mtp" in (tmp_path / "tune.md").read_text()
    assert (tmp_path / "tok_s_vs_k.png").stat().st_size > 100

    # the recommendation is the winner's, across methods, in vLLM's spelling, and `serve` builds it
    best = data["best_speculative"]
    assert best == max(({"method": s["method"], "k": s["k"]} for s in data["summary"] if s["method"] != "ar"),
                       key=lambda pick: next(s["speedup"] for s in data["summary"]
                                             if (s["method"], s["k"]) == (pick["method"], pick["k"])))
    spec = SpeculativeConfig.from_json(data["speculative_config"])
    assert (spec.method, spec.num_speculative_tokens) == (best["method"], best["k"])
    assert spec.model == (draft if best["method"] == "dflash" else None)
    args = build_parser().parse_args(["serve", model, "--speculative-config", data["speculative_config"],
                                      "--device", "cpu", "--max-model-len", "256"])
    engine = Engine(build_engine_config(args))
    assert engine.proposer.method.startswith(best["method"]) and engine.num_speculative_tokens == best["k"]


def test_tune_sweeps_the_method_that_can_run(mtp_target, tiny_models, tiny_drafter, tmp_path, capsys):
    # no drafter given: MTP alone, the missing one named in a note
    data = _tune(capsys, "--model", str(mtp_target["model"]), "--method", "dflash,mtp", "--n", "1",
                 "--out", str(tmp_path / "a"))
    assert sorted({(p["method"], p["k"]) for p in data["points"]}) == [("ar", 0), ("mtp", 1)]
    assert "dflash not swept: no drafter given (pass --draft DIR)" in data["notes"]
    assert json.loads(data["speculative_config"]) == {"method": "mtp", "num_speculative_tokens": 1}
    # a target without mtp.* weights: DFlash alone
    data = _tune(capsys, "--model", str(tiny_models["qwen3"]), "--draft", str(tiny_drafter), "--method", "mtp,dflash",
                 "--k", "2", "--out", str(tmp_path / "b"))
    assert sorted({(p["method"], p["k"]) for p in data["points"]}) == [("ar", 0), ("dflash", 2)]
    assert [n for n in data["notes"] if n.startswith("mtp not swept: ")]
    assert json.loads(data["speculative_config"])["method"] == "dflash"


def test_tune_refuses_when_no_method_can_run(tiny_models, tmp_path, capsys):
    rc = main(["tune", "--model", str(tiny_models["qwen3"]), "--method", "dflash,mtp", "--device", "cpu",
               "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and "none of the methods can run here" in err and "--draft DIR" in err and "MTP" in err
    assert not (tmp_path / "tune.json").exists()


def test_tune_against_a_server_takes_one_method(tmp_path, capsys):
    rc = main(["tune", "--base-url", "http://127.0.0.1:9", "--method", "dflash,mtp", "--k", "4", "--out",
               str(tmp_path)])
    assert rc == 2 and "a server runs one proposer" in capsys.readouterr().err


def test_method_list_spellings():
    assert method_list("dflash,mtp") == ["dflash", "mtp"]
    assert method_list("qwen3_next_mtp, dflash,mtp") == ["mtp", "dflash"]
    with pytest.raises(argparse.ArgumentTypeError, match="eagle"):
        method_list("dflash,eagle")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["tune", "--method", "eagle"])


def _point(method: str, k: int, cls: str, tok_s: float) -> dict:
    return {"method": method, "k": k, "prompt_class": cls, "tok_s": tok_s, "tau": 1.0 + k / 2}


def test_choose_picks_across_methods_against_one_baseline():
    points = [_point("ar", 0, "code", 100), _point("ar", 0, "prose", 50),
              _point("dflash", 8, "code", 300), _point("dflash", 8, "prose", 60),  # 3x, 1.2x: geomean 1.90
              _point("mtp", 2, "code", 200), _point("mtp", 2, "prose", 100)]  # 2x, 2x: geomean 2
    chosen = choose(points)
    assert chosen["best"] == chosen["best_speculative"] == {"method": "mtp", "k": 2}
    assert chosen["best_per_class"] == {"code": {"method": "dflash", "k": 8}, "prose": {"method": "mtp", "k": 2}}
    slow = [p if p["method"] == "ar" else {**p, "tok_s": p["tok_s"] / 4} for p in points]
    chosen = choose(slow)
    assert chosen["best"] == {"method": "ar", "k": 0} and chosen["best_speculative"] == {"method": "mtp", "k": 2}
    assert speculative_config(None, 2, "mtp") == '{"method": "mtp", "num_speculative_tokens": 2}'
    assert json.loads(speculative_config("/d", 8, "dflash")) == {"method": "dflash", "model": "/d",
                                                                  "num_speculative_tokens": 8}


def test_server_calls_merge_into_one_table_of_both_methods():
    """--base-url measures one method a call; the calls merge by (method, k, class), old files included."""
    old = [{"k": 0, "prompt_class": "code", "tok_s": 10}, {"k": 8, "prompt_class": "code", "tok_s": 20}]
    new = [{"method": "mtp", "k": 2, "prompt_class": "code", "tok_s": 18},
           {"method": "ar", "k": 0, "prompt_class": "code", "tok_s": 11}]
    merged = merge_points(old, new, old_method="dflash")
    assert [(p["method"], p["k"], p["tok_s"]) for p in merged] == [("ar", 0, 11), ("dflash", 8, 20), ("mtp", 2, 18)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_each_method_engine_gives_its_memory_back(mtp_target):
    """dflash,mtp builds one engine per method in turn: the first must free its weights, KV cache and CUDA
    graphs before the second plans its memory (never two targets at once)."""
    settings = TuneSettings(model=str(mtp_target["model"]), draft=str(mtp_target["draft"]), max_tokens=4,
                            device="cuda", gpu_memory_utilization=0.5)
    prompt = load_prompt_sets("code:1")["code"][0]
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    for method in ("dflash", "mtp", "dflash"):
        sweep = EngineSweep(settings, max_k=2, method=method)
        assert sweep.engine.proposer.method.startswith(method)
        assert sweep.run(prompt)["completion_tokens"] > 0
        sweep.close()
        assert torch.cuda.memory_allocated() - before < 1 << 20, method
