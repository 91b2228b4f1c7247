"""EAGLE-3 heads in the layout SGLang and vLLM run: `LlamaForCausalLMEagle3`, SpecForge's folder.

The head reads three taps of the target (the residual stream after layers 1, n/2-1 and n-4 of an
n-layer target, SpecForge's default), fuses them with `fc` (3H -> H, no norm before it), and runs
one decoder layer, the "midlayer", on the 2H-wide concatenation of the next token's embedding
(RMS-normed by `input_layernorm`) and the fused feature (normed by `hidden_norm`), in that
order. The fused feature, not its norm, is the attention's residual; `post_attention_layernorm`,
the MLP and the final `norm` follow as in a Llama layer. The LM head spans the draft vocabulary
only: `d2t[i]` is the offset from draft id i to its target id, `t2d` marks the target ids in it.
A draft step's output before the final norm is what the next step reads in place of the fused
taps (the norm feeds the LM head only). Token embeddings are the target's: the folder holds none.

The same layout in the engines' sources (vLLM 0.32.0, SGLang 0.5.23):
- vllm/model_executor/models/llama_eagle3.py: `LlamaDecoderLayer.forward` (layer 0: `embeds =
  self.input_layernorm(embeds)`, `_norm_after_residual`: residual = hidden, hidden =
  hidden_norm(hidden), `torch.cat([embeds, hidden_states], dim=-1)`), `LlamaModel.forward`
  (`hidden_states, hidden_prenorm = self.norm(hidden_states, residual)`, the pre-norm one
  returned to the proposer), `combine_hidden_states` (`self.model.fc` over the concatenated
  taps), `compute_logits` (`targets = base + self.draft_id_to_target_id`), `load_weights`
  ("midlayer." -> "layers.0.", q/k/v and gate/up stacked, "d2t" loaded, "t2d" skipped,
  embed_tokens absent: shared with the target).
- vllm/v1/spec_decode/llm_base_proposer.py `propose`: first pass on `combine_hidden_states`
  of the target's taps, positions of the target tokens, input ids shifted by one; later steps
  `last_hidden_states, hidden_states = ret_hidden_states`: logits from the first, the second
  fed back, positions + 1.
- sglang/srt/models/llama_eagle3.py: the same layer (`residual = hidden_states; hidden_states =
  self.hidden_norm(...); embeds = self.input_layernorm(embeds); torch.cat([embeds,
  hidden_states])`), `fc` only where the input is wider than H, the pre-norm output captured
  for draft decode; `lm_head` is the embedding where `tie_word_embeddings` is set, so the
  config says false.

Which layers: vLLM (models/interfaces.py `_maybe_add_hidden_state(aux, idx + 1, ...)` after
layer idx) and SGLang (models/llama.py: capture at layer i's input) both read layer id i as
the residual stream entering layer i, and both default to (2, n//2, n-3) when the draft's
config names no layers. An id list in the config (`eagle_config.eagle_aux_hidden_state_layer_ids`)
means the output of layer i to SpecForge and SGLang (`set_eagle3_layers_to_capture`: "we plus 1
here") but is used as is by vLLM 0.32 (gpu_model_runner `_get_eagle3_aux_layers_from_config`):
one layer earlier. A folder written here therefore names no layers: both engines take their
(equal) defaults, the outputs of layers 1, n/2-1 and n-4 (the engine's taps), as SpecForge does.
A folder from elsewhere that names layers is read with SpecForge's meaning.

config.json is SpecForge's Llama draft config, plus the runner's own entry under
`openalice_runner` (the target's fingerprint, the taps, training figures): the engines ignore it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from openalice_runner.engine.cpu_kernels import cpu_kernels
from openalice_runner.engine.eagle.eagle3_config import (
    WEIGHTS_FILE,
    Eagle3Config,
    config_from_hf,
    default_taps,
    is_eagle3_config,
)
from openalice_runner.engine.eagle.head import (
    CONFIG_FILE,
    HeadRuntime,
    RMSNorm,
    check_target,
    ttt_attention,
)
from openalice_runner.engine.llama import Linear, LlamaModel, RotaryTable
from openalice_runner.engine.tree import TreeMask

__all__ = ["Eagle3Config", "Eagle3Head", "Eagle3Runtime", "default_taps", "is_eagle3_config", "load_eagle3"]

class _Attention(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.q_proj = nn.Linear(2 * c.hidden, c.n_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden, c.n_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden, c.n_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.n_heads * c.head_dim, c.hidden, bias=False)


class _MLP(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden, c.intermediate, bias=False)
        self.up_proj = nn.Linear(c.hidden, c.intermediate, bias=False)
        self.down_proj = nn.Linear(c.intermediate, c.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.hidden_norm = RMSNorm(c.hidden, c.eps)
        self.input_layernorm = RMSNorm(c.hidden, c.eps)
        self.self_attn = _Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden, c.eps)
        self.mlp = _MLP(c)


class Eagle3Head(nn.Module):
    """Trainable EAGLE-3 head; its state dict is the folder's model.safetensors, name for name."""

    predicts_features = False  # trained on tokens alone: its hidden state is its own

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden
        self.fc = nn.Linear(len(cfg.taps) * h, h, bias=False)
        self.midlayer = _MidLayer(cfg)
        self.norm = RMSNorm(h, cfg.eps)
        self.lm_head = nn.Linear(h, len(cfg.draft_vocab), bias=False)
        ids = torch.tensor(cfg.draft_vocab, dtype=torch.long)
        self.register_buffer("d2t", ids - torch.arange(len(ids)))
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        self.register_buffer("t2d", t2d)
        self._rotary: RotaryTable | None = None

    def init_from_target(self, model: LlamaModel) -> None:
        """Start from the target's last layer, final norm and LM head rows: the feature half of
        q/k/v is the last layer's, the embedding half small; fc passes the highest tap through."""
        last = model.layers[-1]
        c = self.cfg
        h = c.hidden
        m = self.midlayer
        with torch.no_grad():
            self.fc.weight.normal_(0.0, 0.02)
            self.fc.weight[:, -h:] += torch.eye(h)
            for norm in (m.hidden_norm, m.input_layernorm):
                norm.weight.copy_(last.attn_norm)
            m.post_attention_layernorm.weight.copy_(last.mlp_norm)
            self.norm.weight.copy_(model.norm)
            self.lm_head.weight.copy_(model.lm_head.weight.detach()[torch.tensor(c.draft_vocab)].float())
            q_rows, kv_rows = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
            q, k, v = last.qkv.weight.float().split([q_rows, kv_rows, kv_rows])
            for proj, w in ((m.self_attn.q_proj, q), (m.self_attn.k_proj, k), (m.self_attn.v_proj, v)):
                proj.weight[:, :h].normal_(0.0, 0.02)
                proj.weight[:, h:] = w
            m.self_attn.o_proj.weight.copy_(last.o.weight.float())
            if c.intermediate == model.cfg.intermediate:
                gate, up = last.gate_up.weight.float().chunk(2)
                m.mlp.gate_proj.weight.copy_(gate)
                m.mlp.up_proj.weight.copy_(up)
                m.mlp.down_proj.weight.copy_(last.down.weight.float())

    def rotary(self) -> RotaryTable:
        if self._rotary is None:
            c = self.cfg
            self._rotary = RotaryTable(c.head_dim, c.rope_theta, c.max_positions, torch.float32)
        return self._rotary

    def training_rows(self, stored: torch.Tensor) -> torch.Tensor:
        """Distilled feature rows (the target's taps at its distinct layers in ascending order, as
        a pass taps them, then f_t) -> the fc input: the head's taps in its order."""
        h = self.cfg.hidden
        distinct = sorted(set(self.cfg.taps))
        return torch.cat([stored[..., distinct.index(i) * h : (distinct.index(i) + 1) * h] for i in self.cfg.taps],
                         dim=-1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-norm hidden states -> logits over the draft vocabulary."""
        return self.lm_head(self.norm(hidden))

    # ---- training forward -------------------------------------------------------------------
    def _qkv(self, emb: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor):
        c, m = self.cfg, self.midlayer
        n = emb.shape[0]
        x = torch.cat([emb, m.hidden_norm(hidden)], dim=-1)
        q = m.self_attn.q_proj(x).view(n, c.n_heads, c.head_dim)
        k = m.self_attn.k_proj(x).view(n, c.n_kv_heads, c.head_dim)
        v = m.self_attn.v_proj(x).view(n, c.n_kv_heads, c.head_dim)
        rot = self.rotary()
        cos, sin = rot.cos[pos].unsqueeze(1), rot.sin[pos].unsqueeze(1)
        q, k = RotaryTable.rotate(q, cos, sin), RotaryTable.rotate(k, cos, sin)
        group = c.n_heads // c.n_kv_heads
        return q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)

    def _finish(self, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        m = self.midlayer
        x = hidden + m.self_attn.o_proj(attn.reshape(hidden.shape[0], -1))
        return x + m.mlp(m.post_attention_layernorm(x))

    def forward_unrolled(self, taps: torch.Tensor, next_emb: torch.Tensor, steps: int,
                         start: int = 0) -> list[torch.Tensor]:
        """One window at positions start..start+L-1: taps (L, 3H) the target's (fc input) and
        next_emb (L, H) the embeddings of the tokens x_{t+1} that follow.

        Returns per step s = 1..steps the pre-norm outputs (L, H) (`logits` reads them): row t
        of step s is the drafter's s-th step predicting the token after x_{t+1}; step s > 1 reads
        step s-1's output at row t-1 in place of fc(taps), and attends as `ttt_attention` says
        (EAGLE-3's training-time test). Rows t < s-1 of step s are meaningless; callers mask them.
        """
        c = self.cfg
        length = taps.shape[0]
        pos = torch.arange(start, start + length)
        scale = c.head_dim**-0.5
        emb = self.midlayer.input_layernorm(next_emb)
        hidden = self.fc(taps)
        q, k1, v1 = self._qkv(emb, hidden, pos)
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        attn = F.scaled_dot_product_attention(
            q.transpose(0, 1), k1.transpose(0, 1), v1.transpose(0, 1), attn_mask=causal
        ).transpose(0, 1)
        out = [self._finish(hidden, attn)]
        extra_k: list[torch.Tensor] = []
        extra_v: list[torch.Tensor] = []
        for _ in range(2, steps + 1):
            shifted = torch.cat([hidden[:1], out[-1][:-1]], dim=0)  # row t: the previous step's output at row t-1
            q, k, v = self._qkv(emb, shifted, pos)
            extra_k.append(k)
            extra_v.append(v)
            out.append(self._finish(shifted, ttt_attention(q, k1, v1, extra_k, extra_v, pos, scale)))
        return out

    # ---- persistence ---------------------------------------------------------------------------
    def save(self, folder: str | Path) -> Path:
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {k: (v.detach().float() if v.is_floating_point() else v.detach()).contiguous()
                   for k, v in self.state_dict().items()}
        if len(self.cfg.draft_vocab) == self.cfg.vocab_size:
            # the whole vocabulary: vLLM makes no draft_id_to_target_id to load d2t into
            del tensors["d2t"], tensors["t2d"]
        save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
        (folder / CONFIG_FILE).write_text(json.dumps(self.cfg.hf_config(), indent=1))
        return folder


def load_eagle3(folder: str | Path, model_name: str | None = None, model: LlamaModel | None = None) -> Eagle3Head:
    """The EAGLE-3 head in `folder`; with a target given, ValueError unless it belongs to it (the
    runner's fingerprint where the folder has one, else hidden and vocabulary sizes)."""
    from safetensors.torch import load_file

    folder = Path(folder).expanduser()
    where = str(folder)
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        raise ValueError(f"eagle_head: {folder} has an EAGLE-3 config.json but no {WEIGHTS_FILE}")
    raw = json.loads((folder / CONFIG_FILE).read_text())
    tensors = load_file(str(path))
    n_draft = raw.get("draft_vocab_size") or raw.get("vocab_size")
    d2t = tensors.get("d2t")
    vocab = (torch.arange(len(d2t)) + d2t).tolist() if d2t is not None else list(range(n_draft or 0))
    cfg = config_from_hf(raw, vocab, model.cfg.n_layers if model is not None else None, where)
    if model is not None:
        if cfg.target is not None:
            check_target(cfg.target, model_name or "", model, where=where)
        for key, mine, theirs in (("hidden_size", cfg.hidden, model.cfg.hidden),
                                  ("vocab_size", cfg.vocab_size, model.cfg.vocab_size)):
            if mine != theirs:
                raise ValueError(f"EAGLE head {where} was trained for another target: {key} is {mine} in "
                                 f"its config.json, {theirs} for the loaded model {model_name!r}")
        for i in cfg.taps:
            if not 0 <= i < model.cfg.n_layers:
                raise ValueError(f"eagle_head: {where}: layer {i} is outside 0..{model.cfg.n_layers - 1} "
                                 "of the target")
    head = Eagle3Head(cfg)
    tensors.setdefault("d2t", head.d2t)
    tensors.setdefault("t2d", head.t2d)
    for key in ("d2t", "t2d"):
        tensors[key] = tensors[key].to(getattr(head, key).dtype)
    head.load_state_dict(tensors)
    return head.eval()


class Eagle3Runtime(HeadRuntime):
    """Inference over an EAGLE-3 head, with the interface the eagle drafter drives: `step` maps
    rows (target taps or the previous step's output, next token, position) to pre-norm outputs,
    `logits` reads them. Weights in the target's weight dtype, on the engine's linear kernel."""

    def __init__(self, head: Eagle3Head, model: LlamaModel):
        c = head.cfg
        self.cfg = c
        self.model = model
        kernels = cpu_kernels()
        dtype = model.weight_dtype
        bf16 = dtype == torch.bfloat16

        def lin(*ws: torch.Tensor) -> Linear:
            return Linear(torch.cat([w.detach() for w in ws]).to(dtype).contiguous(), None, bf16, kernels)

        m = head.midlayer
        self.fc = lin(head.fc.weight)
        self.qkv = lin(m.self_attn.q_proj.weight, m.self_attn.k_proj.weight, m.self_attn.v_proj.weight)
        self.o = lin(m.self_attn.o_proj.weight)
        self.gate_up = lin(m.mlp.gate_proj.weight, m.mlp.up_proj.weight)
        self.down = lin(m.mlp.down_proj.weight)
        self.lm_head = lin(head.lm_head.weight)
        self.hidden_norm = m.hidden_norm.weight.detach().float().clone()
        self.input_norm = m.input_layernorm.weight.detach().float().clone()
        self.post_norm = m.post_attention_layernorm.weight.detach().float().clone()
        self.out_norm = head.norm.weight.detach().float().clone()
        self.share(model, kernels)
        self.tap_width = len(c.taps) * c.hidden

    @torch.inference_mode()
    def step(self, cache: tuple[torch.Tensor, torch.Tensor], feats: torch.Tensor, next_tokens: list[int],
             positions: list[int], tree: TreeMask | None = None) -> torch.Tensor:
        """Rows (feature at t, token x_{t+1}, position t) -> pre-norm outputs (rows, H). A feature
        is the target's (its taps first; the final hidden state the drafter appends is not read)
        or a previous step's output (H wide). `tree`: as `EagleRuntime.step`."""
        c = self.cfg
        rows = len(positions)
        rope_t = torch.tensor(positions) if tree is None else tree.rope_pos
        feats = feats.float()
        hidden = feats if feats.shape[-1] == c.hidden else self.fc(feats[..., : self.tap_width].contiguous())
        emb = self._norm(self.embed[torch.tensor(next_tokens)].float(), self.input_norm)
        x = torch.cat([emb, self._norm(hidden, self.hidden_norm)], dim=-1)
        n_qk = c.n_heads + c.n_kv_heads
        qkv = self.qkv(x).view(rows, n_qk + c.n_kv_heads, c.head_dim)
        cos, sin = self.rotary.cos[rope_t].unsqueeze(1), self.rotary.sin[rope_t].unsqueeze(1)
        qk = RotaryTable.rotate(qkv[:, :n_qk], cos, sin)
        q, k, v = qk[:, : c.n_heads], qk[:, c.n_heads :], qkv[:, n_qk:]
        attn = self.attend(cache, q, k, v, positions, tree)
        x = hidden + self.o(attn.reshape(rows, -1))
        gate, up = self.gate_up(self._norm(x, self.post_norm)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)

    def logits(self, feats: torch.Tensor) -> torch.Tensor:
        """Pre-norm outputs -> (..., N) logits over the draft vocabulary (`self.vocab`: full ids)."""
        return self.lm_head(self._norm(feats.float(), self.out_norm))
