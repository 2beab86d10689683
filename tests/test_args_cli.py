"""The flags of `python -m engine` are generated from EngineArgs: one flag per field, with its default."""
from dataclasses import MISSING, fields

import pytest

from engine.args import EngineArgs
from engine.server.cli import make_parser, parse_args


def test_every_field_is_a_flag_with_the_fields_default():
    parser = make_parser()
    by_dest = {a.dest: a for a in parser._actions}
    for f in fields(EngineArgs):
        action = by_dest[f.name]
        assert action.option_strings[0] == "--" + f.name.replace("_", "-")
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


@pytest.mark.parametrize("argv", [["--model", "m", "--dtype", "int3"], ["--model", "m", "--block-size", "12"],
                                  ["--model", "m", "--max-num-seqs", "many"], []])
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
