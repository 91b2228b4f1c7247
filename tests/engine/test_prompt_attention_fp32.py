"""Prompt rows' attention in fp32 tiles (csrc/attention.c, `attention_prompt_fp32`).

Where prompt rows run fp32 on a CPU whose decode attention is the AVX2 one, their attention runs
tiles of their own: near the decode kernel's result, and with bits that depend on each row's
position and the cache alone (so a prompt's cache does not depend on how it was chunked or what
shared its pass), but not the decode kernel's bits. Decode, verify and tree rows never run them,
so `policy` still equals `off` token for token. The kernel is AVX2 code: these tests run it on
every CPU with the kernels, turning the model's choice on where the CPU would not take it.
"""

from __future__ import annotations

import pytest
import torch

from openalice_runner.engine import Engine, SamplingParams, SpecConfig
from openalice_runner.engine.cpu_kernels import cpu_kernels

KERNELS = cpu_kernels()
# A hardware skip, not an install skip (tests/tiers.py): it stays a skip, with its reason, under CI=true.
pytestmark = pytest.mark.skipif(KERNELS is None, reason="the engine's CPU kernels do not run here (x86-64, AVX2)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 32), (8, 2, 128), (8, 1, 16)])
def test_near_the_decode_kernel_and_rows_independent(heads, kv_heads, dim, dtype):
    torch.manual_seed(dim + heads)
    keys = torch.randn(2, kv_heads, 700, dim).to(dtype)
    values = torch.randn(2, kv_heads, 700, dim).to(dtype)
    keys[:, :, 650:] = float("nan")  # past every row's keys: must never be read into a result
    values[:, :, 650:] = float("nan")
    scale = dim**-0.5
    for start, rows in ((0, 1), (0, 5), (3, 16), (100, 37), (0, 600), (620, 30)):
        q = torch.randn(rows, heads, dim)
        slot, pos = torch.ones(rows, dtype=torch.long), torch.arange(start, start + rows)
        decode = KERNELS.attention(q, keys, values, slot, pos, scale)
        ours = KERNELS.attention_prompt_fp32(q, keys, values, slot, pos, scale)
        # the same fp32 arithmetic summed in another order: outputs, averages of unit normal
        # values, within 1e-5 (measured under 4e-6)
        assert (ours - decode).abs().max().item() < 1e-5, (start, rows)
        # a row alone, or the rows from a later start (other tiles, other key blocks per tile),
        # give the same bits as in the whole run
        picks = list(range(0, rows, max(1, rows // 5)))
        alone = torch.cat([KERNELS.attention_prompt_fp32(q[i : i + 1], keys, values, slot[i : i + 1], pos[i : i + 1],
                                                         scale) for i in picks])
        assert torch.equal(alone, ours[picks]), (start, rows)
        k = min(3, rows - 1)
        later = KERNELS.attention_prompt_fp32(q[k:], keys, values, slot[k:], pos[k:], scale)
        assert torch.equal(later, ours[k:]), (start, rows)


def test_rows_of_two_slots_in_one_call_keep_their_bits():
    keys = torch.randn(3, 2, 300, 64).to(torch.bfloat16)
    values = torch.randn(3, 2, 300, 64).to(torch.bfloat16)
    q = torch.randn(50, 6, 64)
    slot = torch.tensor([2] * 20 + [0] * 30)
    pos = torch.cat([torch.arange(40, 60), torch.arange(200, 230)])
    both = KERNELS.attention_prompt_fp32(q, keys, values, slot, pos, 0.125)
    first = KERNELS.attention_prompt_fp32(q[:20], keys, values, slot[:20], pos[:20], 0.125)
    second = KERNELS.attention_prompt_fp32(q[20:], keys, values, slot[20:], pos[20:], 0.125)
    assert torch.equal(both, torch.cat([first, second]))


def test_declines_what_it_does_not_run():
    cache = torch.randn(1, 2, 8, 12)  # head_dim 12: not a multiple of 8
    q = torch.randn(3, 4, 12)
    assert KERNELS.attention_prompt_fp32(q, cache, cache, torch.zeros(3, dtype=torch.long), torch.arange(3), 0.25) is None
    cache = torch.randn(1, 1, 8, 16)  # 9 query heads to a KV head: more than the tiles take
    q = torch.randn(3, 9, 16)
    assert KERNELS.attention_prompt_fp32(q, cache, cache, torch.zeros(3, dtype=torch.long), torch.arange(3), 0.25) is None


@pytest.fixture(scope="module")
def tiny():
    """Serial and batching engines on a small random bf16 model (head_dim 16), fp32 prefill, the
    fp32 prompt attention on (where the CPU would not choose it: the tests run it everywhere)."""
    engines = [Engine.tiny_random(seed=5, dtype="bf16", max_batch=b) for b in (1, 4)]
    for engine in engines:
        engine.model.prefill_bf16 = False
        engine.model.prompt_attention_fp32 = True
    return engines


def test_the_model_takes_it_where_decode_attention_is_avx2():
    model = Engine.tiny_random(seed=5, dtype="bf16").model
    assert model.prompt_attention_fp32 == (not KERNELS.wide)
    assert model.prompt_kernels == (model.prefill_bf16 or not KERNELS.wide)


def test_policy_equals_off(tiny):
    prompt_text = "the cat sat on the mat. the cat sat on the mat. the cat sat on the"
    for engine in tiny:
        prompt = engine.encode(prompt_text)
        sampling = SamplingParams(max_tokens=40)
        off = engine.generate(prompt, sampling, SpecConfig(method="off"))
        for method, gamma in (("ngram", 4), ("draft", 3)):
            spec = engine.generate(prompt, sampling, SpecConfig(method=method, gamma=gamma))
            assert spec.token_ids == off.token_ids, (engine.max_batch, method)


def test_a_prompt_chunked_or_beside_a_decode_row_leaves_the_same_cache(tiny):
    model = tiny[0].model
    prompt = torch.randint(0, 1000, (40,))
    one = model.new_cache(2, 64)
    whole = model.forward(prompt.view(1, -1), one, [0], prompt=True)[0, -1]
    chunked = model.new_cache(2, 64)
    for first in range(0, 40, 7):
        part = model.forward(prompt[first : first + 7].view(1, -1), chunked, [0], prompt=True)[0, -1]
    assert torch.equal(part, whole)
    shared = model.new_cache(2, 64)
    model.forward(torch.tensor([[5, 6, 7]]), shared, [1])
    alone = model.forward_rows(torch.tensor([8]), shared, [1], [3])
    rows = model.forward_rows(torch.cat([torch.tensor([8]), prompt]), shared, [1] + [0] * 40, [3, *range(40)],
                              prompt_spans=[(1, 41)])
    assert torch.equal(rows[0], alone[0])  # the decode row keeps its bits beside the prompt
    assert torch.equal(rows[-1], whole)
    for layer in range(model.cfg.n_layers):
        assert torch.equal(shared.keys[layer][0, :, :40], one.keys[layer][0, :, :40])
        assert torch.equal(shared.values[layer][0, :, :40], one.values[layer][0, :, :40])


def test_prompt_rows_run_it_and_decode_rows_do_not(tiny, monkeypatch):
    model = tiny[0].model
    calls = {"prompt": 0, "decode": 0}
    cls = type(KERNELS)  # a frozen dataclass: its methods are counted on the class
    prompt_fn, decode_fn = cls.attention_prompt_fp32, cls.attention

    def counting(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(cls, "attention_prompt_fp32", counting("prompt", prompt_fn))
    monkeypatch.setattr(cls, "attention", counting("decode", decode_fn))
    cache = model.new_cache(1, 64)
    model.forward(torch.randint(0, 1000, (1, 9)), cache, [0], prompt=True)
    assert calls == {"prompt": model.cfg.n_layers, "decode": 0}
    model.forward(torch.randint(0, 1000, (1, 3)), cache, [0])  # a verify's rows
    assert calls == {"prompt": model.cfg.n_layers, "decode": model.cfg.n_layers}
