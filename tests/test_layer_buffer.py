"""``LayerBuffer``: a simulated forward over L layers aliased onto S device buffers.

Each step writes new K/V into some blocks of every layer (as vLLM's cache
update does, right before the layer's attention) and then "attends": reads
every resident block of the layer and compares it with a reference cache that
keeps all layers. Runs on the CPU and, where present, on CUDA (the path with
streams, events and page-locked staging).
"""

from __future__ import annotations

import pytest
import torch

from vllm_aio.connector.layer_buffer import BufferStep, LayerBuffer

NUM_BLOCKS, PAGE = 24, (2, 16, 32)  # [blocks, K/V, tokens, channels]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


class Model:
    """L layer views on S buffers of one allocation, plus the reference cache."""

    def __init__(self, device: str, layers: int, buffers: int, staging: int = 1 << 20):
        self.names = [f"layer.{i}" for i in range(layers)]
        backing = torch.zeros(buffers, NUM_BLOCKS, *PAGE, dtype=torch.bfloat16, device=device)
        self.views = {n: backing[i % buffers] for i, n in enumerate(self.names)}
        self.truth = {n: torch.zeros(NUM_BLOCKS, *PAGE, dtype=torch.bfloat16, device=device) for n in self.names}
        self.buffer = LayerBuffer(self.views, self.names, NUM_BLOCKS, buffers, staging)
        self.generator = torch.Generator().manual_seed(0)

    def step(self, resident: list[int], written: list[int], **updates) -> list[str]:
        """One forward; returns the layers whose attention saw wrong KV."""
        wrong = []
        step = BufferStep(resident=resident, written=written, **updates)
        self._apply_to_truth(step)
        self.buffer.begin_step(step)
        for i, name in enumerate(self.names):
            new = torch.randn(len(written), *PAGE, generator=self.generator).to(torch.bfloat16)
            self.views[name][written] = new.to(self.views[name].device)  # vLLM's cache update
            self.truth[name][written] = new.to(self.truth[name].device)
            if not torch.equal(self.views[name][resident], self.truth[name][resident]):
                wrong.append(name)
            self.buffer.layer_done(i)
            if i + 1 < len(self.names):
                self.buffer.before_layer(i + 1)
        self.buffer.end_step()
        return wrong

    def _apply_to_truth(self, step: BufferStep) -> None:
        for t in self.truth.values():
            t[step.zeroed] = 0
            for src, dst in step.copies:
                t[dst] = t[src]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layers,buffers", [(6, 2), (6, 3), (7, 2)])
def test_every_layer_attends_over_its_own_kv(device, layers, buffers):
    model = Model(device, layers, buffers)
    assert model.step(resident=list(range(8)), written=list(range(8))) == []  # prefill
    for decode in range(3):
        assert model.step(resident=list(range(9)), written=[8]) == []
    # Another request, chunked: its first chunk's blocks stay resident for the next chunk.
    assert model.step(resident=[10, 11, 12], written=[10, 11, 12]) == []
    assert model.step(resident=[10, 11, 12, 13, 14, 0, 1], written=[13, 14]) == []


@pytest.mark.parametrize("device", DEVICES)
def test_zeroed_and_copied_blocks_reach_the_host_copy(device):
    model = Model(device, 6, 2)
    assert model.step(resident=list(range(6)), written=list(range(6))) == []
    assert model.step(resident=[2, 3, 7, 9], written=[9], zeroed=[9], copies=[(2, 7)]) == []


@pytest.mark.parametrize("device", DEVICES)
def test_small_staging_moves_layers_in_chunks(device):
    page = 2 * 16 * 32 * 2
    model = Model(device, 6, 2, staging=4 * 3 * page)  # chunks of 3 blocks
    assert model.step(resident=list(range(20)), written=list(range(20))) == []
    assert model.step(resident=list(range(21)), written=[20]) == []


def test_without_the_buffer_the_check_fails():
    # Negative control: views aliased onto 2 buffers with no streaming serve stale KV.
    model = Model("cpu", 6, 2)
    model.buffer.begin_step = model.buffer.layer_done = model.buffer.end_step = lambda *a: None
    model.step(resident=list(range(4)), written=list(range(4)))
    assert model.step(resident=list(range(5)), written=[4]) != []
