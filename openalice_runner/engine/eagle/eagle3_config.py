"""An EAGLE-3 head's config (eagle3.py holds the head): the runner's `Eagle3Config`, and
config.json as SpecForge, vLLM and SGLang read it."""

from __future__ import annotations

from dataclasses import dataclass

from openalice_runner.engine.eagle.head import target_fingerprint
from openalice_runner.engine.llama import LlamaModel
from openalice_runner.head_folders import EAGLE3_ARCHITECTURES, OWN_KEY

# names vLLM's registry maps to llama_eagle3's Eagle3LlamaForCausalLM (SGLang registers the first);
# read without torch by `policy check` (head_folders.py), hence defined there
ARCHITECTURES = EAGLE3_ARCHITECTURES
ARCHITECTURE = ARCHITECTURES[0]
WEIGHTS_FILE = "model.safetensors"
FORMAT_VERSION = 1
# config switches of variant layouts (vLLM's and SGLang's llama_eagle3.py): this runner runs none of them
_VARIANTS = ("norm_before_fc", "fc_norm", "use_aux_norm", "norm_before_residual", "norm_output", "attention_bias",
             "mlp_bias")


def default_taps(n_layers: int) -> list[int]:
    """SpecForge's default layers (Eagle3TargetModel.set_aux_hidden_states_layers): the outputs of
    layers 1, n/2-1 and n-4 (vLLM's and SGLang's defaults, which count layer inputs: 2, n/2, n-3).
    Clamped into 0..n-1 for the tiny targets of tests."""
    return [min(1, n_layers - 1), max(0, n_layers // 2 - 1), max(0, n_layers - 4)]


@dataclass
class Eagle3Config:
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    rope_theta: float
    max_positions: int
    vocab_size: int  # the target's
    draft_vocab: list[int]  # target ids of the draft vocabulary, ascending: draft id i is draft_vocab[i]
    feature_layers: list[int]  # target layers whose output (residual stream) the head fuses, in fc order
    target: dict | None  # target_fingerprint; None for a head trained elsewhere
    trained: dict | None = None  # training figures
    format_version: int = FORMAT_VERSION

    @property
    def taps(self) -> tuple[int, ...]:
        return tuple(self.feature_layers)

    @classmethod
    def for_target(cls, model_name: str, model: LlamaModel, draft_vocab: list[int],
                   feature_layers: list[int] | None = None) -> Eagle3Config:
        cfg = model.cfg
        layers = list(feature_layers) if feature_layers is not None else default_taps(cfg.n_layers)
        for i in layers:
            if not 0 <= i < cfg.n_layers:
                raise ValueError(f"feature_layers: layer {i} is outside 0..{cfg.n_layers - 1} of the target")
        return cls(
            hidden=cfg.hidden, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
            intermediate=cfg.intermediate, eps=cfg.eps, rope_theta=cfg.rope_theta, max_positions=cfg.max_positions,
            vocab_size=cfg.vocab_size, draft_vocab=sorted(set(int(t) for t in draft_vocab)), feature_layers=layers,
            target=target_fingerprint(model_name, model),
        )

    def hf_config(self) -> dict:
        """config.json: SpecForge's draft config (what vLLM and SGLang read) and the runner's entry."""
        own = {"format_version": self.format_version, "layout": "eagle3", "target": self.target,
               "feature_layers": list(self.feature_layers), "trained": self.trained}
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
            "hidden_size": self.hidden,
            "target_hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": 1,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "max_position_embeddings": self.max_positions,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": len(self.draft_vocab),
            "tie_word_embeddings": False,  # SGLang's lm_head would be the embedding otherwise
            "attention_bias": False,
            "mlp_bias": False,
            "torch_dtype": "float32",
            OWN_KEY: own,
        }


def is_eagle3_config(raw: dict) -> bool:
    return any(a in ARCHITECTURES for a in raw.get("architectures") or ())


def config_from_hf(raw: dict, draft_vocab: list[int], n_layers: int | None, where: str) -> Eagle3Config:
    """An `Eagle3Config` from a folder's config.json; ValueError naming the field this runner
    cannot run. `n_layers`: the target's, for a folder from elsewhere that names no layers."""
    def need(key: str):
        if key not in raw:
            raise ValueError(f"eagle_head: {where}: config.json has no {key!r}")
        return raw[key]

    if need("num_hidden_layers") != 1:
        raise ValueError(f"eagle_head: {where}: num_hidden_layers is {raw['num_hidden_layers']}; "
                         "this runner runs EAGLE-3 heads of one layer")
    eagle_config = raw.get("eagle_config") or {}
    for key in _VARIANTS:
        if raw.get(key) or eagle_config.get(key):
            raise ValueError(f"eagle_head: {where}: {key} is set; this runner runs the plain EAGLE-3 layout")
    if raw.get("tie_word_embeddings"):
        raise ValueError(f"eagle_head: {where}: tie_word_embeddings is true (lm_head would be the embedding); "
                         "this runner needs the head's own lm_head")
    hidden = need("hidden_size")
    if raw.get("target_hidden_size", hidden) != hidden:
        raise ValueError(f"eagle_head: {where}: target_hidden_size {raw['target_hidden_size']} differs "
                         f"from hidden_size {hidden}")
    own = raw.get(OWN_KEY) or {}
    if own and own.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"eagle_head: {where}: {OWN_KEY}.format_version {own.get('format_version')!r}, "
                         f"this runner reads {FORMAT_VERSION}")
    layers = own.get("feature_layers")
    if layers is None:
        layers = eagle_config.get("eagle_aux_hidden_state_layer_ids") or raw.get("eagle_aux_hidden_state_layer_ids")
    if layers is None:
        if n_layers is None:
            raise ValueError(f"eagle_head: {where}: names no target layers; load it with its target")
        layers = default_taps(n_layers)
    n_heads = need("num_attention_heads")
    return Eagle3Config(
        hidden=hidden, n_heads=n_heads, n_kv_heads=raw.get("num_key_value_heads") or n_heads,
        head_dim=raw.get("head_dim") or hidden // n_heads, intermediate=need("intermediate_size"),
        eps=raw.get("rms_norm_eps", 1e-6), rope_theta=raw.get("rope_theta", 10000.0),
        max_positions=raw.get("max_position_embeddings", 2048), vocab_size=need("vocab_size"),
        draft_vocab=list(draft_vocab), feature_layers=list(layers), target=own.get("target"),
        trained=own.get("trained"),
    )
