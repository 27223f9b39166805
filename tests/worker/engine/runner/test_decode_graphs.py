"""The CUDA-graph decode path on the CPU.

Its static buffers, run uncaptured or through a capturer that runs instead of recording
(``RunningCapturer``): padding to a bucket, the scratch block for padded rows and the fixed
per-bucket metadata give exactly the eager path's tokens, with every attention backend
(Triton under the interpreter). The capture itself: its warm-up launches exactly the
kernel variants the capture launches (so nothing compiles during capture), the graphs keep
hidden states and no per-bucket logits, and a capture that fails or disagrees leaves the
worker eager, degraded and saying so. On a GPU the same path is captured and replayed;
CI has none, so these are its checks here."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kernels.decode_splits import choose_num_kv_splits
from protocol.sampling import SamplingParams
from tests.checkpoints import build_checkpoint
from tests.worker.engine.triton_launches import RunningCapturer, recorded_launches
from worker import Engine, EngineConfig
from worker.engine import health
from worker.engine.output.text_output import TextOutputs
from worker.engine.runner.decode_graphs import CudaGraphCapturer, DecodeGraphs, bucket_sizes


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_checkpoint("llama", tmp_path_factory.mktemp("graphs"), hidden=32)


def _engine(path: str, backend: str) -> Engine:
    return Engine(EngineConfig.create(
        path, device="cpu", num_blocks=40, block_size=8, max_num_seqs=6,
        max_num_batched_tokens=32, long_prefill_token_threshold=16,
        attention_backend=backend))


def _run(path: str, static: bool, backend: str, sizes: list[int] | None = None,
         captured: bool = False) -> dict[str, list[int]]:
    engine = _engine(path, backend)
    if captured:
        runner = engine.runner
        runner.graphs = runner.capture_graphs(RunningCapturer(), runner.tables.rows)
        assert runner.graphs is not None and runner.health.decode_graphs_active
    elif static:
        engine.runner.use_static_decode()
    if static or captured:
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
            for out in TextOutputs.of(engine).step():
                outs.setdefault(out.request_id, []).extend(out.new_token_ids)
    while engine.has_unfinished_requests():
        for out in TextOutputs.of(engine).step():
            outs.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert engine.block_manager.num_free_blocks == 40
    return outs


@pytest.mark.parametrize("backend", ["cpu", "torch", "triton"])
def test_static_decode_path_matches_eager(ckpt: str, backend: str) -> None:
    sizes: list[int] = []
    assert _run(ckpt, True, backend, sizes) == _run(ckpt, False, backend)
    assert len(sizes) > 20 and {3, 5} & set(sizes)  # ran, and padded (to 4, to 6)


def test_replayed_graphs_match_eager(ckpt: str) -> None:
    """Capture (stand-in), verify, then serve: every pure-decode step replays a bucket's
    graph and takes logits from its hidden states; the tokens equal the eager path's."""
    sizes: list[int] = []
    assert _run(ckpt, False, "cpu", sizes, captured=True) == _run(ckpt, False, "cpu")
    assert len(sizes) > 20


def test_warm_up_launches_exactly_what_each_capture_launches(
        ckpt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Per bucket, the warm-up before the capture makes the same Triton launches (kernel,
    grid, variant) as the capture, with the graph's split count: every variant the capture
    needs is compiled and loaded before capture begins."""
    engine = _engine(ckpt, "triton")
    runner = engine.runner
    with recorded_launches(monkeypatch) as log:
        graphs = runner.capture_graphs(RunningCapturer(log), runner.tables.rows)
    assert graphs is not None
    longest = runner.tables.max_blocks * runner.block_size
    for call, size in enumerate(reversed(graphs.buckets)):
        warm, captured = log.launches[f"warm_up:{call}"], log.launches[f"capture:{call}"]
        assert warm == captured, size
        splits = {launch.grid[2] for launch in captured
                  if launch.kernel == "_decode_split_kernel"}
        assert splits == {choose_num_kv_splits(size, runner.shape.num_kv_heads, longest)}
        assert splits != {1}  # the graph's rule, not the eager one (which takes 1 here)
        assert any(launch.kernel == "_decode_reduce_kernel" for launch in warm)


def _tensors(value: Any, depth: int = 0) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if depth > 3:
        return []
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list | tuple):
        return [t for item in value for t in _tensors(item, depth + 1)]
    if hasattr(value, "__dict__") and not isinstance(value, type):
        return _tensors(list(vars(value).values()), depth + 1)
    return []


def test_graphs_keep_hidden_states_not_logits(ckpt: str) -> None:
    """What the graphs hold after capture: static inputs and one shared hidden-state
    buffer; no [bucket, vocab] logits per bucket (they would pin the graph pool)."""
    engine = _engine(ckpt, "cpu")
    runner = engine.runner
    graphs = runner.capture_graphs(RunningCapturer(), runner.tables.rows)
    assert graphs is not None
    vocab = runner.shape.vocab_size
    held = _tensors({k: v for k, v in vars(graphs).items() if k != "runner"})
    assert held and not [tuple(t.shape) for t in held if vocab in t.shape]
    outputs = [t for t in held if t.is_floating_point()]
    assert [tuple(t.shape) for t in outputs] == [(runner.tables.rows, runner.shape.hidden_size)]


class _Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, dict[str, Any]]] = []

    def error(self, event: str, **kw: Any) -> None:
        self.events.append(("error", event, kw))


def test_a_failing_capture_leaves_the_worker_eager_degraded_and_loud(
        ckpt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    recorder = _Recorder()
    monkeypatch.setattr(health, "log", recorder)
    engine = _engine(ckpt, "cpu")
    runner = engine.runner
    assert runner.capture_graphs(RunningCapturer(fail_capture_end=1), runner.tables.rows) is None
    assert [(level, event) for level, event, _ in recorder.events] == \
        [("error", "decode_graphs_unavailable")]
    assert "capture_end" in recorder.events[0][2]["error"]
    stats = engine.stats()
    assert stats.degraded == ("decode_graphs_unavailable",) and not stats.decode_graphs_active


def test_a_replay_that_disagrees_drops_the_graphs(
        ckpt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``verify`` finds a graph whose replay differs from the eager forward (as one that
    recorded a host value would), and the runner then drops all graphs, loudly."""
    engine = _engine(ckpt, "cpu")
    runner = engine.runner
    graphs = DecodeGraphs(runner, runner.tables.rows, RunningCapturer())
    assert graphs.verify() is None
    honest = graphs.graphs[4]
    graphs.graphs[4] = SimpleNamespace(replay=lambda: (honest.replay(), graphs.hidden.mul_(2)))
    assert graphs.verify() == 4

    recorder = _Recorder()
    monkeypatch.setattr(health, "log", recorder)
    monkeypatch.setattr(DecodeGraphs, "verify", lambda self: 4)
    assert runner.capture_graphs(RunningCapturer(), runner.tables.rows) is None
    assert [event for _, event, _ in recorder.events] == ["decode_graph_mismatch"]
    assert engine.stats().degraded == ("decode_graph_mismatch",)


def test_cuda_capturer_gives_the_stream_back_when_capture_end_raises(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.cuda.graph`` leaves its side stream current when ``capture_end`` raises, so
    the eager fallback would run there; ours restores the caller's stream. The CUDA calls
    are stand-ins that keep only what matters here: which stream is current."""

    class Stream:
        def __init__(self, name: str) -> None:
            self.name = name

        def wait_stream(self, other: Stream) -> None:
            pass

    current = {"stream": Stream("default")}

    class FailingGraph:
        def capture_begin(self, pool: object = None) -> None:
            pass

        def capture_end(self) -> None:
            raise RuntimeError("CUDA error: capture_end failed (simulated)")

    devices: list[object] = []  # every device a stream call names: the worker's own

    def on(device: object, result: object) -> object:
        devices.append(device)
        return result

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: on(device, Stream("side")))
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: on(device, current["stream"]))
    monkeypatch.setattr(torch.cuda, "set_stream", lambda s: current.__setitem__("stream", s))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: on(device, None))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FailingGraph)
    capturer = CudaGraphCapturer(torch.device("cuda", 1))
    ran_on: list[str] = []
    capturer.warm_up(lambda: ran_on.append(current["stream"].name))
    with pytest.raises(RuntimeError, match="capture_end"):
        capturer.capture(lambda: ran_on.append(current["stream"].name))
    assert ran_on == ["side", "side"] and current["stream"].name == "default"
    assert devices and set(devices) == {torch.device("cuda", 1)}


def test_bucket_sizes() -> None:
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(6) == [1, 2, 4, 6]
    assert bucket_sizes(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert bucket_sizes(256)[-3:] == [240, 248, 256]
