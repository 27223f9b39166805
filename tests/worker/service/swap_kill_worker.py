"""``python -m tests.worker.service.swap_kill_worker worker ...``: the real ``ferry worker``
command, except that it SIGKILLs itself in the middle of a host-tier swap: inside
``HostTier.flush``, with the tier full and having restored blocks before, after the copies
out landed and before the copies in. ``FERRY_TEST_SWAP_KILL=N`` lets N such flushes
through first. Only the moment is chosen: the death is a real ``kill -9``.
"""

from __future__ import annotations

import os
import signal

import torch

from ferry.cli import main
from worker.engine.kv.host_tier import HostTier

_SKIP = int(os.environ["FERRY_TEST_SWAP_KILL"])
_flush = HostTier.flush
_seen = [0]


def _dying_flush(self: HostTier, pool: torch.Tensor) -> None:
    swapping = bool(self._outs and self._ins)
    if swapping and self.num_cached == self.num_blocks and self.stats.restored > len(self._ins):
        _seen[0] += 1
        if _seen[0] > _SKIP:
            self._copy_out(pool, self._outs)  # one direction of the swap lands...
            os.kill(os.getpid(), signal.SIGKILL)  # ...and the worker dies before the other
    _flush(self, pool)


HostTier.flush = _dying_flush  # type: ignore[method-assign]

if __name__ == "__main__":
    main()
