"""`blockspec serve`: the seeds' vLLM command lines parse unchanged; the process starts, warns once
per ignored flag, fails fast with one error line, and exits 0 on SIGTERM."""

from __future__ import annotations

import json
import shlex
import signal
import socket

import httpx
import pytest

from blockspec.cli import build_parser
from blockspec.errors import ConfigError
from blockspec.server.args import build_engine_config, build_server_config, warn_ignored
from blockspec.server.served_models import parse_alias
from tests.server.server_helpers import free_port, start_subprocess, stop_subprocess, wait_healthy

# Launch commands from the seeds (docs 000, 002, 003, 004), program name swapped, paths kept.
SEED_COMMANDS = [
    "/models/qwen36 --load-format fastsafetensors --quantization compressed-tensors --trust-remote-code "
    "--language-model-only --moe-backend marlin --attention-backend flash_attn --gpu-memory-utilization 0.78 "
    "--max-model-len 65536 --max-num-seqs 4 "
    """--speculative-config '{"method":"dflash","num_speculative_tokens":12,"model":"/draft"}'""",
    "/models/qwen122 --moe-backend cutlass --attention-backend TRITON_ATTN --gpu-memory-utilization 0.78 "
    "--max-model-len 16384 --max-num-seqs 2 "
    """--speculative-config '{"method":"dflash","num_speculative_tokens":10,"model":"/draft","max_model_len":1024}'""",
    "Intel/Qwen3.5-35B-A3B-int4-AutoRound --host 0.0.0.0 --port 8888 --max-model-len 262144 "
    "--max-num-batched-tokens 32768 --gpu-memory-utilization 0.7 --enable-auto-tool-choice "
    "--tool-call-parser qwen3_xml --load-format fastsafetensors --enable-prefix-caching --chat-template unsloth.jinja "
    """--speculative-config '{"method": "dflash", "model": "z-lab/Qwen3.5-35B-A3B-DFlash", """
    """"num_speculative_tokens": 15}' """
    "--attention-backend flash_attn",
    "Kbenkhaled/Qwen3.5-35B-A3B-NVFP4 --gpu-memory-utilization 0.8 --enable-prefix-caching --reasoning-parser qwen3 "
    "--enable-auto-tool-choice --tool-call-parser qwen3_coder",
    "/models/target --served-model-name qwen36-35b-heretic qwen36-fast qwen36-deep --max-num-seqs 128 "
    "--max-model-len 262144 --max-num-batched-tokens 65536 --enforce-eager -tp 1 --dtype bfloat16 "
    "--kv-cache-dtype auto --alias qwen36-fast:temperature=0 --alias qwen36-deep:temperature=0.7 --seed 0",
]


def _parse(command: str):
    return build_parser().parse_args(["serve", *shlex.split(command)])


@pytest.mark.parametrize("command", SEED_COMMANDS)
def test_seed_commands_parse_and_map_to_configs(command):
    args = _parse(command)
    warnings = warn_ignored(args)
    assert len(warnings) == len(set(warnings))
    engine = build_engine_config(args)
    server = build_server_config(args)
    assert engine.model == shlex.split(command)[0] and server.served_model_names
    assert server.model_root == engine.model


def test_flags_map_to_engine_and_server_settings(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    args = _parse(SEED_COMMANDS[1])
    engine, server = build_engine_config(args), build_server_config(args)
    assert engine.speculative.model == "/draft" and engine.speculative.num_speculative_tokens == 10
    assert engine.speculative.draft_window == 1024
    assert (engine.max_model_len, engine.max_num_seqs, engine.gpu_memory_utilization) == (16384, 2, 0.78)
    assert server.api_keys == ["from-env"] and server.served_model_names == ["/models/qwen122"]
    assert build_server_config(_parse("m --api-key flag-key")).api_keys == ["flag-key"]
    warnings = warn_ignored(args)
    assert sorted(warnings) == ["warning: --attention-backend TRITON_ATTN is ignored: blockspec picks its own kernels",
                                "warning: --moe-backend cutlass is ignored: blockspec picks its own kernels"]
    aliases = build_server_config(_parse(SEED_COMMANDS[4]))
    assert aliases.served_model_names == ["qwen36-35b-heretic", "qwen36-fast", "qwen36-deep"]
    assert aliases.aliases == {"qwen36-fast": {"temperature": 0.0}, "qwen36-deep": {"temperature": 0.7}}


def test_prefix_caching_flags():
    on = build_engine_config(_parse(SEED_COMMANDS[2]))  # --enable-prefix-caching: on, as by default
    assert on.enable_prefix_caching and build_engine_config(_parse("m")).enable_prefix_caching
    off = build_engine_config(_parse("m --no-enable-prefix-caching"))
    assert not off.enable_prefix_caching and off.num_state_snapshots() == 0
    hybrid = build_engine_config(_parse("m --mamba-block-size 512 --mamba-cache-snapshots 4"))
    assert (hybrid.snapshot_interval(), hybrid.num_state_snapshots()) == (512, 4)
    assert build_engine_config(_parse("m --mamba-cache-mode all")).snapshot_interval() == 16
    assert build_engine_config(_parse("m --mamba-cache-mode none")).num_state_snapshots() == 0
    with pytest.raises(ConfigError, match="multiple of --block-size"):
        build_engine_config(_parse("m --mamba-block-size 100")).validate()
    with pytest.raises(SystemExit):
        _parse("m --mamba-cache-mode sometimes")


def test_model_positional_overrides_flag_and_default_model_name():
    assert build_engine_config(_parse("/a --model /b")).model == "/a"
    args = _parse("")
    assert build_engine_config(args).model is None
    assert build_server_config(args).served_model_names == ["SmolLM2-135M-Instruct"]


def test_alias_and_config_errors():
    assert parse_alias("deep:temperature=0.7,top_p=0.9,stop=END") == \
        ("deep", {"temperature": 0.7, "top_p": 0.9, "stop": ["END"]})
    assert parse_alias('t:{"chat_template_kwargs": {"enable_thinking": false}}') == \
        ("t", {"chat_template_kwargs": {"enable_thinking": False}})
    assert parse_alias("plain") == ("plain", {})
    for bad in ("fast:temp=0", "fast:temperature=hot", ":temperature=0", "x:temperature"):
        with pytest.raises(ConfigError):
            parse_alias(bad)
    with pytest.raises(ConfigError, match="not valid JSON"):
        build_engine_config(_parse("m --speculative-config {oops"))
    with pytest.raises(ConfigError, match="use one"):
        build_engine_config(_parse("""m --draft /d --speculative-config '{"model":"/d"}'"""))
    with pytest.raises(ConfigError, match="sampling parameter"):
        build_server_config(_parse("""m --override-generation-config '{"temp":1}'"""))
    with pytest.raises(SystemExit):
        _parse("m --reasoning-parser nope")


def test_tool_call_flags():
    server = build_server_config(_parse(SEED_COMMANDS[2]))
    assert server.enable_auto_tool_choice and server.tool_call_parser == "qwen3_xml"
    assert not any("tool" in w for w in warn_ignored(_parse(SEED_COMMANDS[3])))  # used, so not "ignored"
    with pytest.raises(ConfigError, match="use one of hermes, qwen3_coder, qwen3_xml, llama3_json"):
        build_server_config(_parse("m --tool-call-parser qwen3"))
    with pytest.raises(ConfigError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        build_server_config(_parse("m --enable-auto-tool-choice"))


def test_serve_subprocess_warns_serves_and_exits_0_on_sigterm(tiny_models, tiny_drafter):
    port = free_port()
    spec = json.dumps({"method": "dflash", "model": str(tiny_drafter), "num_speculative_tokens": 3})
    proc = start_subprocess([str(tiny_models["qwen3"]), "--host", "127.0.0.1", "--port", str(port),
                             "--speculative-config", spec, "--served-model-name", "a", "b",
                             "--trust-remote-code", "--attention-backend", "flash_attn",
                             "--load-format", "fastsafetensors", "--enable-prefix-caching", "--mamba-cache-mode",
                             "align"])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, timeout=90, proc=proc)
        models = httpx.get(url + "/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["a", "b"]
        resp = httpx.post(url + "/v1/completions", json={"model": "b", "prompt": "hi", "max_tokens": 5}, timeout=60)
        assert len(resp.json()["spec_decode"]["accepted_per_position"]) == 3, resp.text
        # SIGTERM with a long stream in flight: the stream ends with an error event and [DONE], exit 0.
        body = {"model": "a", "prompt": "hi", "max_tokens": 480, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and "shutting down" in rest[-2]
    finally:
        code, out = stop_subprocess(proc)
    assert code == 0, out
    for flag in ("--trust-remote-code", "--attention-backend flash_attn", "--load-format fastsafetensors"):
        assert out.count(f"warning: {flag} is ignored") == 1, out
    assert "--enable-prefix-caching is ignored" not in out
    assert "Application shutdown complete" in out


def test_serve_fails_fast_with_one_error_line(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = start_subprocess([str(tmp_path / "missing"), "--host", "127.0.0.1", "--port", str(port)])
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "error: cannot listen on 127.0.0.1" in out, out
    proc = start_subprocess([str(tmp_path / "missing"), "--host", "127.0.0.1", "--port", str(free_port())])
    out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 2, out
    assert "error: model" in out and "not found" in out and "Traceback" not in out


def test_deterministic_flag():
    assert not build_engine_config(_parse("m")).deterministic  # off by default for now
    assert build_engine_config(_parse("m --deterministic")).deterministic
    assert not build_engine_config(_parse("m --deterministic --no-deterministic")).deterministic
