"""Fixtures for the service tests: a private redis-server per module, a tiny checkpoint.

Worker processes are real ``ferry worker`` subprocesses (``tests/worker/service/procs.py``) on a
random 2-layer Llama built once per session; they run one torch thread each so the suite
stays light on a shared machine.
"""

import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

_ROOT = str(Path(__file__).resolve().parents[3])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from tests.redis_cluster import cluster_client, redis_cluster  # noqa: E402, F401
from tests.redis_server import redis_client, redis_server  # noqa: E402, F401


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random tiny Llama with a real BPE tokenizer and a chat template."""
    from tests.checkpoints import build_checkpoint

    return build_checkpoint("llama", tmp_path_factory.mktemp("service-ckpt"))


@pytest.fixture
def log_dir(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "logs"
    path.mkdir()
    yield path


class Reference:
    """The in-process engine on the same checkpoint: what a request alone must produce."""

    def __init__(self, model: str) -> None:
        import torch

        from worker import LLM

        torch.set_num_threads(1)
        self.llm = LLM(model, device="cpu", kv_cache_blocks=256)
        self._n = 0

    def run(self, prompt: "str | list[int] | None", params: object,
            messages: "list[dict[str, str]] | None" = None) -> "tuple[list[int], str]":
        """Tokens and text of one request run alone."""
        engine = self.llm.engine
        self._n += 1
        rid = f"ref-{self._n}"
        engine.add_request(rid, prompt, params, messages=messages)  # type: ignore[arg-type]
        ids: list[int] = []
        text = ""
        while engine.has_unfinished_requests():
            for out in self.llm.text.step():
                ids += out.new_token_ids
                text += out.text
        return ids, text


@pytest.fixture(scope="session")
def reference(checkpoint: str) -> Reference:
    return Reference(checkpoint)


def make_engine(checkpoint: str, **kw: object) -> Any:
    """An in-process engine on the test checkpoint: CPU, one torch thread, 256 blocks."""
    import torch

    from worker import Engine, EngineConfig

    torch.set_num_threads(1)
    return Engine(EngineConfig.create(checkpoint, device="cpu", num_blocks=256, **kw))


@pytest.fixture(scope="module")
def engine(checkpoint: str) -> Any:
    """One engine per test module, for in-process services (``Running``)."""
    return make_engine(checkpoint)


@pytest.fixture
def client(redis_server: Any, redis_client: Any) -> Iterator[Any]:  # noqa: F811
    """A ``FerryClient`` on the module's redis-server, with the consumer groups created."""
    from protocol.client import FerryClient

    c = FerryClient.from_url(redis_server.url)
    c.ensure_group()
    yield c
    c.close()


@pytest.fixture(scope="module")
def openai_stack(request: pytest.FixtureRequest, redis_server: Any,  # noqa: F811
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real ``ferry worker`` on the default model and a gateway, on the module's Redis,
    with an openai SDK client: ``worker``, ``url``, ``client``. The worker is named after
    the module (``test_service_tools`` -> ``tools-1``), so each module's logs are its own."""
    import openai

    from gateway.settings import GatewaySettings
    from tests.gateway.server import GatewayServer
    from tests.worker.service.procs import WorkerProcess
    from worker.models import default_model_path

    name = request.module.__name__.rsplit("_", 1)[-1] + "-1"
    log_dir = tmp_path_factory.mktemp("logs")
    with WorkerProcess(default_model_path(), redis_server.url, name, log_dir) as worker:
        worker.wait_live()
        with GatewayServer(GatewaySettings(redis_url=redis_server.url)) as gateway:
            client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
            yield SimpleNamespace(worker=worker, url=gateway.url, client=client)
