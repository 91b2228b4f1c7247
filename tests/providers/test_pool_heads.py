"""`policy check --providers` holds an EAGLE pool's head against the model the pool serves (issue 47):
the runner's fingerprint (config.json's `openalice_runner.target`) against the model's name and, where the
model is a local folder, its config.json's sizes; a head from elsewhere against hidden and vocabulary
sizes alone, which a note says. Each refusal at the head's line (FILE:LINE:COL). json only: no torch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from openalice_runner.cli import main
from openalice_runner.head_folders import DEFAULT_MODEL_NAME, model_shape, read_head_target

POLICY = """\
version: 1
rules:
  - name: chat
    match: {turn_type: chat}
    method: eagle
    gamma: 3
    pool: eagle3
default: {method: "off", pool: plain}
"""

SMOL = {"architectures": ["LlamaForCausalLM"], "hidden_size": 576, "vocab_size": 49152, "num_hidden_layers": 30}
FINGERPRINT = {"name": DEFAULT_MODEL_NAME, "vocab_size": 49152, "hidden": 576, "n_layers": 30,
               "lm_head_sha256": "0c8d76d0178f771e"}  # fmt: skip


def eagle3_config(target: dict | None, hidden: int = 576, vocab: int = 49152) -> dict:
    """config.json of an eagle3 folder: SpecForge's draft config, with the runner's entry where `target`."""
    raw = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
           "num_hidden_layers": 1, "vocab_size": vocab, "draft_vocab_size": 1024}  # fmt: skip
    if target is not None:
        raw["openalice_runner"] = {"format_version": 1, "layout": "eagle3", "target": target}
    return raw


def folder(path: Path, config: dict, marker: bool = False) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    if marker:
        (path / "complete").write_text("")
    return path


def vllm_routing(head: Path | str, model: Path | str) -> str:
    return f"""\
providers:
  cpu:
    type: vllm
    model: smollm2
    default_pool: plain
    pools:
      plain:
        replicas: [http://127.0.0.1:1]
        launch: {{model_path: {model}, tool_call_parser: hermes}}
      eagle3:
        replicas: [http://127.0.0.1:2]
        launch:
          model_path: {model}
          method: eagle3
          draft_model: {head}
          num_speculative_tokens: 3
          tool_call_parser: hermes
routes:
  - name: d
    chain: [cpu]
"""


def sglang_routing(head: Path, model: str) -> str:
    return f"""\
providers:
  gpu:
    type: sglang
    model: {model}
    default_pool: plain
    pools:
      plain:
        replicas: [http://127.0.0.1:1]
        launch: {{tool_call_parser: llama3}}
      eagle3:
        replicas: [http://127.0.0.1:2]
        launch:
          algorithm: EAGLE3
          draft_model_path: {head}
          num_steps: 3
          tool_call_parser: llama3
routes:
  - name: d
    chain: [gpu]
"""


def check(capsys, tmp_path: Path, routing: str) -> tuple[int, str, str, Path]:
    policy, providers = tmp_path / "policy.yaml", tmp_path / "providers.yaml"
    policy.write_text(POLICY)
    providers.write_text(routing)
    code = main(["policy", "check", str(policy), "--providers", str(providers)])
    out, err = capsys.readouterr()
    return code, out, err, providers


@pytest.fixture
def smol(tmp_path) -> Path:
    """The runner's conversion of its default model: NAME-KEY with the `complete` marker."""
    return folder(tmp_path / "models" / f"{DEFAULT_MODEL_NAME}-0123456789abcdef", SMOL, marker=True)


def test_a_head_trained_for_the_pools_model_passes(capsys, tmp_path, smol):
    head = folder(tmp_path / "head", eagle3_config(FINGERPRINT))
    assert check(capsys, tmp_path, vllm_routing(head, smol))[:3] == (0, "ok\n", "")
    # `model_path: embedded` is the default model, by name
    assert check(capsys, tmp_path, vllm_routing(head, "embedded"))[:3] == (0, "ok\n", "")
    # SGLang, a hub id as the model: by name
    assert check(capsys, tmp_path, sglang_routing(head, "HuggingFaceTB/SmolLM2-135M-Instruct"))[:3] == (0, "ok\n", "")
    assert model_shape(str(smol)).names == (smol.name, DEFAULT_MODEL_NAME)
    # the NAME-KEY form without the marker is just a folder of that name
    (smol / "complete").unlink()
    assert model_shape(str(smol)).names == (smol.name,)


def test_a_head_for_another_model_is_refused_at_its_line(capsys, tmp_path, smol):
    head = folder(tmp_path / "head", eagle3_config({**FINGERPRINT, "name": "SmolLM2-360M-Instruct"}))
    code, out, _, providers = check(capsys, tmp_path, vllm_routing(head, smol))
    assert code == 2 and out.startswith(f"{providers}:15:24: pool 'eagle3': draft_model {head} was trained for "
                                        f"another target than '{smol}'"), out  # fmt: skip
    assert "openalice_runner.target.name is 'SmolLM2-360M-Instruct'" in out and len(out.splitlines()) == 1
    code, out, _, providers = check(capsys, tmp_path, sglang_routing(head, "HuggingFaceTB/SmolLM2-135M-Instruct"))
    assert code == 2 and out.startswith(f"{providers}:14:29: pool 'eagle3': draft_model_path {head}"), out


@pytest.mark.parametrize(("key", "value", "field"), [("n_layers", 32, "num_hidden_layers is 30"),
                                                     ("hidden", 960, "hidden_size is 576"),
                                                     ("vocab_size", 32000, "vocab_size is 49152")])
def test_the_same_name_with_other_sizes_is_refused(capsys, tmp_path, smol, key, value, field):
    """A local model folder is held to the fingerprint's sizes too (a folder renamed, a model resized)."""
    head = folder(tmp_path / "head", eagle3_config({**FINGERPRINT, key: value}))
    code, out, _, _ = check(capsys, tmp_path, vllm_routing(head, smol))
    assert code == 2 and f"openalice_runner.target.{key} is {value}, {field} in {smol / 'config.json'}" in out, out


def test_a_head_from_elsewhere_is_checked_on_sizes_alone_and_says_so(capsys, tmp_path, smol):
    head = folder(tmp_path / "specforge", eagle3_config(None))
    code, out, err, providers = check(capsys, tmp_path, vllm_routing(head, smol))
    assert (code, out) == (0, "ok\n")
    assert err.startswith(f"{providers}:15:24: note: pool 'eagle3': draft_model {head} has no openalice_runner "
                          "target fingerprint"), err  # fmt: skip
    assert "on hidden and vocabulary sizes only" in err
    # the model no local folder: nothing to hold it to, said
    code, out, err, _ = check(capsys, tmp_path, vllm_routing(head, "HuggingFaceTB/SmolLM2-135M-Instruct"))
    assert (code, out) == (0, "ok\n") and "not checked" in err
    wide = folder(tmp_path / "wide", eagle3_config(None, hidden=4096, vocab=128256))
    code, out, _, _ = check(capsys, tmp_path, vllm_routing(wide, smol))
    assert code == 2 and "its config.json's hidden_size is 4096, 576 in" in out
    assert "checked on hidden and vocabulary sizes only" in out


def test_the_runners_own_layout_and_a_broken_folder_are_refused(capsys, tmp_path, smol):
    own = folder(tmp_path / "own", {"format_version": 1, "target": FINGERPRINT, "hidden": 576})
    code, out, _, _ = check(capsys, tmp_path, vllm_routing(own, smol))
    assert code == 2 and "is the runner's own eagle layout, which vLLM does not load" in out
    assert "--layout eagle3" in out
    empty = tmp_path / "empty"
    empty.mkdir()
    code, out, _, providers = check(capsys, tmp_path, vllm_routing(empty, smol))
    assert code == 2 and out.startswith(f"{providers}:15:24: pool 'eagle3': draft_model {empty}: cannot read"), out


def test_a_head_that_is_no_folder_here_is_the_engines_to_resolve(capsys, tmp_path, smol):
    for head in ("lmsys/sglang-EAGLE3-LLaMA3.1-Instruct-8B", tmp_path / "on-the-serving-host"):
        assert check(capsys, tmp_path, vllm_routing(head, smol))[:3] == (0, "ok\n", "")


def test_read_head_target_layouts(tmp_path):
    assert read_head_target(folder(tmp_path / "a", eagle3_config(FINGERPRINT))).fingerprint == FINGERPRINT
    other = read_head_target(folder(tmp_path / "b", eagle3_config(None, hidden=4096)))
    assert (other.layout, other.fingerprint, other.hidden) == ("eagle3", None, 4096)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "config.json").write_text("{")
    with pytest.raises(ValueError, match="is not JSON"):
        read_head_target(tmp_path / "c")


def test_loading_the_files_refuses_a_head_for_another_model(tmp_path, smol):
    """Runner.from_config (and so `serve`) runs the same check at load."""
    from openalice_runner import Runner
    from openalice_runner.config_files import ConfigError

    head = folder(tmp_path / "head", eagle3_config({**FINGERPRINT, "n_layers": 24}))
    policy, providers = tmp_path / "policy.yaml", tmp_path / "providers.yaml"
    policy.write_text(POLICY)
    providers.write_text(vllm_routing(head, smol))
    with pytest.raises(ConfigError, match=r"providers.yaml:15:24: .*openalice_runner.target.n_layers is 24"):
        Runner.from_config(providers, policy, telemetry=False)
