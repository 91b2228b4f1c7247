"""The EAGLE-style draft head: one decoder layer over (target feature, next-token embedding).

At position t the head reads the target's final hidden state f_t (after the final norm: what
the LM head reads) and the embedding of the token x_{t+1} that follows it, fuses them with one
linear layer (a head with `feature_layers` first fuses f_t with the target's residual stream
after those layers, low, middle and high, as EAGLE-3 does: one linear over the RMS-normalised
taps and f_t), runs one Llama decoder layer (attention over its own KV cache, MLP) and a final
RMSNorm, and predicts f_{t+1}. Logits come from the target's frozen LM head, restricted to a
draft vocabulary (the most frequent target tokens in the training data, mapped back to full
ids): the LM head over the full vocabulary would be the dominant cost of a draft step.

`EagleHead` is the trainable torch module (fp32, autograd); `EagleRuntime` is the inference
path over the same weights, using the engine's CPU kernels where they build.
A head is saved as `head.safetensors` + `config.json`; the config names the target it belongs
to (model name, vocab and hidden sizes, a hash of the LM head weights) and loading it for
another target is a ValueError.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from openalice_runner.engine.attention import attention_visible
from openalice_runner.engine.cpu_kernels import cpu_kernels
from openalice_runner.engine.llama import Linear, LlamaModel, RotaryTable
from openalice_runner.engine.tree import TreeMask

HEAD_FILE = "head.safetensors"
CONFIG_FILE = "config.json"
FORMAT_VERSION = 1


def lm_head_hash(model: LlamaModel) -> str:
    """sha256 (16 hex) of the LM head weights rounded to bf16: equal for a bf16 and an fp32 load."""
    w = model.lm_head.weight.detach().to(torch.bfloat16).contiguous()
    return hashlib.sha256(w.view(torch.int16).numpy().tobytes()).hexdigest()[:16]


def target_fingerprint(model_name: str, model: LlamaModel) -> dict:
    cfg = model.cfg
    return {
        "name": model_name,
        "vocab_size": cfg.vocab_size,
        "hidden": cfg.hidden,
        "n_layers": cfg.n_layers,
        "lm_head_sha256": lm_head_hash(model),
    }


def check_target(expected: dict, model_name: str, model: LlamaModel, where: str = "") -> None:
    """ValueError naming the first field where the head's target differs from this model."""
    actual = target_fingerprint(model_name, model)
    for key in ("name", "vocab_size", "hidden", "n_layers", "lm_head_sha256"):
        if expected.get(key) != actual[key]:
            raise ValueError(
                f"EAGLE head {where or ''} was trained for another target: {key} is "
                f"{expected.get(key)!r} in the head's config, {actual[key]!r} for the loaded model "
                f"{model_name!r}; train a head for this model with `openalice-runner draft train`"
            )


@dataclass
class HeadConfig:
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    rope_theta: float
    max_positions: int
    target: dict  # target_fingerprint
    draft_vocab: list[int]  # full ids of the draft vocabulary, in head-logit order
    format_version: int = FORMAT_VERSION
    trained: dict | None = None  # training figures (minutes, loss, held-out acceptance, data)
    feature_layers: list[int] | None = None  # target layers fused with f_t (EAGLE-3); None: f_t alone

    @property
    def taps(self) -> tuple[int, ...]:
        return tuple(self.feature_layers or ())

    @property
    def feature_width(self) -> int:
        """Width of a target feature row as stored and observed: taps, then f_t."""
        return (len(self.taps) + 1) * self.hidden

    @classmethod
    def for_target(cls, model_name: str, model: LlamaModel, draft_vocab: list[int],
                   intermediate: int | None = None, feature_layers: list[int] | None = None) -> HeadConfig:
        cfg = model.cfg
        check_feature_layers(feature_layers, cfg.n_layers)
        return cls(
            hidden=cfg.hidden, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
            intermediate=intermediate or cfg.intermediate, eps=cfg.eps, rope_theta=cfg.rope_theta,
            max_positions=cfg.max_positions, target=target_fingerprint(model_name, model),
            draft_vocab=list(draft_vocab), feature_layers=list(feature_layers) if feature_layers else None,
        )


def default_feature_layers(n_layers: int) -> list[int]:
    """Low, middle and high taps as in EAGLE-3 (f_t, after the last layer, comes on top)."""
    return sorted({min(2, n_layers - 1), n_layers // 2, max(0, n_layers - 3)})


def check_feature_layers(layers: list[int] | None, n_layers: int) -> None:
    for i in layers or ():
        if not 0 <= i < n_layers:
            raise ValueError(f"feature_layers: layer {i} is outside 0..{n_layers - 1} of the target")


def fuse_input(feats: torch.Tensor, hidden: int, eps: float) -> torch.Tensor:
    """(..., (k+1)H) taps + f_t -> the fuse layer's input: each tap RMS-normalised (residual
    streams differ in scale by orders of magnitude across layers), f_t as it is."""
    if feats.shape[-1] == hidden:
        return feats
    taps = feats[..., :-hidden].unflatten(-1, (-1, hidden))
    taps = taps * torch.rsqrt(taps.pow(2).mean(-1, keepdim=True) + eps)
    return torch.cat([taps.flatten(-2), feats[..., -hidden:]], dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class EagleHead(nn.Module):
    """Trainable head. `forward_unrolled` trains the γ-step chain the drafter runs (see there)."""

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.attn_norm = RMSNorm(h, cfg.eps)
        self.qkv = nn.Linear(h, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim, bias=False)
        self.o = nn.Linear(cfg.n_heads * cfg.head_dim, h, bias=False)
        self.mlp_norm = RMSNorm(h, cfg.eps)
        self.gate_up = nn.Linear(h, 2 * cfg.intermediate, bias=False)
        self.down = nn.Linear(cfg.intermediate, h, bias=False)
        self.out_norm = RMSNorm(h, cfg.eps)
        self.fuse = nn.Linear(cfg.feature_width, h, bias=False) if cfg.taps else None
        self._rotary: RotaryTable | None = None

    def fused(self, feats: torch.Tensor) -> torch.Tensor:
        """Target feature rows (..., feature_width) -> (..., H); H-wide rows (the head's own
        predictions) pass as they are."""
        if self.fuse is None or feats.shape[-1] == self.cfg.hidden:
            return feats
        return self.fuse(fuse_input(feats, self.cfg.hidden, self.cfg.eps))

    def init_from_target(self, model: LlamaModel) -> None:
        """Start from the target's last layer and final norm; fc passes the feature through."""
        last = model.layers[-1]
        with torch.no_grad():
            h = self.cfg.hidden
            self.fc.weight.zero_()
            self.fc.weight[:, h:] = torch.eye(h)
            self.fc.weight[:, :h].normal_(0.0, 0.02)
            self.attn_norm.weight.copy_(last.attn_norm)
            self.mlp_norm.weight.copy_(last.mlp_norm)
            self.out_norm.weight.copy_(model.norm)
            if self.fuse is not None:  # starts as f_t alone, with a little of each tap
                self.fuse.weight.normal_(0.0, 0.02)
                self.fuse.weight[:, -h:] = torch.eye(h)
            if self.cfg.intermediate == model.cfg.intermediate:
                self.qkv.weight.copy_(last.qkv.weight.float())
                self.o.weight.copy_(last.o.weight.float())
                self.gate_up.weight.copy_(last.gate_up.weight.float())
                self.down.weight.copy_(last.down.weight.float())

    def rotary(self) -> RotaryTable:
        if self._rotary is None:
            c = self.cfg
            self._rotary = RotaryTable(c.head_dim, c.rope_theta, c.max_positions, torch.float32)
        return self._rotary

    # ---- training forward -------------------------------------------------------------------
    def _qkv(self, x: torch.Tensor, pos: torch.Tensor):
        c = self.cfg
        n = x.shape[0]
        h = self.attn_norm(x)
        qkv = self.qkv(h).view(n, c.n_heads + 2 * c.n_kv_heads, c.head_dim)
        rot = self.rotary()
        cos, sin = rot.cos[pos].unsqueeze(1), rot.sin[pos].unsqueeze(1)
        n_qk = c.n_heads + c.n_kv_heads
        qk = RotaryTable.rotate(qkv[:, :n_qk], cos, sin)
        q, k, v = qk[:, : c.n_heads], qk[:, c.n_heads :], qkv[:, n_qk:]
        group = c.n_heads // c.n_kv_heads
        return q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)

    def _finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        x = x + self.o(attn.reshape(x.shape[0], -1))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        x = x + self.down(F.silu(gate) * up)
        return self.out_norm(x)

    def forward_unrolled(self, feats: torch.Tensor, next_emb: torch.Tensor, steps: int,
                         start: int = 0) -> list[torch.Tensor]:
        """One window at positions start..start+L-1: feats (L, feature_width) are its target
        features (f_t, with taps first where the head fuses them) and next_emb (L, H) embeds
        the tokens x_{t+1} that follow them.

        Returns per step s = 1..steps the predictions (L, H), where row t of step s predicts
        f_{t+1} as the drafter's s-th step does: step 1 reads the true f_t; step s > 1 reads
        step s-1's prediction of f_t (made at row t-1) and attends to true entries at rows
        <= t-s+1 and to steps 2..s's own entries at rows t-s+2..t (EAGLE-3's training-time
        test). Rows t < s-1 of step s are meaningless; callers mask them.
        """
        c = self.cfg
        length = feats.shape[0]
        pos = torch.arange(start, start + length)
        scale = c.head_dim**-0.5
        feats = self.fused(feats)
        x = self.fc(torch.cat([next_emb, feats], dim=-1))
        q, k1, v1 = self._qkv(x, pos)  # (L, heads, D)
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        attn = F.scaled_dot_product_attention(
            q.transpose(0, 1), k1.transpose(0, 1), v1.transpose(0, 1), attn_mask=causal
        ).transpose(0, 1)
        out = [self._finish(x, attn)]
        extra_k: list[torch.Tensor] = []  # keys/values of steps 2..s, row-aligned
        extra_v: list[torch.Tensor] = []
        for _ in range(2, steps + 1):  # step s = len(extra_k) + 2
            prev = out[-1]
            shifted = torch.cat([feats[:1], prev[:-1]], dim=0)  # row t: step s-1's prediction of f_t
            x = self.fc(torch.cat([next_emb, shifted], dim=-1))
            q, k, v = self._qkv(x, pos)
            extra_k.append(k)
            extra_v.append(v)
            out.append(self._finish(x, ttt_attention(q, k1, v1, extra_k, extra_v, pos, scale)))
        return out

    # ---- persistence ---------------------------------------------------------------------------
    def save(self, folder: str | Path) -> Path:
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().float().contiguous() for k, v in self.state_dict().items()}
        save_file(tensors, str(folder / HEAD_FILE))
        (folder / CONFIG_FILE).write_text(json.dumps(asdict(self.cfg), indent=1))
        return folder


def ttt_attention(q: torch.Tensor, k1: torch.Tensor, v1: torch.Tensor, extra_k: list[torch.Tensor],
                  extra_v: list[torch.Tensor], pos: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of unrolled step s = len(extra_k) + 1 >= 2 (training-time test): row t attends the
    true keys k1 at rows j <= t-s+1 and the keys of steps r = 2..s (extra_k[r-2]) at row t-s+r,
    the entries the drafter's chain wrote before it. q, k, v: (L, heads, D) (KV heads repeated)."""
    s = len(extra_k) + 1
    length = q.shape[0]
    # scores against true keys j <= t-s+1
    scores = torch.einsum("thd,jhd->htj", q, k1) * scale
    mask = pos.view(1, -1) <= (pos - (s - 1)).view(-1, 1)
    scores = scores.masked_fill(~mask.unsqueeze(0), float("-inf"))
    # scores against steps r = 2..s at rows t-s+r (shift by s-r)
    diag = []
    for r, kr in enumerate(extra_k, start=2):
        diag.append((q * _shift_rows(kr, s - r)).sum(-1).transpose(0, 1) * scale)  # (heads, L)
    all_scores = torch.cat([scores, torch.stack(diag, dim=-1)], dim=-1)
    probs = torch.softmax(all_scores, dim=-1).nan_to_num(0.0)
    attn = torch.einsum("htj,jhd->thd", probs[..., :length], v1)
    for i, (r, vr) in enumerate(zip(range(2, s + 1), extra_v, strict=True)):
        attn = attn + probs[..., length + i].transpose(0, 1).unsqueeze(-1) * _shift_rows(vr, s - r)
    return attn


def _shift_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """Row t of the result is row t-n of x (zeros above)."""
    if n == 0:
        return x
    return torch.cat([torch.zeros_like(x[:n]), x[:-n]], dim=0)


def read_config(folder: str | Path) -> HeadConfig:
    folder = Path(folder).expanduser()
    path = folder / CONFIG_FILE
    if not path.is_file() or not (folder / HEAD_FILE).is_file():
        raise ValueError(f"eagle_head: {folder} is not a trained head (needs {CONFIG_FILE} and {HEAD_FILE}); "
                         "train one with `openalice-runner draft train`")
    raw = json.loads(path.read_text())
    if raw.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"eagle_head: {folder}: format_version {raw.get('format_version')!r}, "
                         f"this runner reads {FORMAT_VERSION}")
    return HeadConfig(**raw)


def load_head(folder: str | Path, model_name: str | None = None, model: LlamaModel | None = None) -> EagleHead:
    """The trained head in `folder`; with a target given, ValueError unless it belongs to it."""
    from safetensors.torch import load_file

    folder = Path(folder).expanduser()
    cfg = read_config(folder)
    if model is not None:
        check_target(cfg.target, model_name or "", model, where=str(folder))
    head = EagleHead(cfg)
    head.load_state_dict(load_file(str(Path(folder) / HEAD_FILE)))
    return head.eval()


class HeadRuntime:
    """What every head layout's runtime shares: a one-slot KV cache (`cfg` has n_kv_heads,
    head_dim, max_positions) and attention over it. A row attends the cache up to its own
    position, so rolling back is simply writing later positions again."""

    cfg: HeadConfig  # or eagle3.Eagle3Config: both have n_kv_heads, head_dim and max_positions
    attention_kernels = None
    scale: float = 1.0

    def share(self, model: LlamaModel, kernels) -> None:
        """What both layouts' runtimes take alike from the config and the target: the draft
        vocabulary's ids, the target's embedding, attention kernels, rotary table and scale."""
        c = self.cfg
        self.vocab = torch.tensor(c.draft_vocab, dtype=torch.long)
        self.embed = model.embed
        self.attention_kernels = (
            kernels if kernels is not None and kernels.attention_supports(c.n_heads, c.n_kv_heads, c.head_dim) else None
        )
        self.rotary = RotaryTable(c.head_dim, c.rope_theta, c.max_positions, torch.float32)
        self.scale = c.head_dim**-0.5
        self.draft_step_s: float | None = None  # EMA of one `step` of one row (the drafters time it)

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.eps))

    def new_cache(self, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (1, n_kv, max_len, D) for one sequence. Rows are written in position
        order before any row reads them, so the memory needs no clearing."""
        shape = (1, self.cfg.n_kv_heads, min(max_len, self.cfg.max_positions), self.cfg.head_dim)
        return torch.empty(shape), torch.empty(shape)

    def attend(self, cache: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               positions: list[int], tree: TreeMask | None) -> torch.Tensor:
        """Write the rows' keys and values at their places in the head's cache, then attend: each
        row sees the cache up to its own position (with `tree`, the keys the mask gives it)."""
        keys, values = cache
        rows = len(positions)
        pos_t = torch.tensor(positions)
        keys[0, :, pos_t] = k.transpose(0, 1)
        values[0, :, pos_t] = v.transpose(0, 1)
        if self.attention_kernels is not None:
            return self.attention_kernels.attention(q, keys, values, torch.zeros(rows, dtype=torch.long),
                                                    pos_t, self.scale, tree)
        if tree is not None:
            return attention_visible(q, keys, values, [0] * rows, positions, tree)
        start, span = positions[0], positions[-1] + 1
        mask = torch.arange(span).view(1, -1) <= (start + torch.arange(rows)).view(-1, 1)
        return F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), keys[:, :, :span], values[:, :, :span],
            attn_mask=mask, enable_gqa=True,
        )[0].transpose(0, 1)


class EagleRuntime(HeadRuntime):
    """Inference over a head's weights: rows of (feature, next token, position) -> predicted features.

    Weights are cast to the target's weight dtype and run through the engine's linear kernel
    where it builds. The head's KV cache is one slot; a row attends the cache up to its own
    position, so rolling back is simply writing later positions again.
    """

    def __init__(self, head: EagleHead, model: LlamaModel):
        c = head.cfg
        self.cfg = c
        self.model = model
        kernels = cpu_kernels()
        dtype = model.weight_dtype

        def lin(w: torch.Tensor) -> Linear:
            return Linear(w.detach().to(dtype).contiguous(), None, dtype == torch.bfloat16, kernels)

        self.fc = lin(head.fc.weight)
        self.fuse = lin(head.fuse.weight) if head.fuse is not None else None
        self.qkv = lin(head.qkv.weight)
        self.o = lin(head.o.weight)
        self.gate_up = lin(head.gate_up.weight)
        self.down = lin(head.down.weight)
        self.attn_norm = head.attn_norm.weight.detach().float().clone()
        self.mlp_norm = head.mlp_norm.weight.detach().float().clone()
        self.out_norm = head.out_norm.weight.detach().float().clone()
        self.share(model, kernels)
        self.lm_sub = Linear(model.lm_head.weight[self.vocab].contiguous(), None, dtype == torch.bfloat16, kernels)

    @torch.inference_mode()
    def step(self, cache: tuple[torch.Tensor, torch.Tensor], feats: torch.Tensor, next_tokens: list[int],
             positions: list[int], tree: TreeMask | None = None) -> torch.Tensor:
        """Rows (feature f_t, token x_{t+1}, position t), consecutive positions -> predicted f_{t+1}.
        Features are the target's (feature_width wide) or the head's own predictions (H wide).
        With `tree`, `positions` are cache places and the mask gives each row's rotary position
        and the keys it sees (the nodes of a draft tree, each seeing its own ancestors)."""
        c = self.cfg
        rows = len(positions)
        pos_t = torch.tensor(positions)
        rope_t = pos_t if tree is None else tree.rope_pos
        feats = feats.float()
        if self.fuse is not None and feats.shape[-1] != c.hidden:
            feats = self.fuse(fuse_input(feats, c.hidden, c.eps))
        x = self.fc(torch.cat([self.embed[torch.tensor(next_tokens)].float(), feats], dim=-1))
        h = self._norm(x, self.attn_norm)
        n_qk = c.n_heads + c.n_kv_heads
        qkv = self.qkv(h).view(rows, n_qk + c.n_kv_heads, c.head_dim)
        cos, sin = self.rotary.cos[rope_t].unsqueeze(1), self.rotary.sin[rope_t].unsqueeze(1)
        qk = RotaryTable.rotate(qkv[:, :n_qk], cos, sin)
        q, k, v = qk[:, : c.n_heads], qk[:, c.n_heads :], qkv[:, n_qk:]
        attn = self.attend(cache, q, k, v, positions, tree)
        x = x + self.o(attn.reshape(rows, -1))
        gate, up = self.gate_up(self._norm(x, self.mlp_norm)).chunk(2, dim=-1)
        x = x + self.down(F.silu(gate) * up)
        return self._norm(x, self.out_norm)

    def logits(self, feats: torch.Tensor) -> torch.Tensor:
        """(..., N) logits over the draft vocabulary (`self.vocab` maps them to full ids)."""
        return self.lm_sub(feats)
