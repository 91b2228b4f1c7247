"""A lean forward pass for Llama-family decoders, on weights taken from a transformers model.

Why not call the transformers module: at one token per step on a CPU the model's own Python
overhead, the growing `DynamicCache` (a `torch.cat` per layer per step) and the LM head over
every position cost as much as the matmuls. Here the KV cache is preallocated and rolled back
by moving a position pointer (as in gpt-fast), q/k/v and gate/up are fused into one matmul
each, and logits are computed only for the positions the caller asks for.

Weights stay in the dtype asked for. Verifying γ draft tokens must cost about what decoding one
costs, and torch's matmuls do not give that on CPUs without bf16 arithmetic: there a bf16
matmul over several rows costs several times one row, and an fp32 one reads twice the bytes.
`Linear` therefore uses the engine's own kernel (cpu_kernels.py) where it builds: on weights
packed once at load, it reads the bf16 weight once for all rows, runs prefill at arithmetic
speed, and gives every row the same bits whatever the row count. Without it, `Linear` keeps an
fp32 copy of each bf16 weight for multi-row inputs and the bf16 weight for one-row decode.

bf16 prefill (`prefill_bf16`, chosen by prefill_choice.py): prompt rows, and only those, run
their linears with activations rounded to bf16, on the CPU's bf16 dot products where it has them
(about twice the fp32 kernel's arithmetic). Decode, verify and tree rows keep the fp32 kernel
and its same-bits-whatever-the-rows property, so speculation stays exact. Where prompt rows run
fp32 on an AVX2-only CPU, their attention runs fp32 tiles of its own (`prompt_attention_fp32`):
each row's bits depend on its position alone, but are not a decode row's.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from openalice_runner.engine import huge_pages
from openalice_runner.engine.attention import attention_by_runs, attention_visible, runs_of
from openalice_runner.engine.cpu_kernels import CpuKernels, cpu_kernels, unavailable_reason
from openalice_runner.engine.kv_cache import KVCache
from openalice_runner.engine.tree import TreeMask

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


def has_native_bf16() -> bool:
    """True where the CPU multiplies bf16 natively (AVX512-BF16 or AMX)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


class Linear:
    """y = x @ W.T for fp32 activations, choosing the kernel and weight copy by row count.

    With the engine's kernels every row count reads the packed weight once. Without them, one
    row (decode) reads the stored weight, bf16 where asked for, which halves the bytes moved;
    several rows (prefill, verify) use an fp32 copy where the CPU has no bf16 arithmetic, and
    tall weights (the LM head) multiply as W @ x.T, which MKL runs markedly faster than x @ W.T
    for a handful of rows.
    """

    __slots__ = ("_weight", "parts", "packed", "weight_rows", "bias", "tall", "kernels", "bf16_dot")

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        split_multi_row: bool,
        kernels: CpuKernels | None = None,
        parts: list[torch.Tensor] | None = None,
        arena: huge_pages.HugePageArena | None = None,
    ):
        """`parts`: tensors held elsewhere whose row-wise concatenation is `weight` (a fused
        q/k/v or gate/up). Where the kernels run this linear they read only the packed copy,
        so `weight` is not kept: other readers (an EAGLE head's initialisation) get it
        re-fused from `parts`, and the fused copy's memory goes back. `arena`: where the packed
        copy goes (huge pages: huge_pages.py)."""
        self._weight = weight.contiguous()
        self.parts = None
        self.bias = None if bias is None else bias.float()
        self.kernels = kernels if kernels is not None and kernels.supports(self._weight) else None
        # the kernels read their own layout, packed once here (`weight` stays for other readers)
        self.packed = None if self.kernels is None else self.kernels.pack(self._weight, arena)
        if self.kernels is not None and parts is not None:
            self._weight, self.parts = None, parts
        # fp32 copy for multi-row inputs (None: kernels in use, the stored weight is fp32
        # already, or the CPU multiplies bf16 natively)
        self.weight_rows = weight.float().contiguous() if split_multi_row and self.kernels is None else None
        self.tall = weight.shape[0] >= 8 * weight.shape[1]
        # prompt rows on the CPU's bf16 dot products (else emulated in fp32 on bf16-rounded inputs)
        self.bf16_dot = self.kernels is not None and self.packed.dtype == torch.bfloat16 and self.kernels.bf16_dot

    @property
    def weight(self) -> torch.Tensor:
        return self._weight if self._weight is not None else torch.cat(self.parts, dim=0)

    def __call__(self, x: torch.Tensor, prompt: PromptRows | None = None) -> torch.Tensor:
        """`prompt`: the rows of x that are prompt rows, run with bf16 activations (see the module)."""
        if prompt is not None:
            if prompt.all:
                return self._bf16_rows(x)
            y = self._fp32_rows(x[prompt.others])
            out = torch.empty(x.shape[0], y.shape[-1], dtype=torch.float32)
            out[prompt.others] = y
            out[prompt.rows] = self._bf16_rows(x[prompt.rows])
            return out
        return self._fp32_rows(x)

    def _bf16_rows(self, x: torch.Tensor) -> torch.Tensor:
        if self.bf16_dot:
            y = self.kernels.linear_bf16_rows(x, self.packed)
        else:  # the same products (bf16 x bf16 is exact in fp32), summed in fp32: any CPU, slowly
            y = F.linear(x.to(torch.bfloat16).float(), self.weight.float())
        return y if self.bias is None else y + self.bias

    def _fp32_rows(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            y = self.kernels.linear(x, self.packed)
        else:
            rows = x.numel() // x.shape[-1]
            if rows == 1:
                y = F.linear(x.to(self.weight.dtype), self.weight).float()
            elif self.weight_rows is None:
                y = self._matmul(x.to(self.weight.dtype), self.weight, rows).float()
            else:
                y = self._matmul(x, self.weight_rows, rows)
        return y if self.bias is None else y + self.bias

    def _matmul(self, x: torch.Tensor, w: torch.Tensor, rows: int) -> torch.Tensor:
        if self.tall:
            return (w @ x.reshape(rows, -1).t()).t().reshape(*x.shape[:-1], -1)
        return F.linear(x, w)


@dataclass(frozen=True)
class PromptRows:
    """Which rows of a pass are prompt rows (their own kernels: `LlamaModel.prompt_kernels`): all of
    them, or `rows` (the rest `others`)."""

    all: bool
    rows: torch.Tensor | None = None
    others: torch.Tensor | None = None

    @staticmethod
    def of(spans: list[tuple[int, int]], total: int) -> PromptRows | None:
        """From (first, end) row spans of a pass of `total` rows; None where there are none."""
        mask = torch.zeros(total, dtype=torch.bool)
        for first, end in spans:
            mask[first:end] = True
        count = int(mask.sum())
        if count == 0:
            return None
        if count == total:
            return PromptRows(True)
        return PromptRows(False, mask.nonzero().flatten(), (~mask).nonzero().flatten())


@dataclass
class Layer:
    attn_norm: torch.Tensor
    qkv: Linear
    o: Linear
    mlp_norm: torch.Tensor
    gate_up: Linear
    down: Linear


@dataclass
class LlamaConfig:
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab_size: int
    eps: float
    rope_theta: float
    max_positions: int


class RotaryTable:
    """cos/sin for every position up to the context length (HF rotate-half layout)."""

    def __init__(self, head_dim: int, theta: float, max_positions: int, dtype: torch.dtype):
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        emb = torch.cat([angles, angles], dim=-1)
        self.cos = emb.cos().to(dtype)
        self.sin = emb.sin().to(dtype)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (..., D) rotated by the angles whose cos/sin broadcast against it."""
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


class LlamaModel:
    """Tensor-in, tensor-out forward over a `KVCache`; no autograd, no module hooks."""

    def __init__(self, hf_model, split_multi_row: bool | None = None, native_kernels: bool | None = None,
                 prefill_bf16: bool = False):
        """`native_kernels`: None uses the engine's CPU kernels where they build, True requires
        them (ValueError naming why not), False uses torch's matmuls only. `prefill_bf16`: prompt
        rows (callers say which) run their linears with bf16 activations (the module's docstring;
        prefill_choice.py decides it from the CPU)."""
        config = hf_model.config
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {config.model_type!r} not supported by the lean forward")
        rope = getattr(config, "rope_parameters", None) or {}
        rope_type = rope.get("rope_type", "default") if isinstance(rope, dict) else "default"
        if rope_type != "default":
            raise ValueError(f"rope type {rope_type!r} not supported by the lean forward")
        theta = rope.get("rope_theta") if isinstance(rope, dict) else None
        theta = theta or getattr(config, "rope_theta", 10000.0)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.cfg = LlamaConfig(
            n_layers=config.num_hidden_layers,
            n_heads=config.num_attention_heads,
            n_kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            hidden=config.hidden_size,
            intermediate=config.intermediate_size,
            vocab_size=config.vocab_size,
            eps=config.rms_norm_eps,
            rope_theta=float(theta),
            max_positions=config.max_position_embeddings,
        )
        inner = hf_model.model
        self.weight_dtype = inner.embed_tokens.weight.dtype
        # Activations, norms and rotary tables stay fp32 whatever the weights: they are small,
        # and a CPU without bf16 arithmetic is faster on fp32 for them.
        self.dtype = torch.float32
        if split_multi_row is None:
            split_multi_row = self.weight_dtype == torch.bfloat16 and not has_native_bf16()
        kernels = None if native_kernels is False else cpu_kernels()
        if native_kernels and kernels is None:
            raise ValueError(
                f"native_kernels: the engine's CPU kernels are unavailable: {unavailable_reason()}"
            )
        self.native_kernels = kernels is not None
        self.linear_kernels = kernels  # what the Linears run on (prefill_choice asks it for bf16 dot products)
        usable = kernels is not None and kernels.attention_supports(
            self.cfg.n_heads, self.cfg.n_kv_heads, self.cfg.head_dim
        )
        self.attention_kernels = kernels if usable else None
        # the fused per-row steps go with the attention kernel (it reads what rope_store writes)
        rowwise = usable and kernels.rowwise_supports(self.cfg.hidden, self.cfg.intermediate, self.cfg.head_dim)
        self.rowwise_kernels = kernels if rowwise else None
        # A bf16 model keeps its KV cache in bf16, as transformers does: half the memory, and
        # half the bytes every decode step reads (the attention kernel widens them exactly).
        bf16_cache = self.weight_dtype == torch.bfloat16 and self.attention_kernels is not None
        self.kv_dtype = torch.bfloat16 if bf16_cache else torch.float32
        self.attention_scale = self.cfg.head_dim**-0.5
        self.prefill_bf16 = prefill_bf16
        # with it, prompt rows also run attention on the bf16 dot products (q and the softmax
        # weights in bf16); decode, verify and tree rows keep the fp32 attention
        self.attention_bf16 = kernels is not None and kernels.bf16_dot
        # Where prompt rows run fp32 on a CPU whose decode attention is the AVX2 one (no AVX-512),
        # their attention runs the fp32 prompt tiles (csrc/attention.c): bits that depend on the
        # row's position alone, as the decode kernel's, but not the same bits as a decode row's.
        # Not on AVX-512 CPUs, whose decode attention takes a row's heads together: not measured.
        self.prompt_attention_fp32 = self.attention_kernels is not None and not kernels.wide
        arena = huge_pages.HugePageArena() if huge_pages.enabled() else None  # every pass reads them all

        def linear(weights: list[torch.Tensor], biases: list[torch.Tensor | None] | None = None) -> Linear:
            # one weight is shared with the transformers module (no copy); several are fused,
            # and the fused copy is dropped where the kernels read their packed one instead
            parts = [t.detach() for t in weights]
            w = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
            b = None
            if biases and all(x is not None for x in biases):
                b = torch.cat([x.detach() for x in biases], dim=0)
            return Linear(w, b, split_multi_row, kernels, parts=parts if len(parts) > 1 else None, arena=arena)

        self.layers: list[Layer] = []
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(
                Layer(
                    attn_norm=layer.input_layernorm.weight.detach().float(),
                    qkv=linear(
                        [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight],
                        [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias],
                    ),
                    o=linear([attn.o_proj.weight]),
                    mlp_norm=layer.post_attention_layernorm.weight.detach().float(),
                    gate_up=linear([mlp.gate_proj.weight, mlp.up_proj.weight]),
                    down=linear([mlp.down_proj.weight]),
                )
            )
        self.embed = inner.embed_tokens.weight.detach()
        self.norm = inner.norm.weight.detach().float()
        self.lm_head = linear([hf_model.lm_head.weight])
        self.rotary = RotaryTable(self.cfg.head_dim, self.cfg.rope_theta, self.cfg.max_positions, self.dtype)

    def truncated(self, n_layers: int) -> LlamaModel:
        """A self-draft: the first `n_layers` layers with the final norm and LM head, sharing weights."""
        if not (1 <= n_layers <= self.cfg.n_layers):
            raise ValueError(f"draft layers must be in [1, {self.cfg.n_layers}], got {n_layers}")
        draft = copy.copy(self)
        draft.layers = self.layers[:n_layers]
        draft.cfg = dataclasses.replace(self.cfg, n_layers=n_layers)
        return draft

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def prompt_kernels(self) -> bool:
        """Whether prompt rows run kernels of their own (bf16 prefill's linears and attention, or
        the fp32 prompt attention tiles): callers mark them (`prompt_spans`, `prompt`)."""
        return self.prefill_bf16 or self.prompt_attention_fp32

    def new_cache(self, batch: int = 1, max_len: int | None = None) -> KVCache:
        return KVCache(self.cfg, batch, max_len or self.cfg.max_positions, self.kv_dtype)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.eps))

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: KVCache, slots: list[int] | None = None,
                taps: tuple[int, ...] = (), tree: TreeMask | None = None, prompt: bool = False):
        """Run `tokens` (B, T) appended at each slot's current length; returns hidden (B, T, H)
        (with `taps`, also the tapped residuals (B, T, len(taps) * H); `tree`: see `forward_rows`).
        `prompt`: the tokens are prompt tokens (their own kernels where the model has them: `prompt_kernels`).

        All sequences in the call append the same number T of tokens. Cache lengths advance
        by T; the caller rolls back rejected tokens by lowering `cache.lengths`.
        """
        batch, steps = tokens.shape
        slots = list(range(batch)) if slots is None else slots
        row_slot = [s for s in slots for _ in range(steps)]
        row_pos = [cache.lengths[s] + t for s in slots for t in range(steps)]
        spans = [(0, len(row_slot))] if prompt else None
        out = self.forward_rows(tokens.reshape(-1), cache, row_slot, row_pos, taps, tree, prompt_spans=spans)
        for s in slots:
            cache.lengths[s] += steps
        if taps:
            return out[0].view(batch, steps, -1), out[1].view(batch, steps, -1)
        return out.view(batch, steps, -1)

    @torch.inference_mode()
    def forward_rows(
        self, tokens: torch.Tensor, cache: KVCache, row_slot: list[int], row_pos: list[int],
        taps: tuple[int, ...] = (), tree: TreeMask | None = None,
        prompt_spans: list[tuple[int, int]] | None = None,
    ):
        """One row per token: row r is a token of slot `row_slot[r]` at position `row_pos[r]`,
        attending to that slot's cache up to and including itself. Returns hidden (R, H); with
        `taps` (layer indices), returns (hidden, tapped) where tapped (R, len(taps) * H) holds
        the residual stream after each of those layers (an EAGLE-3 head fuses them).

        Rows of many sequences, each feeding its own number of tokens (a decode step, a verify
        of γ drafts, a prefill chunk), share one pass. A slot's rows must be consecutive and in
        position order, and its cache must hold every earlier position. Each row's key and value
        are written at its position; `cache.lengths` is the caller's to move.

        `tree` (draft trees, tree.py): per row, its rotary position and the keys it sees, where
        these differ from a plain row's (a tree node's rotary position is its depth).

        `prompt_spans`: (first, end) spans of rows that are prompt rows; with `prefill_bf16` their
        linears take bf16 activations, and their attention runs the prompt kernels where the model
        has them (`prompt_kernels`). Other rows get the bits they would get in any pass.
        """
        cfg = self.cfg
        rows = len(row_slot)
        if max(row_pos) >= cache.max_len:
            raise ValueError(f"position {max(row_pos)} is beyond the cache of {cache.max_len}")
        slot_t = torch.tensor(row_slot)
        pos_t = torch.tensor(row_pos)
        tapped: list[torch.Tensor] = []
        prompt = PromptRows.of(prompt_spans, rows) if self.prompt_kernels and prompt_spans else None
        if self.rowwise_kernels is not None:
            hidden = self._forward_rows_fused(tokens, cache, slot_t, pos_t, taps, tapped, tree, prompt)
            return (hidden, torch.cat(tapped, dim=-1)) if taps else hidden
        rope_t = pos_t if tree is None else tree.rope_pos
        cos = self.rotary.cos[rope_t].unsqueeze(1)  # (R, 1, D), shared by every layer and head
        sin = self.rotary.sin[rope_t].unsqueeze(1)
        runs = None if self.attention_kernels is not None or tree is not None else runs_of(row_slot, row_pos)
        n_qk = cfg.n_heads + cfg.n_kv_heads
        bf16_rows = prompt if self.prefill_bf16 else None  # here prompt rows differ only in their linears
        x = self.embed[tokens].float()
        for i, layer in enumerate(self.layers):
            h = self._rms_norm(x, layer.attn_norm)
            qkv = layer.qkv(h, bf16_rows).view(rows, n_qk + cfg.n_kv_heads, cfg.head_dim)
            qk = RotaryTable.rotate(qkv[:, :n_qk], cos, sin)  # q and k heads in one go
            q, k, v = qk[:, : cfg.n_heads], qk[:, cfg.n_heads :], qkv[:, n_qk:]
            keys, values = cache.keys[i], cache.values[i]
            keys[slot_t, :, pos_t] = k.to(keys.dtype)
            values[slot_t, :, pos_t] = v.to(values.dtype)
            if self.attention_kernels is not None:
                attn = self.attention_kernels.attention(q, keys, values, slot_t, pos_t, self.attention_scale, tree)
            elif runs is None:
                attn = attention_visible(q, keys, values, row_slot, row_pos, tree)
            else:
                attn = attention_by_runs(q, keys, values, runs)
            x = x + layer.o(attn.reshape(rows, -1), bf16_rows)
            h = self._rms_norm(x, layer.mlp_norm)
            gate, up = layer.gate_up(h, bf16_rows).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up, bf16_rows)
            if i in taps:
                tapped.append(x)
        hidden = self._rms_norm(x, self.norm)
        return (hidden, torch.cat(tapped, dim=-1)) if taps else hidden

    def _forward_rows_fused(
        self, tokens: torch.Tensor, cache: KVCache, slot_t: torch.Tensor, pos_t: torch.Tensor,
        taps: tuple[int, ...] = (), tapped: list[torch.Tensor] | None = None, tree: TreeMask | None = None,
        prompt: PromptRows | None = None,
    ) -> torch.Tensor:
        """forward_rows on the engine's kernels throughout: the same steps, with each layer's
        norms (and residual adds), rotary embedding, cache write and SiLU gate one call each."""
        cfg, k = self.cfg, self.rowwise_kernels
        rows = len(tokens)
        bf16_rows = prompt if self.prefill_bf16 else None  # the rows whose linears take bf16 activations
        x = self.embed[tokens].float()  # the residual stream, updated in place
        h = k.add_rms_norm(x, self.layers[0].attn_norm, cfg.eps)
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv(h, bf16_rows).view(rows, cfg.n_heads + 2 * cfg.n_kv_heads, cfg.head_dim)
            keys, values = cache.keys[i], cache.values[i]
            k.rope_store(qkv, self.rotary.cos, self.rotary.sin, slot_t, pos_t, cfg.n_heads, cfg.n_kv_heads, keys, values,
                         None if tree is None else tree.rope_pos)
            attn = self._attention(k, qkv[:, : cfg.n_heads], keys, values, slot_t, pos_t, tree, prompt)
            h = k.add_rms_norm(x, layer.mlp_norm, cfg.eps, delta=layer.o(attn.reshape(rows, -1), bf16_rows))
            down = layer.down(k.silu_mul(layer.gate_up(h, bf16_rows)), bf16_rows)
            after = self.layers[i + 1].attn_norm if i + 1 < len(self.layers) else self.norm
            h = k.add_rms_norm(x, after, cfg.eps, delta=down)
            if i in taps:
                tapped.append(x.clone())  # x is updated in place by the next layer
        return h

    def _attention(self, k: CpuKernels, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   slot_t: torch.Tensor, pos_t: torch.Tensor, tree: TreeMask | None, prompt: PromptRows | None):
        """The kernels' attention; prompt rows on the prompt kernels where the model runs them (bf16
        prefill: the bf16 dot products; else the fp32 prompt tiles), with the same bits whatever
        else shares the pass: a prompt's cache does not depend on its pass."""
        scale = self.attention_scale
        if prompt is None:
            return k.attention(q, keys, values, slot_t, pos_t, scale, tree)
        if self.prefill_bf16 and self.attention_bf16 and keys.dtype == torch.bfloat16:
            prompt_attention = k.attention_prompt
        elif self.prompt_attention_fp32:
            prompt_attention = k.attention_prompt_fp32
        else:
            return k.attention(q, keys, values, slot_t, pos_t, scale, tree)
        if prompt.all and tree is None:
            out = prompt_attention(q, keys, values, slot_t, pos_t, scale)
            return out if out is not None else k.attention(q, keys, values, slot_t, pos_t, scale)
        rows = prompt.rows if not prompt.all else torch.arange(len(q))
        ours = prompt_attention(q[rows], keys, values, slot_t[rows], pos_t[rows], scale)
        if ours is None:
            return k.attention(q, keys, values, slot_t, pos_t, scale, tree)
        if tree is None:  # the other rows on their own
            out = torch.empty_like(q)
            others = prompt.others
            out[others] = k.attention(q[others], keys, values, slot_t[others], pos_t[others], scale)
        else:  # tree rows index the whole pass: run it whole, then put the prompt rows in
            out = k.attention(q, keys, values, slot_t, pos_t, scale, tree)
        out[rows] = ours
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits (sampling and acceptance tests want full precision probabilities)."""
        return self.lm_head(hidden)
