"""Small steps on the CPU replayed from a recording: the CPU's CUDA graph.

A decode step (or a speculative verify step, up to MAX_ROWS tokens) runs the same
kernels on the same buffers every time; only the step's inputs (token ids, positions,
cache slots, block tables) differ.  The second step of a shape (a one-off shape, such
as a short prompt's, is never recorded) runs the model's forward while every kernel
call is recorded (`Scratch.call`: each Numba kernel and each NumPy
routine the CPU backend runs goes through it); later steps of that shape copy their
inputs into the plan's own input arrays and call the recorded kernels in order.  That
skips the model's Python, the backend's op wrappers and the matmul dispatch (2 cores,
A/B: a SmolLM2-135M decode step 6.12 -> 5.00 ms, Qwen2.5-1.5B 26.1 -> 24.4 ms).

Every argument a recorded call got is kept and passed again: the arena and scratch
buffers, the weights, the KV pools, and scalars fixed by the shape.  So a plan is only
valid while those are: the key holds everything about a step that a scalar argument
may depend on (token and sequence counts, rows wanted, table width rounded up, splits,
block size), and the backend drops its plans when its KV pools or a model's weights
change (`CPUBackend.invalidate_plans`).  A recording in which a call returned an array
that none of its arguments is, or a number (a later call may have used it), is
refused: that step shape keeps running the plain forward.  An op that skips
`Scratch.call` cannot be seen in a recording, so the first replay for each model is
checked against the plain forward of the same step (bit for bit; the second run writes
the same K/V again), and a mismatch turns plans off for that model.  Backends derived
from CPUBackend get no plans unless they say their ops record (`plans_ok`).
"""
from __future__ import annotations

import dataclasses
import os
from collections import OrderedDict

import numpy as np

from quant.dequant import check_rows
from quant.matmul_cpu import parallel_chunks_one

ENABLED = os.environ.get("LLAMBA_CPU_PLANS", "1") != "0"
MAX_ROWS = 16           # steps of up to this many tokens (engine._splits keeps their splits fixed)
MAX_PLANS = 16


class Unplannable(Exception):
    """The step's recording cannot be replayed."""


MIN_WIDTH = 256         # blocks: 4096 tokens of 16


def _width(mb: int) -> int:
    """Block-table width a plan is recorded at: mb rounded up to a power of two, at least
    MIN_WIDTH.  Attention reads a table only up to each token's position, so the width
    changes no arithmetic; a narrower one made every sequence that grew past 4, 8, 16...
    blocks (and every batch whose longest sequence did) record its steps again.  The
    plan's tables cost S x width int32 (16 KiB at 16 sequences)."""
    w = MIN_WIDTH
    while w < mb:
        w *= 2
    return w


def plan_key(model, step):
    """The plan a step can use, or None (too many tokens, or a step the plans do not cover)."""
    n = len(step.tokens)
    if n == 0 or n > MAX_ROWS or step.block_tables.ndim != 2:
        return None
    S, mb = step.block_tables.shape
    return (id(model), n, S, _width(mb), step.logit_rows.tobytes(), step.attn_splits, step.block_size,
            len(step.group_tables), step.group_slots is None)


def _own_inputs(step, W: int):
    """A copy of step with input arrays of the plan's own (StepPlan.load fills them): the
    block tables W entries wide (the entries past a sequence's blocks are never read)."""
    def zeros(a):
        return np.zeros(np.shape(a), np.int32)
    S = step.block_tables.shape[0]
    group_tables = [np.zeros((S, W), np.int32) for _ in step.group_tables]
    group_slots = None if step.group_slots is None else zeros(step.group_slots)
    return dataclasses.replace(
        step, tokens=zeros(step.tokens), positions=zeros(step.positions),
        slots=zeros(step.slots) if group_slots is None else group_slots[0], seq_of_token=zeros(step.seq_of_token),
        block_tables=group_tables[0] if group_tables else np.zeros((S, W), np.int32),
        logit_rows=np.array(step.logit_rows, np.int64), group_slots=group_slots, group_tables=group_tables)


_array_types: dict = {}


def _numba_type(fn, a):
    """fn.typeof_pyval(a), remembered per array kind (typing ~6000 arguments one by one
    took ~25 ms a recording)."""
    if type(a) is np.ndarray:
        f = a.flags
        key = (a.dtype, a.ndim, f.c_contiguous, f.f_contiguous, f.writeable, f.aligned)
        t = _array_types.get(key)
        if t is None:
            t = _array_types[key] = fn.typeof_pyval(a)
        return t
    return fn.typeof_pyval(a)


def _entry(fn, args):
    """A Numba dispatcher's compiled entry point for these arguments (a replay then skips
    the dispatcher's typing of every argument: ~2.4% of a SmolLM2 step), else fn itself."""
    overloads = getattr(fn, "overloads", None)
    if overloads is None:
        return fn
    try:
        cres = overloads.get(tuple(_numba_type(fn, a) for a in args))
    except Exception:           # an argument Numba cannot type here: the dispatcher decides
        return fn
    return cres.entry_point if cres is not None else fn


class StepPlan:
    def __init__(self, model, step, width: int):
        self.model = model
        self.embd = getattr(model, "tok_embd", None)
        if getattr(self.embd, "rows", None) is None:
            raise Unplannable("no token embedding to check ids against")
        self.step = _own_inputs(step, width)
        self.load(step)
        self.calls: list = []
        self.out = None

    def record(self, backend) -> np.ndarray:
        """Run the forward on the plan's inputs, recording its kernel calls; its logits."""
        sc = backend.scratch
        calls = sc.rec = []
        backend.recordable = True
        try:
            out = backend.plain_forward(self.model, self.step)
        finally:
            sc.rec = None
        if not backend.recordable:
            raise Unplannable("an op ran outside the recorded kernels")
        for fn, args, r in calls:
            if r is None or (isinstance(r, np.ndarray) and any(r is a for a in args)):
                continue
            raise Unplannable(f"{getattr(fn, '__name__', fn)} returned {type(r).__name__}")
        self.calls = [(_entry(fn, args), args) for fn, args, _ in calls]
        self.out = out
        return out

    def load(self, step) -> None:
        """The step's inputs into the plan's arrays."""
        p = self.step
        check_rows(self.embd, step.tokens)
        p.tokens[:] = step.tokens
        p.positions[:] = step.positions
        p.seq_of_token[:] = step.seq_of_token
        if p.group_slots is not None:
            p.group_slots[:] = step.group_slots
        else:
            p.slots[:] = step.slots
        tables = list(zip(p.group_tables, step.group_tables)) or [(p.block_tables, step.block_tables)]
        for mine, theirs in tables:
            mb = theirs.shape[1]
            mine[:, :mb] = theirs
            mine[:, mb:] = 0

    def replay(self, step) -> np.ndarray:
        """Run the recorded kernels on step's inputs; the plan's logits array (reused by
        the next replay: copy what must outlive it)."""
        self.load(step)
        parallel_chunks_one()
        for fn, args in self.calls:
            fn(*args)
        return self.out


class Plans:
    """A backend's step plans, by plan_key, the most recently used kept."""

    def __init__(self):
        self.plans: OrderedDict = OrderedDict()
        self.refused: set = set()
        self.seen: set = set()          # keys met once: recorded the second time (a prompt's one-off shape never is)
        self.checked: set = set()       # models whose first replay equalled the plain forward
        self.broken: set = set()        # models whose did not: no plans
        self.recorded = 0
        self.replayed = 0

    def clear(self) -> None:
        self.plans.clear()
        self.refused.clear()
        self.seen.clear()
        self.checked.clear()

    def run(self, backend, model, step):
        """The step's logits through a plan (recorded now if new), or None where no
        plan applies (the caller runs the plain forward)."""
        key = plan_key(model, step)
        if key is None or key in self.refused or id(model) in self.broken:
            return None
        plan = self.plans.get(key)
        if plan is not None and plan.model is model:
            self.plans.move_to_end(key)
            self.replayed += 1
            out = plan.replay(step)
            if id(model) not in self.checked:
                backend.setup_events += 1
                out = out.copy()
                plain = backend.plain_forward(model, step)
                if not np.array_equal(out, plain):
                    self.broken.add(id(model))
                    for k in [k for k, p in self.plans.items() if p.model is model]:
                        del self.plans[k]
                    return plain
                self.checked.add(id(model))
            return out
        if key not in self.seen:
            if len(self.seen) > 1024:
                self.seen.clear()
            self.seen.add(key)
            return None
        backend.setup_events += 1
        try:
            plan = StepPlan(model, step, key[3])
            out = plan.record(backend)
        except Unplannable:
            self.refused.add(key)
            return None
        self.plans[key] = plan
        while len(self.plans) > MAX_PLANS:
            self.plans.popitem(last=False)
        self.recorded += 1
        return out
