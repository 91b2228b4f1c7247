"""The embedded engine: a model, its tokenizer and the decode loop behind a small API."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator

import torch

from openalice_runner.engine.batching import BatchScheduler
from openalice_runner.engine.cost_model import PassCostModel
from openalice_runner.engine.drafters.base import Drafter
from openalice_runner.engine.drafters.draft_model import DraftModelDrafter
from openalice_runner.engine.drafters.ngram import NgramDrafter
from openalice_runner.engine.drafters.suffix import SuffixDrafter, TenantResponses
from openalice_runner.engine.generator import run_sequence
from openalice_runner.engine.grammar import Grammar, GrammarCompiler
from openalice_runner.engine.hf_model import HFCausalModel
from openalice_runner.engine.kv_cache import KVCache
from openalice_runner.engine.llama import LlamaModel
from openalice_runner.engine.model_loading import (
    DEFAULT_MODEL_NAME,
    converted_folder,
    load_hf_model,
    resolve_model_source,
)
from openalice_runner.engine.prefill_choice import PrefillChoice, choose_prefill, resolve_mode
from openalice_runner.engine.prefixes import HeldPrefixes
from openalice_runner.engine.round import round_rows
from openalice_runner.engine.sequence import SequenceRequest, Target, new_sequence
from openalice_runner.engine.slots import CACHE_GRANULE
from openalice_runner.engine.types import GenerationResult, SamplingParams, SpecConfig, StreamEvent

DTYPES = ("bf16", "fp32")
DEFAULT_MAX_BATCH = 8  # sequences decoded together (continuous batching); 1: one at a time
# The batching scheduler's KV cache at most (admission waits past it). `serve` on the default model
# holds ~1020 MiB besides it, so it stays near 1.4 GiB, under 1.5 GiB; that is two requests at the
# whole 8k context, or 8 of 2k (bf16, 23040 bytes a position) (docs/batching.md).
DEFAULT_KV_CACHE_BYTES = 384 * 2**20


def default_draft_layers(n_layers: int) -> int:
    # A quarter of the depth: enough to agree with the target often on easy tokens while
    # costing about a quarter of a target step.
    return max(1, n_layers // 4)


class Engine:
    def __init__(
        self,
        hf_model,
        tokenizer,
        model_name: str,
        dtype: str,
        context_length: int | None = None,
        max_batch: int = DEFAULT_MAX_BATCH,
        prefix_reuse: bool = False,
        kv_cache_bytes: int | None = DEFAULT_KV_CACHE_BYTES,
        prefill: str | None = None,
    ):
        """`max_batch` > 1 decodes concurrent requests together (batching.py); 1 runs them one
        at a time on the serial decode loop (generator.run_sequence). `prefix_reuse`: a request
        whose prompt starts like a finished one's tokens prefills only the rest (batching: the
        finished histories of the free slots; serial: the last request's; off by default so that benchmarks that run one prompt several times stay comparable).
        `kv_cache_bytes`: the most the batching KV cache may hold; a request that would take it past
        waits for running ones to finish (batching.py; None: unbounded). The serial loop holds one
        request's cache. `prefill`: auto, bf16 or fp32 (prefill_choice.py; None: $OPENALICE_PREFILL
        or auto): whether prompt rows run their linears with bf16 activations."""
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch!r}")
        if kv_cache_bytes is not None and kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be >= 1 or None, got {kv_cache_bytes!r}")
        self.hf_model = hf_model
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.dtype = dtype
        resolve_mode(prefill)  # a bad setting is refused whatever the model
        try:
            self.model = LlamaModel(hf_model)
            self.prefill = choose_prefill(prefill, self.model.weight_dtype, self.model.linear_kernels)
            self.model.prefill_bf16 = self.prefill.bf16
            max_positions = self.model.cfg.max_positions
        except ValueError:  # not a Llama-family layout: transformers' own forward
            self.model = HFCausalModel(hf_model)
            self.prefill = PrefillChoice(resolve_mode(prefill), False, "prefill: fp32, transformers' own forward")
            max_positions = self.model.max_positions
        self.torch_threads = torch.get_num_threads()  # for work outside the engine's passes
        if getattr(self.model, "native_kernels", False):
            # The kernels run the heavy work on their own workers (csrc/pool.c). torch's OpenMP
            # workers spinning beside them on the same cores slow both several-fold, and what is
            # left to torch in a pass (norms, rotary, activations) is too small to parallelise.
            torch.set_num_threads(1)
        self.context_length = min(context_length or max_positions, max_positions)
        self.eos_token_ids = self._eos_ids()
        self.pass_costs = PassCostModel()
        self._lock = threading.Lock()  # the serial loop runs one request at a time
        self.scheduler: BatchScheduler | None = None
        if max_batch > 1 and isinstance(self.model, LlamaModel):
            self.scheduler = BatchScheduler(self.model, max_batch, costs=self.pass_costs, prefix_reuse=prefix_reuse,
                                            kv_cache_bytes=kv_cache_bytes)
        self.max_batch = max_batch if self.scheduler is not None else 1
        self._cache: KVCache | None = None
        # serial loop with prefix reuse: the history `_cache` holds in its one slot (prefixes.py)
        self.prefix_reuse = prefix_reuse and isinstance(self.model, LlamaModel)
        self._prefixes = HeldPrefixes()
        self._draft_models: dict[int, LlamaModel] = {}
        self._draft_caches: dict[int, KVCache] = {}
        self._eagle_heads: dict[str, object] = {}  # head folder -> EagleRuntime
        # what `suffix` drafters look up across requests: one store per tenant, never shared between them
        self.recent_responses = TenantResponses()
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()

    @contextlib.contextmanager
    def torch_work(self) -> Iterator[None]:
        """torch on the threads it had before the engine took them, for the block: work that is
        torch's alone (training a head, transformers' generate) rather than the kernels' passes."""
        own = torch.get_num_threads()
        torch.set_num_threads(self.torch_threads)
        try:
            yield
        finally:
            torch.set_num_threads(own)

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def load(
        cls,
        model: str | None = None,
        dtype: str = "bf16",
        threads: int | None = None,
        max_batch: int = DEFAULT_MAX_BATCH,
        prefix_reuse: bool = False,
        kv_cache_bytes: int | None = DEFAULT_KV_CACHE_BYTES,
        prefill: str | None = None,
    ) -> Engine:
        """Load the default model (None) or a local HF folder / .gguf file."""
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        if threads:
            torch.set_num_threads(threads)
        source = resolve_model_source(model)
        folder = converted_folder(source)
        hf_model, tokenizer = load_hf_model(folder, dtype)
        name = DEFAULT_MODEL_NAME if model is None else source.name
        return cls(hf_model, tokenizer, name, dtype, max_batch=max_batch, prefix_reuse=prefix_reuse,
                   kv_cache_bytes=kv_cache_bytes, prefill=prefill)

    @classmethod
    def tiny_random(
        cls, seed: int = 0, dtype: str = "fp32", layers: int = 4, max_batch: int = DEFAULT_MAX_BATCH,
        prefix_reuse: bool = False, kv_cache_bytes: int | None = DEFAULT_KV_CACHE_BYTES, prefill: str | None = None,
    ) -> Engine:
        """A tiny random Llama with the default model's tokenizer, for fast tests."""
        from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

        tokenizer = AutoTokenizer.from_pretrained(converted_folder(resolve_model_source(None)))
        config = LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2048,
            tie_word_embeddings=True,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        torch.manual_seed(seed)
        torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
        hf_model = LlamaForCausalLM(config).to(torch_dtype).eval()
        return cls(hf_model, tokenizer, "tiny-random", dtype, max_batch=max_batch, prefix_reuse=prefix_reuse,
                   kv_cache_bytes=kv_cache_bytes, prefill=prefill)

    def _eos_ids(self) -> frozenset[int]:
        ids = set()
        for source in (self.hf_model.config.eos_token_id, self.tokenizer.eos_token_id,
                       getattr(self.hf_model.generation_config, "eos_token_id", None)):
            if isinstance(source, int):
                ids.add(source)
            elif source:
                ids.update(int(x) for x in source)
        im_end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        if isinstance(im_end, int) and im_end != self.tokenizer.unk_token_id:
            ids.add(im_end)
        return frozenset(ids)

    # ---- prompts --------------------------------------------------------------------------
    def render_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids of OpenAI-shaped messages through the model's chat template."""
        return self.encode(self.chat_text(messages, tools))

    def chat_text(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The chat template's text of OpenAI-shaped messages (tokenized as `encode` does: no special
        tokens added, as the template's own tokenizing does; apart so that each step can be timed)."""
        return self.tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                                  tokenize=False)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    # ---- grammars -------------------------------------------------------------------------
    @property
    def grammars(self) -> GrammarCompiler:
        """Compiles grammars for this model's tokenizer (grammar.py); made on first use (about 2 s)."""
        if self._grammars is None:
            with self._grammars_lock:
                if self._grammars is None:
                    vocab = self.hf_model.config.vocab_size
                    self._grammars = GrammarCompiler(self.tokenizer, vocab, self.eos_token_ids)
        return self._grammars

    # ---- decoding -------------------------------------------------------------------------
    def _target(self, cache: KVCache) -> Target:
        return Target(cache, self.tokenizer, self.eos_token_ids, self.context_length, self.pass_costs)

    def stream(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams | None = None,
        spec: SpecConfig | None = None,
        cancel: threading.Event | None = None,
        drafter: Drafter | None = None,
        grammar: Grammar | None = None,
        tenant: str | None = None,
    ) -> Iterator[StreamEvent]:
        """Generate, yielding text as rounds are accepted; the last event carries the result.

        `drafter` overrides the one `spec` names (tests use it for all-accept/all-reject drafters).
        `spec.per_batch` sets γ at every step of a batched engine from the live batch size.
        `grammar` (from `self.grammars.compile`) constrains the reply (grammar.py).
        `tenant`: whose request; what it leaves behind (its prefix in the cache, its reply in the
        suffix drafter's store) serves that tenant's later requests only.
        """
        sampling = sampling or SamplingParams()
        spec = spec or SpecConfig()
        rows = round_rows(spec, grammar is not None)
        need = min(len(prompt_ids) + sampling.max_tokens + rows + 1, self.context_length + rows + 1)
        if self.scheduler is not None:
            if drafter is None and spec.method != "off":
                drafter = self._make_drafter(spec, need, own_cache=True, tenant=tenant)
            constraint = None if grammar is None else grammar.constraint()
            seq = new_sequence(SequenceRequest(prompt_ids, sampling, spec, drafter, constraint, tenant),
                               self._target(self.scheduler.cache), slot=-1)
            request = self.scheduler.submit(seq, cancel)
            yield from self.scheduler.events(request)
            return
        with self._lock:
            cache = self._target_cache(need)
            if drafter is None and spec.method != "off":
                drafter = self._make_drafter(spec, cache.max_len, tenant=tenant)
            constraint = None if grammar is None else grammar.constraint()
            seq = new_sequence(SequenceRequest(prompt_ids, sampling, spec, drafter, constraint, tenant),
                               self._target(cache))
            _, reused = self._prefixes.best([seq.slot], seq) if self.prefix_reuse else (None, 0)
            reused = self._prefixes.take(seq.slot, seq, reused)  # the cache is rewritten from `reused` on
            try:
                yield from run_sequence(self.model, seq, cancel, reused)
            except GeneratorExit:  # the caller left between rounds: the cache is whole
                self._hold(seq, cache)
                raise
            # an error (a pass may have failed mid-write) leaves nothing held
            self._hold(seq, cache)

    def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams | None = None,
        spec: SpecConfig | None = None,
        cancel: threading.Event | None = None,
        drafter: Drafter | None = None,
        grammar: Grammar | None = None,
        tenant: str | None = None,
    ) -> GenerationResult:
        result = None
        for event in self.stream(prompt_ids, sampling, spec, cancel, drafter, grammar, tenant):
            result = event.result or result
        assert result is not None
        return result

    # ---- caches and drafters --------------------------------------------------------------
    def _hold(self, seq, cache: KVCache) -> None:
        """The serial cache holds `seq`'s history for the next request (prefix reuse), not its
        drafter: a drafter that reads hidden states prefills in full here."""
        if self.prefix_reuse:
            self._prefixes.hold(seq, cache.lengths[seq.slot], drafter=False)

    def _target_cache(self, need: int) -> KVCache:
        if self._cache is None or self._cache.max_len < need:
            self._prefixes.clear()
            size = -(-need // CACHE_GRANULE) * CACHE_GRANULE
            self._cache = None  # free the old one before allocating
            self._cache = self.model.new_cache(1, size)
        return self._cache

    def time_passes(self, rows: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 17), context: int = 128,
                    repeats: int = 3) -> None:
        """Seed the pass-cost model with timed passes of `rows` rows at a short context.

        Drafters size their drafts against these costs, and until a one-row pass and a longer
        one were timed they draft γ every round. The rows reach 17: a 16-token draft tree and
        the token before it; a row count never timed is extrapolated, dearly, from below. A server whose requests all speculate may never
        run a one-row pass, so it times them once at start (later passes refine the figures)."""
        if not isinstance(self.model, LlamaModel):
            return
        cache = self.model.new_cache(1, context + max(rows))
        with torch.inference_mode():
            self.model.forward(torch.zeros(1, context, dtype=torch.long), cache, [0])
            for _ in range(repeats):
                for n in rows:
                    t0 = time.perf_counter()
                    hidden = self.model.forward_rows(torch.zeros(n, dtype=torch.long), cache, [0] * n,
                                                     list(range(context, context + n)))
                    self.model.logits(hidden)  # as the scheduler times a step: pass and logits
                    self.pass_costs.record(n, time.perf_counter() - t0, context=context + n)

    def eagle_runtime(self, folder: str | None):
        """The head in `folder`, loaded once; ValueError (naming the field) where it is missing or
        belongs to another target."""
        from openalice_runner.engine.eagle.folder import load_runtime

        if not folder:
            raise ValueError("method 'eagle' needs eagle_head (policy options.eagle_head, CLI --eagle-head): "
                             "the folder of a head trained with `openalice-runner draft train`")
        if not isinstance(self.model, LlamaModel):
            raise ValueError("method 'eagle' needs a Llama-family target")
        runtime = self._eagle_heads.get(folder)
        if runtime is None:
            runtime = self._eagle_heads[folder] = load_runtime(folder, self.model_name, self.model)
        return runtime

    def _make_drafter(self, spec: SpecConfig, max_len: int, own_cache: bool = False,
                      tenant: str | None = None) -> Drafter:
        """`own_cache`: a fresh draft cache for this request (concurrent requests cannot share one);
        `tenant`: whose recent responses a suffix drafter looks up."""
        if spec.method == "ngram":
            return NgramDrafter(spec.ngram_min, spec.ngram_max, costs=self.pass_costs if spec.adaptive_length else None)
        if spec.method == "suffix":
            costs = self.pass_costs if spec.adaptive_length else None
            return SuffixDrafter(self.recent_responses.of(tenant), spec.ngram_min, spec.ngram_max, costs=costs)
        if spec.method == "draft":
            if not isinstance(self.model, LlamaModel):
                raise ValueError("method 'draft' needs a Llama-family target (self-draft from its layers)")
            if spec.draft_model:
                raise ValueError("draft_model: separate draft models are not supported yet; use draft_layers (self-draft)")
            n = spec.draft_layers or default_draft_layers(self.model.cfg.n_layers)
            if n not in self._draft_models:
                self._draft_models[n] = self.model.truncated(n)
            cache = None if own_cache else self._draft_caches.get(n)
            if own_cache:
                cache = self._draft_models[n].new_cache(1, max_len)
            elif cache is None or cache.max_len < max_len:
                cache = self._draft_models[n].new_cache(1, max_len)
                self._draft_caches[n] = cache
            return DraftModelDrafter(self._draft_models[n], cache)
        if spec.method == "eagle":
            from openalice_runner.engine.drafters.eagle import EagleDrafter

            runtime = self.eagle_runtime(spec.eagle_head)
            costs = self.pass_costs if spec.adaptive_length else None
            head_drafter = EagleDrafter(runtime, max_len, self.model.cfg.vocab_size, costs=costs,
                                        tree_nodes=spec.eagle_tree)
            if not spec.eagle_lookup:
                return head_drafter
            from openalice_runner.engine.drafters.lookup_first import LookupFirstDrafter

            return LookupFirstDrafter(NgramDrafter(spec.ngram_min, spec.ngram_max, costs=costs), head_drafter)
        raise ValueError(f"speculation method {spec.method!r} is not available in the embedded engine yet")
