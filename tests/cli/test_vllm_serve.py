"""``rloo vllm-serve``: vLLM's server command with what the trainer's server mode needs added.

vLLM's own flags (vllm/engine/arg_utils.py ``--worker-extension-cls``, ``--logprobs-mode``,
``--generation-config``; vllm/entrypoints/launchers/cli_args.py ``--host``/``--port``) are checked against the
installed parser where vLLM is installed; tests/vllm_engine/test_server_mode.py starts the real server.
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools

import pytest

from rloo.cli import main
from rloo.cli.vllm_serve_cmd import server_argv, server_env
from rloo.errors import UserError
from rloo.training.vllm_weight_sync import EXTENSION


def test_the_trainers_needs_are_added_and_the_users_flags_kept() -> None:
    args = server_argv(["--model", "org/m", "--port=9000", "--tensor-parallel-size", "2"])
    assert args[:4] == ["--model", "org/m", "--port=9000", "--tensor-parallel-size"]
    flags = dict(itertools.pairwise(args))
    assert flags["--logprobs-mode"] == "processed_logprobs" and flags["--generation-config"] == "vllm"
    assert flags["--host"] == "127.0.0.1" and "--port" not in args  # the user's --port=9000 stays alone
    assert "--enable-prefix-caching" in args and args[-2:] == ["--worker-extension-cls", EXTENSION]
    assert server_env({"A": "1"}) == {"A": "1", "VLLM_SERVER_DEV_MODE": "1"}
    assert "--enable-prefix-caching" not in server_argv(["--model", "org/m", "--no-enable-prefix-caching"])


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--port", "1"], "needs --model"),
        (["--model", "org/m", "--worker-extension-cls", "x.Y"], "sets --worker-extension-cls itself"),
        (["--model=/no/such/dir"], "--model /no/such/dir"),
    ],
)
def test_what_would_break_the_weight_sync_is_refused(argv: list[str], says: str) -> None:
    with pytest.raises(UserError, match=says):
        server_argv(argv)


def test_the_extension_is_importable_by_the_name_given_to_vllm() -> None:
    module, _, cls = EXTENSION.rpartition(".")
    assert hasattr(importlib.import_module(module), cls)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_without_vllm_the_command_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["vllm-serve", "--model", "org/m"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rloo vllm-serve: error: rloo vllm-serve runs vLLM, which is not installed here")
    assert "\n" not in err


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed here")
def test_every_added_flag_is_one_the_installed_vllm_server_takes() -> None:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parsed = make_arg_parser(FlexibleArgumentParser()).parse_args(server_argv(["--model", "org/m"]))
    assert parsed.worker_extension_cls == EXTENSION and parsed.logprobs_mode == "processed_logprobs"
    assert parsed.generation_config == "vllm" and parsed.enable_prefix_caching is True


def test_without_arguments_it_prints_its_usage_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["vllm-serve"]) == 2
    assert capsys.readouterr().out.startswith("usage: rloo vllm-serve --model MODEL")
