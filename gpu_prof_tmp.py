import cProfile, pstats, uuid, time, sys, torch
sys.path.insert(0, ".")
from vllm_aio.backends.local import LocalBackend
from vllm_aio.connector.block_io import BlockRef, CopyHandoff, open_block_io
from vllm_aio.pool.entry import HEADER_BYTES, EntryHeader
from vllm_aio.pool.keys import Unit
dev = torch.device("cuda", 0)
NB = 2100; L = 32
caches = {f"l{i}": torch.zeros(2, NB, 16, 8, 128, dtype=torch.bfloat16, device=dev) for i in range(L)}
names = list(caches)
for case, unit, n in (("whole", Unit(tuple(range(L)), None), 256), ("layer", Unit((0,), 0), 1024)):
    from vllm_aio.connector.block_layout import BlockLayout
    value = HEADER_BYTES + BlockLayout(caches, names, NB).payload_bytes(unit.layers)
    be = LocalBackend(f"p-{uuid.uuid4().hex[:6]}", (2 * n + 8) * value, value, seal=True)
    io = open_block_io(caches, names, NB, be, EntryHeader("0123456789abcdef", "pp0.dcp0.h0", -1, 16, 0), 1 << 28, 30.0)
    assert io.direct
    refs = [BlockRef(i, f"h{i}".encode().ljust(32, b"x")) for i in range(n)]
    io.save(refs, unit, io.device.record(), CopyHandoff())
    into = [BlockRef(i + n, r.block_hash) for i, r in enumerate(refs)]
    def load():
        r = io.load(into, unit); torch.cuda.current_stream().wait_event(r.copied); st = r.settle(); torch.cuda.synchronize()
        assert all(s.value == "ok" for s in st)
    for _ in range(3): load()
    t = time.perf_counter()
    for _ in range(10): load()
    dt = (time.perf_counter() - t) / 10
    print(f"{case} x {n}: {dt*1e3:.2f} ms, {n*(value-64)/dt/1e9:.1f} GB/s")
    pr = cProfile.Profile(); pr.enable()
    for _ in range(10): load()
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(12)
    io.close(); be.close()
