"""Target features from vLLM, on the readers' side: what `extract --engine vllm` and
`train --engine vllm` ask the engine replicas for through the spool (`spool.py`, `feed.py`) and how
they turn its files into the target's outputs training reads.

vLLM's `extract_hidden_states` method stores the states entering chosen layers of every prompt token;
blockdraft asks for

* the ids `hidden_states_index(L)` of its feature layers L (clause 1: vLLM's aux id k is the input of
  layer k, transformers' `hidden_states[k]`, which is the output of layer k - 1), and
* id n (n decoder layers): the last layer's output *before* the final norm, to which the reader
  applies the target's own final-norm module (transformers', loaded from the checkpoint: never a
  re-implemented norm, never twice) for the final state that the labels come from (clause 3).

A packed row holds several documents (positions restart at 0 for each, and for the padding);
transformers keeps attention inside each, so each is its own vLLM request, and the row is put back
together from them. Items are read in the order the trainer (or extract) reads rows, and each item's
files are deleted once read.
"""

from __future__ import annotations

import time
from collections import deque

import torch

from ...target import hidden_states_index
from .launch import Engines
from .spool import Request, Spool, item_key, state_bytes
from .states import read_states


def capture_ids(layer_ids: list[int], num_layers: int) -> list[int]:
    """The aux ids vLLM is asked for: the feature layers' (through clause 1's one owner function),
    then the last layer's output (id n), ascending and each once, as vLLM returns them."""
    return sorted({hidden_states_index(L) for L in layer_ids} | {num_layers})


def segments(rows: dict, idx) -> list[tuple[int, int, int]]:
    """(row, start, end) of each document (and of the padding) in the given rows: the spans that
    start where the position ids restart at 0."""
    out = []
    for r in [int(i) for i in idx]:
        pos = rows["position_ids"][r]
        starts = (pos == 0).nonzero()[:, 0].tolist()
        if not starts or starts[0] != 0:
            raise ValueError(f"row {r}: positions must start at 0 (packed rows restart them per document)")
        ends = starts[1:] + [pos.numel()]
        out.extend((r, s, e) for s, e in zip(starts, ends))
    return out


def segment_name(seg: tuple[int, int, int]) -> str:
    return f"r{seg[0]:07d}-{seg[1]:05d}-{seg[2]:05d}"


def check_can_capture(target, untested: bool = False) -> None:
    """A one-line error where neither the installed vLLM's class for the target nor blockdraft's plugin
    gives its layer states, or where that capture was not measured equal (`untested`: --engine-untested,
    tried anyway)."""
    from ...target.layers import final_from_mean_state
    from ..base import architectures
    from .consumer import features_capture, not_captured

    archs = architectures(target)
    if not final_from_mean_state(target.model.config):
        raise ValueError(f"the vLLM engines cannot give {archs[0]}'s labels: its last layer's state (the mean of its "
                         "hyper-connection streams) is not what its final norm reads (a learned weighing of them), "
                         "so id n plus the final norm is not its final state; use --engine transformers")
    known, source = features_capture(untested)
    if any(a in known for a in archs):
        return
    other = "use --engine transformers (extract: one rank per shard set under torchrun, or --target-device-map; " \
            "train: --target-fsdp)"
    why = not_captured(archs[0])
    if why:
        raise ValueError(f"the vLLM engines do not capture {archs[0]}: {why}; {other}, or --engine-untested to try")
    raise ValueError(f"vLLM cannot capture {archs[0]}'s hidden states (its class lacks SupportsEagle3 and "
                     f"blockdraft's vLLM plugin cannot add it, by {source}); {other}")


class StateReader:
    """Rows' target outputs put together from the engine's files: features of the chosen layers in
    config order, the final state from the target's own final norm, and the argmax of its own head."""

    def __init__(self, target, rows: dict, final_norm, itemsize: int, labels_only: bool = False, fp8: bool = False):
        """`labels_only`: the argmax only where a label reads it (the position before each loss token),
        for a trainer; a cache (extract) keeps it everywhere. `fp8`: the engine sends fp8 states with
        per-token scales (--engine-states fp8), dequantized here."""
        from ...data.packing import padding

        self.target, self.rows, self.norm, self.labels_only = target, rows, final_norm, labels_only
        self.ids = capture_ids(target.layer_ids, target.num_layers)
        self.pick = [self.ids.index(hidden_states_index(L)) for L in target.layer_ids]  # config order
        self.itemsize, self.fp8 = itemsize, fp8
        self.pad = padding(rows)  # never sent to the engine: no document reads it, its states stay zeros

    def captured(self, idx) -> list[tuple[int, int, int]]:
        """The rows' documents the engine computes: every segment but the padding."""
        return [seg for seg in segments(self.rows, idx) if not self.pad[seg[0], seg[1]]]

    def documents(self, idx) -> list[tuple[str, list[int]]]:
        return [(segment_name(s), self.rows["input_ids"][s[0], s[1]:s[2]].tolist()) for s in self.captured(idx)]

    def nbytes(self, idx) -> int:
        """What the item's files take in the spool."""
        return sum(state_bytes(e - s, len(self.ids), self.target.hidden_size, self.itemsize, self.fp8)
                   for _, s, e in self.captured(idx))

    def placeholder(self, idx) -> "StoredOutputs":  # noqa: F821 (data.features)
        """Zeros of the shapes `assemble` gives: what a step that will be thrown away computes with, so
        that every rank runs the same collectives (`StopGuard`)."""
        from ...data.features import StoredOutputs

        n, L, H = len(idx), self.rows["input_ids"].shape[1], self.target.hidden_size
        dt = self.target.dtype
        return StoredOutputs(torch.zeros(n, L, len(self.pick) * H, dtype=dt), torch.zeros(n, L, H, dtype=dt),
                             torch.zeros(n, L, dtype=torch.long))

    @torch.no_grad()
    def assemble(self, idx, load) -> "StoredOutputs":  # noqa: F821 (data.features)
        """The rows' outputs from the engine's states, each state copied once into these tensors; the
        padding's states are zeros. `load(segment)`: (its states, where they came from), from a spool's
        mapped file (`states.read_states`) or a Mooncake store (`remote`)."""
        from ...data.features import StoredOutputs, full_argmax
        from .states import SCALES, dequantize

        n, L, H, F = len(idx), self.rows["input_ids"].shape[1], self.target.hidden_size, len(self.pick)
        dev, dt = self.target.device, self.target.dtype
        feats = torch.empty(n, L, F * H, dtype=dt)
        last = torch.empty(n, L, H, dtype=dt)
        where = {int(r): i for i, r in enumerate(idx)}
        pick = torch.tensor(self.pick)
        for seg in segments(self.rows, idx):
            r, s, e = seg
            i = where[r]
            if self.pad[r, s]:
                feats[i, s:e], last[i, s:e] = 0, 0
                continue
            got, path = load(seg)
            want = self.rows["input_ids"][r, s:e]
            if not torch.equal(got["token_ids"].to(want.dtype), want):
                raise ValueError(f"{path} holds other tokens than row {r} [{s}:{e}]: the engine answered another "
                                 "request (delete the spool and rerun)")
            hs = got["hidden_states"]  # [T, k, Ht] in `self.ids` order
            if SCALES in got:  # fp8 states: one copy back to the training dtype
                hs = dequantize(hs, got[SCALES], dt)
            if hs.shape[1:] != (len(self.ids), H):
                raise ValueError(f"{path} has states {tuple(hs.shape)}, expected [T, {len(self.ids)}, {H}]: the "
                                 "engine captured other layers than these")
            if hs.dtype == dt:  # straight into the row: the one copy
                torch.index_select(hs, 1, pick, out=feats[i, s:e].view(e - s, F, H))
            else:
                feats[i, s:e] = hs[:, pick].reshape(e - s, -1)
            last[i, s:e] = hs[:, -1]
        final = torch.cat([self.norm(last[i:i + 1].to(dev)).cpu() for i in range(n)])
        if not self.labels_only:
            return StoredOutputs(feats, final, full_argmax(self.target, final.to(dev)).cpu())
        mask = self.rows["loss_mask"][torch.as_tensor(idx)].bool()
        need = torch.zeros_like(mask)
        need[:, :-1] = mask[:, 1:]  # the label of the token at p is the target's choice at p - 1
        top = torch.zeros(n, L, dtype=torch.long)
        top[need] = full_argmax(self.target, final[need].to(dev)).cpu()
        return StoredOutputs(feats, final, top)


class SpoolReader:
    """One reader (a rank, or extract) of a spool: asks for items by key and reads them back."""

    def __init__(self, reader: StateReader, spool: Spool, engines: Engines, client: str, budget: int,
                 poll_s: float = 0.5):
        self.reader, self.spool, self.engines, self.client = reader, spool, engines, client
        self.budget, self.poll_s = budget, poll_s
        spool.forget_client(client)  # what an earlier run of this reader asked for and never read

    def ask(self, key: str, idx: torch.Tensor) -> Request:
        nbytes = self.reader.nbytes(idx)
        if nbytes > self.budget:
            raise ValueError(f"{len(idx)} rows of a micro-batch need {nbytes / 2**30:.3f} GiB of states at once, more "
                             f"than the spool's {self.budget / 2**30:.3f} GiB: raise --spool-gib, or lower --batch-tokens")
        return self.spool.ask(self.client, key, self.reader.documents(idx), nbytes)

    def read(self, req: Request, idx: torch.Tensor):
        """Wait for the item (checking the engines as it waits), put its outputs together, free it."""
        t0, checked, nap = time.monotonic(), 0.0, 0.001
        while not self.spool.done(req):
            if time.monotonic() - checked > self.poll_s:
                self.engines.check()
                checked = time.monotonic()
            time.sleep(nap)
            nap = min(0.05, nap * 2)
        self.waited = getattr(self, "waited", 0.0) + time.monotonic() - t0
        d = self.spool.item_dir(req)

        def load(seg):
            path = d / f"{segment_name(seg)}.safetensors"
            return read_states(str(path)), path

        out = self.reader.assemble(idx, load)
        self.spool.release(req)
        return out

    def release(self, req: Request) -> None:
        self.spool.release(req)

    def get(self, key: str, idx: torch.Tensor):
        return self.read(self.ask(key, idx), idx)

    def close(self) -> None:
        self.spool.forget_client(self.client)


class OnlineFeatures:
    """The trainer's stored-output source for `train --engine vllm`: each micro-batch's outputs computed
    by the engines as the trainer reaches it (every epoch anew), asked for `lookahead` micro-batches
    ahead in the trainer's own order (the engines stop at the spool's budget). Held-out rows are the
    same kind of source, given each evaluation's order as it starts."""

    prefetch = True  # the trainer reads one micro-batch ahead on a thread (data.prefetch)

    def __init__(self, spool_reader: SpoolReader, lookahead: int = 8):
        self.r, self.lookahead = spool_reader, max(1, lookahead)
        self.step, self._one_offs = 0, 0
        self._order, self._asked, self._phase = None, deque(), 1

    def at(self, step: int) -> None:
        """The step the trainer is at: what it reads outside the schedule (the feature scale) is asked
        for before that step's micro-batches."""
        self.step = int(step)

    def begin(self, order, phase: int = 1) -> None:
        """The reading order from here on: an iterator of (step, slot, row indices), slot the item's place
        among every rank's items of its step and phase (1: a step's micro-batches; 0: what is read before
        them, such as an evaluation's batches). Anything asked and not read before is dropped."""
        for _, req in self._asked:
            self.r.release(req)
        self._order, self._asked, self._phase = iter(order), deque(), phase
        self._top_up()

    def _top_up(self) -> None:
        while self._order is not None and len(self._asked) < self.lookahead:
            try:
                step, slot, idx = next(self._order)
            except StopIteration:
                self._order = None
                break
            self._asked.append((idx, self.r.ask(item_key(step, self._phase, slot), idx)))

    def __call__(self, idx: torch.Tensor):
        if not self._asked:
            self._top_up()
        if not self._asked:
            raise RuntimeError("the trainer read past the end of its own schedule")
        want, req = self._asked.popleft()
        if not torch.equal(want, idx):
            raise RuntimeError(f"the trainer read rows {idx.tolist()} where its schedule says {want.tolist()}")
        out = self.r.read(req, idx)
        self._top_up()
        return out

    def compute(self, idx: torch.Tensor):
        """Rows read outside the schedule (the feature scale): a row an item (so a spool that holds one
        micro-batch holds them), all asked for before the first is read."""
        from ...data.features import StoredOutputs

        asked = []
        for row in idx.tolist():
            self._one_offs += 1
            asked.append((row, self.r.ask(item_key(self.step, 0, self._one_offs), torch.tensor([row]))))
        parts = [self.r.read(req, torch.tensor([row])) for row, req in asked]
        return StoredOutputs(*(torch.cat([getattr(p, f) for p in parts]) for f in ("features", "final_hidden", "top")))

    def close(self) -> None:
        self.r.close()


class StopGuard:
    """A rank's online feature source while the run may be preempted: when the engines were stopped by a
    signal, or failed once this process was asked to stop (a scheduler signals every process of a job at
    once, and either may notice first), a read answers with zeros of the right shapes and marks the
    source `lost` instead of raising. The step (or evaluation) that read them then runs its collectives
    like every other rank's and is thrown away by all of them together (the trainer all-reduces `lost`),
    and the run saves the last whole step and exits as preempted."""

    GRACE_S = 5.0  # how long a failure waits for this process's own stop signal to arrive

    def __init__(self, source: OnlineFeatures):
        self.source, self.lost = source, False
        self.prefetch = source.prefetch

    def _stopping(self, e: Exception) -> bool:
        from ...preempt import noted
        from .job import EngineStopped

        if isinstance(e, EngineStopped) or noted():
            return True
        deadline = time.monotonic() + self.GRACE_S
        while time.monotonic() < deadline and not noted():
            time.sleep(0.05)
        return noted() is not None

    def _guarded(self, read, idx):
        from .job import EngineFailed

        if self.lost:
            return self.source.r.reader.placeholder(idx)
        try:
            return read(idx)
        except EngineFailed as e:
            if not self._stopping(e):
                raise
            self.lost, self.why = True, str(e)
            return self.source.r.reader.placeholder(idx)

    def __call__(self, idx):
        return self._guarded(self.source, idx)

    def compute(self, idx):
        return self._guarded(self.source.compute, idx)

    def __getattr__(self, name):  # at, begin, close: the source's own
        return getattr(self.source, name)


class RowsAhead:
    """extract's source of outputs: rows read in order, asked for up to `lookahead` rows ahead."""

    def __init__(self, spool_reader: SpoolReader, order: list[int], lookahead: int = 16):
        self.r, self.lookahead = spool_reader, max(1, lookahead)
        self._order, self._asked = deque(order), deque()

    def _top_up(self) -> None:
        while self._order and len(self._asked) < self.lookahead:
            row = self._order.popleft()
            idx = torch.tensor([row])
            self._asked.append((row, self.r.ask(item_key(0, 1, row), idx)))

    def __call__(self, idx: torch.Tensor):
        from ...data.features import StoredOutputs

        parts = []
        for row in idx.tolist():
            self._top_up()
            want, req = self._asked.popleft()
            if want != row:
                raise RuntimeError(f"extract read row {row} where its order says {want}")
            parts.append(self.r.read(req, torch.tensor([row])))
        return StoredOutputs(*(torch.cat([getattr(p, f) for p in parts]) for f in ("features", "final_hidden", "top")))
