"""The engine's CPU kernels (linear, attention, the per-row layer steps, greedy argmax): right
results, the same bits for any row count, and a clean fallback to torch where they are turned
off."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from openalice_runner.engine import Engine, SamplingParams, SpecConfig
from openalice_runner.engine.cpu_kernels import DISABLE_ENV, cpu_kernels, unavailable_reason
from openalice_runner.engine.llama import LlamaModel


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 17, 40])
@pytest.mark.parametrize("n", [40, 37])  # 40: two full panels and a half one; 37: padded to 40
def test_matches_torch(kernels, dtype, rows, n):
    torch.manual_seed(rows)
    weight = torch.randn(n, 600).to(dtype)  # K = 600: two full k blocks and a short one
    x = torch.randn(rows, 600)
    expected = x.double() @ weight.double().T
    got = kernels.linear(x, kernels.pack(weight))
    assert got.dtype == torch.float32 and got.shape == (rows, n) and got.is_contiguous()
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [104, 232])  # 6 or 14 full panels and a half one: one and two rows take several at once
def test_row_results_do_not_depend_on_row_count(kernels, dtype, n):
    """A row gets the same bits alone (decode), among a few (verify, a batch) or among many
    (prefill), wherever it falls in the register tiles."""
    torch.manual_seed(0)
    weight = kernels.pack(torch.randn(n, 520).to(dtype))
    x = torch.randn(23, 520)
    alone = [kernels.linear(x[r : r + 1], weight)[0] for r in range(23)]
    for first, end in [(0, 2), (0, 5), (0, 6), (0, 7), (0, 8), (0, 9), (0, 13), (0, 23), (3, 11), (5, 23)]:
        together = kernels.linear(x[first:end], weight)
        for r in range(first, end):
            assert torch.equal(alone[r], together[r - first]), (first, end, r)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_no_rows_give_an_empty_result(kernels, dtype):
    """A pass may hold no rows of a linear: nothing is written (one- and two-row tiles do not run)."""
    weight = kernels.pack(torch.randn(232, 520).to(dtype))
    got = kernels.linear(torch.randn(0, 520), weight)
    assert got.shape == (0, 232)


_LINEAR_BITS = """
import sys, torch
from openalice_runner.engine.cpu_kernels import cpu_kernels
k = cpu_kernels()
g = torch.Generator().manual_seed(0)
out = {"wide": k.wide, "y": []}
for n, depth in [(104, 520), (40, 600), (64, 64), (8, 16)]:
    weight = k.pack(torch.randn(n, depth, generator=g).to(torch.bfloat16))
    for rows in (1, 2, 6, 7, 12, 13, 25):
        out["y"].append(k.linear(torch.randn(rows, depth, generator=g), weight))
out["silu"] = [k.silu_mul(torch.randn(rows, 2 * inter, generator=g) * 8) for rows in (1, 40) for inter in (8, 24, 1536)]
# decode attention in SmolLM2's shape (9 heads on 3 KV heads of 64): a step, a verify, a mixed batch
keys, values = torch.randn(3, 3, 300, 64, generator=g), torch.randn(3, 3, 300, 64, generator=g)
out["attention"] = []
for dtype in (torch.bfloat16, torch.float32):
    for runs in (((1, 0, 1),), ((1, 250, 9),), ((2, 33, 5), (0, 100, 1), (1, 7, 13))):
        slot = torch.cat([torch.full((n,), s, dtype=torch.long) for s, _, n in runs])
        pos = torch.cat([torch.arange(p, p + n) for _, p, n in runs])
        q = torch.randn(len(slot), 9, 64, generator=g)
        out["attention"].append(k.attention(q, keys.to(dtype), values.to(dtype), slot, pos, 0.125))
torch.save(out, sys.argv[1])
"""


def test_avx512_tile_gives_the_avx2_tiles_bits(kernels, tmp_path):
    """Where the CPU has AVX-512, bf16 linears run a wider register tile; every output must
    still be the AVX2 kernel's sum in the same order, so a machine's choice never changes a
    token. The choice is made once per process, so each side runs in its own."""
    if not kernels.wide:
        pytest.skip("this CPU has no AVX-512 (or OPENALICE_NATIVE_AVX512=0): only the AVX2 tile runs")
    got = {}
    for flag in ("1", "0"):
        path = tmp_path / f"linear-{flag}.pt"
        env = dict(os.environ, OPENALICE_NATIVE_AVX512=flag)
        subprocess.run([sys.executable, "-c", _LINEAR_BITS, str(path)], env=env, check=True, timeout=300)
        got[flag] = torch.load(path)
    assert got["1"]["wide"] and not got["0"]["wide"]
    assert len(got["1"]["y"]) == len(got["0"]["y"]) == 28
    for wide, narrow in zip(got["1"]["y"], got["0"]["y"], strict=True):
        assert torch.equal(wide, narrow)
    assert len(got["1"]["silu"]) == len(got["0"]["silu"]) == 6  # the SiLU gate's 16 lanes: the same bits too
    for wide, narrow in zip(got["1"]["silu"], got["0"]["silu"], strict=True):
        assert torch.equal(wide, narrow)
    # decode attention with a row's heads together (AVX-512 VL's registers): the same bits too
    assert len(got["1"]["attention"]) == len(got["0"]["attention"]) == 6
    for wide, narrow in zip(got["1"]["attention"], got["0"]["attention"], strict=True):
        assert torch.equal(wide, narrow)


def test_chunked_and_batched_prefill_equal_one_prefill(kernels):
    """A prompt fed in one pass, in chunks, or beside another sequence's decode row in the same
    pass leaves the same keys, values and last hidden state."""
    model = Engine.tiny_random(seed=3, dtype="bf16").model
    prompt = torch.randint(0, 1000, (30,))
    one = model.new_cache(2, 64)
    whole = model.forward(prompt.view(1, -1), one, [0])[0, -1]
    chunked = model.new_cache(2, 64)
    for first in range(0, 30, 7):
        part = model.forward(prompt[first : first + 7].view(1, -1), chunked, [0])[0, -1]
    assert torch.equal(part, whole)
    shared = model.new_cache(2, 64)
    model.forward(torch.tensor([[5, 6, 7]]), shared, [1])
    rows = model.forward_rows(torch.cat([torch.tensor([8]), prompt]), shared, [1] + [0] * 30, [3, *range(30)])
    assert torch.equal(rows[-1], whole)
    for layer in range(model.cfg.n_layers):
        assert torch.equal(shared.keys[layer][0, :, :30], one.keys[layer][0, :, :30])
        assert torch.equal(shared.values[layer][0, :, :30], one.values[layer][0, :, :30])


def test_batched_leading_dims_and_strided_input(kernels):
    weight = torch.randn(24, 32)
    x = torch.randn(2, 3, 64)[..., ::2]  # not contiguous: the kernel wrapper must copy it
    torch.testing.assert_close(kernels.linear(x, weight), x @ weight.T, rtol=1e-5, atol=1e-5)


def test_supports_only_what_the_kernel_handles(kernels):
    assert kernels.supports(torch.zeros(4, 16, dtype=torch.bfloat16))
    assert not kernels.supports(torch.zeros(4, 12))  # K not a multiple of 8
    assert not kernels.supports(torch.zeros(4, 16, dtype=torch.float16))
    assert not kernels.supports(torch.zeros(16, 4).T)  # not contiguous


def test_one_pass_equals_token_by_token_in_bf16(kernels):
    """What makes speculative output identical to plain decode in bf16: a verify pass over T
    tokens gives each position the same hidden state as T one-token decode steps."""
    engine = Engine.tiny_random(seed=1, dtype="bf16")
    model = engine.model
    assert model.native_kernels
    tokens = torch.randint(0, 1000, (1, 24))
    cache = model.new_cache(1, 64)
    model.forward(tokens[:, :16], cache)
    together = model.logits(model.forward(tokens[:, 16:], cache))
    cache.lengths[0] = 16
    one_by_one = torch.cat(
        [model.logits(model.forward(tokens[:, t : t + 1], cache)) for t in range(16, 24)], 1
    )
    assert torch.equal(together, one_by_one)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_attention_matches_sdpa_on_ragged_rows(kernels, cache_dtype):
    """Rows of three slots with different lengths and token counts in one call; the cache in
    fp32 or bf16 (which the kernel widens exactly, so SDPA gets the same widened values)."""
    torch.manual_seed(3)
    keys, values = torch.randn(3, 2, 40, 16).to(cache_dtype), torch.randn(3, 2, 40, 16).to(cache_dtype)
    row_slot = [2, 2, 2, 0, 1, 1, 1, 1, 1]
    row_pos = [30, 31, 32, 5, 0, 1, 2, 3, 4]  # a verify, a decode step, a prefill chunk
    q = torch.randn(len(row_slot), 4, 16)
    got = kernels.attention(q, keys, values, torch.tensor(row_slot), torch.tensor(row_pos), 0.25)
    for r, (slot, pos) in enumerate(zip(row_slot, row_pos, strict=True)):
        expected = torch.nn.functional.scaled_dot_product_attention(
            q[r].unsqueeze(1),
            keys[slot, :, : pos + 1].float(),
            values[slot, :, : pos + 1].float(),
            scale=0.25,
            enable_gqa=True,
        )
        torch.testing.assert_close(got[r], expected[:, 0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n_heads", "n_kv_heads", "dim"), [(9, 3, 64), (4, 2, 16)])  # SmolLM2's shape, another
def test_attention_rows_get_the_same_bits_alone_as_in_a_run(kernels, cache_dtype, n_heads, n_kv_heads, dim):
    """Consecutive rows of a slot are attended together in tiles (csrc/attention.c); a row still
    gets the bits it gets alone, wherever the tiles and key blocks fall. (That the tiles reduce
    scores as the tree rows' path does is what test_engine_tree's tree-equals-chain checks.)"""
    torch.manual_seed(4)
    keys = torch.randn(3, n_kv_heads, 48, dim).to(cache_dtype)
    values = torch.randn(3, n_kv_heads, 48, dim).to(cache_dtype)
    row_slot = [0] * 13 + [1] * 5 + [2, 2] + [0]
    row_pos = list(range(20, 33)) + list(range(7, 12)) + [0, 47] + [40]  # prefill, verify, decodes
    q = torch.randn(len(row_slot), n_heads, dim)
    together = kernels.attention(q, keys, values, torch.tensor(row_slot), torch.tensor(row_pos), 0.125)
    for r, (slot, pos) in enumerate(zip(row_slot, row_pos, strict=True)):
        alone = kernels.attention(q[r : r + 1], keys, values, torch.tensor([slot]), torch.tensor([pos]), 0.125)
        assert torch.equal(alone[0], together[r]), (r, slot, pos)


def test_attention_refuses_unsupported_shapes(kernels):
    assert not kernels.attention_supports(n_heads=6, n_kv_heads=4, head_dim=16)
    assert not kernels.attention_supports(n_heads=4, n_kv_heads=2, head_dim=12)
    with pytest.raises(ValueError, match="unsupported shape"):
        kernels.attention(
            torch.zeros(1, 4, 12), torch.zeros(1, 2, 8, 12), torch.zeros(1, 2, 8, 12),
            torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), 1.0,
        )  # fmt: skip


def test_turned_off_falls_back_to_torch(monkeypatch, kernels):
    monkeypatch.setenv(DISABLE_ENV, "0")
    assert cpu_kernels() is None
    assert DISABLE_ENV in unavailable_reason()
    engine = Engine.tiny_random(seed=2, dtype="fp32")
    assert not engine.model.native_kernels
    with pytest.raises(ValueError, match="native_kernels"):
        LlamaModel(engine.hf_model, native_kernels=True)
    # the fallback path decodes speculatively with the same greedy output
    prompt = engine.encode("a b c a b c a b c a b")
    sampling = SamplingParams(max_tokens=24)
    plain = engine.generate(prompt, sampling, SpecConfig(method="off"))
    assert engine.generate(prompt, sampling, SpecConfig(method="ngram", gamma=4)).token_ids == plain.token_ids


def test_bf16_model_keeps_a_bf16_cache_and_fp32_model_an_fp32_one(kernels):
    from openalice_runner.engine import Engine

    bf16 = Engine.tiny_random(dtype="bf16", max_batch=1).model.new_cache(1, 8)
    fp32 = Engine.tiny_random(dtype="fp32", max_batch=1).model.new_cache(1, 8)
    assert bf16.keys[0].dtype == bf16.values[0].dtype == torch.bfloat16
    assert fp32.keys[0].dtype == torch.float32


def test_add_rms_norm_matches_torch_and_adds_the_residual_in_place(kernels):
    torch.manual_seed(4)
    x, delta, weight = torch.randn(5, 64), torch.randn(5, 64), torch.randn(64)
    expected_x = x + delta
    expected = weight * (expected_x * torch.rsqrt(expected_x.pow(2).mean(-1, keepdim=True) + 1e-5))
    out = kernels.add_rms_norm(x, weight, 1e-5, delta=delta)
    torch.testing.assert_close(x, expected_x, rtol=0, atol=0)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    plain = kernels.add_rms_norm(expected_x.clone(), weight, 1e-5)
    torch.testing.assert_close(plain, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 40])  # 40: shared among the workers
def test_silu_mul_matches_torch(kernels, rows):
    torch.manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 24) * 6  # both signs, large magnitudes
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(kernels.silu_mul(gate_up), torch.nn.functional.silu(gate) * up, rtol=2e-6, atol=1e-6)


def test_argmax_is_torch_argmax_within_the_allowed_tokens(kernels):
    """The greedy choice per row, as torch's argmax over logits masked to -inf makes it: ties to
    the first index, tokens past the mask's width (a padded vocabulary) never chosen, a row with
    nothing allowed giving 0."""
    from openalice_runner.engine.grammar import masked_logits

    gen = torch.Generator().manual_seed(0)
    vocab, padded = 1000, 1011  # widths that leave a tail past the 8-lane blocks
    for trial in range(120):
        rows = 1 + trial % 13
        logits = torch.randn(rows, padded, generator=gen)
        if trial % 3 == 0:
            logits = torch.round(logits * 2) / 2  # many ties
        if trial % 4 == 0:
            assert kernels.argmax(logits) == logits.argmax(dim=-1).tolist()
            continue
        allowed = torch.rand(rows, vocab, generator=gen) > (0.5 if trial % 4 == 1 else 0.995)
        if trial % 4 == 3:
            allowed[0] = False  # nothing allowed in the first row
        assert kernels.argmax(logits, allowed) == masked_logits(logits, allowed).argmax(dim=-1).tolist(), trial


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_rope_store_rotates_q_and_k_and_writes_the_cache(kernels, cache_dtype):
    from openalice_runner.engine.llama import RotaryTable

    torch.manual_seed(5)
    n_heads, n_kv, dim = 4, 2, 16
    table = RotaryTable(dim, 10000.0, 64, torch.float32)
    qkv = torch.randn(3, n_heads + 2 * n_kv, dim)
    row_slot, row_pos = torch.tensor([1, 1, 0]), torch.tensor([7, 8, 30])
    keys = torch.zeros(2, n_kv, 40, dim, dtype=cache_dtype)
    values = torch.zeros_like(keys)
    original = qkv.clone()
    kernels.rope_store(qkv, table.cos, table.sin, row_slot, row_pos, n_heads, n_kv, keys, values)
    rotated = RotaryTable.rotate(
        original[:, : n_heads + n_kv], table.cos[row_pos].unsqueeze(1), table.sin[row_pos].unsqueeze(1)
    )
    torch.testing.assert_close(qkv[:, : n_heads + n_kv], rotated, rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv[:, n_heads + n_kv :], original[:, n_heads + n_kv :])  # v untouched
    for r, (slot, pos) in enumerate(zip(row_slot.tolist(), row_pos.tolist(), strict=True)):
        assert torch.equal(keys[slot, :, pos], qkv[r, n_heads : n_heads + n_kv].to(cache_dtype))
        assert torch.equal(values[slot, :, pos], original[r, n_heads + n_kv :].to(cache_dtype))
    assert int((keys != 0).any(-1).sum()) == 3 * n_kv  # nothing else written


def test_fused_forward_matches_the_torch_op_forward_and_transformers(kernels):
    """The kernels' layer steps compute what the torch-op path and transformers compute."""
    engine = Engine.tiny_random(seed=2, dtype="fp32", max_batch=1)
    fused = engine.model
    assert fused.rowwise_kernels is not None
    plain = LlamaModel(engine.hf_model)
    plain.rowwise_kernels = None
    tokens = torch.randint(0, 1000, (1, 20))
    out = [m.logits(m.forward(tokens, m.new_cache(1, 32))) for m in (fused, plain)]
    torch.testing.assert_close(out[0], out[1], rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        reference = engine.hf_model(tokens).logits
    torch.testing.assert_close(out[0], reference, rtol=1e-4, atol=1e-4)


def test_fused_weights_are_not_kept_beside_their_packed_copy(kernels):
    """Memory: where the kernels run a fused q/k/v or gate/up linear, the model keeps only the
    packed copy; `weight` is re-fused from the transformers module's tensors for other readers."""
    engine = Engine.tiny_random(seed=4, dtype="bf16")
    layer, hf_layer = engine.model.layers[0], engine.hf_model.model.layers[0]
    for linear, parts in ((layer.qkv, [hf_layer.self_attn.q_proj, hf_layer.self_attn.k_proj,
                                        hf_layer.self_attn.v_proj]),
                          (layer.gate_up, [hf_layer.mlp.gate_proj, hf_layer.mlp.up_proj])):  # fmt: skip
        assert linear.packed is not None and linear._weight is None
        assert torch.equal(linear.weight, torch.cat([p.weight for p in parts]))
    # a single weight is shared with the transformers module, not copied
    assert layer.o.weight.data_ptr() == hf_layer.self_attn.o_proj.weight.data_ptr()
