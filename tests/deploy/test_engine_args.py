"""One definition of the engine options for every entry point, vLLM's names and our aliases."""

from __future__ import annotations

import argparse
import subprocess

import pytest

from deploy import batch
from deploy.cli import build_parser
from deploy.engine_args import add_engine_args, engine_options
from tests.deploy.conftest import MTPSERVE


def _options(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return engine_options(parser.parse_args(argv))


def test_vllm_names_and_short_forms_give_the_same_engine():
    vllm = _options(
        [
            "--tensor-parallel-size", "2",
            "--expert-parallel-size", "2",
            "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 3}',
            "--max-model-len", "4096",
            "--max-num-seqs", "32",
            "--max-num-batched-tokens", "1024",
            "--gpu-memory-utilization", "0.8",
            "--no-enable-prefix-caching",
        ]
    )  # fmt: skip
    short = _options(
        ["--tp", "2", "--ep", "2", "--num-draft-tokens", "3", "--max-model-len", "4096"]
        + ["--max-num-seqs", "32", "--max-num-batched-tokens", "1024"]
        + ["--gpu-memory-utilization", "0.8", "--no-enable-prefix-caching"]
    )
    assert (
        vllm
        == short
        == {
            "tp_size": 2,
            "ep_size": 2,
            "num_draft_tokens": 3,
            "max_model_len": 4096,
            "max_num_seqs": 32,
            "max_num_batched_tokens": 1024,
            "gpu_memory_utilization": 0.8,
            "enable_prefix_caching": False,
        }
    )
    assert _options([]) == {}  # unset options are left to EngineConfig's defaults


def test_overlap_steps_option():
    assert _options(["--overlap-steps", "off"]) == {"overlap_steps": "off"}
    with pytest.raises(SystemExit):
        _options(["--overlap-steps", "sometimes"])


@pytest.mark.parametrize(
    "config, message",
    [
        ('{"method": "eagle", "num_speculative_tokens": 3}', "method 'eagle' is not served"),
        ('{"method": "mtp"}', "num_speculative_tokens must be an integer >= 0"),
        ('{"method": "mtp", "num_speculative_tokens": 2, "x": 1}', "unknown keys ['x']"),
        ("mtp", "is not JSON"),
    ],
)
def test_a_bad_speculative_config_is_named(config, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        _options(["--speculative-config", config])
    with pytest.raises(ValueError, match="contradicts"):
        _options(
            ["--num-draft-tokens", "2", "--speculative-config", '{"num_speculative_tokens": 3}']
        )


def _option_strings(parser: argparse.ArgumentParser) -> dict[str, str | None]:
    return {s: a.help for a in parser._actions for s in a.option_strings}


def test_every_entry_point_takes_the_same_engine_options_with_help():
    engine = argparse.ArgumentParser()
    add_engine_args(engine)
    wanted = set(_option_strings(engine)) - {"-h", "--help"}
    commands = build_parser()._subparsers._group_actions[0].choices
    for parser in (commands["serve"], commands["generate"], batch.build_parser()):
        options = _option_strings(parser)
        assert wanted <= set(options)
        assert all(help_text for option, help_text in options.items()), options


def test_version_and_a_bad_option_exit_cleanly():
    done = subprocess.run([MTPSERVE, "--version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("mtpserve 0.1")
    done = subprocess.run(
        [MTPSERVE, "generate", "--prompt", "x", "--speculative-config", '{"method": "eagle"}'],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "method 'eagle' is not served" in done.stderr
