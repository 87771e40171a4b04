"""ZeroOptimizer's gradient reduction: buckets launched in order from the
gradient hooks (all-reduce at stage 1, reduce-scatter at stage 2), waited
for at the step, and the device buffers they reuse every step."""

from __future__ import annotations

import contextlib
from typing import cast

import torch
import torch.distributed as dist

from zerostack.chunk import all_reduce_sum, phase, reduce_scatter_sum, set_collective_label
from zerostack.shard._bucket import BufferRing, _Bucket, pack_grads


class BucketBuffers:
    """The device buffers of the buckets, allocated at first use and reused
    at every later step (see [Note: persistent bucket buffers]): two-slot
    rings shared by all buckets, and buffers each bucket owns."""

    def __init__(self, buckets: list[_Bucket], device: torch.device) -> None:
        self._largest = max(b.piece_total for b in buckets)
        self.device = device
        self.rings: dict[tuple[str, torch.dtype], BufferRing] = {}
        self.own: dict[int, dict[str, torch.Tensor]] = {}  # per bucket id: its buffers by kind
        self.allocations = 0  # of per-bucket buffers (tests: none after the first step)

    def ring(self, kind: str, dtype: torch.dtype, rows: int) -> BufferRing:
        """The two-slot ring of ``kind`` buffers for ``dtype``, sized for the
        largest bucket times ``rows``."""
        ring = self.rings.get((kind, dtype))
        if ring is None:
            numel = rows * self._largest
            ring = self.rings[(kind, dtype)] = BufferRing(2, numel, dtype, self.device)
        return ring

    def of_bucket(self, bucket: _Bucket, kind: str, dtype: torch.dtype, rows: int) -> torch.Tensor:
        """``bucket``'s own (rows, piece_total) buffer, allocated at its first
        reduction and reused at every later one (a new dtype reallocates)."""
        buffers = self.own.setdefault(id(bucket), {})
        buf = buffers.get(kind)
        if buf is None or buf.dtype != dtype:
            buf = torch.empty(rows, bucket.piece_total, dtype=dtype, device=self.device)
            buffers[kind] = buf
            self.allocations += 1
        return buf


class GradientReduction:
    """The buckets' reductions of one step: launched strictly in bucket
    order (so every rank issues the same collectives in the same order even
    when ranks differ in which parameters got gradients), asynchronously and
    on a side stream on CUDA with ``overlap`` (one rank, with no collective,
    packs on the compute stream and sends only its copies to the host
    there), and finished at the step, where each shard gets its reduced
    piece."""

    def __init__(
        self,
        buckets: list[_Bucket],
        buffers: BucketBuffers,
        *,
        stage: int,
        group: dist.ProcessGroup | None,
        rank: int,
        world: int,
        comm_dtype: torch.dtype | None,
        overlap: bool,
        host_grads_as_sent: bool,
    ) -> None:
        self.buckets = buckets
        self.buffers = buffers
        self.stage, self.group, self.rank, self.world = stage, group, rank, world
        self.device = buffers.device
        self.comm_dtype = comm_dtype
        # Offloaded low-precision gradients stay so (CPUAdam reads them as they are).
        self.host_grads_as_sent = host_grads_as_sent
        self.stream = (
            torch.cuda.Stream(self.device) if overlap and self.device.type == "cuda" else None
        )
        n = sum(len(b.shards) for b in buckets)
        self.bucket_of = [buckets[0]] * n  # shard index -> its bucket
        self.offset_of = [0] * n  # shard index -> its offset in the bucket
        for bucket in buckets:
            for s, off in zip(bucket.shards, bucket.offsets, strict=True):
                self.bucket_of[s.index], self.offset_of[s.index] = bucket, off
        self.next = 0  # the first bucket not launched in this reduction
        self.in_flight: _Bucket | None = None  # stage 2: the bucket whose input is still sent
        # Gradients summed over several reductions in this step: the device
        # norms of the buckets no longer give the norm of the sum.
        self.accumulated = False

    def launch_ready(self, flush: bool = False) -> None:
        """Launch, in order, every bucket whose shards all got their gradient;
        ``flush`` launches the rest too (at step time)."""
        while self.next < len(self.buckets):
            bucket = self.buckets[self.next]
            if not flush and not all(s.ready for s in bucket.shards):
                return
            set_collective_label(f"gradient reduction of bucket {self.next}")
            self._launch(bucket)
            self.next += 1

    def _launch(self, bucket: _Bucket) -> None:
        dtype = self.comm_dtype or bucket.shards[0].param.dtype
        # One rank launches no collective, so there is nothing to overlap:
        # the packing runs in order on the compute stream, without a wait
        # between the streams and a record_stream of every gradient each
        # bucket; only a copy to the host goes to the side stream (_copy_down).
        stream = self.stream if self.world > 1 else None
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with phase("zerostack::reduce"), ctx:
            if self.stage == 2 and self.world == 1:
                # A reduce-scatter over one rank is the identity: the
                # gradients go straight into the bucket's reduced piece.
                buf = self.buffers.of_bucket(bucket, "reduced", dtype, 1)
            elif self.stage == 2:
                # ZeRO-2 keeps 1/N of the gradients: a reduce-scatter's full
                # input lives only until the next bucket is launched, so its
                # buffer comes from a ring of two (slot reused by bucket i + 2,
                # after bucket i was waited for at bucket i + 1's launch).
                # See [Note: persistent bucket buffers]
                buf = self.buffers.ring("send", dtype, self.world).take(
                    self.world * bucket.piece_total
                )
                buf = buf.view(self.world, bucket.piece_total)
            else:  # stage 1 keeps every bucket's all-reduced buffer until the step
                buf = self.buffers.of_bucket(bucket, "reduced_full", dtype, self.world)
            pack_grads(bucket, buf, stream)
            if self.world > 1:
                buf.div_(self.world)
            bucket.launched = True
            mine = self._start_collective(bucket, buf, dtype)
            bucket.norm_sq = None
            offloaded = bucket.host_grads is not None or bucket.lane is not None
            if self.device.type == "cuda" and offloaded:
                # cpu_offload: NCCL's wait only orders this stream after the
                # collective, so the bucket's norm and its copy to the host
                # queue up here and run while backward goes on (a norm of the
                # pieces on the host would cost a CPU pass over all of them;
                # at one rank the norm is one more kernel of the compute stream).
                # A device-lane bucket's gradient stays here (see [Note:
                # Adam where the bandwidth is]).
                bucket.wait()
                # clip_grad_by_norm's fp32 norm kernel (see norm_part) over the
                # bf16 piece, squared: no fp32 copy of it.
                bucket.norm_sq = torch._foreach_norm([mine], 2.0, dtype=torch.float32)[0].square()
                if bucket.host_grads is not None:
                    self._copy_down(bucket, mine)
            if self.stage == 2:
                if self.in_flight is not None:
                    self.in_flight.wait()
                self.in_flight = bucket

    def _copy_down(self, bucket: _Bucket, mine: torch.Tensor) -> None:
        """cpu_offload: queue the copy of the reduced pieces to the bucket's
        pinned ``host_grads`` beside the rest of backward: on the side stream
        (at one rank it waits there for the packing on the compute stream).
        ``finish`` makes the compute stream wait for it before anything
        writes ``mine`` again."""
        side = self.stream
        if self.world == 1 and side is not None:
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                bucket.host_grads.copy_(mine, non_blocking=True)  # type: ignore[union-attr]
        else:  # already on the side stream (several ranks), or no side stream
            bucket.host_grads.copy_(mine, non_blocking=True)  # type: ignore[union-attr]
        bucket.on_host = True

    def _start_collective(
        self, bucket: _Bucket, buf: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """The bucket's asynchronous reduce-scatter (stage 2) or all-reduce
        (stage 1) of ``buf``; returns the view that will hold this rank's
        reduced pieces."""
        if self.world == 1:  # no collective: ``buf`` holds the reduced pieces already
            bucket.send_buf, bucket.work = None, None
            bucket.reduced = buf.view(-1) if self.stage == 2 else buf
            return buf.view(-1) if self.stage == 2 else buf[0]
        if self.stage == 2:
            bucket.reduced = self.buffers.of_bucket(bucket, "reduced", dtype, 1).view(-1)
            bucket.send_buf = buf
            bucket.work = reduce_scatter_sum(
                bucket.reduced, buf.view(-1), self.group, async_op=True
            )
            return bucket.reduced
        bucket.reduced = buf
        bucket.work = all_reduce_sum(buf, self.group, async_op=True)
        return buf[self.rank]

    def restart(self) -> None:
        """A backward began after buckets of this step were reduced (two
        backwards before ``step()``: torch's accumulation, without
        ``no_sync``). Their reductions go into the shards' gradients, out of
        the buffers the next reductions reuse, and the buckets are reduced
        again from the first: ``step()`` then sums both.
        """
        self.finish(flush=False)
        for bucket in self.buckets:
            for s in bucket.shards:
                if s.grad is not None and s.grad._base is not None:  # a view of a bucket buffer
                    s.grad = s.grad.clone()
        self.accumulated = True

    def finish(self, flush: bool = True) -> torch.Tensor | None:
        """Wait for every bucket (``flush``: launching those not launched
        yet); give each shard its reduced piece. Returns the squared gradient
        norm summed on the device, or None when it has to be computed from
        the pieces (gradients accumulated over several reductions, or no
        device-side norm)."""
        if flush:
            self.launch_ready(flush=True)
        self.next = 0
        self.in_flight = None
        norm_parts: list[torch.Tensor] | None = []
        synced = False
        for bucket in self.buckets:
            if not bucket.launched:
                continue
            bucket.wait()
            reduced = cast(torch.Tensor, bucket.reduced)  # set by every launch
            bucket.reduced, bucket.launched = None, False
            if self.stream is not None and not synced:
                torch.cuda.current_stream(self.device).wait_stream(self.stream)
            mine = reduced if self.stage == 2 else reduced[self.rank]
            if bucket.host_grads is not None:
                synced = self._to_host(bucket, mine, synced)
                mine = bucket.host_grads
                if not self.host_grads_as_sent:
                    mine = mine.to(bucket.shards[0].master.dtype)
            elif bucket.lane is not None:
                pass  # stays on the device as sent: the device's Adam reads it there
            else:
                mine = mine.to(dtype=bucket.shards[0].master.dtype)  # one cast per bucket
            if norm_parts is not None and bucket.norm_sq is not None:
                norm_parts.append(bucket.norm_sq)
            else:
                norm_parts = None
            self._hand_out(bucket, mine)
        if norm_parts is None or self.accumulated or not norm_parts:
            return None
        return torch.stack(norm_parts).sum()

    def _to_host(self, bucket: _Bucket, mine: torch.Tensor, synced: bool) -> bool:
        """cpu_offload: the reduced pieces into the bucket's pinned
        ``host_grads``, readable by the CPU on return; returns ``synced``."""
        if not bucket.on_host:
            bucket.host_grads.copy_(mine, non_blocking=True)  # type: ignore[union-attr]
        bucket.on_host = False
        if self.device.type == "cuda" and not synced:
            torch.cuda.current_stream(self.device).synchronize()  # the CPU reads them next
            return True
        return synced

    def _hand_out(self, bucket: _Bucket, mine: torch.Tensor) -> None:
        """Each shard's piece of the bucket's reduced ``mine`` becomes (or,
        a second reduction in one step, adds to) its gradient."""
        for s, off in zip(bucket.shards, bucket.offsets, strict=True):
            piece = mine[off : off + s.piece]
            if s.grad is None:
                s.grad = piece
            else:  # a second reduction in one step: the norm must come from the sum
                s.grad = s.grad + piece
                self.accumulated = True

    def reset(self) -> None:
        """Wait for and forget every reduction of this step (``zero_grad``)."""
        for bucket in self.buckets:
            bucket.clear()
        self.next = 0
        self.in_flight = None
        self.accumulated = False
