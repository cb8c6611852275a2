"""One declaration per option: the flags, the TOML keys, the docs' tables and the example config agree."""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path

import pytest

from hkvd.daemon.cli import build_config
from hkvd.daemon.config import ConfigError, DaemonConfig
from hkvd.daemon.options import (
    INTERNAL_FIELDS,
    OPTIONS,
    check_defaults,
    example_toml,
    from_toml,
    generated_files,
    main,
)

REPO = Path(__file__).resolve().parents[2]


def test_every_config_field_is_declared_once():
    declared = [o.field for o in OPTIONS]
    assert len(declared) == len(set(declared))
    fields = {f.name for f in dataclasses.fields(DaemonConfig)}
    assert set(declared) | set(INTERNAL_FIELDS) == fields, "declare the new field in hkvd.daemon.options"


def test_the_defaults_shown_are_the_defaults():
    assert check_defaults() == []


def test_generated_files_are_up_to_date():
    stale = [str(p.relative_to(REPO)) for p, text in generated_files(REPO).items() if p.read_text() != text]
    assert stale == [], "run: python -m hkvd.daemon.options --write"


def test_the_check_sees_a_drifted_table(tmp_path, capsys):
    for name in ("README.md", "docs/configuration.md", "packaging/hkvd.toml"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text((REPO / name).read_text())
    assert main(["--root", str(tmp_path)]) == 0
    readme = tmp_path / "README.md"
    readme.write_text(readme.read_text().replace("| 256 |", "| 512 |"))
    assert main(["--root", str(tmp_path)]) == 1
    assert "README.md is out of date" in capsys.readouterr().err


def test_every_example_in_the_toml_is_a_valid_value():
    uncommented = "\n".join(line[2:] if re.match(r"# [a-z0-9-]+ = ", line) else line
                            for line in example_toml().splitlines())
    values = from_toml(tomllib.loads(uncommented), "example")
    assert len(values) == sum(o.in_toml for o in OPTIONS)
    DaemonConfig(**{**values, "peer_listen": "", "peer_advertise": "", "peer_allow": (), "socket_group": ""})


def test_flags_and_toml_keys_set_the_same_fields(tmp_path):
    import argparse

    from hkvd.daemon.cli import _serve_parser
    from hkvd.daemon.cli import main as cli_main  # noqa: F401 - the parser is built there

    parser = argparse.ArgumentParser()
    _serve_parser(parser.add_subparsers(dest="cmd"))
    toml = tmp_path / "c.toml"
    toml.write_text('chunk-size = 64\nl1-size-gb = 0.5\nlease_ttl_s = 7\n')
    cfg = build_config(parser.parse_args(["serve", "--config", str(toml), "--chunk-size", "128",
                                          "--eviction-policy", "HYBRID"]))
    assert (cfg.chunk_size, cfg.l1_size_bytes, cfg.lease_ttl_s, cfg.eviction_policy) == (128, 1 << 29, 7.0, "hybrid")
    with pytest.raises(ConfigError, match="unknown key 'chunk-sise'"):
        toml.write_text("chunk-sise = 64\n")
        build_config(parser.parse_args(["serve", "--config", str(toml)]))
    with pytest.raises(ConfigError, match="--l1-size-gb 'lots'"):
        build_config(parser.parse_args(["serve", "--l1-size-gb", "lots"]))
    with pytest.raises(ConfigError, match="unknown key 'peer-token'"):  # secrets stay out of config files
        toml.write_text('peer-token = "x"\n')
        build_config(parser.parse_args(["serve", "--config", str(toml)]))


def test_the_reload_texts_name_every_reloadable_key():
    """docs/operating.md's Reload paragraph and the example config's header say what SIGHUP applies: each key
    the daemon applies on reload (``RELOADABLE``) is named in both."""
    from hkvd.daemon.reload import RELOADABLE

    doc = (REPO / "docs/operating.md").read_text()
    reload_text = doc[doc.index("**Reload**"):doc.index("**Stop**")]
    header = "\n".join(line for line in example_toml().splitlines() if line.startswith("# "))
    for field in RELOADABLE:
        flag = field.replace("_", "-")
        assert f"`{flag}`" in reload_text, f"docs/operating.md's Reload paragraph does not name {flag}"
        assert flag in header, f"the example config's header (hkvd.daemon.options.example_toml) does not name {flag}"


def test_tp_reshard_is_on_or_off_as_a_flag_and_a_toml_key(tmp_path):
    import argparse

    from hkvd.daemon.cli import _serve_parser

    parser = argparse.ArgumentParser()
    _serve_parser(parser.add_subparsers(dest="cmd"))
    assert build_config(parser.parse_args(["serve"])).tp_reshard is True
    assert build_config(parser.parse_args(["serve", "--tp-reshard", "off"])).tp_reshard is False
    assert build_config(parser.parse_args(["serve", "--tp-reshard", "ON"])).tp_reshard is True
    toml = tmp_path / "c.toml"
    for text, want in (('tp-reshard = "off"\n', False), ("tp_reshard = false\n", False), ("tp-reshard = true\n", True)):
        toml.write_text(text)
        assert build_config(parser.parse_args(["serve", "--config", str(toml)])).tp_reshard is want, text
    toml.write_text('tp-reshard = "off"\n')  # the flag wins over the file
    assert build_config(parser.parse_args(["serve", "--config", str(toml), "--tp-reshard", "on"])).tp_reshard is True
    with pytest.raises(ConfigError, match="--tp-reshard 'sometimes': expected on or off"):
        build_config(parser.parse_args(["serve", "--tp-reshard", "sometimes"]))
