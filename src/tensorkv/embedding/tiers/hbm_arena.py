"""HBM tier 0: embedding rows in torch tensors on a GPU, the hash index on the host.

:class:`HBMArena` has the API of :class:`~tensorkv.embedding.arena.RowArena` with ``values``
and ``slots`` as float32 tensors on a torch device; optimizer steps run in the host kernels,
so results are bit-identical to a DRAM table. The host-memory tier below it (``HBM_DRAM*``
chains) is :class:`~tensorkv.embedding.tiers.dram.DRAMTier`. See docs/tiers.md ("HBM tier 0").
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tensorkv import config
from tensorkv.embedding.arena import HostRows, RowArena
from tensorkv.errors import ConfigError, import_optional


def _torch() -> Any:
    return import_optional("torch", "the HBM tier", "torch")


def _last_wins(rows: np.ndarray) -> np.ndarray:
    """Positions of the last occurrence of each distinct row (rows >= 0 only)."""
    rev = rows[::-1]
    _, first = np.unique(rev, return_index=True)
    pos = rows.size - 1 - first
    return pos[rows[pos] >= 0]


class HBMArena(RowArena):
    """Hash index on the host + row tensors on a torch device.

    The operations whose arithmetic depends on where rows live (initial values, optimizer
    steps, record copies, eviction's view of the rows) run on the host, so results are
    bit-identical to a DRAM arena.

    Parameters
    ----------
    dim
        Columns of a value row.
    slot_width
        Columns of the slot row (``num_slots * dim``).
    capacity
        Initial row capacity; with ``growth=False`` the most rows ever held.
    growth
        Whether the arena may grow past ``capacity`` (a growth allocates a larger tensor and
        copies on the device).
    max_load
        Index load factor that triggers doubling.
    device
        torch device of the rows: ``"cuda"`` (default), ``"cuda:1"``, ``"cpu"``.
    """

    kind = "HBM"
    on_device = True
    values: Any  # float32 torch tensor [capacity, dim] on ``device``
    slots: Any  # float32 torch tensor [capacity, slot_width] on ``device``

    def __init__(
        self,
        dim: int,
        slot_width: int = 0,
        *,
        capacity: int | None = None,
        growth: bool = True,
        max_load: float = config.TABLE_MAX_LOAD_FACTOR,
        device: Any = "cuda",
    ) -> None:
        torch = _torch()
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise ConfigError(f"device={device!r} is not a torch device ({e}); use 'cuda' or "
                              "'cpu'") from None
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(
                f"device={device!r} needs CUDA, which this torch build/machine does not have; "
                "use device='cpu' or a DRAM table"
            )
        super().__init__(dim, slot_width, capacity=capacity, growth=growth, max_load=max_load)
        # pinned host buffers for the optimizer's round trip (CUDA), and the event of the last
        # upload from each (the buffer is reused once that copy has finished)
        self._stage: dict[str, tuple[Any, Any]] = {}

    # --- allocation ---------------------------------------------------------------------------
    def _alloc_row_arrays(self, cap: int) -> None:
        torch = _torch()
        self.values = torch.zeros((cap, self.dim), dtype=torch.float32, device=self.device)
        self.slots = torch.zeros((cap, self.slot_width), dtype=torch.float32, device=self.device)

    @property
    def nbytes(self) -> int:
        """Bytes of the device tensors plus the host index and metadata."""
        dev = (self.values.numel() + self.slots.numel()) * 4
        host = (self.freq, self.version, self.seq, self.row_key, self.live, self.index,
                self.state)
        return int(dev + sum(a.nbytes for a in host))

    @property
    def device_bytes(self) -> int:
        """Bytes of the row tensors on the device."""
        return int((self.values.numel() + self.slots.numel()) * 4)

    def _resized_row_arrays(self, new: int) -> list[Any]:
        torch = _torch()
        keep = min(self.capacity, new)
        fresh = [torch.zeros((new, old.shape[1]), dtype=old.dtype, device=self.device)
                 for old in (self.values, self.slots)]  # both allocated before any copy
        for t, old in zip(fresh, (self.values, self.slots), strict=True):
            t[:keep] = old[:keep]
        return fresh

    def _move_rows(self, src: np.ndarray, dst: np.ndarray) -> None:
        for name in ("freq", "version", "seq", "row_key", "live"):
            arr = getattr(self, name)
            arr[dst] = arr[src]
        s, d = self._rows_t(src), self._rows_t(dst)
        for t in (self.values, self.slots):
            t.index_copy_(0, d, t.index_select(0, s))

    # --- transfers ------------------------------------------------------------------------------
    def _rows_t(self, rows: np.ndarray):
        torch = _torch()
        return torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64)).to(self.device)

    def _gather_t(self, tensor, rows: np.ndarray):
        """Device tensor of ``tensor[rows]`` with zero rows where ``rows < 0``."""
        torch = _torch()
        safe = np.maximum(rows, 0)
        out = tensor.index_select(0, self._rows_t(safe))
        if (rows < 0).any():
            out[torch.from_numpy(rows < 0).to(self.device)] = 0
        return out

    def _to_host(self, t) -> np.ndarray:
        return np.ascontiguousarray(t.detach().to("cpu").numpy(), dtype=np.float32)

    # --- the RowArena API -----------------------------------------------------------------------
    def find_gather(self, keys: np.ndarray, out: np.ndarray) -> tuple[np.ndarray, int]:
        """Rows of ``keys`` and their values copied into the host array ``out``."""
        rows = self.find(keys)
        hit = np.flatnonzero(rows >= 0)
        if hit.size:
            out[hit] = self._to_host(self.values.index_select(0, self._rows_t(rows[hit])))
        return rows, int(keys.shape[0] - hit.size)

    def gather(self, rows: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Host copy of the value rows (``-1`` rows left as in ``out`` / zero)."""
        if out is None:
            out = np.zeros((rows.shape[0], self.dim), np.float32)
        hit = np.flatnonzero(rows >= 0)
        if hit.size:
            out[hit] = self._to_host(self.values.index_select(0, self._rows_t(rows[hit])))
        return out

    def gather_slots(self, rows: np.ndarray) -> np.ndarray:
        """Host copy of the slot rows."""
        out = np.zeros((rows.shape[0], self.slot_width), np.float32)
        hit = np.flatnonzero(rows >= 0)
        if self.slot_width and hit.size:
            out[hit] = self._to_host(self.slots.index_select(0, self._rows_t(rows[hit])))
        return out

    def _scatter(self, tensor, rows: np.ndarray, src: np.ndarray) -> None:
        torch = _torch()
        rows = np.asarray(rows, np.int64)
        pos = _last_wins(rows)  # a later duplicate wins, as in the DRAM arena
        if pos.size == 0:
            return
        data = torch.from_numpy(np.ascontiguousarray(np.asarray(src)[pos], dtype=np.float32))
        tensor.index_copy_(0, self._rows_t(rows[pos]), data.to(self.device))

    def _scatter_values(self, rows: np.ndarray, values: np.ndarray) -> None:
        """Write value rows from host data (in order; a later duplicate wins)."""
        self._scatter(self.values, rows, values)

    def _scatter_slots(self, rows: np.ndarray, slots: np.ndarray) -> None:
        """Write slot rows from host data."""
        self._scatter(self.slots, rows, slots)

    # --- device-side and table helpers ----------------------------------------------------------
    def lookup_torch(self, keys: np.ndarray, fill: Any = None):
        """Values of ``keys`` as a ``[n, dim]`` float32 tensor on the device.

        Absent keys read zeros, or ``fill`` (a ``[n, dim]`` host array/tensor whose rows are
        used where the key is absent).
        """
        torch = _torch()
        rows = self.find(np.ascontiguousarray(keys, dtype=np.int64))
        out = self._gather_t(self.values, rows)
        miss = np.flatnonzero(rows < 0)
        if fill is not None and miss.size:
            f = torch.as_tensor(np.asarray(fill)[miss], dtype=torch.float32)
            out[self._rows_t(miss)] = f.to(self.device)
        return out

    def torch_rows(self, keys: np.ndarray, values: np.ndarray, torch: Any) -> Any:
        """The rows of ``keys`` gathered on the device; absent keys from host ``values``."""
        return self.lookup_torch(keys, fill=values)

    def _init_rows(self, initializer, rows: np.ndarray, keys: np.ndarray, seed: int,
                   slot_init: np.ndarray) -> None:
        """Write initial values (computed on the host, as the DRAM table does) and slots."""
        if rows.size == 0:
            return
        self.scatter(rows, initializer.values(keys, self.dim, seed))
        if self.slot_width:
            num = self.slot_width // self.dim
            s = np.repeat(np.asarray(slot_init, np.float32), self.dim)[: num * self.dim]
            self.scatter_slots(rows, np.broadcast_to(s, (rows.size, self.slot_width)))
        self.freq[rows] = 0

    def _download(self, name: str, tensor, rt) -> tuple[np.ndarray, Any]:
        """``tensor[rt]`` on the host: ``(numpy array, torch tensor sharing its memory)``.

        On CUDA the rows land in a pinned buffer (reused across steps, grown as needed), so
        the copy runs at full bus speed and :meth:`_upload` can send it back asynchronously.
        """
        torch = _torch()
        src = tensor.index_select(0, rt)
        if self.device.type != "cuda":
            return src.numpy(), src  # index_select made a copy on the host already
        m, width = src.shape
        buf, done = self._stage.get(name, (None, None))
        if done is not None:
            done.synchronize()  # the previous upload from this buffer has finished
        if buf is None or buf.shape[0] < m or buf.shape[1] != width:
            rows = max(m, 2 * buf.shape[0] if buf is not None else 0)
            buf = torch.empty((rows, width), dtype=torch.float32, pin_memory=True)
        self._stage[name] = (buf, None)
        host = buf[:m]
        host.copy_(src)  # device -> pinned host; returns once the data is there
        return host.numpy(), host

    def _upload(self, name: str, tensor, rt, host) -> None:
        """``tensor[rt] = host`` (a tensor from :meth:`_download`), asynchronous on CUDA."""
        torch = _torch()
        if self.device.type != "cuda":
            tensor.index_copy_(0, rt, host)
            return
        tensor.index_copy_(0, rt, host.to(self.device, non_blocking=True))
        done = torch.cuda.Event()
        done.record()
        self._stage[name] = (self._stage[name][0], done)

    def _apply_optimizer(self, optimizer: Any, rows: np.ndarray, grads: np.ndarray, step: int,
                         parallel: bool | None = None, split: Any = None) -> None:
        """One optimizer step on ``rows`` (unique), bit-identical to the DRAM table.

        Gathers the rows' values and slots to host float32 (pinned buffers on CUDA), runs
        ``optimizer.apply`` (the numba kernel) with ``rows = arange(m)``, and copies both back
        to the device. ``parallel`` and ``split`` are ignored (the host kernel's defaults).
        """
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        m = rows.size
        rt = self._rows_t(rows)
        v, vt = self._download("values", self.values, rt)
        if self.slot_width:
            s, st = self._download("slots", self.slots, rt)
        else:
            s, st = np.zeros((m, 0), np.float32), None
        optimizer.apply(v, s, np.arange(m, dtype=np.int64),
                        np.ascontiguousarray(grads, dtype=np.float32), step)
        self._upload("values", self.values, rt, vt)
        if st is not None:
            self._upload("slots", self.slots, rt, st)

    def host_view(self) -> HostRows:
        """A host copy of the live rows for :meth:`~tensorkv.embedding.filters.Eviction.select`.

        Row numbers of the view index its own arrays: map them back with its ``row_key``.
        """
        live = np.flatnonzero(self.live[:self.high_water])
        return HostRows(self.row_key[live], self.freq[live], self.version[live],
                        self.gather(live))

    def _write_records(self, layout: Any, word: np.dtype,
                       pieces: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
                       split: Any = None) -> None:
        """Copy records into device rows (unpacked on the host, then uploaded)."""
        for src, src_rows, rows in pieces:
            f = layout.unpack(np.ascontiguousarray(src[src_rows, :layout.record_bytes]))
            self.scatter(rows, np.ascontiguousarray(f.values))
            if self.slot_width:
                self.scatter_slots(rows, np.ascontiguousarray(f.slots))
            self.freq[rows], self.version[rows], self.seq[rows] = f.freq, f.version, f.change_seq

    def read_records(self, layout: Any, word: np.dtype, keys: np.ndarray, rows: np.ndarray,
                     out: np.ndarray) -> None:
        """Pack device rows into records (downloaded, then packed on the host)."""
        recs = layout.pack(keys, self.gather(rows), self.gather_slots(rows), self.freq[rows],
                           self.version[rows], self.seq[rows])
        out[:, :layout.record_bytes] = recs

    def row_l2(self, rows: np.ndarray) -> np.ndarray:
        """L2 norm (float64) of value rows, computed on the host like the DRAM table's kernel."""
        from tensorkv.kernels import arena as ak

        v = self.gather(rows)
        return ak.row_l2(v, np.arange(rows.size, dtype=np.int64))

__all__ = ["HBMArena"]
