"""Flag parsing of ``rloo train`` (rloo.parsing on HfArgumentParser): the reference command lines verbatim,
booleans, aliases, YAML, lists, --help."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from rloo.cli import main
from rloo.config import ALIASES, RLOOConfig
from rloo.demo.tiny import TinySetup
from rloo.errors import UserError
from rloo.parsing import parse_bool, parse_config

# Copied verbatim from rloo_trainer_classic.md ("Get started"), script path included.
GET_STARTED = r"""
python examples/scripts/rloo/rloo.py \
    --dataset_name trl-internal-testing/descriptiveness-sentiment-trl-style \
    --dataset_train_split descriptiveness \
    --learning_rate 3e-6 \
    --output_dir models/minimal/rloo \
    --per_device_train_batch_size 64 \
    --gradient_accumulation_steps 1 \
    --total_episodes 10000 \
    --model_name_or_path EleutherAI/pythia-14m \
    --reward_model_path EleutherAI/pythia-14m \
    --missing_eos_penalty 1.0
"""

# Copied verbatim from rloo_trainer_classic.md ("Benchmark experiments"); the document leaves out the
# script path, so the script's flags start at --output_dir, after accelerate's own --config_file.
BENCHMARK = r"""
accelerate launch --config_file examples/accelerate_configs/deepspeed_zero2.yaml \
    --output_dir models/minimal/rloo_tldr \
    --dataset_name trl-internal-testing/tldr-preference-sft-trl-style \
    --dataset_test_split validation \
    --num_ppo_epochs 2 \
    --num_mini_batches 2 \
    --learning_rate 3e-6 \
    --per_device_train_batch_size 16 \
    --gradient_accumulation_steps 16 \
    --total_episodes 1000000 \
    --model_name_or_path EleutherAI/pythia-1b-deduped \
    --sft_model_path cleanrl/EleutherAI_pythia-1b-deduped__sft__tldr \
    --reward_model_path cleanrl/EleutherAI_pythia-1b-deduped__reward__tldr \
    --local_rollout_forward_batch_size 16 \
    --missing_eos_penalty 1.0 \
    --stop_token eos \
    --kl_coef 0.03
"""


def script_flags(command: str, first_flag: str, local: dict[str, str]) -> list[str]:
    """The flags of a documented command line from ``first_flag`` on, Hub ids replaced by local dirs."""
    tokens = shlex.split(command.replace("\\\n", " "))
    tokens = tokens[tokens.index(first_flag) :]
    assert all(t in tokens for t in local), "a Hub id to replace is missing from the command line"
    return [local.get(t, t) for t in tokens]


def parse(argv: list[str]) -> RLOOConfig:
    return parse_config(RLOOConfig, argv, prog="rloo train")


@pytest.fixture
def base(tiny_setup: TinySetup, toy_dataset: Path) -> list[str]:
    return [
        "--model_name_or_path",
        str(tiny_setup.policy),
        "--reward_model_path",
        str(tiny_setup.reward_model),
        "--dataset_name",
        str(toy_dataset),
    ]


@pytest.fixture
def captured_train(monkeypatch: pytest.MonkeyPatch) -> list[RLOOConfig]:
    """Replace the trainer so ``main(["train", ...])`` runs the real CLI path up to training."""
    import rloo.training.trainer as trainer

    calls: list[RLOOConfig] = []
    monkeypatch.setattr(trainer, "train", calls.append)
    return calls


def test_get_started_command_line_verbatim(
    tiny_setup: TinySetup,
    toy_dataset: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    captured_train: list[RLOOConfig],
) -> None:
    monkeypatch.chdir(tmp_path)
    local = {
        "trl-internal-testing/descriptiveness-sentiment-trl-style": str(toy_dataset),
        "EleutherAI/pythia-14m": str(tiny_setup.policy),
    }
    argv = script_flags(GET_STARTED, "--dataset_name", local)
    # the reward model is the same Hub id as the policy in the document: both become the policy dir
    assert argv.count(str(tiny_setup.policy)) == 2
    assert main(["train", *argv]) == 0
    (cfg,) = captured_train
    assert cfg == parse(argv)
    assert cfg.dataset_name == str(toy_dataset)
    assert cfg.dataset_train_split == "descriptiveness"
    assert cfg.dataset_test_split == "test"
    assert cfg.learning_rate == 3e-6
    assert cfg.output_dir == "models/minimal/rloo"
    assert cfg.per_device_train_batch_size == 64
    assert cfg.gradient_accumulation_steps == 1
    assert cfg.total_episodes == 10_000
    assert cfg.model_name_or_path == cfg.reward_model_path == str(tiny_setup.policy)
    assert cfg.missing_eos_penalty == 1.0
    assert cfg.rloo_k == 2 and cfg.sft_model_path is None
    assert not Path("models").exists()  # parsing writes nothing


def test_benchmark_command_line_verbatim(
    tiny_setup: TinySetup, toy_dataset: Path, tmp_path: Path, captured_train: list[RLOOConfig]
) -> None:
    sft = tmp_path / "sft"  # a second local directory for the SFT checkpoint
    sft.mkdir()
    local = {
        "trl-internal-testing/tldr-preference-sft-trl-style": str(toy_dataset),
        "EleutherAI/pythia-1b-deduped": str(tiny_setup.policy),
        "cleanrl/EleutherAI_pythia-1b-deduped__sft__tldr": str(sft),
        "cleanrl/EleutherAI_pythia-1b-deduped__reward__tldr": str(tiny_setup.reward_model),
    }
    argv = script_flags(BENCHMARK, "--output_dir", local)
    assert main(["train", *argv]) == 0
    (cfg,) = captured_train
    assert cfg.output_dir == "models/minimal/rloo_tldr"
    assert cfg.dataset_name == str(toy_dataset)
    assert cfg.dataset_train_split == "train"
    assert cfg.dataset_test_split == "validation"
    assert (cfg.num_ppo_epochs, cfg.num_mini_batches) == (2, 2)
    assert cfg.learning_rate == 3e-6
    assert (cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps) == (16, 16)
    assert cfg.total_episodes == 1_000_000
    assert cfg.model_name_or_path == str(tiny_setup.policy)
    assert cfg.sft_model_path == cfg.policy_path == str(sft)
    assert cfg.reward_model_path == str(tiny_setup.reward_model)
    assert cfg.local_rollout_forward_batch_size == 16
    assert cfg.missing_eos_penalty == 1.0
    assert cfg.stop_token == "eos"
    assert cfg.kl_coef == 0.03
    # 16 x 16 x 2 = 512 completions per update, 256 prompts with k=2; ceil(1e6 / 512) = 1954 updates
    plan = cfg.batch_plan(world_size=1)
    assert (plan.local_batch_size, plan.prompts_per_rank, plan.num_total_batches) == (512, 256, 1954)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--disable_tqdm"], True),
        (["--disable_tqdm", "true"], True),
        (["--disable_tqdm", "True"], True),
        (["--disable_tqdm", "1"], True),
        (["--disable_tqdm", "false"], False),
        (["--disable_tqdm", "False"], False),
        (["--disable_tqdm", "no"], False),
        ([], False),
    ],
)
def test_booleans(base: list[str], flags: list[str], expected: bool) -> None:
    # the boolean as the last flag, and followed by another flag
    assert parse([*base, *flags]).disable_tqdm is expected
    cfg = parse([*flags, *base])
    assert cfg.disable_tqdm is expected
    assert cfg.model_name_or_path == base[1]


def test_several_bare_booleans_in_a_row(base: list[str]) -> None:
    cfg = parse([*base, "--normalize_reward", "--normalize_advantage", "--token_level_kl", "false", "--bf16"])
    assert (cfg.normalize_reward, cfg.normalize_advantage, cfg.token_level_kl, cfg.bf16) == (
        True,
        True,
        False,
        True,
    )


def test_parse_bool() -> None:
    for text in ("true", "TRUE", "yes", "on", "1"):
        assert parse_bool(text) is True
    for text in ("false", "No", "off", "0"):
        assert parse_bool(text) is False
    with pytest.raises(ValueError):
        parse_bool("maybe")


def test_bad_boolean_value_names_the_flag(base: list[str]) -> None:
    with pytest.raises(UserError, match="--disable_tqdm expects true or false"):
        parse([*base, "--disable_tqdm", "maybe"])


def test_aliases_map_to_classic_fields(base: list[str]) -> None:
    cfg = parse(
        [
            *base,
            "--num_generations", "4",
            "--beta", "0.1",
            "--epsilon", "0.3",
            "--num_iterations", "3",
            "--steps_per_generation", "2",
            "--max_completion_length", "16",
            "--normalize_advantages", "true",
            "--epsilon_high", "0.35",
        ]
    )  # fmt: skip
    assert cfg.rloo_k == 4
    assert cfg.kl_coef == 0.1
    assert cfg.cliprange == 0.3
    assert cfg.num_ppo_epochs == 3
    assert cfg.num_mini_batches == 2
    assert cfg.response_length == 16
    assert cfg.normalize_advantage is True
    assert cfg.cliprange_high == 0.35


def test_loss_option_flags_parse(base: list[str]) -> None:
    cfg = parse(
        [
            *base,
            "--kl_estimator", "k3",
            "--kl_in_loss",
            "--loss_agg_mode", "token-mean",
            "--cliprange_high", "0.28",
            "--mask_truncated_completions", "true",
            "--stop_token", "eos",
            "--vllm_importance_sampling_cap", "3",
        ]
    )  # fmt: skip
    assert cfg.kl_estimator == "k3" and cfg.kl_in_loss is True
    assert cfg.loss_agg_mode == "token-mean" and cfg.cliprange_high == 0.28
    assert cfg.mask_truncated_completions is True and cfg.vllm_importance_sampling_cap == 3.0


def test_alias_and_classic_name_with_different_values_are_refused(base: list[str]) -> None:
    # the user report: '--rloo_k 4 --num_generations 2' trained with k=2, silently
    with pytest.raises(UserError) as info:
        parse([*base, "--rloo_k", "4", "--num_generations", "2"])
    assert str(info.value) == (
        "--rloo_k 4 and --num_generations 2 both set rloo_k, to different values: give it once."
    )
    with pytest.raises(UserError, match=r"^--num-generations 4 and --rloo_k 2 both set rloo_k"):
        parse([*base, "--num-generations", "4", "--rloo_k", "2"])
    with pytest.raises(UserError, match=r"^--beta 0.1 and --kl_coef 0.2 both set kl_coef"):
        parse([*base, "--beta", "0.1", "--kl_coef", "0.2"])
    # a boolean's --no_<name> is another name of the same field
    with pytest.raises(
        UserError, match=r"^--ds3_gather_for_generation true and --no_ds3_gather_for_generation "
    ):
        parse([*base, "--ds3_gather_for_generation", "true", "--no_ds3_gather_for_generation"])


def test_alias_and_classic_name_with_the_same_value_are_accepted(base: list[str]) -> None:
    assert parse([*base, "--rloo_k", "4", "--num_generations", "4"]).rloo_k == 4
    assert parse([*base, "--beta", "0.1", "--kl_coef", "1e-1"]).kl_coef == 0.1
    # one name given twice: the last one wins, as with any argparse flag
    assert parse([*base, "--rloo_k", "4", "--rloo_k", "2"]).rloo_k == 2
    assert parse([*base, "--rloo-k", "4", "--rloo_k", "2"]).rloo_k == 2  # the dashed spelling of one name


def test_alias_in_the_file_and_classic_name_on_the_command_line(tmp_path: Path, base: list[str]) -> None:
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text("num_generations: 2\n")
    # the same name on the command line overrides the file, as for any key
    assert parse([*base, "--config", str(cfg_file), "--num_generations", "4"]).rloo_k == 4
    # another name of the same field with another value: which one was meant is not ours to guess
    with pytest.raises(UserError) as info:
        parse([*base, "--config", str(cfg_file), "--rloo_k", "4"])
    assert str(info.value) == (
        f"--rloo_k 4 on the command line and 'num_generations: 2' in --config {cfg_file} both set rloo_k, to "
        "different values: use one name for it (the command line overrides the file under the same name)."
    )
    # the same value under the other name is no conflict
    assert parse([*base, "--config", str(cfg_file), "--rloo_k", "2"]).rloo_k == 2
    cfg_file.write_text("rloo_k: 4\nnum_generations: 4\n")
    assert parse([*base, "--config", str(cfg_file)]).rloo_k == 4


def test_cli_conflicting_spellings_is_one_line_exit_2(
    base: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", *base, "--rloo_k", "4", "--num_generations", "2"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "rloo train: error: --rloo_k 4 and --num_generations 2 both set rloo_k, to different values: give it "
        "once.\n"
    )


def test_seed_and_numbers(base: list[str]) -> None:
    cfg = parse([*base, "--seed", "7", "--learning_rate", "1e-5", "--num_train_epochs", "2", "--top_k", "5"])
    assert cfg.seed == 7 and isinstance(cfg.seed, int)
    assert cfg.learning_rate == 1e-5
    assert cfg.num_train_epochs == 2.0 and isinstance(cfg.num_train_epochs, float)
    assert cfg.top_k == 5


def test_lists(base: list[str]) -> None:
    argv = [
        "--model_name_or_path", base[1],
        "--dataset_name", base[5],
        "--reward_funcs", "rloo.demo.toy:letter_reward", "rloo.demo.toy:target_letter_reward",
        "--reward_weights", "1", "0.5",
        "--seed", "3",
    ]  # fmt: skip
    cfg = parse(argv)
    assert cfg.reward_funcs == ["rloo.demo.toy:letter_reward", "rloo.demo.toy:target_letter_reward"]
    assert cfg.reward_weights == [1.0, 0.5]
    assert cfg.seed == 3
    # with a reward model, it counts first: three weights for the model and two functions
    cfg = parse([*argv, "--reward_model_path", base[3], "--reward_weights", "2", "1", "0.5"])
    assert cfg.reward_weights == [2.0, 1.0, 0.5]
    with pytest.raises(UserError, match="--reward_weights"):
        parse([*argv, "--reward_weights", "1"])


def test_optional_none(base: list[str]) -> None:
    assert parse([*base, "--missing_eos_penalty", "1.0"]).missing_eos_penalty == 1.0
    assert parse([*base, "--missing_eos_penalty", "-2"]).missing_eos_penalty == -2.0
    assert parse([*base, "--missing_eos_penalty", "none"]).missing_eos_penalty is None
    assert parse([*base, "--total_episodes", "None"]).total_episodes is None
    assert parse([*base, "--stop_token_id", "0"]).stop_token_id == 0


@pytest.mark.parametrize(
    ("flags", "name"),
    [
        (["--rloo_k", "two"], "--rloo_k"),
        (["--rloo_k", "2.5"], "--rloo_k"),
        (["--learning_rate", "fast"], "--learning_rate"),
        (["--reward_weights", "1", "x"], "--reward_weights"),
        (["--seed", "none"], "--seed"),  # not optional: 'none' is not an integer
    ],
)
def test_wrong_type_names_the_flag(base: list[str], flags: list[str], name: str) -> None:
    with pytest.raises(UserError) as info:
        parse([*base, *flags])
    assert str(info.value).startswith(f"{name} expects")


def test_unknown_flag_and_no_abbreviations(base: list[str]) -> None:
    with pytest.raises(UserError, match=r"unknown flag\(s\) --no_such_flag"):
        parse([*base, "--no_such_flag", "1"])
    with pytest.raises(UserError, match="--lr"):
        parse([*base, "--lr", "1e-5"])  # no prefix matching onto --lr_scheduler_type
    with pytest.raises(UserError, match="stray"):
        parse([*base, "stray"])


def test_yaml_config_with_aliases_and_cli_override(tmp_path: Path, base: list[str]) -> None:
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text(
        f"model_name_or_path: {base[1]}\n"
        f"dataset_name: {base[5]}\n"
        "reward_funcs: [rloo.demo.toy:letter_reward]\n"
        "num_generations: 4\n"  # alias of rloo_k
        "beta: 0.02\n"  # alias of kl_coef
        "learning_rate: 1.0e-5\n"
        "num_train_epochs: 2\n"  # an int where a float is expected
        "disable_tqdm: true\n"
        "missing_eos_penalty: null\n"
        "seed: 11\n"
        "per_device_train_batch_size: 8\n"
    )
    cfg = parse(["--config", str(cfg_file)])
    assert cfg.rloo_k == 4
    assert cfg.kl_coef == 0.02
    assert cfg.learning_rate == 1e-5
    assert cfg.num_train_epochs == 2.0 and isinstance(cfg.num_train_epochs, float)
    assert cfg.disable_tqdm is True
    assert cfg.missing_eos_penalty is None
    assert cfg.seed == 11
    assert cfg.reward_funcs == ["rloo.demo.toy:letter_reward"]
    # the command line wins over the file under the file's name, wherever --config sits
    for argv in (
        ["--config", str(cfg_file), "--beta", "0.5", "--seed", "1"],
        ["--beta", "0.5", "--seed", "1", "--config", str(cfg_file)],
    ):
        over = parse(argv)
        assert (over.kl_coef, over.seed, over.rloo_k) == (0.5, 1, 4)
    # under another name of the same field it is a conflict, said in one line (see the test below)
    with pytest.raises(UserError, match=r"^--kl_coef 0.5 on the command line and 'beta: 0.02' in --config "):
        parse(["--kl_coef", "0.5", "--seed", "1", "--config", str(cfg_file)])


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("no_such_key: 1\n", "unknown key 'no_such_key'"),
        (
            "rloo_k: 2\nnum_generations: 4\n",
            "'rloo_k: 2' and 'num_generations: 4' both set rloo_k, to different",
        ),
        ("rloo_k: two\n", "--rloo_k expects an integer"),
        ("rloo_k: 2.5\n", "'rloo_k' expects an integer"),
        ("seed: null\n", "'seed' cannot be null"),
        ("- a\n- b\n", "expected a mapping"),
        ("rloo_k: [1\n", "not valid YAML"),
    ],
)
def test_yaml_errors(tmp_path: Path, base: list[str], text: str, match: str) -> None:
    cfg_file = tmp_path / "bad.yaml"
    cfg_file.write_text(text)
    with pytest.raises(UserError, match=match):
        parse([*base, "--config", str(cfg_file)])


def test_yaml_missing_file(tmp_path: Path, base: list[str]) -> None:
    with pytest.raises(UserError, match="no such file"):
        parse([*base, "--config", str(tmp_path / "absent.yaml")])


def test_train_help_lists_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--help"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert out.startswith("usage: rloo train")
    for name in [*RLOOConfig.field_names(), *ALIASES, "config"]:
        assert f"--{name} " in out or f"--{name}\n" in out or f"--{name}," in out, name
    # each field's help text is printed (argparse re-wraps it, also at hyphens: compare without spaces)
    squeezed = "".join(out.split())
    for f in RLOOConfig.__dataclass_fields__.values():
        assert "".join(f.metadata["help"].split()) in squeezed, f.name


def test_top_level_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert "train" in capsys.readouterr().out
    assert main([]) == 2
    assert main(["nonsense"]) == 2
    assert "unknown command 'nonsense'" in capsys.readouterr().err


def test_main_reports_user_errors_in_one_line(capsys: pytest.CaptureFixture[str], base: list[str]) -> None:
    assert main(["train", *base, "--rloo_k", "1"]) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and err.startswith("rloo train: error: --rloo_k must be >= 2")
    assert "Traceback" not in out + err


@pytest.mark.parametrize("value", ["-1e-3", "-1E-3", "-.5", "-0.001", "-2", "-inf"])
def test_negative_numbers_are_values_not_flags(base: list[str], value: str) -> None:
    # argparse's own pattern misses exponent notation: '-1e-3' was "expected one argument"
    with pytest.raises(UserError, match=r"^--learning_rate must be"):
        parse([*base, "--learning_rate", value])
    cfg = parse([*base, "--reward_funcs", "rloo.demo.toy:letter_reward", "--reward_weights", "1", value])
    assert cfg.reward_weights == [1.0, float(value)]


def test_parser_errors_carry_one_prefix(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--learning_rate"]) == 2
    err = capsys.readouterr().err
    assert err == "rloo train: error: --learning_rate: expected one argument.\n"


def test_unknown_flag_suggests_the_closest(base: list[str]) -> None:
    with pytest.raises(UserError) as info:
        parse([*base, "--learning_rat", "1e-5", "--zzz", "1"])
    message = str(info.value)
    assert message.startswith("unknown flag(s) --learning_rat (did you mean --learning_rate?), --zzz: see")
    assert "--zzz (did you mean" not in message  # nothing close: no guess


def test_yaml_unknown_keys_are_all_named(tmp_path: Path, base: list[str]) -> None:
    cfg_file = tmp_path / "typos.yaml"
    cfg_file.write_text("lerning_rate: 1.0e-5\nrloo_k: 4\nrlo_k: 2\nnot_a_key_at_all: 1\n")
    with pytest.raises(UserError) as info:
        parse([*base, "--config", str(cfg_file)])
    message = str(info.value)
    assert (
        "unknown keys 'lerning_rate' (did you mean learning_rate?), 'rlo_k' (did you mean rloo_k?)" in message
    )
    assert "'not_a_key_at_all';" in message


def _help_entries(text: str) -> dict[str, str]:
    """Option -> its help text, from argparse's --help output."""
    entries: dict[str, str] = {}
    current = None
    for line in text.split("options:", 1)[1].splitlines():
        if line.startswith("  -"):
            current = line.split()[0].rstrip(",")
            entries[current] = line
        elif current:
            entries[current] += line
    return {k: " ".join(v.split()) for k, v in entries.items()}


def test_train_help_states_each_default_once(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--help"]) == 0
    entries = _help_entries(capsys.readouterr().out)
    for text in entries.values():
        assert text.count("default:") <= 1, text
        assert "(default: None)" not in text and "(default: [])" not in text, text
    assert "(default: model_name_or_path)." in entries["--sft_model_path"]
    assert entries["--seed"].endswith("(must be in [0, 2^32); default: 42)")  # the rule the field declares
    # a help that speaks of "the default" without its value still gets it; one that says it does not
    assert entries["--loss_agg_mode"].endswith("default: seq-mean-token-sum)")
    assert "default:" not in entries["--max_steps"] and "-1 (the default)" in entries["--max_steps"]


def test_train_help_keeps_hyphenated_values_whole(capsys: pytest.CaptureFixture[str]) -> None:
    """argparse's formatter wraps with textwrap, which breaks at hyphens (cpython Lib/argparse.py,
    HelpFormatter._split_lines): a choice such as seq-mean-token-sum must stay whole, ready to copy."""
    assert main(["train", "--help"]) == 0
    lines = [line.strip() for line in capsys.readouterr().out.splitlines()]
    assert not [line for line in lines if line.endswith("-") and not line.endswith(" -")], lines
    assert any("seq-mean-token-sum-norm" in line for line in lines)


def test_demo_help_is_plain_text_and_documents_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--help"]) == 0
    out = capsys.readouterr().out
    assert "``" not in out
    entries = _help_entries(out)
    assert set(entries) == {"-h", "--output_dir", "--updates", "--arch", "--seed"}
    for flag, text in entries.items():
        assert len(text.split()) > 3, f"{flag} has no help text"
    assert main(["demo", "--updates", "x"]) == 2
    assert capsys.readouterr().err == "rloo demo: error: --updates: invalid int value: 'x'.\n"


def test_top_level_usage_aligns_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    from rloo.cli import COMMANDS

    assert main(["--help"]) == 0
    lines = capsys.readouterr().out.split("commands:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert [line.split()[0] for line in lines] == list(COMMANDS)
    starts = {len(line) - len(line[2:].split(maxsplit=1)[1]) for line in lines}
    assert len(starts) == 1, lines  # every description starts in the same column


def test_a_bare_value_is_not_called_a_flag(capsys: pytest.CaptureFixture[str]) -> None:
    # `rloo push /some/model` (the path without its flag): say so, rather than "unknown flag(s) /some/model"
    assert main(["push", "/nonexistent/model"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        "rloo push: error: unexpected argument '/nonexistent/model': every value follows its flag"
    )
    assert len(err.splitlines()) == 1


def test_hf_argument_parser_spellings(base: list[str]) -> None:
    """What HfArgumentParser adds, as TRL's CLI users know it: dashed flag names, --no_<name> for a boolean
    that defaults to true; an alias keeps working under its dashed spelling too."""
    cfg = parse(
        [*base, "--learning-rate", "1e-5", "--num-generations", "4", "--no_ds3_gather_for_generation"]
    )
    assert (cfg.learning_rate, cfg.rloo_k, cfg.ds3_gather_for_generation) == (1e-5, 4, False)
    assert RLOOConfig.__dataclass_fields__["ds3_gather_for_generation"].default is True
