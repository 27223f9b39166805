"""The Triton LoRA shrink/expand kernels equal their pure-torch twins.

Mixed batches: tokens of several adapter slots interleaved, tokens with no adapter
(slot -1, whose output rows must stay untouched), slots with no tokens, more tokens of
one slot than a program's block; ranks 8 and 16 in a pool padded to a larger rank.
"""

from __future__ import annotations

import pytest
import torch

from kernels import lora_reference as ref
from kernels.lora import lora_expand, lora_segments, lora_shrink

SLOTS = 4
MIXES = {
    "mixed": [0, -1, 2, 0, 3, -1, 2, 2, 0],
    "one_slot_long": [1] * 37,  # more than one BLOCK_M of one slot
    "none": [-1, -1, -1],
    "single": [2],
}


def _pool(randn, ranks: list[int], max_rank: int, in_f: int, out_f: int, dtype):
    """A and B stacks with each slot's rank zero-padded to ``max_rank``."""
    a = torch.zeros(SLOTS, max_rank, in_f, dtype=dtype, device=randn(1).device)
    b = torch.zeros(SLOTS, out_f, max_rank, dtype=dtype, device=a.device)
    for s, r in enumerate(ranks):
        a[s, :r] = randn(r, in_f, dtype=dtype) / in_f ** 0.5
        b[s, :, :r] = randn(out_f, r, dtype=dtype)
    return a, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("rank", [8, 16])
def test_shrink_expand_match_reference(device, randn, close, dtype, mix, rank) -> None:
    in_f, out_f = 96, 80  # neither a multiple of the kernel's blocks
    slots = torch.tensor(MIXES[mix], dtype=torch.int32, device=device)
    tokens = slots.shape[0]
    a, b = _pool(randn, [rank, rank // 2, rank, 8], 32, in_f, out_f, dtype)
    scale = torch.tensor([0.5, 2.0, 1.25, -1.0], device=device)
    x = randn(tokens, in_f, dtype=dtype)
    y0 = randn(tokens, out_f, dtype=dtype)

    groups = ref.lora_groups(slots.cpu())
    want_t = ref.lora_shrink(x.cpu(), a.cpu(), groups)
    want_y = y0.cpu().clone()
    ref.lora_expand(want_t, b.cpu(), scale.cpu(), groups, want_y)

    sorted_tokens, starts = lora_segments(slots, SLOTS)
    t = torch.zeros(tokens, 32, dtype=torch.float32, device=device)
    lora_shrink(x, a, sorted_tokens, starts, t)
    y = y0.clone()
    lora_expand(t, b, scale, sorted_tokens, starts, y)
    close(t.cpu(), want_t)
    close(y.cpu(), want_y)
    untouched = (slots < 0).cpu()
    assert torch.equal(y.cpu()[untouched], y0.cpu()[untouched])


def test_segments_group_tokens_by_slot(device) -> None:
    slots = torch.tensor(MIXES["mixed"], dtype=torch.int32, device=device)
    sorted_tokens, starts = lora_segments(slots, SLOTS)
    assert starts.tolist() == [2, 5, 5, 8, 9]  # two tokens with no adapter come first
    assert sorted_tokens[2:].tolist() == [0, 3, 8, 2, 6, 7, 4]


def test_launchers_check_shapes(device) -> None:
    x = torch.zeros(3, 16, device=device)
    a = torch.zeros(2, 8, 12, device=device)
    tokens, starts = lora_segments(torch.zeros(3, dtype=torch.int32, device=device), 2)
    with pytest.raises(ValueError, match="must be"):
        lora_shrink(x, a, tokens, starts, torch.zeros(3, 8, device=device))
    with pytest.raises(ValueError, match="starts has"):
        lora_shrink(x, torch.zeros(3, 8, 16, device=device), tokens, starts,
                    torch.zeros(3, 8, device=device))


@pytest.mark.parametrize("wide", [True, False])
def test_layer_kernel_path_equals_cpu_paths(device, wide, monkeypatch) -> None:
    """``LoraLinear`` through the kernels (the CUDA path, over the slot pool's permuted B
    view) equals its CPU paths: every slot at once (``wide``) and per adapter."""
    import numpy as np

    from worker.engine.lora import metadata as md
    from worker.engine.lora.adapter import LoraAdapter
    from worker.engine.lora.config import LoraConfig
    from worker.engine.lora.layer import LoraLinear
    from worker.engine.lora.slots import LoraSlots
    from worker.engine.lora.targets import BaseTargets, TargetShape

    if device.type != "cpu":
        pytest.skip("compares with the CPU paths, which run on CPU tensors")
    monkeypatch.setattr(md, "WIDE_MAX_TOKENS", 256 if wide else 0)
    base = BaseTargets("m", {"up_proj": TargetShape(48, 40)})
    slots = LoraSlots(base, LoraConfig(max_loras=3, max_lora_rank=16), device,
                      torch.float32)
    gen = torch.Generator().manual_seed(3)
    for i, rank in enumerate([8, 16, 4]):
        weights = {"up_proj": (torch.randn(rank, 48, generator=gen),
                               torch.randn(40, rank, generator=gen))}
        slots.acquire(LoraAdapter(f"a{i}", "", rank, 0.5 + i, weights))
    linear = torch.nn.Linear(48, 40)
    step = md.LoraStep()
    layer = LoraLinear(linear, "up_proj", slots, step)
    token_slots = np.array([2, -1, 0, 0, 1, 2, -1, 1, 1, 0])
    x = torch.randn(len(token_slots), 48, generator=gen)
    with torch.inference_mode():
        step.meta = md.build_metadata(token_slots, slots.ranks, slots.scales, 16,
                                      torch.device("cpu"))
        assert (step.meta.wide is not None) == wide
        want = layer(x)
        slots_t = torch.from_numpy(token_slots.astype(np.int32))
        sorted_tokens, starts = lora_segments(slots_t, 3)
        step.meta = md.LoraMetadata(slots_t, None, slots.ranks, sorted_tokens=sorted_tokens,
                                    starts=starts)
        got = layer(x)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    base_rows = torch.from_numpy(token_slots < 0)
    torch.testing.assert_close(got[base_rows], linear(x)[base_rows])


# --- isolation: a slot holding a NaN or an Inf reaches no other slot's token -----------

BAD = {"nan": float("nan"), "inf": float("inf"), "-inf": -float("inf")}


def _poison(a: torch.Tensor, b: torch.Tensor, slot: int, value: float) -> None:
    a[slot, 1, 3] = value
    b[slot, 2, 1] = value


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # interpreter
@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("used", [True, False], ids=["in-use", "stale"])
def test_a_bad_slot_reaches_no_other_token(device, randn, bad, impl, used) -> None:
    """Slot 1 holds a NaN/Inf in A and in B, and has tokens (``in-use``) or none
    (``stale``: a freed slot's leftovers): every other token's output is bit for bit
    what it is when slot 1 is clean; tokens of no adapter are untouched."""
    in_f, out_f = 96, 80
    mix = [0, -1, 1, 2, 1, -1, 0, 2, 2] if used else [0, -1, 2, 0, -1, 2]
    slots = torch.tensor(mix, dtype=torch.int32, device=device)
    a, b = _pool(randn, [8, 16, 8, 4], 16, in_f, out_f, torch.float32)
    scale = torch.tensor([0.5, 2.0, 1.25, -1.0], device=device)
    x = randn(len(mix), in_f)
    y0 = randn(len(mix), out_f)

    def run(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        y = y0.clone()
        if impl == "triton":
            sorted_tokens, starts = lora_segments(slots, SLOTS)
            t = torch.full((len(mix), 16), float("nan"), device=device)  # unread rows
            lora_shrink(x, a, sorted_tokens, starts, t)
            lora_expand(t, b, scale, sorted_tokens, starts, y)
        else:
            groups = ref.lora_groups(slots.cpu())
            ref.lora_expand(ref.lora_shrink(x, a, groups), b, scale, groups, y)
        return y

    want = run(a, b)
    _poison(a, b, 1, BAD[bad])
    got = run(a, b)
    others = slots != 1
    assert torch.equal(got[others], want[others])
    assert torch.equal(got[slots < 0], y0[slots < 0])
    if used:
        assert not torch.isfinite(got[slots == 1]).all()  # the bad slot's own tokens


def _layer_setup(path: str, stale: bool, bad: float | None, dtype: torch.dtype):
    """A ``LoraLinear`` over three slots: clean adapters in 0 and 2, in 1 the ``bad``
    adapter (installed past the load check; its clean twin for None), then freed for
    ``stale``. Returns (layer, step, its slots' tokens, x)."""
    import numpy as np

    from worker.engine.lora import metadata as md
    from worker.engine.lora.adapter import LoraAdapter
    from worker.engine.lora.config import LoraConfig
    from worker.engine.lora.layer import LoraLinear
    from worker.engine.lora.slots import LoraSlots
    from worker.engine.lora.targets import BaseTargets, TargetShape

    base = BaseTargets("m", {"up_proj": TargetShape(48, 40)})
    slots = LoraSlots(base, LoraConfig(max_loras=3, max_lora_rank=16), torch.device("cpu"),
                      dtype)
    gen = torch.Generator().manual_seed(3)
    for i, rank in enumerate([8, 16, 4]):
        a, b = torch.randn(rank, 48, generator=gen), torch.randn(40, rank, generator=gen)
        if i == 1 and bad is not None:
            a[1, 3], b[2, 1] = bad, bad
        slots.acquire(LoraAdapter(f"a{i}", "", rank, 0.5 + i, {"up_proj": (a, b)}))
    if stale:
        slots.release("a1")
        assert slots.evict("a1")
    linear = torch.nn.Linear(48, 40)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(40, 48, generator=gen))
        linear.bias.copy_(torch.randn(40, generator=gen))
    linear = linear.to(dtype)
    step = md.LoraStep()
    layer = LoraLinear(linear, "up_proj", slots, step)
    token_slots = np.array([2, -1, 0, 0, 2, -1, 0] if stale else
                           [2, -1, 0, 1, 0, 1, 2, -1, 1, 0])
    x = torch.randn(len(token_slots), 48, generator=gen).to(dtype)
    return layer, step, token_slots, x


def _layer_forward(path: str, layer, step, token_slots, x) -> torch.Tensor:
    import numpy as np

    from worker.engine.lora import metadata as md

    ranks, scales = [8, 16, 4], [0.5, 1.5, 2.5]
    with torch.inference_mode():
        if path == "triton":
            slots_t = torch.from_numpy(token_slots.astype(np.int32))
            sorted_tokens, starts = lora_segments(slots_t, 3)
            step.meta = md.LoraMetadata(slots_t, None, ranks, sorted_tokens=sorted_tokens,
                                        starts=starts)
        else:
            step.meta = md.build_metadata(token_slots, ranks, scales, 16, torch.device("cpu"))
            assert (step.meta.wide is not None) == (path == "wide")
        return layer(x)  # type: ignore[no-any-return]


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("path", ["wide", "groups", "reference", "triton"])
@pytest.mark.parametrize("stale", [False, True], ids=["in-use", "stale"])
def test_layer_paths_keep_a_bad_slot_to_itself(device, bad, path, stale, monkeypatch) -> None:
    """Each of ``LoraLinear``'s paths: every slot at once (``wide``), per adapter
    (``groups``), the torch twin (``reference``: a bf16 layer) and the kernels
    (``triton``). A NaN/Inf adapter in slot 1, in use or freed, changes no other token's
    output by a bit."""
    from worker.engine.lora import metadata as md

    if device.type != "cpu":
        pytest.skip("the CPU paths run on CPU tensors")
    monkeypatch.setattr(md, "WIDE_MAX_TOKENS", 256 if path == "wide" else 0)
    dtype = torch.bfloat16 if path == "reference" else torch.float32
    want = _layer_forward(path, *_layer_setup(path, stale, None, dtype))
    layer, step, token_slots, x = _layer_setup(path, stale, BAD[bad], dtype)
    got = _layer_forward(path, layer, step, token_slots, x)
    others = torch.from_numpy(token_slots != 1)
    assert torch.equal(got[others], want[others])
    with torch.inference_mode():
        base_rows = torch.from_numpy(token_slots < 0)
        assert torch.equal(got[base_rows], layer.base(x)[base_rows])
    if not stale:
        assert not torch.isfinite(got[~others]).all()


def test_wide_path_is_the_every_slot_product_bit_for_bit(device) -> None:
    """With clean slots the wide path is exactly ``y + ((x A_flatᵀ) * wide) B_flatᵀ``: its
    isolation changes no bit of a clean step."""
    if device.type != "cpu":
        pytest.skip("the CPU paths run on CPU tensors")
    layer, step, token_slots, x = _layer_setup("wide", False, None, torch.float32)
    got = _layer_forward("wide", layer, step, token_slots, x)
    meta = step.meta
    cols = meta.wide_cols
    with torch.inference_mode():
        want = layer.base(x).addmm_(torch.mm(x, layer._a_flat[cols].T).mul_(meta.wide),
                                    layer._b_flat[:, cols].T)
    assert torch.equal(got, want)
