"""The sampler's host syncs: a step reads the device back a fixed number of times, however
many rows it samples and whatever they ask for (penalties, masks, grammars, logprobs)."""

import pytest
import torch

from protocol.sampling import SamplingParams
from worker.engine.sample.sampler import Sampler, SamplingRow

VOCAB = 50


def row(index=0, out=(), prompt=(1, 2), **kw):
    return SamplingRow(SamplingParams(**kw), index, list(prompt), list(out))


# (``numpy()`` is absent: on a device tensor it raises; only ``cpu()`` first would sync)
_SYNCING_METHODS = ("item", "tolist", "cpu", "nonzero", "bincount", "unique",
                    "masked_select", "__bool__", "__float__", "__int__", "__index__")


class SyncCounter:
    """Counts calls that make the host wait for a GPU (on a CPU they do not, so they are
    counted by name): value reads (``item``, ``tolist``, ``float(t)``...), ops whose output
    size depends on values (``nonzero``, boolean-mask indexing, ``bincount``, ``unique``),
    and ``torch.tensor(..., device=...)`` from host data (a pageable copy that syncs)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[str] = []
        for name in _SYNCING_METHODS:
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))
        for name in ("nonzero", "unique", "bincount", "masked_select"):
            monkeypatch.setattr(torch, name, self._wrap("torch." + name, getattr(torch, name)))
        getitem, setitem, tensor = torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.tensor

        def index(name, fn):
            def wrapped(t, key, *rest):
                keys = key if isinstance(key, tuple) else (key,)
                if any(isinstance(k, torch.Tensor) and k.dtype == torch.bool for k in keys):
                    self.calls.append(f"{name}[bool mask]")
                return fn(t, key, *rest)
            return wrapped

        def new_tensor(*args, **kw):
            if kw.get("device") is not None:
                self.calls.append("torch.tensor(device=...)")
            return tensor(*args, **kw)

        monkeypatch.setattr(torch.Tensor, "__getitem__", index("getitem", getitem))
        monkeypatch.setattr(torch.Tensor, "__setitem__", index("setitem", setitem))
        monkeypatch.setattr(torch, "tensor", new_tensor)

    def _wrap(self, name, fn):
        def wrapped(*args, **kw):
            self.calls.append(name)
            return fn(*args, **kw)
        return wrapped

    def take(self) -> list[str]:
        calls, self.calls = self.calls, []
        return calls


def _busy_rows(n: int, vocab: int) -> list[SamplingRow]:
    """Every feature at once: penalties, logprobs, seeds, top-k/p, min-p, bias, greedy,
    allowed token ids, bad words."""
    rows = []
    for i in range(n):
        rows.append(row(
            index=i, out=list(range(i % 7)), prompt=[1, 2, i % vocab], seed=i if i % 2 else None,
            temperature=0 if i % 5 == 0 else 0.8, top_k=(0, 5, 20)[i % 3],
            top_p=(1.0, 0.9)[i % 2], min_p=0.05 if i % 4 == 0 else 0.0,
            repetition_penalty=1.1 if i % 3 == 0 else 1.0, frequency_penalty=0.2 * (i % 2),
            logprobs=(None, 0, 3)[i % 3], logit_bias={3: 2.0} if i % 6 == 0 else None,
            allowed_token_ids=list(range(0, vocab, 3)) if i % 5 == 1 else None))
        if i % 4 == 1:  # bad words: one token, and one that follows the output
            rows[-1].bad_words_ids = ((4,), (i % 7 - 1, 6) if i % 7 else (2, 6))
    return rows


def test_a_step_syncs_the_host_a_fixed_number_of_times_whatever_the_batch(monkeypatch):
    """``launch`` never reads a device value; ``result`` reads the tokens and the logprobs
    back once each: the count does not grow with the rows."""
    counts = {}
    for n in (4, 64):
        logits = torch.randn(n, VOCAB)
        rows = _busy_rows(n, VOCAB)
        grammar = ([1, 2], torch.full((2, (VOCAB + 31) // 32), -1, dtype=torch.int32))
        with monkeypatch.context() as patch:
            counter = SyncCounter(patch)
            pending = Sampler(seed=1).launch(logits, rows, grammar)
            launched = counter.take()
            out = pending.result()
            read = counter.take()
        assert len(out.token_ids) == n
        counts[n] = (launched, read)
    assert counts[4] == counts[64]
    launched, read = counts[64]
    assert launched == [] and sorted(read) == ["tolist", "tolist"], counts[64]
