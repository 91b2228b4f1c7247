"""Training data for an EAGLE head: prompts, and the target's own greedy replies with their features.

Prompts come from JSON-lines files: lines with `messages` (the workload format, saved traffic,
OpenAI-shaped requests) or `prompt` (plain user text). `builtin_prompts` writes a varied set of
chat, reasoning and code prompts from templates and from Python standard-library docstrings
(modules the shared workload does not quote), for operators without traffic of their own.
Prompts equal or close to the excluded ones (the benchmark's) are dropped.

Self-distillation decodes many prompts together on the target (one batched pass per step over
the engine's ragged forward) and keeps, for every fed token, the target's final hidden state:
that is everything training needs, so no second teacher-forcing pass is run. Results are cached
under the runner's cache folder, keyed by the target and the prompt.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import random
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from openalice_runner.engine.generator import PREFILL_CHUNK
from openalice_runner.workload_files import json_lines, stdlib_context


@dataclass
class Sample:
    """One distilled sequence: tokens x_0..x_L (prompt + greedy reply) and features f_0..f_{L-1}."""

    key: str
    tokens: torch.Tensor  # (L+1,) int64
    feats: torch.Tensor  # (L, W) bf16: f_t, after the taps of `distill` where it tapped layers
    prompt_len: int
    complete: bool = True  # False: cut short by the deadline (used, not cached)


# ---- prompts -----------------------------------------------------------------------------------
def read_prompts(paths: Iterable[str | Path]) -> list[list[dict]]:
    """Message lists from JSON-lines files (`messages` or `prompt` per line; `{context}` filled)."""
    out: list[list[dict]] = []
    for path in paths:
        for n, raw in json_lines(path):
            if isinstance(raw.get("messages"), list):
                context = ""
                if raw.get("context"):
                    context = stdlib_context(raw["context"])
                msgs = [
                    {**m, "content": m["content"].replace("{context}", context)}
                    if isinstance(m.get("content"), str) else m
                    for m in raw["messages"]
                ]
                # the reply is what gets distilled: drop a trailing assistant turn of saved traffic
                while msgs and msgs[-1].get("role") == "assistant":
                    msgs.pop()
                if msgs:
                    out.append(msgs)
            elif isinstance(raw.get("prompt"), str):
                out.append([{"role": "user", "content": raw["prompt"]}])
            else:
                raise ValueError(f"{path}:{n}: needs 'messages' (a list) or 'prompt' (a string)")
    return out


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", text.lower()))


def user_text(messages: list[dict]) -> str:
    return "\n".join(m["content"] for m in messages if m.get("role") == "user" and isinstance(m.get("content"), str))


def exclude_prompts(prompts: list[list[dict]], excluded: list[list[dict]], max_overlap: float = 0.5) -> list[list[dict]]:
    """Drop prompts whose user text equals or overlaps (Jaccard over words > max_overlap) an excluded one."""
    banned = [_words(user_text(m)) for m in excluded]
    kept = []
    for msgs in prompts:
        w = _words(user_text(msgs))
        if any(b and len(w & b) / max(1, len(w | b)) > max_overlap for b in banned):
            continue
        kept.append(msgs)
    return kept


_TOPICS = [
    "sleep", "learning a new language", "saving money", "running a marathon", "public speaking", "gardening",
    "remote work", "cooking for one", "reading more books", "learning to code", "time management", "travelling cheaply",
    "writing a novel", "job interviews", "keeping houseplants alive", "moving to a new city", "meditation",
    "learning guitar", "photography", "hiking safely", "reducing screen time", "making friends as an adult",
    "studying for exams", "starting a small business", "composting", "cycling to work", "baking bread",
    "caring for a dog", "negotiating a salary", "writing clear emails", "managing stress", "home workouts",
    "decluttering", "learning chess", "camping", "birdwatching", "volunteering", "drinking enough water",
    "eating well on a budget", "keeping a journal", "learning to swim", "raising teenagers", "planning a wedding",
    "buying a used car", "fixing a leaky tap", "packing for a trip", "writing a cover letter", "learning to draw",
    "caring for a cat", "recycling at home", "preparing for a career change", "keeping a tidy kitchen",
    "planning a birthday party", "growing tomatoes", "choosing a laptop", "protecting your privacy online",
    "making good coffee at home", "teaching a child to read", "dealing with jet lag", "getting up early",
    "listening well", "giving feedback at work", "running a team meeting", "first aid basics", "stretching",
    "cooking vegetables", "saving energy at home", "learning to dance", "caring for elderly parents",
    "moving house", "writing a speech", "learning to knit", "staying focused", "building a habit of exercise",
    "preparing for a long flight", "looking after your eyes", "making a family budget", "learning to cook rice",
]
_CONCEPTS = [
    "a hash table", "recursion", "a database index", "TCP vs UDP", "garbage collection", "a mutex", "caching",
    "big-O notation", "a REST API", "version control", "unit tests", "a compiler", "virtual memory", "DNS",
    "public-key cryptography", "a load balancer", "eventual consistency", "a neural network", "gradient descent",
    "overfitting", "a linked list", "binary search", "a race condition", "an operating system scheduler",
    "photosynthesis", "inflation", "compound interest", "the water cycle", "plate tectonics", "vaccines",
    "supply and demand", "black holes", "the greenhouse effect", "electric circuits", "DNA replication",
    "the scientific method", "a budget deficit", "entropy", "natural selection", "the internet",
    "a CPU cache", "a database transaction", "a memory leak", "a hash function", "latency and throughput",
    "a message queue", "encryption", "a web browser", "a search engine", "an interpreter", "a container image",
    "a firewall", "a spreadsheet formula", "the immune system", "the moon's phases", "tides", "rainbows",
    "interest rates", "the stock market", "electric cars", "solar panels", "recycling", "the printing press",
    "democracy", "the Roman Empire", "volcanoes", "earthquakes", "the human heart", "sound waves", "magnets",
]
_AUDIENCES = ["a child", "a beginner", "a new engineer", "a manager", "a high-school student", "my grandmother"]
_CHAT_TEMPLATES = [
    "Give me {n} tips for {topic}.",
    "What are the most common mistakes people make with {topic}?",
    "I want to get better at {topic}. Where should I start?",
    "Write a short motivational message for someone struggling with {topic}.",
    "What are the pros and cons of {topic}?",
    "Describe a simple weekly plan for {topic}.",
    "Explain {concept} to {audience} in a few sentences.",
    "What is {concept}, and why does it matter?",
    "Compare {concept} and {concept2} briefly.",
    "Write a haiku about {concept}.",
    "Summarize in one paragraph how {concept} works.",
    "Give an everyday analogy for {concept}.",
    "Write a short friendly email inviting a colleague to talk about {topic}.",
    "Tell me a short story about a robot who learns about {topic}.",
    "List {n} questions I could ask an expert on {concept}.",
    "How do I get started with {topic}?",
    "What should a beginner know about {topic}?",
    "Why is {topic} worth the effort? Keep it brief.",
    "What are {n} simple ways to get better at {topic}?",
    "My friend finds {topic} hard. What advice would you give them?",
    "Write a short blog introduction about {topic}.",
    "What is a common myth about {concept}?",
    "Why is {concept} important? Keep it short.",
    "How would you teach {concept} to {audience}?",
    "Write {n} bullet points summarizing {concept}.",
]
_NAMES = ["Alice", "Bob", "Maria", "Kenji", "Fatima", "Tom", "Priya", "Lucas"]
_ITEMS = ["apples", "pencils", "books", "marbles", "stickers", "cookies", "coins", "cards"]


def _reasoning(rng: random.Random) -> str:
    kind = rng.randrange(8)
    a, b, c = rng.randint(3, 60), rng.randint(2, 40), rng.randint(2, 12)
    name, name2, item = rng.choice(_NAMES), rng.choice(_NAMES), rng.choice(_ITEMS)
    tail = rng.choice([" Think step by step.", " Explain your reasoning.", " Show your work.", ""])
    if kind == 0:
        return f"{name} has {a} {item} and gives {b % a + 1} to {name2}, then buys {c} more. How many {item} does {name} have now?{tail}"
    if kind == 1:
        h, m = rng.randint(6, 20), rng.choice([0, 10, 15, 25, 30, 45, 50])
        return f"A meeting starts at {h:02d}:{m:02d} and lasts {a + 20} minutes. At what time does it end?{tail}"
    if kind == 2:
        return f"What is the product of {a} and {b}? Show the multiplication step by step."
    if kind == 3:
        lo, hi = rng.randint(1, 20), rng.randint(30, 120)
        what = rng.choice(["odd numbers", "multiples of 3", "multiples of 5", "numbers"])
        return f"How many {what} are there between {lo} and {hi}, inclusive?{tail}"
    if kind == 4:
        speed = rng.randint(30, 110)
        return f"A car travels at {speed} km/h for {c} hours and then {b} km more. How far does it go in total?{tail}"
    if kind == 5:
        price = rng.randint(5, 200)
        pct = rng.choice([10, 15, 20, 25, 30, 40])
        return f"A jacket costs {price} euros and is discounted by {pct}%. What is the new price?{tail}"
    if kind == 6:
        return f"If {c} workers build a wall in {b} days, how long would {c * 2} workers take, working at the same rate?{tail}"
    return f"Is {a * b + 1} a prime number? Reason it out.{tail}"


def _docstring_prompts(rng: random.Random, skip_modules: set[str], limit: int) -> list[str]:
    modules = ["json", "string", "heapq", "bisect", "functools", "itertools", "statistics", "fractions", "calendar",
               "random", "csv", "difflib", "queue", "base64", "colorsys", "contextlib", "dataclasses", "pprint",
               "copy", "glob", "posixpath", "operator", "abc", "secrets", "enum", "numbers", "graphlib", "html"]
    prompts = []
    for name in modules:
        if name in skip_modules:
            continue
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        for attr, obj in sorted(vars(module).items()):
            if attr.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            doc = inspect.getdoc(obj)
            if not doc or len(doc) < 40 or getattr(obj, "__module__", "") != module.__name__:
                continue
            doc = doc[:600]
            try:
                src = inspect.getsource(obj)
            except (OSError, TypeError):
                src = None
            choice = rng.randrange(5)
            if choice == 0:
                prompts.append(f"Explain what `{name}.{attr}` does, based on its documentation:\n\n{doc}")
            elif choice == 1:
                prompts.append(f"Write a short usage example for `{name}.{attr}`. Its docstring:\n\n{doc}")
            elif choice == 2 and src and len(src) < 2500:
                prompts.append(f"Explain this Python code step by step:\n\n```python\n{src}```")
            elif choice == 3 and src and len(src) < 2500:
                prompts.append(f"Add type hints to this function and return the full code:\n\n```python\n{src}```")
            else:
                prompts.append(f"Summarize this documentation in two sentences:\n\n{doc}")
    rng.shuffle(prompts)
    return prompts[:limit]


def builtin_prompts(n: int = 1500, seed: int = 0, skip_modules: Iterable[str] = ("textwrap", "shlex", "fnmatch")) -> list[dict]:
    """A varied prompt set: ~50% chat/explanations, ~30% arithmetic reasoning, ~20% code and docs.
    Chat has the larger share: its replies vary most, and they are the cheapest to distill."""
    rng = random.Random(seed)
    out: list[dict] = []
    docs = _docstring_prompts(rng, set(skip_modules), limit=n // 5)
    seen: set[str] = set()
    while len(out) < n - len(docs):
        if rng.random() < 0.63:
            concept, concept2 = rng.sample(_CONCEPTS, 2)
            text = rng.choice(_CHAT_TEMPLATES).format(
                n=rng.choice(["three", "four", "five", "two"]), topic=rng.choice(_TOPICS), concept=concept,
                concept2=concept2, audience=rng.choice(_AUDIENCES))
        else:
            text = _reasoning(rng)
        if text not in seen:
            seen.add(text)
            out.append({"prompt": text})
    out += [{"prompt": d} for d in docs]
    rng.shuffle(out)
    return out


# ---- self-distillation ---------------------------------------------------------------------------
def prompt_key(fingerprint: dict, prompt_ids: list[int], max_new: int, taps: tuple[int, ...] = ()) -> str:
    key = [fingerprint["name"], fingerprint["lm_head_sha256"], prompt_ids, max_new]
    raw = json.dumps(key + [list(taps)] if taps else key)
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


class SampleCache:
    """Distilled samples on disk, one safetensors file each, keyed by target + prompt + budget."""

    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        return self.folder / f"{key}.safetensors"

    def get(self, key: str) -> Sample | None:
        from safetensors.torch import load_file

        p = self.path(key)
        if not p.is_file():
            return None
        try:
            t = load_file(str(p))
        except Exception:  # noqa: BLE001 - a torn file is regenerated
            return None
        return Sample(key, t["tokens"], t["feats"], int(t["prompt_len"]))

    def put(self, s: Sample) -> None:
        from safetensors.torch import save_file

        tmp = self.path(s.key).with_suffix(".tmp")
        save_file({"tokens": s.tokens, "feats": s.feats.contiguous(), "prompt_len": torch.tensor(s.prompt_len)},
                  str(tmp))
        tmp.replace(self.path(s.key))


def _feature_rows(out, taps: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """A pass's (hidden, feature rows as stored): f_t alone, or the tapped layers then f_t."""
    if not taps:
        return out, out
    hidden, tapped = out
    return hidden, torch.cat([tapped, hidden], dim=-1)


def _admitted(model, cache, slot: int, prompt: list[int], key: str, taps: tuple[int, ...]) -> dict:
    """A prompt prefilled into cache row `slot`: its state, with the first greedy token."""
    cache.lengths[slot] = 0
    feats = []
    hidden = None
    for i in range(0, len(prompt), PREFILL_CHUNK):
        chunk = torch.tensor([prompt[i : i + PREFILL_CHUNK]])
        hidden, rows = _feature_rows(model.forward(chunk, cache, [slot], taps), taps)
        hidden = hidden[0]
        feats.append(rows[0].to(torch.bfloat16))
    first = int(model.logits(hidden[-1]).argmax())
    return {"key": key, "tokens": list(prompt) + [first], "feats": feats, "prompt_len": len(prompt)}


def _retire(slots: list[dict | None], slot: int, on_sample: Callable[[Sample], None] | None,
            complete: bool = True) -> None:
    """Free `slot`, handing its sequence to `on_sample` (cut short at a deadline: incomplete)."""
    s = slots[slot]
    slots[slot] = None
    tokens = s["tokens"]
    feats = torch.cat(s["feats"])
    if on_sample is not None:
        on_sample(Sample(s["key"], torch.tensor(tokens[: feats.shape[0] + 1]), feats, s["prompt_len"], complete))


@torch.inference_mode()
def distill(engine, prompts: list[list[int]], keys: list[str], max_new: int, batch: int = 8,
            deadline: float | None = None, on_sample: Callable[[Sample], None] | None = None,
            max_prompt: int = 1536, taps: tuple[int, ...] = ()) -> int:
    """Greedy-decode `prompts` on the target, `batch` at a time, calling `on_sample` for each
    finished one (features of every fed token). Stops taking new prompts at `deadline`.
    At the deadline the sequences in flight are cut short and handed over as incomplete.
    With `taps`, each feature row is the residual stream after those layers, then f_t.
    Returns the number of samples produced."""
    model = engine.model
    eos = engine.eos_token_ids
    cache = model.new_cache(batch, max_prompt + max_new + 2)
    slots: list[dict | None] = [None] * batch
    queue = [(p[-max_prompt:], k) for p, k in zip(prompts, keys, strict=True)]
    queue.reverse()
    done = 0

    while True:
        for slot in range(batch):
            if slots[slot] is None and queue and (deadline is None or time.monotonic() < deadline):
                slots[slot] = _admitted(model, cache, slot, *queue.pop(), taps)
        active = [i for i in range(batch) if slots[i] is not None]
        if not active:
            break
        if deadline is not None and time.monotonic() >= deadline:
            for i in active:
                _retire(slots, i, on_sample, complete=False)
                done += 1
            break
        for i in active:  # finished ones (EOS or budget) leave before the next pass
            s = slots[i]
            if s["tokens"][-1] in eos or len(s["tokens"]) - s["prompt_len"] >= max_new:
                _retire(slots, i, on_sample)
                done += 1
        active = [i for i in range(batch) if slots[i] is not None]
        if not active:
            continue
        feed = torch.tensor([slots[i]["tokens"][-1] for i in active])
        pos = [cache.lengths[i] for i in active]
        hidden, rows = _feature_rows(model.forward_rows(feed, cache, active, pos, taps), taps)
        nxt = model.logits(hidden).argmax(-1).tolist()
        for r, i in enumerate(active):
            cache.lengths[i] += 1
            slots[i]["feats"].append(rows[r : r + 1].to(torch.bfloat16))
            slots[i]["tokens"].append(int(nxt[r]))
    return done
