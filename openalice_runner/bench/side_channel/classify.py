"""The observer's classifier: which of K prompts a stream answered, from its reads alone.

Leave-one-out 1-nearest-neighbour over standardised features (each feature scaled by its spread
over all streams). Three observers, each told apart in the report, so a mode must defeat all:
- `sizes`: the byte count of each of the first L reads (0 past the end), the number of reads and the
  total bytes: what tokens per pass shows as under `pass` (one write per pass);
- `timing`: the time to the response's head, the gap before each of the first L reads, the total
  time and the time to the first read;
- `both`: the two together.
And one observer per feature, to say where what leaks comes from (ABLATIONS): `count` (the number of
writes: the reply's length), `head` (the time to the response's status line and headers), `first`
(the time to the first write), `gaps` (the gaps alone), `end` (the time to the last write). The bar
is held against the best of all of them.
Accuracy is the share of streams whose nearest other stream answered the same prompt; chance is 1/K.
"""

from __future__ import annotations

import math

from openalice_runner.bench.side_channel.observe import Observation

SEQUENCE = 48  # reads per stream the sequence features cover
ABLATIONS = ("count", "head", "first", "gaps", "end")
OBSERVERS = ("sizes", "timing", "both", *ABLATIONS)


def features(obs: Observation, observer: str, length: int = SEQUENCE) -> list[float]:
    sizes = obs.sizes
    times = [t for t, _ in obs.reads]
    first, end = (times[0], times[-1]) if times else (0.0, 0.0)
    single = {"count": [float(len(sizes))], "head": [obs.head], "first": [first], "end": [end],
              "gaps": [*(obs.gaps + [0.0] * length)[:length]]}
    if observer in single:
        return single[observer]
    size_part = [float(x) for x in (sizes + [0] * length)[:length]] + [float(len(sizes)), float(sum(sizes))]
    gaps = [first] + obs.gaps
    time_part = [obs.head, *(gaps + [0.0] * length)[:length], end]
    if observer == "sizes":
        return size_part
    if observer == "timing":
        return time_part
    return size_part + time_part


def standardised(rows: list[list[float]]) -> list[list[float]]:
    """Each column shifted by its mean and scaled by its standard deviation (a constant column: 0)."""
    columns = list(zip(*rows, strict=True))
    out_columns = []
    for col in columns:
        mean = sum(col) / len(col)
        sd = math.sqrt(sum((x - mean) ** 2 for x in col) / len(col))
        out_columns.append([(x - mean) / sd if sd > 0 else 0.0 for x in col])
    return [list(r) for r in zip(*out_columns, strict=True)]


def loo_accuracy(rows: list[list[float]], labels: list[int]) -> float:
    """Leave-one-out 1-NN accuracy. A tie among nearest neighbours (identical streams give them) is
    broken at random: a stream scores the share of its tied nearest neighbours that answered its own
    prompt, so streams that all look alike score chance, neither 0 nor 1."""
    x = standardised(rows)
    score = 0.0
    for i, row in enumerate(x):
        best, tied = math.inf, []
        for j, other in enumerate(x):
            if i == j:
                continue
            d = sum((a - b) ** 2 for a, b in zip(row, other, strict=True))
            if d < best - 1e-9:
                best, tied = d, [labels[j]]
            elif d <= best + 1e-9:
                tied.append(labels[j])
        score += tied.count(labels[i]) / len(tied)
    return score / len(x)


def accuracy(observations: list[Observation], observer: str) -> float:
    return loo_accuracy([features(o, observer) for o in observations], [o.label for o in observations])
