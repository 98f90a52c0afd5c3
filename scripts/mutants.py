#!/usr/bin/env python
"""The mutation suite of the asynchronous code: every wait has a test that fails without it.

Each mutant is one small textual change at an anchored place (a wait removed, a wait moved
after the read, a ``record_stream`` dropped, a skip path that updates anyway) with the
narrowest test selection that must fail for it. The suite copies the repository's tracked
files to a temporary directory, applies one mutant there, runs its selection (with delayed
copies, ``FLAT_DELAYED_COPIES=1``, unless the mutant says otherwise) under a timeout, and
prints one row per mutant: killed (the selection failed or hung), survived, or GPU-only (the
CPU model cannot express the race; ``gpu_only`` says why and the GPU check runs it).

    python scripts/mutants.py --check          # every anchor matches exactly once
    python scripts/mutants.py --list           # the mutants and the sites without one
    python scripts/mutants.py [NAME ...]       # run (default: every CPU mutant)

An anchor that no longer matches exactly once is an error, so the suite follows the code.
Sites where no mutant can be written are listed in ``NO_MUTANT`` with the reason.
Every distinct selection first runs on the unmutated copy and must pass (else a kill would
prove nothing), unless ``--proven`` says this run's stage of the same mode already passed it
on the same tree (``make test`` runs the suite last and passes the stages that succeeded).
Exit status: 0 when every CPU mutant is killed, 1 when one survives, 2 on a broken anchor or a
selection that fails unmutated.
"""

from __future__ import annotations

import argparse
import ast
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    """One single-place bug: ``anchor`` (exact text, once in ``path``) becomes ``replacement``.

    ``tests``: the pytest selection that must fail (paths or node ids, relative to the root);
    ``world``: ranks to run it on (1: plain pytest, N: torchrun); ``delayed``: with delayed
    copies; ``gpu_only``: why only a GPU can kill it (not run on CPU); ``timeout``: a shorter
    limit for one whose failure may be a hang (a rank-divergent decision); ``gpu_tests``: for a
    GPU-only mutant, the CUDA selection ``--gpu`` runs (none: it needs more than one GPU);
    ``late_producer``: a missing wait for the compute stream, which ``--gpu`` shows by making
    compute-stream work late (a late copy would hide it) instead of the side-stream copies."""

    name: str
    path: str
    anchor: str
    replacement: str
    tests: Tuple[str, ...]
    world: int = 1
    delayed: bool = True
    gpu_only: str = ""
    timeout: float = 0.0  # seconds; 0: the suite's --timeout (a rank-divergent one may hang)
    gpu_tests: Tuple[str, ...] = ()  # GPU-only: the CUDA selection that must fail (--gpu)
    late_producer: bool = False  # --gpu: compute-stream work lands late, not the copies


def _drop(line: str) -> str:
    """A line removed, indentation kept (``pass`` keeps the block valid)."""
    indent = line[: len(line) - len(line.lstrip())]
    return f"{indent}pass  # mutant: {line.strip()}"


def drop(name: str, path: str, line: str, tests: Tuple[str, ...], **kw) -> Mutant:
    """The mutant that removes ``line`` (one whole line, as it stands in ``path``)."""
    return Mutant(name, path, line + "\n", _drop(line) + "\n", tests, **kw)


SPAN_MOVER = ("tests/checkpoint/test_span_mover.py",)
# On CUDA (--gpu, with a sleep kernel before every side-stream copy): SCO's and the
# optimizer's stream tests.
SCO_CUDA = ("tests/checkpoint/test_cuda.py",)
OPT_CUDA = ("tests/optim/test_offload_adamw.py::test_cuda_streams_bitwise_equal_to_adamw",)
SCO_RACES = ("tests/checkpoint/test_races.py", "tests/checkpoint/test_span_mover.py")
OPT_RACES = ("tests/optim/test_races.py",)
TRANSFER = "megatron_flat/checkpoint/transfer.py"
PIPELINE = "megatron_flat/optim/pipeline.py"

# The producer-stream and record_stream mutants: on CPU the producer (the default stream) is
# inline, so the side stream's copy always sees the finished tensor, and a source tensor stays
# alive while Python holds it; only the CUDA caching allocator reuses its memory early.
_INLINE_PRODUCER = ("the producer stream is inline on CPU: the copy always reads the finished "
                    "tensor")
# Delayed copies model a source freed early (transfer.offload-source-not-recorded is a CPU
# kill) but not a destination handed out again while its copy still writes into it.
_ALLOCATOR = ("a destination freed before its copy lands has no later tensor in its memory on "
              "CPU to corrupt; on a GPU the caching allocator hands the block to the next "
              "allocation mid-copy")

MUTANTS: List[Mutant] = [
    # -- checkpoint/transfer.py: SCO's SpanMover -------------------------------------------
    Mutant("transfer.drain-releases-before-copy-landed", TRANSFER,
           "            if wait or event.query():\n",
           "            if True:  # mutant: released before the copy landed\n", SPAN_MOVER),
    Mutant("transfer.drain-wait-skipped", TRANSFER,
           "            if wait:\n                event.synchronize()\n",
           "            if wait:\n                pass  # mutant: no synchronize\n", SPAN_MOVER),
    drop("transfer.offload-ignores-producer", TRANSFER,
         "        d2h.wait_stream(current_stream(src.device))", SCO_RACES,
         gpu_only=_INLINE_PRODUCER, gpu_tests=SCO_CUDA, late_producer=True),
    # Delayed copies hold a source as the caching allocator does: freed before its copy
    # ran (no record_stream), the copy reads nothing and the reload is poison.
    drop("transfer.offload-source-not-recorded", TRANSFER,
         "        record_stream(src, d2h)", SCO_RACES),
    drop("transfer.reload-ignores-consumer", TRANSFER,
         "        h2d.wait_stream(current_stream(span.device))", SCO_RACES,
         gpu_only="the reload buffer is new; on CPU nothing on the current stream can "
                  "still be using it", gpu_tests=SCO_CUDA, late_producer=True),
    drop("transfer.reload-before-offload-landed", TRANSFER,
         "        h2d.wait_event(span.offloaded)", SCO_RACES),
    drop("transfer.reload-buffer-not-recorded", TRANSFER,
         "        record_stream(buffer, h2d)", SCO_RACES, gpu_only=_ALLOCATOR,
         gpu_tests=SCO_CUDA),
    drop("transfer.release-ignores-reload", TRANSFER,
         "            span.last_copy = event", SPAN_MOVER),
    Mutant("transfer.synchronize-skips-side-streams", TRANSFER,
           "            d2h.synchronize()\n            h2d.synchronize()\n",
           "            pass  # mutant: side streams not synchronized\n", SCO_RACES),
    # -- checkpoint/offload.py: SCO dropped with copies in flight ----------------------------
    drop("offload.dropped-sco-leaves-copies-in-flight", "megatron_flat/checkpoint/offload.py",
         "        synchronize_on_drop(self, self._mover.synchronize)",
         ("tests/checkpoint/test_races.py::test_a_dropped_sco_lets_its_copies_land_first",)),
    # -- checkpoint/offload.py: SCO's reload consumer ---------------------------------------
    Mutant("offload.unpack-without-reload-wait", "megatron_flat/checkpoint/offload.py",
           "        event.wait()\n        with torch.no_grad():\n            return rebuild(",
           "        pass  # mutant: no wait\n"
           "        with torch.no_grad():\n            return rebuild(",
           ("tests/checkpoint/test_races.py",)),
    # -- attention/replay_host.py: attention replay's reload consumer ----------------------
    Mutant("replay_host.take-without-reload-wait", "megatron_flat/attention/replay_host.py",
           "            event.wait()\n",
           "            pass  # mutant: no wait\n",
           ("tests/attention/test_replay.py",)),
    # -- optim/pipeline.py: OffloadStreamAdamW's slots --------------------------------------
    drop("pipeline.streams-ignore-caller", PIPELINE,
         "            stream.wait_stream(caller)", OPT_RACES,
         gpu_only="on CPU the caller's work (the gradients) is complete when step() starts",
         gpu_tests=OPT_CUDA, late_producer=True),
    drop("pipeline.upload-into-busy-slot", PIPELINE,
         "                self.upload.wait_event(slot.free)", OPT_RACES),
    drop("pipeline.update-before-upload", PIPELINE,
         "                self.compute.wait_event(slot.uploaded)", OPT_RACES),
    drop("pipeline.writeback-before-update", PIPELINE,
         "                self.writeback.wait_event(slot.updated)", OPT_RACES,
         gpu_only="only copies are delayed on CPU; the update runs inline, so the write-back "
                  "always reads the updated slot", gpu_tests=OPT_CUDA),
    drop("pipeline.run-returns-before-writeback", PIPELINE,
         "        self.writeback.synchronize()", OPT_RACES,
         gpu_only="on CPU the caller's wait completes the delayed write-backs before run "
                  "returns, so the host state is complete either way",
         gpu_tests=("tests/optim/test_offload_adamw.py::"
                    "test_cuda_host_state_is_complete_when_step_returns",)),
    Mutant("pipeline.caller-ignores-writeback", PIPELINE,
           "        caller.wait_stream(self.writeback)\n        self.writeback.synchronize()\n",
           "        pass  # mutant: caller does not wait for the write-back\n", OPT_RACES),
]

# The skip decision: every rank agrees on a non-finite gradient before the offloaded step.
MUTANTS += [
    Mutant("optimizer.non-finite-check-reads-grad", "megatron_flat/megatron/optimizer.py",
           '    attr = getattr(inner, "grad_attr", "grad")  # precision-aware: decoupled_grad\n',
           '    attr = "grad"  # mutant: decoupled_grad ignored\n',
           ("tests/optim/test_megatron_offload_world2.py::"
            "test_inf_gradient_skips_the_step_everywhere[distopt-bf16]",), world=2,
           delayed=False),
    # A rank-divergent decision: the rank that saw the inf skips, the other steps.
    Mutant("optimizer.non-finite-verdict-alone", "megatron_flat/megatron/optimizer.py",
           "    if torch.distributed.is_initialized():\n        torch.distributed.all_reduce(found",
           "    if False:  # mutant: not agreed\n        torch.distributed.all_reduce(found",
           ("tests/optim/test_megatron_offload_world2.py::"
            "test_inf_gradient_skips_the_step_everywhere[distopt-fp32]",), world=2,
           delayed=False, timeout=90),
]

# -- vocab/: Ring-DTP's hops and travelling sums ---------------------------------------------
# With delayed copies a hop or relay runs at its wait (runtime/deferred.py): a receive buffer
# read early is poison, a send buffer written early sends the new bytes, a hop never waited
# never exchanges. The selections run at world 2, both ring schedules.
RING = "megatron_flat/vocab/ring.py"
CROSS_ENTROPY = "megatron_flat/vocab/cross_entropy.py"
RING_DTP = ("tests/vocab/test_ring_dtp_worlds.py",)
# A relay is still in flight when the next contribution is written only from the third
# rank on (at P = 2 the one relay is the last): the write-order mutants need P = 4.
RING_DTP4 = ("tests/vocab/test_ring_dtp_worlds.py",)
_NO_RING_STREAM = ("the ring has no side stream on CPU: gloo's exchanges are issued inline with "
                   "the compute they follow (on CUDA it takes two GPUs: NCCL)")
_RING_ALLOCATOR = ("a hop's buffers are recorded on the ring's CUDA side stream, which CPU does "
                   "not have; on a GPU the caching allocator would hand them out mid-transfer "
                   "(on CUDA it takes two GPUs: NCCL)")

MUTANTS += [
    drop("ring.hop-not-waited", RING, "                work.wait()", RING_DTP, world=2),
    drop("ring.relay-piece-not-waited", RING,
         "                    work.wait()  # on the side stream (CUDA); the rows sent are free now",
         RING_DTP, world=2),
    drop("ring.hop-ignores-side-stream", RING,
         "            current_stream(self._device).wait_stream(self._stream)", RING_DTP,
         world=2, gpu_only=_NO_RING_STREAM),
    Mutant("ring.shift-ignores-compute", RING,
           "            self.stream.wait_stream(current_stream(self.device))\n        ops = []\n",
           "            pass  # mutant: sends not ordered after their producer\n        ops = []\n",
           RING_DTP, world=2, gpu_only=_NO_RING_STREAM),
    Mutant("ring.relay-ignores-compute", RING,
           "            self.stream.wait_stream(current_stream(self.device))\n"
           "        with use_stream(self.stream):\n            pieces()\n",
           "            pass  # mutant: relay not ordered after the sum it sends\n"
           "        with use_stream(self.stream):\n            pieces()\n",
           RING_DTP, world=2, gpu_only=_NO_RING_STREAM),
    drop("ring.hop-buffers-not-recorded", RING, "                record_stream(tensor, self.stream)",
         RING_DTP, world=2, gpu_only=_RING_ALLOCATOR),
    drop("ring.relay-buffer-not-recorded", RING, "            record_stream(buffer, self.stream)",
         RING_DTP, world=2, gpu_only=_RING_ALLOCATOR),
    drop("ring.relay-slot-not-recorded", RING, "            record_stream(slot, self.stream)",
         RING_DTP, world=2, gpu_only=_RING_ALLOCATOR),
    # Reading a hop's receive buffers instead of waiting for them (Hop._received is what the
    # caller's own reference to its buffer would be).
    Mutant("ce.forward-shard-read-before-hop", CROSS_ENTROPY,
           "            (w_cur,), q = hop.wait(), nxt\n",
           "            (w_cur,), q = hop._received, nxt  # mutant: not waited\n", RING_DTP, world=2),
    Mutant("ce.forward-state-read-before-hop", CROSS_ENTROPY,
           "            (packed,) = state_hop.wait()\n",
           "            (packed,) = state_hop._received  # mutant: not waited\n", RING_DTP, world=2),
    Mutant("ce.forward-tokens-read-before-hop", CROSS_ENTROPY,
           "            (x_cur, lab_cur), s = data_hop.wait(), prv\n",
           "            (x_cur, lab_cur), s = data_hop._received, prv  # mutant: not waited\n",
           RING_DTP, world=2),
    Mutant("ce.return-hop-read-before-wait", CROSS_ENTROPY,
           "\n    (packed,) = state_hop.wait()\n",
           "\n    (packed,) = state_hop._received  # mutant: not waited\n", RING_DTP, world=2),
    Mutant("ce.backward-shard-read-before-hop", CROSS_ENTROPY,
           "            (w_cur,), q = w_hop.wait(), nxt\n",
           "            (w_cur,), q = w_hop._received, nxt  # mutant: not waited\n", RING_DTP,
           world=2),
    Mutant("ce.backward-tokens-read-before-hop", CROSS_ENTROPY,
           "            (x_cur, lab_cur, aux_cur), s = data_hop.wait(), prv\n",
           "            (x_cur, lab_cur, aux_cur), s = data_hop._received, prv  # mutant\n",
           RING_DTP, world=2),
    drop("ce.travelling-sum-relay-not-waited", CROSS_ENTROPY, "            self.pending.wait()",
         RING_DTP, world=2),
    Mutant("ce.shard-sum-written-before-relay-sent", CROSS_ENTROPY,
           "travel.target(k, q) if travel is not None else None,\n"
           "                   before_write=travel.arrived if travel is not None else None,",
           "travel.target(k, q) if travel is not None else None,\n"
           "                   before_write=None,  # mutant: relay still reading the buffer\n",
           RING_DTP4, world=4),
    Mutant("ce.token-sum-written-before-relay-sent", CROSS_ENTROPY,
           "travel.target(k, s) if travel is not None else None, dw,\n"
           "                   before_write=travel.arrived if travel is not None else None,",
           "travel.target(k, s) if travel is not None else None, dw,\n"
           "                   before_write=None,  # mutant: relay still reading the buffer\n",
           RING_DTP4, world=4),
    # Collective decision: a rank whose inputs are bad must stop every rank before the ring.
    drop("ce.peer-errors-ignored", CROSS_ENTROPY, "        planning.raise_for_peer_errors(table)",
         ("tests/vocab/test_ring_dtp_worlds.py::test_bad_labels_raise_on_every_rank",), world=2,
         delayed=False, timeout=60),
]

# -- dispatch/: PipelinedLLEP's all-to-alls and the group's decisions -----------------------
EXCHANGE = "megatron_flat/dispatch/exchange.py"
LLEP = "megatron_flat/dispatch/llep.py"
OVERLAP = ("tests/dispatch/test_llep_worlds.py::test_overlap_is_bitwise_the_serial_schedule",)

MUTANTS += [
    drop("exchange.in-flight-all-to-all-not-waited", EXCHANGE, "                work.wait()",
         OVERLAP, world=2),
    Mutant("step.helper-weights-read-before-transfer", "megatron_flat/dispatch/step.py",
           "            (got,) = pending.wait()\n",
           "            (got,) = pending.outputs  # mutant: not waited\n", OVERLAP, world=2),
    Mutant("passes.combine-reads-return-before-wait", "megatron_flat/dispatch/passes.py",
           "        (y_send,) = returning.wait()\n",
           "        (y_send,) = returning.unpack(returning.outputs)  # mutant: not waited\n",
           OVERLAP, world=2),
    Mutant("passes.input-grads-read-before-wait", "megatron_flat/dispatch/passes.py",
           "        dx_send, dp_send = returning.wait()\n",
           "        dx_send, dp_send = returning.unpack(returning.outputs)  # mutant\n",
           OVERLAP, world=2),
    Mutant("passes.chunk-read-before-dispatch-landed", "megatron_flat/dispatch/passes.py",
           "        received = pending.wait()\n",
           "        received = pending.unpack(pending.outputs)  # mutant: not waited\n",
           OVERLAP, world=2),
    # Decisions every rank of the group must make alike.
    Mutant("llep.settings-disagreement-ignored", LLEP,
           "        bad = [name for c, name in enumerate(fields)\n",
           "        bad = [] and [name for c, name in enumerate(fields)  # mutant\n",
           ("tests/dispatch/test_llep_worlds.py::test_ranks_must_agree_on_settings",), world=2,
           delayed=False, timeout=60),
    Mutant("llep.receive-bound-judged-alone", LLEP,
           "        if self.ep_size > 1:\n            every = mine.new_empty(self.ep_size * 2)\n",
           "        if False:  # mutant: each rank judges only its own chunks\n"
           "            every = mine.new_empty(self.ep_size * 2)\n",
           ("tests/dispatch/test_llep_worlds.py::"
            "test_receive_bound_violation_raises_on_every_rank",), world=2, delayed=False,
           timeout=60),
    Mutant("llep.graph-only-verdict-alone", LLEP,
           "        if all(wants):\n",
           "        if wants_graph_only:  # mutant: this rank's wish, not the group's\n",
           ("tests/dispatch/test_graph_only_world2.py::"
            "test_regions_that_differ_between_ranks_compute_values_everywhere",), world=2,
           delayed=False, timeout=60),
    Mutant("llep.violation-raised-alone", LLEP,
           "            if shape is not None:\n",
           "            if shape is not None and r == self.rank:  # mutant: only the finder\n",
           ("tests/dispatch/test_graph_only_world2.py::"
            "test_a_violation_on_one_rank_is_raised_on_every_rank",), world=2, delayed=False,
           timeout=60),
]

TILED_LINEAR = "megatron_flat/attention/tiled_linear.py"
MUTANTS += [
    Mutant("tiles.gather-own-piece", TILED_LINEAR,
           "    _all_gather(out, piece.contiguous(), group=group)\n",
           "    out.copy_(piece.repeat((tp,) + (1,) * (piece.dim() - 1)))  # mutant\n",
           ("tests/attention/test_tiled_linear_world2.py",), world=2, delayed=False),
    Mutant("tiles.reduce-scatter-without-sum", TILED_LINEAR,
           "    dist.reduce_scatter_tensor(out, full.contiguous(), group=group)\n",
           "    out.copy_(_ranked(full, tp)[dist.get_rank(group)])  # mutant: no sum\n",
           ("tests/attention/test_tiled_linear_world2.py",), world=2, delayed=False),
]

PARAMS = "megatron_flat/params/offload.py"
PARAMS_EXACT = ("tests/params/test_offload.py::test_offloaded_training_is_bitwise_the_resident_one",)
PARAMS_CUDA = ("tests/params/test_cuda.py",)
_INLINE_COMPUTE = ("the compute stream is inline on CPU: the slot's previous user has finished "
                   "before the copy is even issued")
MUTANTS += [
    drop("params.fetch-ignores-slot-user", PARAMS,
         "            self._h2d.wait_event(self._free[slot])  # compute is done with the old layer",
         PARAMS_EXACT, gpu_only=_INLINE_COMPUTE, gpu_tests=PARAMS_CUDA, late_producer=True),
    drop("params.weights-used-before-fetch-landed", PARAMS,
         "        current_stream(self.device).wait_event(self._fetched[slot])", PARAMS_EXACT),
    drop("params.grad-slot-reused-before-drain", PARAMS,
         "            compute.wait_event(self._grad_free[gslot])  # its last drain has read it",
         PARAMS_EXACT),
    drop("params.grad-upload-ignores-compute", PARAMS,
         "                self._h2d.wait_stream(compute)", PARAMS_EXACT,
         gpu_only=_INLINE_COMPUTE, gpu_tests=PARAMS_CUDA, late_producer=True),
    drop("params.grad-used-before-upload-landed", PARAMS,
         "            compute.wait_event(staged[1])", PARAMS_EXACT),
    drop("params.grad-prefetch-overwrites-draining-slot", PARAMS,
         "            self._h2d.wait_event(self._grad_free[gslot])", PARAMS_EXACT,
         gpu_only="on CPU a delayed drain is completed by the compute stream's wait for it, "
                  "which comes before its wait for the upload, so the drain always reads the "
                  "slot first", gpu_tests=PARAMS_CUDA),
    drop("params.drain-before-grad-written", PARAMS,
         "        self._d2h.wait_stream(current_stream(self.device))  # the gradient is written",
         PARAMS_EXACT, gpu_only=_INLINE_COMPUTE, gpu_tests=PARAMS_CUDA, late_producer=True),
    Mutant("params.host-grads-read-before-drains-landed", PARAMS,
           "        self._d2h.synchronize()\n        self._unsynced = False\n",
           "        self._unsynced = False  # mutant: no synchronize\n", PARAMS_EXACT),
    Mutant("params.first-fetch-ignores-slot-allocation", PARAMS,
           "        self._h2d.wait_stream(current_stream(self.device))\n"
           "        # Dropped without close()",
           "        pass  # mutant: first fetches do not wait for the slots' allocation\n"
           "        # Dropped without close()", PARAMS_EXACT, gpu_only=_INLINE_COMPUTE,
           gpu_tests=("tests/params/test_cuda.py::"
                      "test_first_fetch_waits_for_the_slots_previous_user",),
           late_producer=True),
    Mutant("params.dropped-offload-leaves-copies-in-flight", PARAMS,
           "    h2d.synchronize()\n    d2h.synchronize()\n",
           "    pass  # mutant: a dropped offload does not wait for its copies\n",
           ("tests/params/test_offload.py::test_a_dropped_offload_lets_its_copies_land_first",)),
    Mutant("params.host-grads-read-without-synchronize", PARAMS,
           "        self.synchronize()\n        if not self._accumulated[layer]:\n",
           "        if not self._accumulated[layer]:  # mutant: no synchronize\n", PARAMS_EXACT),
]

# Waits, synchronisations and exchanges in the covered packages that have no mutant, and why
# ("path" for a whole file, "path: Function" for one function's calls).
NO_MUTANT: Dict[str, str] = {
    "megatron_flat/runtime/streams.py": "the stream/event layer itself: every call above goes "
                                        "through it, so each mutant above also mutates its use",
    "megatron_flat/optim/pipeline.py: StagingPipeline.synchronize": (
        "a host wait for code outside the step (checkpoint save); the save tests read the "
        "state after it"),
    "megatron_flat/optim/offload_adamw.py": "host waits before state is read or rebuilt "
                                            "(state_dict, load, new param groups) all go through "
                                            "Pipeline.synchronize; step() already ends with the "
                                            "caller waiting for the write-back (mutated above)",
    "megatron_flat/params/offload.py: ParamOffload.zero_grad": (
        "a new accumulation after the step: its synchronize is ParamOffload.synchronize, "
        "already waited by host_grads in every step (params.host-grads-read-*)"),
    "megatron_flat/params/offload.py: ParamOffload.close": (
        "release (megatron_flat.release): waits for the copies in flight before the buffers "
        "are dropped, so a late copy cannot land in memory given back; nothing reads the "
        "buffers afterwards, so only a GPU allocator reusing that memory could show a "
        "missing wait, and release's tests check that the buffers are gone"),
    "megatron_flat/params/offload.py: ParamOffload.weights_updated": (
        "its wait orders the refetch after a stream writer of the host weights (the "
        "optimizer's write-back, which the current stream waits for); while "
        "StagingPipeline.run also blocks the host until the write-backs land "
        "(pipeline.run-returns-before-writeback), no run can tell that wait missing, and the "
        "slots are made stale whatever is in flight (a late fetch is fetched again)"),
    "megatron_flat/checkpoint/offload.py: SelectiveCheckpointOffload.synchronize": (
        "forwards to SpanMover.synchronize (transfer.synchronize-skips-side-streams)"),
    "megatron_flat/vocab/ring.py: Ring._post": "posts a hop's exchanges; their waits are "
                                               "Hop.wait's and the relay's (mutated above)",
    "megatron_flat/dispatch/llep.py: PipelinedLLEP._check_group": (
        "the settings gather; the decision made from it is llep.settings-disagreement-ignored"),
    "megatron_flat/dispatch/llep.py: PipelinedLLEP._check_receive_bound": (
        "the bound gather; the decision made from it is llep.receive-bound-judged-alone"),
    "megatron_flat/vocab/ring.py: _exchange": "a deferred hop's own wait: it runs inside "
                                              "Hop.wait (ring.hop-not-waited)",
    "megatron_flat/vocab/ring.py: Ring.gather_rows": "a blocking all-gather of the plan rows; "
                                                     "the decision made from it is "
                                                     "ce.peer-errors-ignored",
    "megatron_flat/dispatch/exchange.py: _all_to_all_now": "a deferred all-to-all's own wait: it "
                                                           "runs inside Pending.wait",
    "megatron_flat/dispatch/exchange.py: all_to_all": "posts the all-to-all (blocking unless in "
                                                      "flight); its wait is Pending.wait",
    "megatron_flat/dispatch/step.py: Step.return_helper_grads": "a blocking all-to-all waited "
                                                                "where it is issued",
    "megatron_flat/dispatch/llep.py: PipelinedLLEP._exchange": "the counts all-gather is data, "
                                                               "not a decision: the plan is a pure "
                                                               "function of the gathered table "
                                                               "(tests/dispatch/test_plan.py), "
                                                               "and a wrong table fails every "
                                                               "equivalence test",
}


# --------------------------------------------------------------------------- coverage
PACKAGES = ("runtime", "checkpoint", "optim", "vocab", "dispatch", "attention", "params")
# Calls that order work (a missing one is a race) and collectives (where ranks must agree).
SYNC_CALLS = {"wait", "wait_stream", "wait_event", "record_stream", "synchronize"}
COLLECTIVES = {"all_gather_into_tensor", "all_gather", "_all_gather", "all_to_all_single",
               "all_reduce", "broadcast", "batch_isend_irecv", "reduce_scatter_tensor"}


@dataclass(frozen=True)
class Site:
    path: str
    line: int
    function: str  # qualified name, e.g. "Ring.relay.pieces"
    call: str


def sites(root: Path = ROOT) -> List[Site]:
    """Every wait, stream ordering, ``record_stream``, ``synchronize`` and collective call in
    the covered packages (by the name called, from the syntax tree)."""
    found: List[Site] = []
    for package in PACKAGES:
        for file in sorted((root / "megatron_flat" / package).glob("*.py")):
            rel = str(file.relative_to(root))
            tree = ast.parse(file.read_text())

            def visit(node: ast.AST, scope: Tuple[str, ...]) -> None:
                for child in ast.iter_child_nodes(node):
                    inner = scope
                    if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        inner = scope + (child.name,)
                    if isinstance(child, ast.Call):
                        f = child.func
                        name = f.attr if isinstance(f, ast.Attribute) else \
                            f.id if isinstance(f, ast.Name) else ""
                        if name in SYNC_CALLS or name in COLLECTIVES:
                            found.append(Site(rel, child.lineno, ".".join(scope), name))
                    visit(child, inner)

            visit(tree, ())
    return found


def _anchor_lines(m: Mutant, root: Path) -> range:
    text = (root / m.path).read_text()
    at = text.find(m.anchor)
    first = text.count("\n", 0, at) + 1
    return range(first, first + max(1, m.anchor.rstrip("\n").count("\n") + 1))


def uncovered(mutants: Sequence[Mutant] = (), root: Path = ROOT,
              reasons: Optional[Dict[str, str]] = None) -> List[Site]:
    """Sites with neither a mutant whose anchor spans their line nor a ``NO_MUTANT`` reason
    (for their file, or their function or one enclosing it)."""
    mutants = mutants or MUTANTS
    reasons = NO_MUTANT if reasons is None else reasons
    spans: Dict[str, List[range]] = {}
    for m in mutants:
        if (root / m.path).exists() and (root / m.path).read_text().count(m.anchor) == 1:
            spans.setdefault(m.path, []).append(_anchor_lines(m, root))
    missing = []
    for site in sites(root):
        if any(site.line in span for span in spans.get(site.path, [])):
            continue
        parts = site.function.split(".")
        keys = [site.path] + [f"{site.path}: {'.'.join(parts[:i])}"
                              for i in range(1, len(parts) + 1)]
        if not any(k in reasons for k in keys):
            missing.append(site)
    return missing


def stale_reasons(root: Path = ROOT, reasons: Optional[Dict[str, str]] = None) -> List[str]:
    """``NO_MUTANT`` keys that name no site (the code moved on; the reason must go too)."""
    reasons = NO_MUTANT if reasons is None else reasons
    named = set()
    for site in sites(root):
        parts = site.function.split(".")
        named.add(site.path)
        named.update(f"{site.path}: {'.'.join(parts[:i])}" for i in range(1, len(parts) + 1))
    return [k for k in reasons if k not in named]


# The packages that import megatron-core (docs/architecture.md, "Layers").
MEGATRON_PACKAGES = ("megatron_flat/megatron/", "megatron_flat/cpu/", "megatron_flat/rehearse/")


def touches_megatron(m: Mutant) -> bool:
    """Whether the mutant's code or its selection involves megatron-core (so its result may
    depend on the version)."""
    return m.path.startswith(MEGATRON_PACKAGES) or any(
        "megatron" in t.split("::")[0] for t in (*m.tests, *m.gpu_tests))


# --------------------------------------------------------------------------- running
def check_anchors(mutants: Sequence[Mutant], root: Path = ROOT) -> List[str]:
    """Problems with the anchors (empty = every anchor matches exactly once and changes it)."""
    problems = []
    names = set()
    for m in mutants:
        if m.name in names:
            problems.append(f"{m.name}: duplicate name")
        names.add(m.name)
        path = root / m.path
        if not path.exists():
            problems.append(f"{m.name}: {m.path} does not exist")
            continue
        count = path.read_text().count(m.anchor)
        if count != 1:
            problems.append(f"{m.name}: anchor found {count} times in {m.path}")
        if m.anchor == m.replacement:
            problems.append(f"{m.name}: the replacement changes nothing")
        for test in m.tests:
            if not (root / test.split("::")[0]).exists():
                problems.append(f"{m.name}: test {test} does not exist")
    return problems


def _copy_tree(dest: Path) -> None:
    """The tracked files (or, outside a git checkout, e.g. on a GPU machine's copy of the tree,
    the package, tests, scripts and benchmarks)."""
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode != 0:
        for name in ("megatron_flat", "tests", "scripts", "benchmarks", "patches"):
            if (ROOT / name).is_dir():
                shutil.copytree(ROOT / name, dest / name,
                                ignore=shutil.ignore_patterns("__pycache__", "*.png"))
        return
    for name in listed.stdout.split():
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target)


# On CUDA (--gpu) every side-stream copy is preceded by a sleep kernel of this many cycles
# (~20 ms on an H200), so a copy lands late and a missing wait fails bitwise.
GPU_SLEEP_CYCLES = "20000000"


def _run(m: Mutant, python: str, timeout: float, mutate: bool,
         gpu: bool = False) -> Tuple[str, float]:
    """Run ``m``'s selection on a fresh copy of the tree, mutated or not: ("failed" |
    "passed" | "timeout" | "no test", seconds). ``gpu``: its CUDA selection, with late copies."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="flat-mutant-") as tmp:
        tree = Path(tmp)
        _copy_tree(tree)
        if mutate:
            path = tree / m.path
            path.write_text(path.read_text().replace(m.anchor, m.replacement, 1))
        env = dict(os.environ, PYTHONPATH=str(tree), TORCHDYNAMO_DISABLE="1",
                   PYTHONWARNINGS="ignore")
        for name in ("FLAT_JUNIT_DIR", "FLAT_JUNIT_TAG", "FLAT_DELAYED_COPIES",
                     "FLAT_CUDA_COPY_SLEEP_CYCLES", "FLAT_CUDA_PRODUCER_SLEEP_CYCLES"):
            env.pop(name, None)  # a mutant's failing run must not count as the suite's
        if gpu:
            late = ("FLAT_CUDA_PRODUCER_SLEEP_CYCLES" if m.late_producer
                    else "FLAT_CUDA_COPY_SLEEP_CYCLES")
            env[late] = GPU_SLEEP_CYCLES
        elif m.delayed:
            env["FLAT_DELAYED_COPIES"] = "1"
        if m.timeout:  # a rank left waiting fails inside gloo, well before the kill
            env["FLAT_DIST_TIMEOUT_S"] = str(max(5, int(m.timeout // 4)))
        tests = m.gpu_tests if gpu else m.tests
        pytest = ["-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests]
        if m.world == 1 or gpu:
            cmd = [python, *pytest]
        else:
            torchrun = str(Path(python).with_name("torchrun"))
            cmd = [torchrun, "--standalone", "--nproc-per-node", str(m.world), *pytest]
        # A session of its own, so a hang (ranks that disagree, waiting in a collective) is
        # killed with every process torchrun started, not only torchrun.
        proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            returncode = proc.wait(timeout=m.timeout or timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return "timeout", time.perf_counter() - start
    seconds = time.perf_counter() - start
    return {0: "passed", 5: "no test"}.get(returncode, "failed"), seconds


def run_mutant(m: Mutant, python: str, timeout: float, gpu: bool = False) -> Tuple[str, float]:
    """("killed" | "killed (timeout)" | "survived" | "error: ...", seconds) for one mutant."""
    outcome, seconds = _run(m, python, timeout, mutate=True, gpu=gpu)
    return {"failed": "killed", "timeout": "killed (timeout)", "passed": "survived",
            "no test": "error: the selection ran no test"}[outcome], seconds


def _mode(m: Mutant) -> str:
    """How a selection runs, as ``--proven`` names it: ``delayed`` (one process, delayed copies)
    or ``world<N>`` (torchrun, copies as issued); anything else has no stage of its own."""
    if m.world == 1 and m.delayed:
        return "delayed"
    if m.world > 1 and not m.delayed:
        return f"world{m.world}"
    return f"world{m.world}-delayed" if m.delayed else "plain"


def _ran_in_part(m: Mutant, part: str) -> bool:
    """Whether a stage limited to ``part`` (all | involved | free) ran every file of ``m``'s
    selection (tests/_megatron_use.py classifies the files)."""
    if part == "all":
        return True
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        from _megatron_use import involves_megatron
    finally:
        sys.path.pop(0)
    return all(involves_megatron(ROOT / t.split("::")[0]) == (part == "involved")
               for t in m.tests)


def baseline_problems(chosen: Sequence[Mutant], python: str, timeout: float, jobs: int = 1,
                      gpu: bool = False, proven: Sequence[str] = (),
                      part: str = "all") -> List[str]:
    """Each distinct selection must pass on the unmutated tree, or a kill proves nothing.

    ``proven``: modes (see :func:`_mode`) whose whole stage already passed in this run on this
    tree, over the test files of ``part``; a selection of such a mode and part is not run again
    (scripts/test.sh runs the mutants after those stages and names only the ones that passed)."""
    distinct: Dict[tuple, Mutant] = {}
    for m in chosen:
        if not gpu and _mode(m) in proven and _ran_in_part(m, part):
            continue
        key = (m.gpu_tests if gpu else m.tests, m.world, m.delayed, m.timeout)
        distinct.setdefault(key, m)
    runs = _parallel(lambda m: _run(m, python, timeout, mutate=False, gpu=gpu),
                     list(distinct.values()), jobs)
    return [f"{' '.join(m.gpu_tests if gpu else m.tests)} (world {m.world}): {outcome} "
            "without a mutant" for m, (outcome, _) in runs if outcome != "passed"]


def _parallel(fn, items: list, jobs: int) -> Iterator[tuple]:
    """(item, fn(item)) in the items' order, ``jobs`` at a time (each a subprocess: a mutant
    that waits in gloo for its timeout leaves the cores to the others)."""
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = [pool.submit(fn, item) for item in items]
        for item, future in zip(items, futures):
            yield item, future.result()


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="*", help="mutants to run (default: every CPU mutant, or "
                                            "with --gpu every GPU-only one)")
    p.add_argument("--check", action="store_true",
                   help="only check the anchors and that every site has a mutant or a reason")
    p.add_argument("--list", action="store_true", help="list the mutants and exit")
    p.add_argument("--gpu", action="store_true",
                   help="run the GPU-only mutants on CUDA with late side-stream copies "
                        "(FLAT_CUDA_COPY_SLEEP_CYCLES); benchmarks/gpu_check.sh does")
    p.add_argument("--jobs", type=int, default=2, help="mutants run at once (default 2)")
    p.add_argument("--megatron-only", action="store_true",
                   help="only the mutants of Megatron glue or with Megatron in their selection "
                        "(the others do not depend on the megatron-core version; CI runs them "
                        "with the first version only)")
    p.add_argument("--proven", default="",
                   help="comma-separated modes whose stage already passed unmutated in this run "
                        "(delayed, world2, world4): their selections' baselines are not rerun")
    p.add_argument("--proven-part", default="all", choices=("all", "involved", "free"),
                   help="the test files those stages ran (FLAT_MEGATRON of scripts/test.sh)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per mutant")
    p.add_argument("--python", default=sys.executable)
    args = p.parse_args(argv)
    problems = check_anchors(MUTANTS) + [
        f"{x.path}:{x.line} {x.call}() in {x.function or 'module'}: no mutant and no reason "
        "in NO_MUTANT" for x in uncovered()] + [
        f"NO_MUTANT[{k!r}] names no site" for k in stale_reasons()]
    if problems:
        print("broken mutation suite (the code moved; update scripts/mutants.py):")
        print("\n".join(f"  {x}" for x in problems))
        return 2
    if args.check:
        print(f"{len(MUTANTS)} mutants, every anchor matches once; {len(sites())} sites, each "
              f"with a mutant or one of {len(NO_MUTANT)} reasons")
        return 0
    if args.list:
        for m in MUTANTS:
            where = f"GPU only: {m.gpu_only}" if m.gpu_only else " ".join(m.tests)
            print(f"{m.name:45s} {m.path:40s} {where}")
        for site, why in NO_MUTANT.items():
            print(f"{'(no mutant)':45s} {site}: {why}")
        return 0
    known = {m.name: m for m in MUTANTS}
    unknown = [n for n in args.names if n not in known]
    if unknown:
        p.error(f"unknown mutants: {', '.join(unknown)}")
    if args.names:
        chosen = [known[n] for n in args.names]
    else:
        chosen = [m for m in MUTANTS if bool(m.gpu_only) == args.gpu]
    if args.megatron_only:
        chosen = [m for m in chosen if touches_megatron(m)]
    skipped: List[Tuple[Mutant, str]] = []
    if args.gpu:
        import torch

        if not torch.cuda.is_available():
            print("--gpu needs CUDA")
            return 2
        for m in chosen:
            if not m.gpu_tests:
                skipped.append((m, "no CUDA selection: needs two GPUs"))
        chosen = [m for m in chosen if m.gpu_tests]
    proven = [x for x in args.proven.split(",") if x]
    unknown_modes = set(proven) - {"delayed", "world2", "world4"}
    if unknown_modes:
        p.error(f"--proven: unknown modes {', '.join(sorted(unknown_modes))}")
    broken = baseline_problems(chosen, args.python, args.timeout, args.jobs, args.gpu,
                               proven, args.proven_part)
    if broken:
        print("selections that do not pass on the unmutated tree:")
        print("\n".join(f"  {x}" for x in broken))
        return 2
    survivors = 0
    print(f"{'mutant':45s} {'result':18s} {'seconds':>8s}  selection")
    runs = _parallel(lambda m: run_mutant(m, args.python, args.timeout, args.gpu), chosen,
                     args.jobs)
    for m, (result, seconds) in runs:
        survivors += result == "survived" or result.startswith("error")
        tests = m.gpu_tests if args.gpu else m.tests
        print(f"{m.name:45s} {result:18s} {seconds:8.1f}  {' '.join(tests)}", flush=True)
    for m, why in skipped:
        print(f"{m.name:45s} {'not run':18s} {'':>8s}  {why}")
    for m in MUTANTS:
        if m.gpu_only and m not in chosen and not args.gpu and not args.names:
            print(f"{m.name:45s} {'GPU only':18s} {'':>8s}  {m.gpu_only}")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
