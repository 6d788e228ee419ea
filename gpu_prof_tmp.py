import time, uuid, sys, torch
sys.path.insert(0, ".")
from vllm_aio.backends.local import LocalBackend
from vllm_aio.connector.block_io import BlockRef, CopyHandoff, open_block_io, _check_headers
from vllm_aio.connector.block_layout import BlockLayout
from vllm_aio.pool.entry import HEADER_BYTES, EntryHeader
from vllm_aio.pool.keys import Unit
dev = torch.device("cuda", 0)
NB, L, n = 2100, 32, 1024
caches = {f"l{i}": torch.zeros(2, NB, 16, 8, 128, dtype=torch.bfloat16, device=dev) for i in range(L)}
names = list(caches); unit = Unit((0,), 0)
value = HEADER_BYTES + BlockLayout(caches, names, NB).payload_bytes(unit.layers)
be = LocalBackend(f"p-{uuid.uuid4().hex[:6]}", (2 * n + 8) * value, value, seal=True)
io = open_block_io(caches, names, NB, be, EntryHeader("0123456789abcdef", "pp0.dcp0.h0", -1, 16, 0), 1 << 28, 30.0)
refs = [BlockRef(i, f"h{i}".encode().ljust(32, b"x")) for i in range(n)]
io.save(refs, unit, io.device.record(), CopyHandoff())
into = [BlockRef(i + n, r.block_hash) for i, r in enumerate(refs)]
ms = io._direct; cp = ms._copies
T = {}
def t(name, fn):
    torch.cuda.synchronize(); a = time.perf_counter(); r = fn(); torch.cuda.synchronize(); T.setdefault(name, []).append((time.perf_counter() - a) * 1e3); return r
for it in range(8):
    keys = t("keys", lambda: io.keys(into, unit))
    hdr = t("headers", lambda: io._headers(into, unit))
    pins = t("pin", lambda: ms.store.pin_for_read(keys))
    slots = [p[0] for p in pins]
    t("check", lambda: _check_headers(torch.from_numpy(ms._host_rows[slots, :64]), hdr, [None] * n))
    idx = t("indices", lambda: io.device.indices(slots + [b.block_id for b in into]))
    rows = t("gather", lambda: cp._rows.index_select(0, idx[:n]))
    t("scatter", lambda: io._layout.scatter(rows.view(torch.uint8)[:, 64:], idx[n:], unit.layers))
    t("torn", lambda: [ms.store.still_valid(s, v) for s, v in pins])
    t("full_load", lambda: io.load(into, unit).settle())
for k, v in T.items():
    v = sorted(v[2:]); print(f"{k:10s} {v[len(v)//2]:.3f} ms")
