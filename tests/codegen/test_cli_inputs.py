"""Every command that reads a file gives one message and exit 2 for a malformed one (issue 10 §1):
`--models DIR` declarations and `--config FILE` selections read through registry/inputs.py; options
are never abbreviated; the CLI runs under an ASCII locale.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.codegen.helpers import MYMOE, ROOT, cli, write_models
from tests.codegen.test_import_checkpoint import checkpoint

MALFORMED = [
    (b"a = \"\xc3\x28\"", "not UTF-8 text (byte 0xc3 at offset 5); save it as UTF-8"),
    (b"a = " + b"[" * 100000 + b"]" * 100000, "nested more than 32 levels deep, deeper than any file moegen reads"),
    (b"a = " + b"{b = " * 40 + b"1" + b"}" * 40, "nested more than 32 levels deep, deeper than any file moegen reads"),
]


def one_message(capsys, *args) -> str:
    code, out, err = cli(capsys, *args)
    assert (code, out) == (2, ""), (code, out, err)
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.removeprefix("error: ").removesuffix("\n")


@pytest.mark.parametrize("content, message", MALFORMED)
def test_a_malformed_declaration_in_models_is_one_message(capsys, tmp_path, content, message):
    folder = write_models(tmp_path / "models", mymoe=MYMOE)
    (folder / "bad.toml").write_bytes(content)
    assert one_message(capsys, "list", "--models", folder) == f"{folder / 'bad.toml'}: {message}"


def test_a_declaration_that_is_a_directory_or_a_dangling_link_is_one_message(capsys, tmp_path):
    folder = write_models(tmp_path / "models", mymoe=MYMOE)
    (folder / "dir.toml").mkdir()
    assert one_message(capsys, "list", "--models", folder) == f"{folder / 'dir.toml'}: a directory, where a file belongs"
    (folder / "dir.toml").rmdir()
    (folder / "gone.toml").symlink_to(tmp_path / "gone.toml")
    assert one_message(capsys, "check", "--models", folder) == (
        f"{folder / 'gone.toml'}: a symbolic link to {tmp_path / 'gone.toml'}, which does not exist")
    assert one_message(capsys, "list", "--models", tmp_path / "absent") == f"--models {tmp_path / 'absent'}: not a folder of declaration files"


@pytest.mark.parametrize("suffix, content, message", [
    (".toml", *MALFORMED[0]), (".toml", *MALFORMED[1]),
    (".json", b'{"moe_config": "\xff"}', "not UTF-8 text (byte 0xff at offset 16); save it as UTF-8"),
    (".json", b"[" * 100000 + b"]" * 100000, "nested more than 32 levels deep, deeper than any file moegen reads"),
    (".json", b'[{"moe_config": {}}]', "holds an array, where a JSON object belongs"),
    (".json", b'{"moe_config": {"backend": Infinity}}', "not valid JSON: Infinity is not a JSON number"),
])
def test_a_malformed_config_file_is_one_message(capsys, tmp_path, suffix, content, message):
    path = tmp_path / f"deploy{suffix}"
    path.write_bytes(content)
    assert one_message(capsys, "explain", "--model", "tiny_mixtral", "--sm", "90", "--config", path) == f"--config {path}: {message}"


def test_a_config_file_that_is_a_directory_a_dangling_link_or_of_the_wrong_shape_is_one_message(capsys, tmp_path):
    args = ("explain", "--model", "tiny_mixtral", "--sm", "90", "--config")
    (tmp_path / "dir.json").mkdir()
    assert one_message(capsys, *args, tmp_path / "dir.json") == f"--config {tmp_path / 'dir.json'}: a directory, where a file belongs"
    (tmp_path / "gone.toml").symlink_to(tmp_path / "nowhere")
    assert one_message(capsys, *args, tmp_path / "gone.toml") == (
        f"--config {tmp_path / 'gone.toml'}: a symbolic link to {tmp_path / 'nowhere'}, which does not exist")
    (tmp_path / "shape.json").write_text(json.dumps({"moe_config": ["TORCH"]}))
    assert one_message(capsys, *args, tmp_path / "shape.json") == (
        f"{tmp_path / 'shape.json'}: moe_config: Input should be a valid dictionary or instance of MoeConfig")


@pytest.mark.parametrize("argv, unknown", [
    (["list", "--model", "x"], "--model x"),                    # once read as --models x
    (["generate", "--mod", "tiny_mixtral"], "--mod tiny_mixtral"),
    (["explain", "--model", "tiny_mixtral", "--sm", "90", "--back", "TORCH"], "--back TORCH"),
    (["import-checkpoint", "ckpt", "--nam", "x"], "--nam x"),
])
def test_options_are_never_abbreviated(capsys, argv, unknown):
    with pytest.raises(SystemExit) as exited:
        cli(capsys, *argv)
    assert exited.value.code == 2
    assert capsys.readouterr().err.endswith(f"error: unrecognized arguments: {unknown}\n")


def _ascii_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LC_", "PYTHONIOENCODING", "PYTHONUTF8"))}
    return env | {"LC_ALL": "C", "LANG": "C"} | extra


@pytest.mark.parametrize("utf8_mode", [None, "0"])
def test_the_cli_works_under_an_ascii_locale_with_non_ascii_paths_and_messages(tmp_path, utf8_mode):
    # Python turns on UTF-8 mode under the C locale by default; PYTHONUTF8=0 keeps ASCII stdio too.
    env = _ascii_env(**({"PYTHONUTF8": utf8_mode} if utf8_mode else {}))
    folder = checkpoint(tmp_path / "modèle-ü")

    def run(*args):
        return subprocess.run([sys.executable, "-m", "codegen", *map(str, args)], cwd=ROOT, env=env, capture_output=True)

    refused = run("import-checkpoint", folder)
    assert refused.returncode == 2 and b"Traceback" not in refused.stderr, refused.stderr
    assert refused.stderr.startswith(b"error: the folder name 'mod") and refused.stderr.count(b"\n") == 1
    printed = run("import-checkpoint", folder, "--name", "m")
    assert printed.returncode == 0, printed.stderr
    assert 'doc = "Imported from modèle-ü."\n'.encode() in printed.stdout   # TOML is UTF-8 whatever the locale
    out = tmp_path / "décls" / "m.toml"
    written = run("import-checkpoint", folder, "--out", out)
    assert (written.returncode, written.stderr) == (0, b""), written.stderr
    listed = run("list", "--models", out.parent)
    assert listed.returncode == 0 and b"m  (mixtral)  Imported from mod" in listed.stdout, listed.stderr


def test_the_models_folder_is_named_in_headers_quoted_and_a_control_character_in_it_is_refused(capsys, tmp_path):
    # RULES GN2: the Regenerate line regenerates the build, so it names the --models folder, shell-quoted.
    folder = write_models(tmp_path / "my models", mymoe=MYMOE)
    code, _, err = cli(capsys, "generate", "--models", folder, "--model", "mymoe", "--sm", "90", "--parallel", "tp1", "--out", tmp_path / "out")
    assert (code, err) == (0, "")
    header = (tmp_path / "out" / "mymoe" / "mymoe_bf16__sm_90__tp1" / "modeling.py").read_text().splitlines()[1]
    assert header == f"# Regenerate: python -m codegen generate --model mymoe --sm 90 --parallel tp1 --models '{folder}'"
    odd = write_models(tmp_path / "x\n# injected", mymoe=MYMOE)
    assert one_message(capsys, "generate", "--models", odd, "--model", "mymoe", "--out", tmp_path / "out2") == (
        f"--models {str(odd)!r}: a folder name with control characters cannot be written in a build's header; rename it")
    assert not (tmp_path / "out2").exists()
