"""The CUDA-graph decode path's static buffers, run uncaptured on the CPU: padding to a
bucket, the scratch block for padded rows and the fixed per-bucket metadata give exactly
the eager path's tokens, with every attention backend (Triton under the interpreter).
On a GPU the same path is captured and replayed; CI has none, so this is its check here."""

from __future__ import annotations

import random

import pytest

from protocol.sampling import SamplingParams
from tests.checkpoints import build_checkpoint
from worker import Engine, EngineConfig
from worker.engine.decode_graphs import bucket_sizes


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_checkpoint("llama", tmp_path_factory.mktemp("graphs"), hidden=32)


def _run(path: str, static: bool, backend: str, sizes: list[int] | None = None
         ) -> dict[str, list[int]]:
    engine = Engine(EngineConfig.create(
        path, device="cpu", num_blocks=40, block_size=8, max_num_seqs=6,
        max_num_batched_tokens=32, long_prefill_token_threshold=16,
        attention_backend=backend))
    if static:
        engine.runner.use_static_decode()
        graphs = engine.runner.graphs
        assert graphs is not None
        inner = graphs.run

        def counted(ids: list[int], *rest: object) -> object:
            if sizes is not None:
                sizes.append(len(ids))
            return inner(ids, *rest)  # type: ignore[arg-type]

        graphs.run = counted  # type: ignore[method-assign]
    rng = random.Random(4)
    vocab = engine.runner.shape.vocab_size
    outs: dict[str, list[int]] = {}
    for i, plen in enumerate([3, 17, 1, 40, 9, 5, 2]):  # 7 > max_num_seqs: preemption too
        engine.add_request(str(i), [rng.randrange(vocab) for _ in range(plen)],
                           SamplingParams(temperature=0, max_tokens=5 + 3 * i, ignore_eos=True))
        if i % 2:
            for out in engine.step():
                outs.setdefault(out.request_id, []).extend(out.new_token_ids)
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert engine.block_manager.num_free_blocks == 40
    return outs


@pytest.mark.parametrize("backend", ["cpu", "torch", "triton"])
def test_static_decode_path_matches_eager(ckpt: str, backend: str) -> None:
    sizes: list[int] = []
    assert _run(ckpt, True, backend, sizes) == _run(ckpt, False, backend)
    assert len(sizes) > 20 and {3, 5} & set(sizes)  # ran, and padded (to 4, to 6)


def test_bucket_sizes() -> None:
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(6) == [1, 2, 4, 6]
    assert bucket_sizes(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert bucket_sizes(256)[-3:] == [240, 248, 256]
