"""``LayerBuffer``: a simulated forward over L layers aliased onto S device buffers.

Each step writes new K/V into some blocks of every layer (as vLLM's cache
update does, right before the layer's attention) and then "attends": reads
every block of the step (the loaded ones and the written ones) and compares
it with a reference cache that keeps all layers. Runs on the CPU and, where
present, on CUDA (the path with streams, events and page-locked memory), with
blocks moved through staging, in place (runs of consecutive blocks), or both.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from harness.devices import CUDA, params, registered

from vllm_aio.device import host_copy
from vllm_aio.buffer.residency import private_blocks
from vllm_aio.device.block_layout import BlockLayout
from vllm_aio.buffer.layer_buffer import LayerBuffer
from vllm_aio.buffer.steps import split_runs
from vllm_aio.shared.metadata import BufferStep

NUM_BLOCKS, PAGE = 24, (2, 16, 32)  # [blocks, K/V, tokens, channels]
PAGE_BYTES = 2 * 16 * 32 * 2  # bf16
DEVICES = params("cpu", *CUDA, "npu")
# Staged only; in place only; runs of 3 blocks or more in place, the rest staged.
COPIES = {"staged": 1 << 40, "in_place": 0, "mixed": 3 * PAGE_BYTES}


# How a runner hands a layer's cache to the connector: vLLM's one tensor, or vllm-ascend's tuple of
# separate allocations, every tensor ``[blocks, tokens, ...]``: ``(k, v)``, or MLA's ``(nope, rope)``.
TUPLE_FORMS = {"kv": ((16, 32), (16, 32)), "mla": ((16, 32), (16, 8))}


def parts(cache) -> tuple[torch.Tensor, ...]:
    return (cache,) if isinstance(cache, torch.Tensor) else tuple(cache)


class Model:
    """L layer views on S buffers (of one allocation, or vllm-ascend's tuples of separate allocations,
    one per buffer and part, every layer of a buffer handed the same tuple), plus the reference cache."""

    def __init__(self, device: str, layers: int, buffers: int, staging: int = 1 << 20, copies: str = "mixed",
                 shape: tuple[int, ...] = (NUM_BLOCKS, *PAGE), form: str = "tensor"):
        self.device = device
        self.names = [f"layer.{i}" for i in range(layers)]
        if form == "tensor":
            backing = torch.zeros(buffers, *shape, dtype=torch.bfloat16, device=device)
            self.views = {n: backing[i % buffers] for i, n in enumerate(self.names)}
            self.truth = {n: torch.zeros(*shape, dtype=torch.bfloat16, device=device) for n in self.names}
        else:
            def cache():
                return tuple(torch.zeros(NUM_BLOCKS, *p, dtype=torch.bfloat16, device=device)
                             for p in TUPLE_FORMS[form])

            shared = [cache() for _ in range(buffers)]
            self.views = {n: shared[i % buffers] for i, n in enumerate(self.names)}
            self.truth = {n: cache() for n in self.names}
        self.kv_split = shape[0] == 2  # [2, blocks, ...]: K and V apart, two planes per layer
        self.buffer = LayerBuffer(self.views, self.names, NUM_BLOCKS, buffers, staging, COPIES[copies])
        for host in self.buffer.host_caches.values():  # like the reference (the memory may be reused)
            for t in parts(host):
                t.zero_()
        self.generator = torch.Generator().manual_seed(0)

    def blocks(self, t: torch.Tensor, ids: list[int]) -> torch.Tensor:
        return t[:, ids] if self.kv_split else t[ids]

    def step(self, resident: list[int], written: list[int], after_layer=None, **updates) -> list[str]:
        """One forward; returns the layers whose attention saw wrong KV."""
        wrong = []
        step = BufferStep(resident=resident, written=written, **updates)
        self._apply_to_truth(step)
        self.buffer.begin_step(step)
        read = sorted(set(resident) | set(written))
        for i, name in enumerate(self.names):
            for view, truth in zip(parts(self.views[name]), parts(self.truth[name])):
                new = torch.randn(*self.blocks(truth, written).shape, generator=self.generator)
                new = new.to(torch.bfloat16)
                self._set(view, written, new)  # vLLM's cache update
                self._set(truth, written, new)
            if not all(torch.equal(self.blocks(view, read), self.blocks(truth, read))
                       for view, truth in zip(parts(self.views[name]), parts(self.truth[name]))):
                wrong.append(name)
            self.buffer.layer_done(i)
            if after_layer is not None:
                after_layer(i)
            if i + 1 < len(self.names):
                self.buffer.before_layer(i + 1)
        self.buffer.end_step()
        return wrong

    def host_matches(self, layer: int, ids: list[int]) -> bool:
        name = self.names[layer]
        return all(torch.equal(self.blocks(host, ids), self.blocks(truth, ids).cpu())
                   for host, truth in zip(parts(self.buffer.host_caches[name]), parts(self.truth[name])))

    def _set(self, t: torch.Tensor, ids: list[int], value: torch.Tensor) -> None:
        if self.kv_split:
            t[:, ids] = value.to(t.device)
        else:
            t[ids] = value.to(t.device)

    def _apply_to_truth(self, step: BufferStep) -> None:
        for t in (t for cache in self.truth.values() for t in parts(cache)):
            self._set(t, step.zeroed, torch.zeros_like(self.blocks(t, step.zeroed)))
            for src, dst in step.copies:
                self._set(t, [dst], self.blocks(t, [src]).clone())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("copies", COPIES)
@pytest.mark.parametrize("layers,buffers", [(6, 2), (6, 3), (7, 2)])
def test_every_layer_attends_over_its_own_kv(device, copies, layers, buffers):
    model = Model(device, layers, buffers, copies=copies)
    assert model.step(resident=list(range(8)), written=list(range(8))) == []  # prefill
    for decode in range(3):
        assert model.step(resident=list(range(9)), written=[8]) == []
    # Another request, chunked: its first chunk's blocks stay resident for the next chunk.
    assert model.step(resident=[10, 11, 12], written=[10, 11, 12]) == []
    assert model.step(resident=[10, 11, 12, 13, 14, 0, 1], written=[13, 14]) == []


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("copies", COPIES)
def test_steps_as_the_scheduler_sends_them_load_only_earlier_tokens(device, copies):
    # Prefill without a prefix loads nothing; decodes load the full blocks (and a partly full last one).
    model = Model(device, 6, 2, copies=copies)
    assert model.step(resident=[], written=[3, 4, 5, 6, 7, 9, 10]) == []
    assert model.step(resident=[3, 4, 5, 6, 7, 9, 10], written=[11]) == []  # token starts block 11
    assert model.step(resident=[3, 4, 5, 6, 7, 9, 10, 11], written=[11]) == []
    assert model.step(resident=[3, 4, 5], written=[5, 12, 13]) == []  # a second request on a cached prefix


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("resident,written", [([], []), ([], [0, 1, 2]), ([0, 1, 2], []), ([0, 5], [])])
def test_empty_block_lists_are_no_ops(device, resident, written):
    model = Model(device, 5, 2)
    assert model.step(resident=[0, 1, 2, 5], written=[0, 1, 2, 5]) == []
    assert model.step(resident=resident, written=written) == []
    assert model.step(resident=[0, 1, 2, 5], written=[6]) == []  # the host copy is intact


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("copies", COPIES)
def test_zeroed_and_copied_blocks_reach_the_host_copy(device, copies):
    model = Model(device, 6, 2, copies=copies)
    assert model.step(resident=list(range(6)), written=list(range(6))) == []
    assert model.step(resident=[2, 3, 7, 9], written=[9], zeroed=[9], copies=[(2, 7)]) == []


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("copies", COPIES)
def test_kv_split_layout_moves_both_planes(device, copies):
    model = Model(device, 5, 2, copies=copies, shape=(2, NUM_BLOCKS, 16, 4, 8))
    # Planes of 1 KiB: "mixed" copies runs of 6 blocks or more in place.
    assert model.step(resident=[], written=[*range(8), 9]) == []
    assert model.step(resident=[*range(8), 9], written=[9, 10]) == []
    assert model.step(resident=list(range(11)), written=[11], copies=[(0, 13)]) == []


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("copies", COPIES)
@pytest.mark.parametrize("form", TUPLE_FORMS)
def test_vllm_ascends_tuple_caches_stream_every_tensor(device, copies, form):
    """vllm-ascend's runner on a shared_by plan: each buffer's K and V (MLA: nope and rope) are
    separate allocations, and every layer of the buffer is handed that same tuple."""
    model = Model(device, 6, 2, copies=copies, form=form)
    assert model.step(resident=[], written=list(range(8))) == []
    assert model.step(resident=list(range(8)), written=[8]) == []
    assert model.step(resident=[2, 3, 7, 9], written=[9], zeroed=[9], copies=[(2, 7)]) == []
    assert all(model.host_matches(layer, [0, 5, 8]) for layer in range(6))
    assert all(isinstance(host, tuple) and len(host) == 2 for host in model.buffer.host_caches.values())


def test_tuple_caches_not_laid_out_for_the_buffer_are_refused():
    # One tensor of the tuple shared, the other not: vLLM's runner did not hand the buffer's pair.
    k = torch.zeros(NUM_BLOCKS, 16, 32, dtype=torch.bfloat16)
    names = [f"layer.{i}" for i in range(4)]
    caches = {n: (k, torch.zeros_like(k)) for n in names}
    with pytest.raises(ValueError, match="transfer_mode dynamic_buffer: layer layer.2 is not the memory of buffer 0"):
        LayerBuffer(caches, names, NUM_BLOCKS, 2, 1 << 20)


@pytest.mark.parametrize("device", DEVICES)
def test_small_staging_moves_layers_in_chunks(device):
    model = Model(device, 6, 2, staging=4 * 3 * PAGE_BYTES, copies="staged")  # chunks of 3 blocks
    assert model.step(resident=list(range(20)), written=list(range(20))) == []
    assert model.step(resident=list(range(21)), written=[20]) == []


@pytest.mark.parametrize("device", DEVICES)
def test_write_backs_complete_during_the_step(device):
    # Staging for 4 chunks of 3 blocks, each layer writes back 7 chunks: the step must
    # complete write-backs as it goes, never by calling end_step in its middle.
    model = Model(device, 6, 2, staging=4 * 3 * PAGE_BYTES, copies="staged")
    written = list(range(0, 21))
    end_steps = []
    end_step = model.buffer.end_step
    model.buffer.end_step = lambda: (end_steps.append(1), end_step())[1]
    landed = []

    def check_earlier_layer(layer: int) -> None:
        if layer >= 1:  # layer_done(layer) completed layer - 1's write-back, whose copies had landed
            landed.append(model.host_matches(layer - 1, written))
        if device == "cuda":
            torch.cuda.synchronize()  # what the forward's next layer takes, at least

    assert model.step(resident=[], written=written, after_layer=check_earlier_layer) == []
    assert end_steps == [1]  # only the model's own, at the end
    assert landed == [True] * 5
    assert all(model.host_matches(i, written) for i in range(6))


@pytest.mark.parametrize("device", DEVICES)
def test_host_copies_spread_over_threads(device, monkeypatch):
    monkeypatch.setenv("VLLM_AIO_COPY_THREADS", "4")
    monkeypatch.setattr(host_copy, "MIN_BYTES_PER_THREAD", 2 * PAGE_BYTES)
    model = Model(device, 4, 2, copies="staged")
    assert model.step(resident=[], written=list(range(0, 24, 2))) == []
    assert model.step(resident=list(range(0, 24, 2)), written=[1, 3, 5, 7, 9, 11, 13]) == []


@pytest.mark.parametrize("threads", ["1", "4"])
@pytest.mark.parametrize("shape", [(NUM_BLOCKS, *PAGE), (2, NUM_BLOCKS, 16, 4, 8)])
def test_host_fast_paths_match_gather_and_scatter(threads, shape, monkeypatch):
    monkeypatch.setenv("VLLM_AIO_COPY_THREADS", threads)
    monkeypatch.setattr(host_copy, "MIN_BYTES_PER_THREAD", PAGE_BYTES)
    g = torch.Generator().manual_seed(1)
    caches = {n: torch.randn(shape, generator=g).to(torch.bfloat16) for n in ("a", "b")}
    layout = BlockLayout(caches, ["a", "b"], NUM_BLOCKS)
    ids = torch.tensor([0, 3, 4, 5, 9, 17, 23])
    rows = torch.empty(len(ids), layout.layer_bytes(1), dtype=torch.uint8)
    layout.gather(ids, [1], rows)
    planes = torch.empty(len(ids) * layout.layer_bytes(1), dtype=torch.uint8)
    layout.gather_planes(ids, 1, planes)
    sizes = [p.size for p in layout.planes[1]]
    assert torch.equal(torch.cat(layout.plane_rows(1, planes, len(ids)), dim=1), rows)
    assert torch.equal(torch.cat(rows.split(sizes, dim=1)).flatten(), planes)
    before, dst = caches["b"].clone(), torch.tensor([1, 2, 6, 7, 8, 20, 22])
    layout.scatter(rows, dst, [1])
    expected = caches["b"].clone()
    caches["b"].copy_(before)
    layout.scatter_planes(planes, dst, 1)
    assert torch.equal(caches["b"], expected) and not torch.equal(expected, before)
    with pytest.raises(IndexError):  # copy_rows would read past the cache
        layout.gather_planes(torch.tensor([0, NUM_BLOCKS]), 1, planes[: 2 * layout.layer_bytes(1)])


def test_consecutive_ids_split_into_runs_and_the_rest():
    assert split_runs([], 1)[0] == [] and len(split_runs([], 1)[1]) == 0
    runs, rest = split_runs([9, 1, 2, 3, 7, 3, 11, 12], 2)
    assert runs == [(1, 4), (11, 13)] and rest.tolist() == [7, 9]
    assert split_runs([5, 6], 3)[1].tolist() == [5, 6]


@pytest.mark.parametrize("device", DEVICES)
def test_host_copy_is_one_exact_page_locked_allocation(device):
    model = Model(device, 5, 2)
    hosts = list(model.buffer.host_caches.values())
    memory = model.buffer.host.memory.tensor
    assert memory.nbytes == 5 * NUM_BLOCKS * PAGE_BYTES  # no power-of-2 rounding
    assert memory.untyped_storage().nbytes() < memory.nbytes + 3 * 65536  # at most page alignment on top
    assert all(h.untyped_storage().data_ptr() == memory.untyped_storage().data_ptr() for h in hosts)
    assert all(registered(h) == (device != "cpu") for h in hosts)
    model.step(resident=[], written=[0, 1])
    model.buffer.close()
    assert not model.buffer.host.memory.registered
    assert not any(registered(h) for h in hosts)  # unregistered; still readable
    assert model.host_matches(4, [0, 1])


@pytest.mark.parametrize("skip", ["begin_step", "_load", "_write_back"])
def test_without_the_buffer_the_check_fails(skip):
    # Negative controls: views aliased onto 2 buffers serve stale KV without the
    # buffer, without its loads, or without its write-backs (seen a step later).
    model = Model("cpu", 6, 2)
    if skip == "begin_step":
        model.buffer.begin_step = model.buffer.layer_done = model.buffer.end_step = lambda *a: None
    else:
        setattr(model.buffer._copier, skip, lambda *a: None)
    model.step(resident=list(range(4)), written=list(range(4)))
    assert model.step(resident=list(range(5)), written=[4]) != []


class ResidentModel:
    """Pinned blocks: L layers on S buffers of ``NUM_BLOCKS`` + private blocks, the forward reading and
    writing through vLLM-like block table and slot mapping tensors that the buffer remaps per layer."""

    def __init__(self, device: str, layers: int, buffers: int, resident: int, copies: str = "mixed",
                 form: str = "tensor"):
        self.names = [f"layer.{i}" for i in range(layers)]
        total = NUM_BLOCKS + private_blocks(layers, buffers, resident)
        backing = torch.zeros(buffers, total, *PAGE, dtype=torch.bfloat16, device=device)
        if form == "kv":  # vllm-ascend's: K and V of a buffer separate allocations (copies of the backing's)
            backing = [(b[:, 0].clone(), b[:, 1].clone()) for b in backing]
        self.views = {n: backing[i % buffers] for i, n in enumerate(self.names)}
        self.truth = {n: torch.zeros(NUM_BLOCKS, *PAGE, dtype=torch.bfloat16) for n in self.names}
        self.buffer = LayerBuffer(self.views, self.names, total, buffers, 1 << 20, COPIES[copies],
                                  resident_blocks=resident, block_tokens=PAGE[1])
        for t in (t for host in self.buffer.host_caches.values() for t in parts(host)):
            t.zero_()
        self.device = device
        self.generator = torch.Generator().manual_seed(0)

    def step(self, read: list[int], written: list[int], pinned=(), promoted=()) -> list[str]:
        """One forward over blocks ``read`` (and ``written``); returns the layers that saw wrong KV."""
        slot_of = dict(pinned)
        step = BufferStep(resident=[b for b in read if b not in slot_of and b not in written], written=written,
                          pinned=list(pinned), promoted=list(promoted))
        ids = sorted(set(read) | set(written))
        table = torch.tensor([ids], dtype=torch.int32, device=self.device)
        slots = torch.tensor([b * PAGE[1] for b in written], dtype=torch.int64, device=self.device)
        meta = SimpleNamespace(block_table=table, slot_mapping=slots)
        forward = SimpleNamespace(attn_metadata=dict.fromkeys(self.names, meta),
                                  slot_mapping=dict.fromkeys(self.names, slots))
        self.buffer.begin_step(step, forward)
        wrong = []
        for i, name in enumerate(self.names):
            new = torch.randn(len(written), *PAGE, generator=self.generator).to(torch.bfloat16)
            # the cache update, through the slot mapping
            _write(self.views[name], slots // PAGE[1], new.to(self.device))
            self.truth[name][written] = new
            if not torch.equal(_read(self.views[name], table[0].long()).cpu(), self.truth[name][ids]):  # attention
                wrong.append(name)
            self.buffer.layer_done(i)
            self.buffer.before_layer(i + 1)
        self.buffer.end_step()
        assert table[0].tolist() == ids and slots.tolist() == [b * PAGE[1] for b in written]  # vLLM's own again
        return wrong

    def host_matches(self, ids: list[int]) -> bool:
        return all(torch.equal(_read(self.buffer.host_caches[n], ids), self.truth[n][ids]) for n in self.names)


def _read(cache, ids) -> torch.Tensor:
    """Blocks ``ids`` of a cache as ``[n, *PAGE]``, from one tensor or a ``(k, v)`` tuple."""
    return cache[ids] if isinstance(cache, torch.Tensor) else torch.stack([t[ids] for t in cache], 1)


def _write(cache, ids, value: torch.Tensor) -> None:
    if isinstance(cache, torch.Tensor):
        cache[ids] = value
    else:
        for i, t in enumerate(cache):
            t[ids] = value[:, i]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("copies", COPIES)
@pytest.mark.parametrize("layers,buffers", [(6, 2), (7, 3)])
@pytest.mark.parametrize("form", ["tensor", "kv"])
def test_pinned_blocks_are_read_and_written_at_each_layers_private_place(device, copies, layers, buffers, form):
    model = ResidentModel(device, layers, buffers, resident=4, copies=copies, form=form)
    high = [(1, 0), (2, 1), (3, 2)]
    assert model.step(read=[], written=[1, 2, 3], pinned=high) == []  # prefill, pinned from the start
    assert model.step(read=[1, 2, 3], written=[3], pinned=high) == []  # decode: nothing of it loaded
    assert model.step(read=[5, 6, 1, 2], written=[6]) == []  # another request streams; 1, 2 read from host
    assert model.host_matches([1, 2, 3, 6])  # written back from the private places
    # Block 5 and 6 become resident holding K/V: filled from the host copy; 1 gives its slot up to 5
    # and is read streamed from the host copy, not from the slot it had.
    assert model.step(read=[5, 6, 2, 1], written=[6], pinned=[(5, 0), (6, 3), (2, 1)], promoted=[5, 6]) == []
    assert model.host_matches([5, 6])
    assert model.step(read=[5, 6, 2, 1], written=[6], pinned=[(5, 0), (6, 3), (2, 1)]) == []  # same pins again


@pytest.mark.parametrize("device", DEVICES)
def test_a_prefill_of_many_pinned_blocks_is_written_back_whole(device):
    # More written pinned blocks than PINNED_COPY_ROWS: the batched copies, not one per block.
    model = ResidentModel(device, 6, 2, resident=12)
    pinned = [(b, b - 1) for b in range(1, 12)]
    assert model.step(read=[], written=list(range(1, 12)), pinned=pinned) == []
    assert model.host_matches(list(range(1, 12)))
    assert model.step(read=list(range(1, 12)), written=[11], pinned=pinned) == []


def test_pinned_blocks_need_the_remap():
    # Negative control: without pointing the tables at the private blocks, attention reads stale KV.
    model = ResidentModel("cpu", 6, 2, resident=4)
    model.buffer._remap.apply = lambda layer: None
    model.step(read=[], written=[1, 2], pinned=[(1, 0), (2, 1)])
    assert model.step(read=[1, 2], written=[2], pinned=[(1, 0), (2, 1)]) != []


def test_attention_backends_that_read_blocks_elsewhere_are_refused():
    from vllm_aio.errors import ConfigError
    from vllm_aio.buffer.remap import check_backends

    check_backends({"layer.0": "CPU_ATTN", "layer.1": "FLASH_ATTN"})
    with pytest.raises(ConfigError, match="attention backend FLASHINFER is not supported; it needs one of CPU_ATTN"):
        check_backends({"layer.0": "FLASHINFER"})


def test_caches_vllm_did_not_lay_out_for_the_buffer_are_refused():
    # Without the vllm_aio_buffer_plan plugin every layer keeps memory of its own: the buffer would
    # stream nothing and the engine would run on a third of the blocks, silently.
    names = [f"layer.{i}" for i in range(4)]
    own = {n: torch.zeros(NUM_BLOCKS, *PAGE, dtype=torch.bfloat16) for n in names}
    with pytest.raises(ValueError, match="transfer_mode dynamic_buffer: layer layer.2 is not the memory of buffer 0"):
        LayerBuffer(own, names, NUM_BLOCKS, 2, 1 << 20)
