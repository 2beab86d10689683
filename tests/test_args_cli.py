"""The flags of `python -m engine` are generated from EngineArgs and the server's ServerArgs: one flag per field,
with its default."""
import re
from dataclasses import MISSING, fields
from pathlib import Path

import pytest

from engine.args import EngineArgs
from engine.server.cli import ServerArgs, make_parser, parse_args

REPO = Path(__file__).resolve().parent.parent


def test_every_field_is_a_flag_with_the_fields_default():
    parser = make_parser()
    by_dest = {a.dest: a for a in parser._actions}
    for f in fields(EngineArgs) + fields(ServerArgs):
        action = by_dest[f.name]
        option = f.metadata["cli"].get("option", "--" + f.name.replace("_", "-"))
        assert action.option_strings[0] == option
        if f.default is MISSING and f.default_factory is MISSING:
            assert action.required
        else:
            default = f.default if f.default is not MISSING else f.default_factory()
            assert action.default == default, f.name


def test_flags_parse_to_typed_engine_args():
    args, _ = parse_args(["--model", "m", "--max-num-seqs", "8", "--gpu-memory-utilization", "0.5",
                          "--enable-prefix-caching", "--enforce-eager", "--limit-mm-per-prompt", '{"image": 2}',
                          "--max-model-len", "512", "--scheduling-policy", "priority"])
    assert args == EngineArgs(model="m", max_num_seqs=8, gpu_memory_utilization=0.5, enable_prefix_caching=True,
                              enforce_eager=True, limit_mm_per_prompt={"image": 2}, max_model_len=512,
                              scheduling_policy="priority")
    assert parse_args(["--model", "m"])[0] == EngineArgs(model="m")


def test_server_flags_parse_to_server_args(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    _, server = parse_args(["--model", "m", "--port", "8000", "--disable-uvicorn-access-log",
                            "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--request-body-timeout", "5"])
    assert server == ServerArgs(port=8000, disable_access_log=True, enable_auto_tool_choice=True,
                                tool_call_parser="hermes", request_body_timeout=5.0)
    monkeypatch.setenv("VLLM_API_KEY", "secret")
    assert parse_args(["--model", "m"])[1].api_key == "secret"


@pytest.mark.parametrize("argv", [["--model", "m", "--dtype", "int3"], ["--model", "m", "--block-size", "12"],
                                  ["--model", "m", "--max-num-seqs", "many"], [],
                                  ["--model", "m", "--port", "70000"], ["--model", "m", "--enable-auto-tool-choice"],
                                  ["--model", "m", "--stream-write-timeout", "0"],
                                  ["--model", "m", "--max-waiting-requests", "-1"]])
def test_a_bad_flag_is_a_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_help_lists_every_flag_but_the_hidden_one(capsys):
    with pytest.raises(SystemExit):
        make_parser().parse_args(["--help"])
    text = capsys.readouterr().out
    for f in fields(EngineArgs):
        flag = "--" + f.name.replace("_", "-")
        assert (flag in text) == (f.name != "demo_model"), flag


@pytest.mark.parametrize("argv", [["--model", "m", "--load-format", "gguf"],
                                  ["--model", "m.gguf", "--load-format", "safetensors"]])
def test_a_load_format_that_disagrees_with_the_path_is_a_usage_error(argv, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert "does not match the model path" in capsys.readouterr().err


def test_a_load_format_that_agrees_with_the_path_parses():
    assert parse_args(["--model", "m.gguf", "--load-format", "gguf"])[0].load_format == "gguf"
    assert parse_args(["--model", "m", "--load-format", "safetensors"])[0].load_format == "safetensors"


# Flags accepted without being read: the reason each stays. Any other flag must be read by the code it configures
# (an attribute of the same name counts as a read: `params.seed` hides an unread --seed from this check).
NOT_READ = {
    "tool_call_parser": "one choice (hermes), the parser always used; --enable-auto-tool-choice needs it, as in vLLM",
}


def test_every_flag_is_read_outside_its_declaration():
    sources = [p for root in ("engine", "app", "proxy") for p in (REPO / root).rglob("*.py")
               if p.relative_to(REPO).as_posix() not in ("engine/args.py", "engine/server/cli.py")]
    text = "\n".join(p.read_text() for p in sources)
    unread = {f.name for f in fields(EngineArgs) + fields(ServerArgs)
              if not re.search(rf"\.{f.name}\b", text)}
    assert unread == set(NOT_READ)
