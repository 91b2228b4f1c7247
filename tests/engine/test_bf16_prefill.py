"""bf16 prefill: prompt rows run their linears with bf16 activations; every other row keeps its bits.

The bf16 path runs on any CPU: on the CPU's bf16 dot products (csrc/linear.c, AVX512-BF16, or AMX
tiles) where it has them, else emulated (the same bf16 products summed in fp32), so these tests check the
path everywhere; the kernel's own tests skip where the CPU lacks AVX512-BF16.

Exactness with it on: the target is the bf16-prefill model. A prompt's keys and values, and the
first token's logits, differ from fp32 prefill's (within the tolerances below), but decode,
verify and tree rows get the bits they get in any pass, so `policy` equals `off` token for token.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from openalice_runner.engine import SamplingParams, SpecConfig
from openalice_runner.engine.cpu_kernels import cpu_kernels
from openalice_runner.engine.llama import Linear, PromptRows
from openalice_runner.engine.prefill_choice import PREFILL_MODES, choose_prefill, resolve_mode

KERNELS = cpu_kernels()
ROOT = Path(__file__).resolve().parents[2]
# A hardware skip, not an install skip (tests/tiers.py): it stays a skip, with its reason, under CI=true.
needs_dot = pytest.mark.skipif(KERNELS is None or not KERNELS.bf16_dot, reason="the CPU has no AVX512-BF16")

# first-token logits of the real model, bf16 prefill against fp32 prefill, bf16 weights: at most
# this times the largest logit's magnitude (measured 0.003-0.004 with bf16 linears and attention:
# 0.107 of 27 on a random 1,000-token prompt, 0.086-0.131 of 31-33 on the workload's first six cases)
LOGIT_TOLERANCE = 0.01


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """bf16(x) @ w.T in float64: what the bf16 path approximates."""
    return x.to(torch.bfloat16).double() @ w.double().t()


@needs_dot
@pytest.mark.parametrize(("n", "k"), [(960, 576), (576, 1536), (40, 16), (24, 64)])
def test_dot_kernel_is_bf16_products_and_rows_independent(n, k):
    torch.manual_seed(n + k)
    w = (torch.randn(n, k) * 0.05).to(torch.bfloat16)
    packed = KERNELS.pack(w)
    for rows in (1, 7, 12, 25, 32, 33, 130):  # AMX blocks of 32 rows: within, at and past one
        x = torch.randn(rows, k)
        y = KERNELS.linear_bf16_rows(x, packed)
        exact = reference(x, w)
        # fp32 sums of k bf16 products: error well under k * 2^-24 of the products' magnitude
        bound = k * 2**-22 * (x.to(torch.bfloat16).double().abs() @ w.double().abs().t())
        assert ((y.double() - exact).abs() <= bound + 1e-30).all()
        # each row's bits do not depend on the others (a prompt's cache does not depend on its chunking)
        alone = torch.cat([KERNELS.linear_bf16_rows(x[i : i + 1], packed) for i in range(rows)])
        assert torch.equal(y, alone)


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(f.read().split())
    except OSError:
        return set()


def _linear_and_attention(kernels):
    """A prompt's linear and attention on `kernels`, with their fp32 references."""
    torch.manual_seed(5)
    w = (torch.randn(576, 1536) * 0.05).to(torch.bfloat16)
    x = torch.randn(45, 1536)
    keys = torch.randn(1, 3, 300, 64).to(torch.bfloat16)
    values = torch.randn(1, 3, 300, 64).to(torch.bfloat16)
    q = torch.randn(45, 9, 64)
    slot, pos = torch.zeros(45, dtype=torch.long), torch.arange(200, 245)
    return (kernels.linear_bf16_rows(x, kernels.pack(w)), kernels.attention_prompt(q, keys, values, slot, pos, 0.125),
            x, w, kernels.attention(q, keys, values, slot, pos, 0.125))


@needs_dot
def test_amx_tiles_run_prompt_rows_where_the_cpu_has_them():
    """On a CPU with AMX-BF16 (and a Linux that grants its state) prompt rows' linears and
    attention run on the tiles; OPENALICE_NATIVE_AMX=0 keeps them on `vdpbf16ps`. Both paths are
    bf16 products summed in fp32, each within its bound of the reference (the tests above), so
    the two agree within twice it, whichever this CPU runs."""
    import os
    import subprocess
    import sys
    import tempfile

    flags = _cpu_flags()
    assert KERNELS.amx == ("amx_bf16" in flags and "amx_tile" in flags)
    script = (
        "import sys, torch\n"
        "from openalice_runner.engine.cpu_kernels import cpu_kernels\n"
        "from tests.engine.test_bf16_prefill import _linear_and_attention\n"
        "k = cpu_kernels()\n"
        "torch.save((k.amx, *_linear_and_attention(k)[:2]), sys.argv[1])\n"
    )
    here, attention_here, x, w, fp32 = _linear_and_attention(KERNELS)
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "dp.pt")
        env = {**os.environ, "OPENALICE_NATIVE_AMX": "0"}
        subprocess.run([sys.executable, "-c", script, out], check=True, env=env, timeout=120, cwd=ROOT)
        amx_off, there, attention_there = torch.load(out)
    assert amx_off is False
    bound = 1536 * 2**-22 * (x.to(torch.bfloat16).double().abs() @ w.double().abs().t())
    assert ((there.double() - reference(x, w)).abs() <= bound + 1e-30).all()
    assert ((here.double() - there.double()).abs() <= 2 * bound + 1e-30).all()
    assert (attention_there - fp32).abs().max().item() < 0.03
    assert (attention_here - attention_there).abs().max().item() < 0.06


@needs_dot
def test_dot_kernel_refuses_fp32_weights():
    with pytest.raises(ValueError, match="bf16 weight"):
        KERNELS.linear_bf16_rows(torch.randn(2, 16), KERNELS.pack(torch.randn(8, 16)))


@pytest.mark.parametrize("dot", [False, True])
def test_mixed_pass_keeps_other_rows_bits(dot):
    if dot and (KERNELS is None or not KERNELS.bf16_dot):
        pytest.skip("the CPU has no AVX512-BF16")
    torch.manual_seed(1)
    w = (torch.randn(48, 64) * 0.05).to(torch.bfloat16)
    lin = Linear(w, None, split_multi_row=True, kernels=KERNELS)
    if not dot:
        lin.bf16_dot = False  # the emulation every CPU runs
    x = torch.randn(10, 64)
    prompt = PromptRows.of([(2, 6), (8, 10)], 10)
    mixed = lin(x, prompt)
    plain = lin(x)
    others = [0, 1, 6, 7]
    assert torch.equal(mixed[others], plain[others])  # decode rows: the fp32 path's bits
    rows = [2, 3, 4, 5, 8, 9]
    assert torch.equal(mixed[rows], lin(x[rows], PromptRows(True)))
    assert torch.allclose(mixed[rows].double(), reference(x[rows], w), rtol=0, atol=1e-5)
    assert PromptRows.of([], 10) is None and PromptRows.of([(0, 10)], 10).all


def test_choice_modes():
    assert resolve_mode(None) in PREFILL_MODES
    with pytest.raises(ValueError, match="prefill must be one of"):
        resolve_mode("fp16")
    assert not choose_prefill("fp32", torch.bfloat16, KERNELS).bf16
    assert choose_prefill("bf16", torch.float32, None).bf16
    auto_fp32 = choose_prefill("auto", torch.float32, KERNELS)
    assert not auto_fp32.bf16 and "weights" in auto_fp32.reason
    assert not choose_prefill("auto", torch.bfloat16, None).bf16

    class NoDot:
        bf16_dot = False

    no_dot = choose_prefill("auto", torch.bfloat16, NoDot())
    assert not no_dot.bf16 and "AVX512-BF16" in no_dot.reason
    expected = KERNELS is not None and KERNELS.bf16_dot
    assert choose_prefill("auto", torch.bfloat16, KERNELS).bf16 == expected


def test_engine_refuses_unknown_mode(tiny_engine):
    from openalice_runner.engine import Engine

    with pytest.raises(ValueError, match="prefill must be one of"):
        Engine(tiny_engine.hf_model, tiny_engine.tokenizer, "tiny", "fp32", prefill="half")


def test_local_config_prefill_setting():
    from pydantic import ValidationError

    from openalice_runner.providers.embedded.config import EmbeddedConfig

    assert EmbeddedConfig(type="local").prefill == "auto"
    assert EmbeddedConfig(type="local", prefill="fp32").prefill == "fp32"
    with pytest.raises(ValidationError, match="prefill"):
        EmbeddedConfig(type="local", prefill="fast")


@needs_dot
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 32), (8, 2, 128)])
def test_prompt_attention_kernel_near_fp32_and_rows_independent(heads, kv_heads, dim):
    torch.manual_seed(dim)
    keys = torch.randn(2, kv_heads, 700, dim).to(torch.bfloat16)
    values = torch.randn(2, kv_heads, 700, dim).to(torch.bfloat16)
    keys[:, :, 650:] = float("nan")  # past every row's keys: must never be read into a result
    values[:, :, 650:] = float("nan")
    for start, rows in ((0, 5), (3, 16), (100, 37), (0, 600)):
        q = torch.randn(rows, heads, dim)
        slot, pos = torch.ones(rows, dtype=torch.long), torch.arange(start, start + rows)
        fp32 = KERNELS.attention(q, keys, values, slot, pos, dim**-0.5)
        ours = KERNELS.attention_prompt(q, keys, values, slot, pos, dim**-0.5)
        # q and the softmax weights in bf16 (relative 2^-9 each): outputs, averages of unit
        # normal values, within 0.03 (measured at most 0.01)
        assert (ours - fp32).abs().max().item() < 0.03, (start, rows)
        picks = list(range(0, rows, max(1, rows // 5)))
        alone = torch.cat([KERNELS.attention_prompt(q[i : i + 1], keys, values, slot[i : i + 1], pos[i : i + 1],
                                                    dim**-0.5) for i in picks])
        assert torch.equal(alone, ours[picks])


@needs_dot
def test_prompt_attention_declines_what_it_does_not_run():
    q = torch.randn(3, 4, 16)
    cache = torch.randn(1, 2, 8, 16)
    assert KERNELS.attention_prompt(q, cache, cache, torch.zeros(3, dtype=torch.long), torch.arange(3), 0.25) is None
    bf16 = cache.to(torch.bfloat16)  # head_dim 16: not a multiple of 32
    assert KERNELS.attention_prompt(q, bf16, bf16, torch.zeros(3, dtype=torch.long), torch.arange(3), 0.25) is None


def _small_llama(head_dim: int):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from openalice_runner.engine.model_loading import converted_folder, resolve_model_source

    tokenizer = AutoTokenizer.from_pretrained(converted_folder(resolve_model_source(None)))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=2 * head_dim, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=head_dim, max_position_embeddings=1024,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(3)
    return LlamaForCausalLM(config).to(torch.bfloat16).eval(), tokenizer


@pytest.fixture(scope="module", params=[16, 64])
def tiny_bf16(request):
    """A small random bf16 model (head_dim 16: fp32 attention; 64: the bf16 prompt attention where
    the CPU runs it), bf16 prefill on (kernel or emulation), serial and batching."""
    from openalice_runner.engine import Engine

    hf_model, tokenizer = _small_llama(request.param)
    serial = Engine(hf_model, tokenizer, "tiny", "bf16", max_batch=1, prefill="bf16")
    batching = Engine(hf_model, tokenizer, "tiny", "bf16", max_batch=4, prefill="bf16")
    return serial, batching


def test_policy_equals_off_with_bf16_prefill(tiny_bf16):
    prompt_text = "the cat sat on the mat. the cat sat on the mat. the cat sat on the"
    for engine in tiny_bf16:
        assert engine.model.prefill_bf16
        prompt = engine.encode(prompt_text)
        sampling = SamplingParams(max_tokens=40)
        off = engine.generate(prompt, sampling, SpecConfig(method="off"))
        for method, gamma in (("ngram", 4), ("draft", 3)):
            spec = engine.generate(prompt, sampling, SpecConfig(method=method, gamma=gamma))
            assert spec.token_ids == off.token_ids, (engine.max_batch, method)


def test_batched_decode_rows_keep_bits_beside_a_prefill_chunk(tiny_bf16):
    # a decode row's hidden state is the same whether a prompt chunk shares its pass or not
    serial, _ = tiny_bf16
    model = serial.model
    cache = model.new_cache(2, 64)
    prompt = torch.tensor(serial.encode("one two three four five six seven"))
    n = len(prompt)
    model.forward(prompt.view(1, -1), cache, [0], prompt=True)
    alone = model.forward_rows(torch.tensor([5]), cache, [0], [n])
    mixed = model.forward_rows(torch.cat([torch.tensor([5]), prompt]), cache, [0] + [1] * n, [n] + list(range(n)),
                               prompt_spans=[(1, 1 + n)])
    assert torch.equal(mixed[0], alone[0])
    # and the prompt rows there are the same as that prompt prefilled alone (rows independent)
    cache.lengths = [n, 0]
    again = model.forward(prompt.view(1, -1), cache, [1], prompt=True)[0]
    assert torch.equal(mixed[1:], again)


@pytest.mark.slow
def test_real_model_logits_and_greedy_replies(workload_path):
    """The default model in bf16: first-token logits of bf16 prefill within LOGIT_TOLERANCE of fp32
    prefill's, greedy replies on the workload's cases compared (reported, not asserted: a near tie
    may flip), and `policy` (n-gram) equal to `off` with bf16 prefill on."""
    from openalice_runner.bench.workload import load_workload, render_case
    from openalice_runner.engine import Engine

    engine = Engine.load(dtype="bf16", max_batch=1, prefill="bf16")
    model = engine.model
    identical, compared, report = 0, 0, []
    for case in load_workload(workload_path)[:6]:
        prompt = render_case(engine, case)
        sampling = SamplingParams(max_tokens=24)
        outs, firsts = {}, {}
        for bf16 in (False, True):
            model.prefill_bf16 = bf16
            cache = model.new_cache(1, len(prompt) + 8)
            hidden = None
            for i in range(0, len(prompt), 512):
                hidden = model.forward(torch.tensor([prompt[i : i + 512]]), cache, [0], prompt=True)
            firsts[bf16] = model.logits(hidden[0, -1])
            outs[bf16] = engine.generate(prompt, sampling, SpecConfig(method="off")).token_ids
        scale = firsts[False].abs().max().item()
        diff = (firsts[True] - firsts[False]).abs().max().item()
        assert diff <= LOGIT_TOLERANCE * scale, (case.id, diff, scale)
        policy = engine.generate(prompt, sampling, SpecConfig(method="ngram", gamma=5)).token_ids
        assert policy == outs[True], case.id  # model.prefill_bf16 is True here
        compared += 1
        identical += outs[True] == outs[False]
        report.append(f"{case.id}: {len(prompt)} prompt tokens, logit diff {diff:.4f} of {scale:.1f}, "
                      f"replies {'identical' if outs[True] == outs[False] else 'differ'}")
    print("\n".join(report) + f"\ngreedy replies identical to fp32 prefill: {identical}/{compared}")
