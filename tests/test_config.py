"""FlatConfig: defaults off, validation names the knob and flag, flags round-trip."""

import argparse

import pytest

from megatron_flat.config import FlatConfig, add_flat_args


def test_defaults_change_nothing():
    cfg = FlatConfig()
    assert not cfg.any_enabled
    assert cfg.dispatch == "off"
    assert (cfg.vocab, cfg.sco, cfg.optimizer_offload, cfg.attn_replay) == (False,) * 4


def test_attention_replay_is_one_flag():
    args = add_flat_args(argparse.ArgumentParser()).parse_args(["--flat-attn-replay"])
    cfg = FlatConfig.from_args(args)
    assert cfg.attn_replay and cfg.any_enabled
    assert "attention replay" in cfg.describe()
    with pytest.raises(ValueError, match="--flat-attn-replay"):
        FlatConfig(attn_replay=1)


@pytest.mark.parametrize(
    "knob,value,flag",
    [
        ("dispatch_chunk_tokens", 0, "--flat-dispatch-chunk-tokens"),
        ("dispatch_max_chunks", -1, "--flat-dispatch-max-chunks"),
        ("dispatch_membership", "random", "--flat-dispatch-membership"),
        ("dispatch_saved_chunks", -1, "--flat-dispatch-saved-chunks"),
        ("llep_alpha", 0.0, "--flat-llep-alpha"),
        ("llep_imbalance_threshold", -0.5, "--flat-llep-imbalance-threshold"),
        ("vocab_mode", "both", "--flat-vocab-mode"),
        ("vocab_block_size", 0, "--flat-vocab-block-size"),
        ("sco_host_budget_gib", -1.0, "--flat-sco-host-budget-gib"),
        ("sco_prefetch", -1, "--flat-sco-prefetch"),
        ("optimizer_bucket_numel", 0, "--flat-optimizer-bucket-numel"),
        ("optimizer_num_slots", 0, "--flat-optimizer-num-slots"),
        ("dispatch", "yes", "--flat-dispatch"),
        ("vocab", 1, "--flat-vocab"),
        ("dispatch_max_chunks", 2.5, "--flat-dispatch-max-chunks"),
    ],
)
def test_invalid_knob_is_named(knob, value, flag):
    with pytest.raises(ValueError) as err:
        FlatConfig(**{knob: value})
    assert f"FlatConfig.{knob}" in str(err.value) and flag in str(err.value)


def test_flags_round_trip_and_compose():
    parser = argparse.ArgumentParser()
    parser.add_argument("--other", type=int, default=3)  # another extra-args provider's flag
    assert add_flat_args(parser) is parser
    add_flat_args(parser)  # a second call is a no-op, not a duplicate-flag error
    args = parser.parse_args([
        "--flat-dispatch", "pipelined", "--flat-dispatch-max-chunks", "4", "--flat-vocab-mode", "weights",
        "--flat-sco", "--flat-sco-host-budget-gib", "1.5", "--no-flat-optimizer-offload",
    ])
    cfg = FlatConfig.from_args(args)
    assert cfg.dispatch == "pipelined" and cfg.sco and not cfg.optimizer_offload
    assert cfg.dispatch_max_chunks == 4 and cfg.vocab_mode == "weights"
    assert cfg.sco_host_budget_bytes == int(1.5 * (1 << 30))
    assert args.other == 3


def test_every_knob_has_a_flag_with_help():
    parser = add_flat_args(argparse.ArgumentParser())
    dests = {a.dest: a for a in parser._actions}
    for name in FlatConfig().to_dict():
        action = dests["flat_" + name]
        assert action.help and "default" in action.help


def test_bad_flag_value_is_rejected_by_the_parser():
    parser = add_flat_args(argparse.ArgumentParser())
    with pytest.raises(SystemExit):
        parser.parse_args(["--flat-vocab-mode", "sideways"])


def test_from_args_validates():
    with pytest.raises(ValueError, match="--flat-optimizer-num-slots"):
        FlatConfig.from_args(argparse.Namespace(flat_optimizer_num_slots=0))


def test_paper_preset_turns_on_all_four_and_flags_override():
    parser = add_flat_args(argparse.ArgumentParser())
    cfg = FlatConfig.from_args(parser.parse_args(["--flat-preset", "paper"]))
    assert cfg.dispatch == "pipelined" and cfg.vocab and cfg.sco and cfg.optimizer_offload
    assert cfg.dispatch_max_chunks == 10 and cfg.optimizer_num_slots == 2
    cfg = FlatConfig.from_args(parser.parse_args(["--flat-preset", "paper", "--flat-optimizer-num-slots", "3",
                                                  "--flat-dispatch", "llep"]))
    assert cfg.optimizer_num_slots == 3 and cfg.dispatch == "llep" and cfg.vocab
    with pytest.raises(ValueError, match="unknown FlatConfig preset"):
        FlatConfig.preset("fast")
    with pytest.raises(SystemExit):
        parser.parse_args(["--flat-preset", "fast"])


def test_preset_flag_repeating_a_default_still_overrides():
    parser = add_flat_args(argparse.ArgumentParser())
    cfg = FlatConfig.from_args(parser.parse_args(
        ["--flat-preset", "paper", "--no-flat-vocab", "--flat-dispatch", "off",
         "--flat-sco-prefetch", "1"]))
    assert not cfg.vocab and cfg.dispatch == "off"
    assert cfg.sco and cfg.optimizer_offload  # untouched preset knobs stay on
    # a namespace built by hand (no record of given flags): differing values override
    manual = argparse.Namespace(flat_preset="paper", flat_optimizer_num_slots=3)
    assert FlatConfig.from_args(manual).optimizer_num_slots == 3
