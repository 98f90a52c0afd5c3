"""patches/apply.py on synthetic pretrain scripts of both generations: apply, idempotence,
--check, --dry-run, exact revert, and refusal (file untouched) when anchors are missing."""

import ast
import io
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

IMPORT_016 = ("from megatron_flat.megatron.entry import flat_extra_args, flat_model_provider"
              "  # megatron-flat")
IMPORT_019 = ("from megatron_flat.megatron.entry import flat_extra_args, flat_install"
              "  # megatron-flat")
WRAPPED_EXTRA = ("extra_args_provider=flat_extra_args(add_modelopt_args if has_nvidia_modelopt"
                 " else None),  # megatron-flat")


def cli(apply, *argv):
    out = io.StringIO()
    rc = apply.run([str(a) for a in argv], out=out)
    return rc, out.getvalue()


def changed_lines(before, after):
    """Lines of ``after`` not in ``before`` (the patch adds or rewrites whole lines)."""
    old = set(before.splitlines())
    return [line for line in after.splitlines() if line not in old]


# ---------------------------------------------------------------------------- apply
def test_016_apply_wraps_both_arguments_and_adds_import(apply, megatron_dir, script_016):
    path = megatron_dir(script_016)
    rc, out = cli(apply, path.parent)
    assert rc == 0, out
    text = path.read_text()
    ast.parse(text)
    assert "0.16-era" in out and "patched" in out
    assert changed_lines(script_016, text) == [
        IMPORT_016,
        "        flat_model_provider(partial(model_provider, gpt_builder)),  # megatron-flat",
        "        " + WRAPPED_EXTRA,
    ]
    # The import goes after the last top-level import, before the try/except block.
    lines = text.splitlines()
    before = lines[lines.index(IMPORT_016) - 1]
    assert before == "from megatron.training import EVENTS, get_args, set_args"
    assert "flat_install" not in text


def test_019_apply_wraps_parse_and_inserts_install(apply, megatron_dir, script_019):
    path = megatron_dir(script_019)
    rc, out = cli(apply, path.parent)
    assert rc == 0, out
    text = path.read_text()
    ast.parse(text)
    assert "0.19-era" in out
    assert changed_lines(script_019, text) == [
        IMPORT_019,
        "        " + WRAPPED_EXTRA,
        "    flat_install(args)  # megatron-flat",
    ]
    lines = text.splitlines()
    at = lines.index("    flat_install(args)  # megatron-flat")
    assert lines[at - 1] == "    )" and lines[at - 4] == "    args = parse_and_validate_args("
    assert "flat_model_provider" not in text  # pretrain(full_config, ...) is left alone


@pytest.mark.parametrize("era", ["016", "019"])
def test_second_apply_is_a_reported_noop(apply, megatron_dir, era, request):
    path = megatron_dir(request.getfixturevalue(f"script_{era}"))
    assert cli(apply, path.parent)[0] == 0
    once = path.read_bytes()
    rc, out = cli(apply, path.parent)
    assert rc == 0 and "already patched" in out
    assert path.read_bytes() == once


@pytest.mark.parametrize("era", ["016", "019"])
def test_check_reports_state(apply, megatron_dir, era, request):
    path = megatron_dir(request.getfixturevalue(f"script_{era}"))
    rc, out = cli(apply, path.parent, "--check")
    assert rc == 1 and "not patched (would apply cleanly)" in out
    cli(apply, path.parent)
    rc, out = cli(apply, path.parent, "--check")
    assert rc == 0 and out.rstrip().endswith("patched")


@pytest.mark.parametrize("era", ["016", "019"])
def test_revert_is_byte_identical(apply, megatron_dir, era, request):
    path = megatron_dir(request.getfixturevalue(f"script_{era}"))
    original = path.read_bytes()
    cli(apply, path.parent)
    assert path.read_bytes() != original
    rc, out = cli(apply, path.parent, "--revert")
    assert rc == 0 and "reverted" in out
    assert path.read_bytes() == original
    rc, out = cli(apply, path.parent, "--revert")
    assert rc == 0 and "nothing to revert" in out
    assert path.read_bytes() == original


@pytest.mark.parametrize("era", ["016", "019"])
def test_dry_run_prints_diff_and_writes_nothing(apply, megatron_dir, era, request):
    path = megatron_dir(request.getfixturevalue(f"script_{era}"))
    original = path.read_bytes()
    rc, out = cli(apply, path.parent, "--dry-run")
    assert rc == 0 and "+" + IMPORT_016[:40] in out and "nothing written" in out
    assert path.read_bytes() == original
    cli(apply, path.parent)
    patched = path.read_bytes()
    rc, out = cli(apply, path.parent, "--revert", "--dry-run")
    assert rc == 0 and "-    " in out and path.read_bytes() == patched


def test_target_may_be_the_file_itself(apply, megatron_dir, script_019):
    path = megatron_dir(script_019)
    assert cli(apply, path)[0] == 0
    assert "flat_install(args)" in path.read_text()


def test_file_mode_is_kept(apply, megatron_dir, script_016):
    path = megatron_dir(script_016)
    path.chmod(0o750)
    cli(apply, path.parent)
    assert path.stat().st_mode & 0o777 == 0o750


# ---------------------------------------------------------------------------- generations
def test_generation_detection(apply, script_016, script_019):
    assert apply.find_anchors(apply.Source(script_016.encode())).generation.name == "0.16"
    assert apply.find_anchors(apply.Source(script_019.encode())).generation.name == "0.19"


def test_generation_reported_for_patched_file(apply, megatron_dir, script_019):
    path = megatron_dir(script_019)
    cli(apply, path.parent)
    rc, out = cli(apply, path.parent, "--check")
    assert "0.19-era" in out


def test_core_version_read_from_package_info(apply, megatron_dir, script_016):
    path = megatron_dir(script_016)
    info = path.parent / "megatron" / "core" / "package_info.py"
    info.parent.mkdir(parents=True)
    info.write_text("MAJOR = 0\nMINOR = 16\nPATCH = 1\nPRE_RELEASE = ''\n")
    rc, out = cli(apply, path.parent, "--check")
    assert "megatron-core 0.16.1" in out and "0.16-era" in out


# ---------------------------------------------------------------------------- keyword missing
def test_016_missing_keyword_is_added(apply, megatron_dir, script_016):
    source = script_016.replace(
        "        extra_args_provider=add_modelopt_args if has_nvidia_modelopt else None,\n", "")
    path = megatron_dir(source)
    rc, out = cli(apply, path.parent)
    assert rc == 0, out
    text = path.read_text()
    ast.parse(text)
    assert "        store=store, extra_args_provider=flat_extra_args(),  # megatron-flat" in text
    cli(apply, path.parent, "--revert")
    assert path.read_text() == source


def test_019_missing_keyword_is_added(apply, megatron_dir, script_019):
    source = script_019.replace(
        "        extra_args_provider=add_modelopt_args if has_nvidia_modelopt else None,\n", "")
    path = megatron_dir(source)
    assert cli(apply, path.parent)[0] == 0
    text = path.read_text()
    assert ("        args_defaults={\"tokenizer_type\": \"GPT2BPETokenizer\"}, "
            "extra_args_provider=flat_extra_args(),  # megatron-flat") in text
    assert "    flat_install(args)  # megatron-flat" in text
    assert cli(apply, path.parent)[1].count("already patched") == 1
    cli(apply, path.parent, "--revert")
    assert path.read_text() == source


def test_call_without_arguments_gets_the_keyword(apply, megatron_dir, script_019):
    source = script_019.replace(
        "    args = parse_and_validate_args(\n"
        "        extra_args_provider=add_modelopt_args if has_nvidia_modelopt else None,\n"
        "        args_defaults={\"tokenizer_type\": \"GPT2BPETokenizer\"},\n"
        "    )\n",
        "    args = parse_and_validate_args()  # defaults\n")
    path = megatron_dir(source)
    assert cli(apply, path.parent)[0] == 0
    text = path.read_text()
    assert ("    args = parse_and_validate_args(extra_args_provider=flat_extra_args())"
            "  # defaults  # megatron-flat") in text
    cli(apply, path.parent, "--revert")
    assert path.read_text() == source


def test_positional_extra_args_provider_is_wrapped(apply, megatron_dir):
    source = ('import os\n\nif __name__ == "__main__":\n'
              '    args = parse_and_validate_args(provider, False)\n'
              '    pretrain(cfg, ds, "t", fs)\n')
    path = megatron_dir(source)
    assert cli(apply, path.parent)[0] == 0
    assert ("    args = parse_and_validate_args(flat_extra_args(provider), False)"
            "  # megatron-flat") in path.read_text()
    cli(apply, path.parent, "--revert")
    assert path.read_text() == source

    source = ('import os\n\nif __name__ == "__main__":\n'
              '    pretrain(ds, mp, "t", fs, None, provider, {})\n')
    path = megatron_dir(source)
    assert cli(apply, path.parent)[0] == 0
    assert ("    pretrain(ds, flat_model_provider(mp), \"t\", fs, None, "
            "flat_extra_args(provider), {})  # megatron-flat") in path.read_text()
    cli(apply, path.parent, "--revert")
    assert path.read_text() == source


# ---------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("era", ["016", "019"])
def test_crlf_file_round_trips(apply, megatron_dir, era, request):
    path = megatron_dir(request.getfixturevalue(f"script_{era}"), newline="\r\n")
    original = path.read_bytes()
    assert cli(apply, path.parent)[0] == 0
    patched = path.read_bytes()
    assert b"  # megatron-flat\r\n" in patched and b"\n" not in patched.replace(b"\r\n", b"")
    cli(apply, path.parent, "--revert")
    assert path.read_bytes() == original


def test_single_line_call_with_unicode_and_comment(apply, megatron_dir):
    # Non-ASCII text before the edited spans: ast columns are UTF-8 byte offsets.
    source = ('import os\n\nif __name__ == "__main__":\n'
              '    pretrain(ds, partial(mp, "größe"), "t", fs, extra_args_provider=None)'
              '  # ünïcode\n')
    path = megatron_dir(source)
    assert cli(apply, path.parent)[0] == 0
    text = path.read_text(encoding="utf-8")
    assert ('    pretrain(ds, flat_model_provider(partial(mp, "größe")), "t", fs, '
            'extra_args_provider=flat_extra_args(None))  # ünïcode  # megatron-flat') in text
    cli(apply, path.parent, "--revert")
    assert path.read_text(encoding="utf-8") == source


def test_model_provider_by_keyword_and_multiline_value(apply, megatron_dir):
    source = ('import os\n\nif __name__ == "__main__":\n'
              '    pretrain(\n        ds,\n        model_provider=partial(\n            mp, b),\n'
              '        extra_args_provider=(\n            a if c else None\n        ),\n    )\n')
    path = megatron_dir(source)
    assert cli(apply, path.parent)[0] == 0
    text = path.read_text()
    ast.parse(text)
    assert "model_provider=flat_model_provider(partial(  # megatron-flat" in text
    assert "            mp, b)),  # megatron-flat" in text
    assert "            flat_extra_args(a if c else None)  # megatron-flat" in text
    cli(apply, path.parent, "--revert")
    assert path.read_text() == source


def test_user_lines_that_look_like_ours_but_are_unmarked_survive_revert(apply, megatron_dir,
                                                                          script_016):
    source = script_016.replace("import argparse\n",
                                "import argparse\nx = flat_extra_args(None)\n", 1)
    path = megatron_dir(source)
    cli(apply, path.parent)
    cli(apply, path.parent, "--revert")
    assert path.read_text() == source


# ---------------------------------------------------------------------------- refusals
def assert_refused(apply, path, *needles):
    before = path.read_bytes()
    rc, out = cli(apply, path.parent)
    assert rc == 2, out
    assert "left unchanged" in out
    for needle in needles:
        assert needle in out, out
    assert path.read_bytes() == before
    return out


def test_refuses_without_main_block(apply, megatron_dir, script_016):
    path = megatron_dir(script_016.replace('if __name__ == "__main__":', "def main():"))
    assert_refused(apply, path, 'no top-level `if __name__ == "__main__":` block')
    rc, out = cli(apply, path.parent, "--check")
    assert rc == 2 and "cannot apply" in out


def test_refuses_two_main_blocks(apply, megatron_dir, script_019):
    path = megatron_dir(script_019 + '\n\nif __name__ == "__main__":\n    pass\n')
    assert_refused(apply, path, "2 `if __name__")


@pytest.mark.parametrize("era", ["016", "019"])
def test_refuses_without_pretrain_call(apply, megatron_dir, era, request):
    source = request.getfixturevalue(f"script_{era}").replace("    pretrain(\n", "    launch(\n")
    path = megatron_dir(source)
    assert_refused(apply, path, "no pretrain(...) call in the __main__ block")


@pytest.mark.parametrize("era", ["016", "019"])
def test_refuses_two_pretrain_calls(apply, megatron_dir, era, request):
    source = request.getfixturevalue(f"script_{era}") + "    pretrain(None, None, None, None)\n"
    path = megatron_dir(source)
    assert_refused(apply, path, "2 pretrain(...) calls", "expected exactly one")


def test_refuses_two_parse_calls(apply, megatron_dir, script_019):
    source = script_019 + "    again = parse_and_validate_args()\n"
    assert_refused(apply, megatron_dir(source), "2 parse_and_validate_args(...) calls")


def test_refuses_unassigned_parse_call(apply, megatron_dir, script_019):
    source = script_019.replace("    args = parse_and_validate_args(",
                                "    parse_and_validate_args(")
    assert_refused(apply, megatron_dir(source), "is not assigned as `args = ")


def test_refuses_imported_but_uncalled_parse(apply, megatron_dir, script_016):
    source = script_016.replace("import argparse\n",
                                "import argparse\nfrom x import parse_and_validate_args\n", 1)
    assert_refused(apply, megatron_dir(source), "imported but not called")


def test_refuses_kwargs_without_keyword(apply, megatron_dir, script_016):
    source = script_016.replace(
        "        extra_args_provider=add_modelopt_args if has_nvidia_modelopt else None,\n",
        "        **more,\n")
    assert_refused(apply, megatron_dir(source), "passes **kwargs")


def test_refuses_star_args_before_the_provider_position(apply, megatron_dir):
    source = ('import os\n\nif __name__ == "__main__":\n'
              '    pretrain(ds, mp, *rest)\n')
    assert_refused(apply, megatron_dir(source), "passes *args")


def test_refuses_016_without_model_provider(apply, megatron_dir):
    source = ('import os\n\nif __name__ == "__main__":\n'
              '    pretrain(ds, extra_args_provider=None)\n')
    assert_refused(apply, megatron_dir(source), "has no model provider")


def test_refuses_syntax_error(apply, megatron_dir, script_016):
    assert_refused(apply, megatron_dir(script_016 + "    )\n"), "does not parse as Python")


def test_refuses_partial_patch_but_reverts_it(apply, megatron_dir, script_016):
    path = megatron_dir(script_016)
    cli(apply, path.parent)
    partial_patch = path.read_text().replace(IMPORT_016 + "\n", "")
    path.write_text(partial_patch)
    assert_refused(apply, path, "partly or differently patched", "--revert")
    rc, out = cli(apply, path.parent, "--check")
    assert rc == 2 and "partly patched" in out
    assert cli(apply, path.parent, "--revert")[0] == 0
    assert path.read_text() == script_016


def test_missing_checkout(apply, tmp_path):
    rc, out = cli(apply, tmp_path / "nowhere")
    assert rc == 2 and "not found" in out


# ---------------------------------------------------------------------------- real CLI
def test_command_line_exit_codes(megatron_dir, script_019):
    path = megatron_dir(script_019)
    script = REPO / "patches" / "apply.py"

    def run(*flags):
        return subprocess.run([sys.executable, str(script), str(path.parent), *flags],
                              capture_output=True, text=True).returncode

    assert run("--check") == 1
    assert run() == 0
    assert run("--check") == 0
    assert run() == 0
    assert run("--revert") == 0
    assert path.read_text() == script_019
    assert run("--check", "--revert") == 2  # argparse: mutually exclusive
