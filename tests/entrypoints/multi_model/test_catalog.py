"""What a multi-model server may serve: names from flags, a models folder and a config file;
every mistake refused at start-up naming what is wrong."""
import json
import os

import pytest

from pagedllm.entrypoints.cli import _build_parser, sub_parser
from pagedllm.entrypoints.multi_model.catalog import build_catalog, option_flags, resolve, scan_models_dir
from pagedllm.entrypoints.multi_model.launcher import child_command, is_multi_model, settings_from


def _serve_parser():
    return sub_parser(_build_parser(), "serve")


def _catalog(argv):
    parser = _serve_parser()
    args = parser.parse_args(argv)
    return args, build_catalog(args, vars(parser.parse_args([])))


def _folder(path, weights: int = 10) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        f.write("{}")
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(b"\0" * weights)
    return str(path)


def test_two_models_by_stem_and_by_served_name(tmp_path):
    a, b = _folder(tmp_path / "alpha"), _folder(tmp_path / "beta", weights=25)
    (tmp_path / "q.gguf").write_bytes(b"GGUF" + b"\0" * 60)
    args, entries = _catalog([a, "--model", b, "--model", str(tmp_path / "q.gguf")])
    assert is_multi_model(args)
    assert [e.names for e in entries] == [("alpha",), ("beta",), ("q",)]
    assert entries[1].weight_bytes() == 25 and entries[2].weight_bytes() == 64
    _, named = _catalog(["--model", a, "--model", b, "--served-model-name", "x", "y"])
    assert [e.name for e in named] == ["x", "y"] and resolve(named, "y").path == b and resolve(named, "beta") is None
    with pytest.raises(ValueError, match="one name per --model"):
        _catalog(["--model", a, "--model", b, "--served-model-name", "x"])
    with pytest.raises(ValueError, match="'alpha' is used twice"):
        _catalog(["--model", a, "--model", _folder(tmp_path / "other" / "alpha")])
    assert not is_multi_model(_serve_parser().parse_args([a, "--model", a]))  # the same model twice: one model


def test_models_dir_serves_checkpoint_folders_and_gguf_files(tmp_path):
    _folder(tmp_path / "m" / "b-model")
    _folder(tmp_path / "m" / "a-model")
    (tmp_path / "m" / "notes").mkdir()  # no config.json: not a checkpoint
    (tmp_path / "m" / "c.gguf").write_bytes(b"GGUF")
    (tmp_path / "m" / "readme.txt").write_text("x")
    assert [os.path.basename(p) for p in scan_models_dir(str(tmp_path / "m"))] == ["a-model", "b-model", "c.gguf"]
    _, entries = _catalog(["--models-dir", str(tmp_path / "m"), "--pin-model", "c"])
    assert [(e.name, e.pinned) for e in entries] == [("a-model", False), ("b-model", False), ("c", True)]
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no checkpoint"):
        _catalog(["--models-dir", str(tmp_path / "empty")])
    with pytest.raises(ValueError, match="--pin-model"):
        _catalog(["--models-dir", str(tmp_path / "m"), "--pin-model", "zzz"])


def test_config_file_options_become_each_models_flags(tmp_path):
    a = _folder(tmp_path / "a")
    _folder(tmp_path / "sub" / "bert")
    cfg = tmp_path / "models.yaml"
    cfg.write_text(f"""models:
  - model: {a}
    names: [chat, assistant]
    pin: true
    options: {{max_model_len: 512, enforce-eager: true, lora_modules: ["sql=/x", '{{"name": "j", "path": "/y"}}']}}
  - model: sub/bert
    options: {{runner: pooling, kv_cache_memory: 32MiB}}
""")
    args, entries = _catalog(["--models-config", str(cfg), "--max-model-len", "256"])
    chat, bert = entries
    assert chat.names == ("chat", "assistant") and chat.pinned and chat.lora_names == ("sql", "j")
    assert chat.flags[:3] == ("--max-model-len", "512", "--enforce-eager")
    assert bert.name == "bert" and bert.path == str(tmp_path / "sub" / "bert")  # relative to the file
    assert resolve(entries, "sql") is chat and resolve(entries, "assistant") is chat
    settings = settings_from(args)
    cmd = child_command(bert, 9999, ["--max-model-len", "256"], settings)
    # the command line's flags first, then the model's own (argparse keeps the last): its KV size is its own
    assert cmd[cmd.index("--max-model-len") + 1] == "256" and cmd[-4:] == ["--runner", "pooling", "--kv-cache-memory",
                                                                           "32MiB"]
    assert cmd.count("--kv-cache-memory") == 1 and "--no-engine-core-process" in cmd
    chat_cmd = child_command(chat, 9999, [], settings)
    assert chat_cmd[chat_cmd.index("--kv-cache-memory") + 1] == str(settings.kv_cache_bytes)
    assert chat_cmd[chat_cmd.index("--served-model-name") + 1:][:2] == ["chat", "assistant"]


@pytest.mark.parametrize("text, why", [
    ("models: 3", "holding a list"),
    ("other: []", "holding a list"),
    ("models: [{name: x}]", "needs a 'model' path"),
    ("models: [{model: a, colour: red}]", "unknown keys \\['colour'\\]"),
    ("models: [{model: a, options: {no_such_flag: 1}}]", "unknown option 'no_such_flag'"),
    ("models: [{model: a, options: {port: 9}}]", "set by the multi-model server itself"),
    ("models: [{model: a, options: [1]}]", "must be a mapping"),
    ("models: [{model: missing}]", "no such model"),
    ("models: [{model: a, names: [1]}]", "non-empty strings"),
    ("models: [: :", "not valid YAML"),
])
def test_a_bad_config_file_is_refused_naming_the_problem(tmp_path, text, why):
    _folder(tmp_path / "a")
    cfg = tmp_path / "m.yaml"
    cfg.write_text(text)
    with pytest.raises(ValueError, match=why):
        _catalog(["--models-config", str(cfg)])


def test_json_config_and_option_spelling(tmp_path):
    a = _folder(tmp_path / "a")
    cfg = tmp_path / "m.json"
    cfg.write_text(json.dumps({"models": [{"model": a, "name": "n", "options": {"dtype": "float32"}}]}))
    _, (entry,) = _catalog(["--models-config", str(cfg)])
    assert entry.name == "n" and entry.flags == ("--dtype", "float32")
    dests = vars(_serve_parser().parse_args([]))
    assert option_flags({"enable_prefix_caching": False, "allowed_origins": ["*"]}, dests, "x") == (
        "--no-enable-prefix-caching", "--allowed-origins", '["*"]')
    cfg.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        _catalog(["--models-config", str(cfg)])


def test_settings_are_checked(tmp_path):
    parser = _serve_parser()
    with pytest.raises(ValueError, match="--model-idle-timeout must be > 0"):
        settings_from(parser.parse_args(["--model-idle-timeout", "0"]))
    s = settings_from(parser.parse_args(["--models-memory", "8GiB"]))
    assert s.memory_budget == 8 << 30 and s.kv_cache_bytes == 1 << 30  # an eighth of the budget each
    assert settings_from(parser.parse_args([])).memory_budget > 0  # from this machine's available memory
