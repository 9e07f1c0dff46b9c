"""Draft-model speculative decoding (Leviathan et al. 2023; Chen et al. 2023).

A small draft model guesses the next k tokens on its own KV cache; the target
scores all k+1 positions in one `Engine.step(..., all_logits=True)` (the k-row
quantized matmul reads each weight block once); tokens are accepted up to the
first rejection and both caches roll back to the accepted length.

* Greedy: a draft token is accepted iff it is the target's argmax at its
  position, so the output is the target's own greedy output — exactly, because
  the target's batched verify step computes each row bit-identically to a
  one-token step (quant.matmul is batch invariant for <= 16 rows).
* Sampling: accept a draft token x ~ q with probability min(1, p(x)/q(x)); on
  rejection draw from norm(max(0, p - q)).  The emitted token is then
  distributed exactly as p.  p and q are both `Sampler.probs` of the same
  sampling settings, so the output follows the target's filtered distribution.

The draft can be made cheaper than the model file alone allows: `draft_vocab=N`
keeps only the first N rows of its output layer (BPE ids are roughly ordered by
merge frequency, so low ids cover most text) plus the end-of-generation ids.
That only changes what the draft proposes; the target still checks every token
over the full vocabulary, so exactness is unaffected.  For the same reason the
draft's layer matrices may be re-encoded in a smaller type at load
(`draft_quant`, default Q4_0): a draft step streams fewer bytes.

k adapts to the measured acceptance and costs (see `KController`); when no k
beats plain decoding the Drafter falls back to it and says so in its stats.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from quant import QTensor

from .constrain import ConstraintDead, apply_mask
from .engine import ContextOverflow, Engine
from .kv_cache import Sequence
from .sampling import Sampler

# llama.cpp's tolerance for vocabularies that differ only in padding at the end
VOCAB_SIZE_SLACK = 128
# default --draft-vocab: the first 32768 ids cover ~95% of the tokens of Python code
# for Qwen2.5's BPE and cut the 0.5B draft's output layer to a fifth
DEFAULT_DRAFT_VOCAB = 32768
# default --draft-quant: the draft's layer matrices re-encoded as Q4_0 where their
# own type takes more bytes a weight (Qwen2.5-0.5B's Q5_0, Q6_K and Q8_0 ones)
DEFAULT_DRAFT_QUANT = "q4_0"


class VocabMismatch(ValueError):
    """Draft and target models do not share a vocabulary."""


# ---- vocabulary check ------------------------------------------------------------------
def check_same_vocab(draft, target) -> None:
    """Raise VocabMismatch saying what differs unless draft and target (LoadedModel)
    tokenize identically: same tokenizer model, the same token strings for every
    id they share, and at most VOCAB_SIZE_SLACK extra (padding) ids on one side."""
    dm, tm = draft.metadata, target.metadata
    dname, tname = draft.path.name, target.path.name
    problems = []
    d_model, t_model = dm.get("tokenizer.ggml.model"), tm.get("tokenizer.ggml.model")
    if d_model != t_model:
        problems.append(f"tokenizer type: draft {d_model!r}, target {t_model!r}")
    d_pre, t_pre = dm.get("tokenizer.ggml.pre"), tm.get("tokenizer.ggml.pre")
    if d_pre != t_pre:
        problems.append(f"pre-tokenizer: draft {d_pre!r}, target {t_pre!r}")
    d_tok, t_tok = list(dm.get("tokenizer.ggml.tokens") or []), list(tm.get("tokenizer.ggml.tokens") or [])
    if not d_tok or not t_tok:
        problems.append("a model file has no tokenizer.ggml.tokens list to compare")
    else:
        if abs(len(d_tok) - len(t_tok)) > VOCAB_SIZE_SLACK:
            problems.append(f"vocabulary size: draft {len(d_tok)}, target {len(t_tok)}")
        n = min(len(d_tok), len(t_tok))
        diff = [i for i in range(n) if d_tok[i] != t_tok[i]]
        if diff:
            i = diff[0]
            problems.append(f"{len(diff)} of {n} shared token ids have different strings, first id {i}: "
                            f"draft {d_tok[i]!r}, target {t_tok[i]!r}")
    for key in ("bos_id", "eos_id"):
        d, t = getattr(draft.tokenizer, key, None), getattr(target.tokenizer, key, None)
        if d != t:
            problems.append(f"{key}: draft {d}, target {t}")
    if problems:
        raise VocabMismatch(f"draft model {dname} cannot draft for {tname}: they do not share a "
                            "vocabulary (" + "; ".join(problems) + ")")


# ---- the accept/reject rule ---------------------------------------------------------------
def _dense(ids: np.ndarray, probs: np.ndarray, support: np.ndarray) -> np.ndarray:
    """probs of (ids, probs) on the sorted id array `support`."""
    out = np.zeros(support.size, np.float64)
    out[np.searchsorted(support, ids)] = probs
    return out


def accept_or_resample(p: tuple[np.ndarray, np.ndarray], q: tuple[np.ndarray, np.ndarray], x: int,
                       rng: np.random.Generator) -> tuple[bool, int]:
    """One step of speculative sampling.

    p, q: (token ids, probabilities) of the target and draft distributions (as
    `Sampler.probs` returns them); x: the draft's token, drawn from q.  Returns
    (accepted, token): (True, x) with probability min(1, p(x)/q(x)), otherwise
    (False, y) with y ~ norm(max(0, p - q)).  The token is distributed as p.
    """
    p_ids, p_pr = np.asarray(p[0], np.int64), np.asarray(p[1], np.float64)
    q_ids, q_pr = np.asarray(q[0], np.int64), np.asarray(q[1], np.float64)
    px = float(p_pr[p_ids == x].sum())
    qx = float(q_pr[q_ids == x].sum())
    if qx <= 0.0:
        raise ValueError(f"draft token {x} has probability 0 under the draft distribution")
    if px >= qx or rng.random() * qx < px:
        return True, int(x)
    support = np.union1d(p_ids, q_ids)
    resid = np.maximum(_dense(p_ids, p_pr, support) - _dense(q_ids, q_pr, support), 0.0)
    total = resid.sum()
    if total <= 0.0:            # p == q up to rounding: rejection had probability ~0
        resid, total = _dense(p_ids, p_pr, support), 1.0
    return False, int(support[rng.choice(support.size, p=resid / total)])


# ---- a cheaper draft: output layer on a subset of the vocabulary ------------------------
def _weights_changed(engine: Engine) -> None:
    """A model's weights were swapped: recorded steps (CPU plans, CUDA graphs) hold the old ones."""
    drop = getattr(engine.backend, "invalidate_plans", None)
    if drop is not None:
        drop()


def restrict_draft_vocab(engine: Engine, n_first: int, always=()) -> np.ndarray | None:
    """Make the draft engine's output layer compute logits only for ids < n_first
    plus `always` (e.g. the end-of-generation ids).  Returns the token id of each
    logit row (None when nothing was cut).  A contiguous prefix of rows is a plain
    view of the weight; extra rows are copied once."""
    model = engine.model
    W = getattr(model, "full_output", None) or getattr(model, "output", None)
    if not isinstance(W, QTensor):
        return None
    model.full_output = W           # so a later Drafter on this engine can choose again
    _weights_changed(engine)
    if n_first <= 0 or n_first >= W.shape[0]:
        model.output = W
        return None
    extra = sorted(int(i) for i in set(always) if n_first <= int(i) < W.shape[0])
    ids = np.concatenate([np.arange(n_first), np.asarray(extra, np.int64)]).astype(np.int64)
    data = W.data[:n_first] if not extra else np.ascontiguousarray(W.data[ids])
    model.output = QTensor(W.name + f"[:{n_first}]", W.qtype, (ids.size, W.shape[1]), data)
    return ids


def _draft_type(qtype: str | None):
    """The GGMLType --draft-quant names (None for none)."""
    if not qtype or qtype.lower() == "none":
        return None
    from quant import GGMLType
    from quant.encode import ENCODERS
    t = GGMLType.__members__.get(qtype.upper())
    if t not in ENCODERS:
        raise ValueError(f"--draft-quant {qtype}: choose none or one of "
                         f"{', '.join(e.name.lower() for e in ENCODERS)}")
    return t


def _reencoded(W, t) -> QTensor | None:
    """W as type t, where W's own type takes more bytes a weight and its rows fit
    t's blocks; else None."""
    from quant import TYPE_INFO, dequantize
    from quant.encode import quantize
    if not isinstance(W, QTensor) or len(W.shape) != 2:
        return None
    per, nbytes = TYPE_INFO[t]
    wper, wbytes = TYPE_INFO[W.qtype]
    if W.shape[1] % per or wbytes / wper <= nbytes / per:
        return None
    return QTensor(W.name, t, W.shape, quantize(dequantize(W), t))


def requantize_draft(lm, qtype: str | None) -> tuple[int, int, int]:
    """Re-encode the layer matrices (blk.*) of a loaded draft model as `qtype`
    (e.g. "q4_0") where their own type takes more bytes a weight and the row
    length allows it.  Returns (matrices re-encoded, bytes before, bytes after)."""
    t = _draft_type(qtype)
    n = before = after = 0
    if t is None:
        return n, before, after
    for name, W in lm.tensors.items():
        R = _reencoded(W, t) if name.startswith("blk.") else None
        if R is not None:
            lm.tensors[name] = R
            n += 1
            before += W.nbytes
            after += R.nbytes
    return n, before, after


# ---- choosing k ------------------------------------------------------------------------
@dataclass
class KController:
    """Picks the draft length that maximizes expected tokens per second.

    With per-token acceptance a, a round of k drafts yields on average
    (1 - a^(k+1)) / (1 - a) tokens and costs k draft steps plus one verify step
    of k+1 rows.  The verify step's cost is not linear in k: the CPU matmuls
    decode each weight block once per group of rows (K-quants: up to 8 rows a
    pass; 32-element formats: row groups of 4, 8 or 16), and past a few rows
    the integer dot products, not the weight stream, set the time
    (Qwen2.5-Coder-1.5B, in 1-row steps: 2 rows 1.09, 3 rows 1.30, 4 rows 1.59,
    5 rows 1.85, 6 rows 2.13, 8 rows 2.69).  So the candidates are a few k:
    those whose k+1 rows fill a pass of the 32-element formats (1, 3, 7, 15)
    and, for K-quant targets (one pass for up to 8 rows), 2, 4 and 5: with
    the draft's 32-element kernels prefetching, its step fell to 0.15-0.3 of the
    target's and the best fixed k on the Qwen pair moved to 3-5.  And
    each one's verify time is a running average of its own measured rounds;
    an unmeasured k is estimated from t_plain plus the measured per-row cost.
    All costs are running averages of measured times, a whole round's in draft
    steps of its moment (round_steps); a comes from tested draft tokens with a
    weak prior, and the tokens a round of k yields from the acceptance measured
    at each draft position (expected_tokens).  k = 0 is plain decoding.

    Replayed on the Qwen pair's agreement data (3 prompts x 128 tokens, six
    generations through one controller; tests/lab/kcontroller.py) with the step
    costs of a bench run in target steps, 6% noise a step and a random-walk drift,
    the adaptive choice came to 1.63-1.65x where fixed k = 3 gives 1.67x (1.61x
    before those two estimators and the hysteresis in choose).
    """
    CANDIDATES = (1, 2, 3, 4, 5, 7, 15)
    EXPLORE = 0.8
    # plain decoding must beat the best k by this factor to be chosen: the rates
    # are noisy running averages, and turning drafting off has a cost they leave
    # out (a retry re-feeds the draft every token it missed)
    SWITCH_OFF = 1.05
    # a measured k is re-measured only when it is chosen, so one slow round (a noisy
    # machine) could keep a good k unchosen for good: every REFRESH_EVERY rounds, of the
    # best k's two neighbours among the candidates, a measured one within REFRESH of the
    # best that has gone unchosen for STALE rounds runs once (the longer unchosen
    # first), and a stale k's new measurement replaces its old one.  Only neighbours:
    # a round of 7 or 15 drafts where 3 is best costs a few per cent of a run each time
    REFRESH_EVERY = 8
    REFRESH = 0.75
    STALE = 8
    POSITION_PRIOR = 2.0
    HYSTERESIS = 1.02
    k_max: int = 8
    adaptive: bool = True
    k_fixed: int = 3
    explore_rounds: int = 3     # drafted rounds measured before k may drop to 0
    rounds: int = 0
    alpha_prior: float = 0.7
    prior_weight: float = 4.0
    ema: float = 0.2
    tested: float = 0.0
    accepted: float = 0.0
    t_plain_seen: float | None = None     # running average of the plain target steps timed
    plain_per_draft: float | None = None  # those steps over the draft step of their time
    t_draft: float | None = None      # one single-token draft forward
    t_catch: float | None = None      # a round's first draft forward (also feeds the 1-2 tokens it missed)
    t_row: float | None = None
    t_verify: dict = field(default_factory=dict)     # k -> running average of its verify step
    k_best: int | None = None         # the k choose() last found best
    # k -> running average of a whole round, in draft steps (t_draft at its time): rounds of
    # different k are timed minutes apart on a machine whose speed drifts by ~20%, so their
    # seconds are not comparable, their multiples of the concurrent draft step are
    round_steps: dict = field(default_factory=dict)
    last_used: dict = field(default_factory=dict)    # k -> value of `rounds` when k last ran
    # draft position j (1-based) -> times it was checked / accepted (decayed as accepted, tested)
    pos_tested: dict = field(default_factory=dict)
    pos_accepted: dict = field(default_factory=dict)

    @property
    def t_plain(self) -> float | None:
        """A plain target step now.  Plain steps are timed rarely (at the start, then
        one every PROBE_EVERY adaptive rounds, and the controller lives across
        generations), while this machine's speed drifts by 20% within minutes: a
        plain-step time from another minute skews the rate of plain decoding and
        the per-row cost unmeasured k are estimated from (a bench run printed a
        4-row verify at 0.97 plain steps where a profile measured 1.48).  So a
        plain step is carried as a multiple of the draft step, which every round
        re-measures: on one device both stream weights through the same memory.
        (A draft on another device than its target drifts on its own; the periodic
        plain steps re-anchor the multiple.)"""
        if self.plain_per_draft is not None and self.t_draft is not None:
            return self.plain_per_draft * self.t_draft
        return self.t_plain_seen

    @property
    def alpha(self) -> float:
        a = (self.accepted + self.alpha_prior * self.prior_weight) / (self.tested + self.prior_weight)
        return min(a, 0.999)

    def _avg(self, old, new):
        return new if old is None else (1 - self.ema) * old + self.ema * new

    def observe_round(self, k: int, n_accepted: int, draft_s: float | None, verify_s: float,
                      catch_s: float | None = None, round_s: float | None = None, timed: bool = True) -> None:
        """draft_s: seconds per single-token draft forward this round; catch_s: its
        first forward, which also feeds the draft what it missed; round_s: the
        whole round, drafting and verifying (None: not representative, e.g. the
        catch-up after the prompt or after a stretch of plain decoding).  timed
        False: a step of the round paid a one-time cost (Engine.setup_events), so
        only its acceptance counts."""
        stale = self.rounds - self.last_used.get(k, self.rounds) >= self.STALE
        self.rounds += 1
        self.last_used[k] = self.rounds
        # acceptance is geometric: after the first rejection nothing more was tested
        self.accepted = self.accepted * 0.98 + n_accepted
        self.tested = self.tested * 0.98 + n_accepted + (1 if n_accepted < k else 0)
        for d in (self.pos_tested, self.pos_accepted):
            for j in d:
                d[j] *= 0.98
        for j in range(1, min(k, n_accepted + 1) + 1):
            self.pos_tested[j] = self.pos_tested.get(j, 0.0) + 1.0
            if j <= n_accepted:
                self.pos_accepted[j] = self.pos_accepted.get(j, 0.0) + 1.0
        if not timed:
            return
        if catch_s is not None:
            self.t_catch = self._avg(self.t_catch, catch_s)
        # the round in draft steps of its own moment (k = 1 has none beyond its first)
        unit = draft_s or self.t_draft
        if round_s is not None and unit:
            self.round_steps[k] = self._avg(None if stale else self.round_steps.get(k), round_s / unit)
        if draft_s is not None:
            self.t_draft = self._avg(self.t_draft, draft_s)
        self.t_verify[k] = self._avg(None if stale else self.t_verify.get(k), verify_s)
        if self.t_plain is not None:
            self.t_row = self._avg(self.t_row, max(0.0, verify_s - self.t_plain) / k)

    def _scale_positions(self, f: float) -> None:
        self.pos_tested = {j: n * f for j, n in self.pos_tested.items()}
        self.pos_accepted = {j: n * f for j, n in self.pos_accepted.items()}

    def forget(self) -> None:
        """Weaken the acceptance history so the prior and new rounds dominate."""
        self.accepted *= 0.25
        self.tested *= 0.25
        self._scale_positions(0.25)
        self.rounds = 0

    def new_generation(self, k_max: int, adaptive: bool, k_fixed: int) -> None:
        """Carry the model over to the next generation: the measured step costs stay
        (the same two models on the same machine), the acceptance history counts half
        (new text may be easier or harder to guess), and nothing is explored again."""
        self.k_max, self.adaptive, self.k_fixed = k_max, adaptive, k_fixed
        self.accepted *= 0.5
        self.tested *= 0.5
        self._scale_positions(0.5)

    def observe_plain(self, seconds: float) -> None:
        self.t_plain_seen = self._avg(self.t_plain_seen, seconds)
        if self.t_draft is not None:
            self.plain_per_draft = self._avg(self.plain_per_draft, seconds / self.t_draft)

    def costs_ms(self) -> dict:
        """The step costs the model runs on (running averages), in milliseconds: what
        bounds the speedup, beside the acceptance."""
        ms = lambda t: None if t is None else round(1e3 * t, 2)
        return {"target": ms(self.t_plain), "draft": ms(self.t_draft), "catch_up": ms(self.t_catch),
                "verify": {str(k): ms(t) for k, t in sorted(self.t_verify.items())}}

    def expected_tokens(self, k: int, a: float | None = None) -> float:
        """Tokens a round of k drafts emits: with a per-token acceptance a given,
        (1 - a^(k+1)) / (1 - a); otherwise 1 + sum over j <= k of p_1 ... p_j, p_j the
        measured rate at which draft j was accepted when drafts 1..j-1 were (each
        pulled toward the overall acceptance by POSITION_PRIOR checks).  Acceptance is
        not independent from token to token (a hard stretch of text rejects early, an
        easy one accepts all): the formula alone kept trying k = 5 and 7 at 90%
        acceptance on the Qwen pair, where rounds of 3 and 4 were faster.  A running
        average of what rounds of each k emitted (the estimate before this one) chased
        single rounds: replayed on the pair's agreement data with exact step costs,
        the adaptive controller came to 1.58x against 1.65x for fixed k = 3 with it,
        1.65x with this one."""
        if a is not None:
            return (1 - a ** (k + 1)) / (1 - a)
        g = self.alpha
        e = run = 1.0
        for j in range(1, k + 1):
            p = (self.pos_accepted.get(j, 0.0) + self.POSITION_PRIOR * g) / (self.pos_tested.get(j, 0.0)
                                                                             + self.POSITION_PRIOR)
            run *= min(p, 0.999)
            e += run
        return e

    def verify_cost(self, k: int) -> float:
        t = self.t_verify.get(k)
        if t is not None:
            return t
        return (self.t_plain or 1.0) + k * (self.t_row or 0.0)

    def rate(self, k: int, a: float | None = None) -> float:
        """Expected tokens per second of rounds with k drafts (k = 0: plain)."""
        tp = self.t_plain or 1.0
        if k == 0:
            return 1.0 / tp
        r = self.round_steps.get(k)
        t = r * self.t_draft if r is not None and self.t_draft else None
        if t is None:       # not measured yet: from the parts
            step = self.t_draft if self.t_draft is not None else (self.t_catch or 0.0)
            first = self.t_catch if self.t_catch is not None else step
            t = first + (k - 1) * step + self.verify_cost(k)
        return self.expected_tokens(k, a) / t

    def candidates(self) -> list[int]:
        if self.k_max < self.CANDIDATES[1]:
            return list(range(1, self.k_max + 1))
        return [k for k in self.CANDIDATES if k <= self.k_max]

    def could_pay(self) -> bool:
        """Whether some k would beat plain decoding if every draft were accepted
        (if not, the costs alone rule drafting out and retrying is pointless)."""
        return any(self.rate(k, 0.999) > self.rate(0) for k in self.candidates())

    def choose(self) -> int:
        if not self.adaptive:
            return self.k_fixed
        start = min(self.k_fixed, self.k_max)
        if self.t_plain is None or (self.t_draft is None and self.t_catch is None) \
                or self.rounds < self.explore_rounds:
            return start
        # an unmeasured k is estimated from the per-row cost of measured ones:
        # if it wins, or comes within EXPLORE of the winner, its first round
        # measures it (the per-row cost falls as rows share weight decodes, so
        # the linear estimate is pessimistic and would never be corrected)
        best = max(self.candidates(), key=self.rate)
        # the last best k stays unless the new one is HYSTERESIS faster: two k a few per
        # cent apart (2 and 3 on the Qwen pair) otherwise trade places with noisy rounds
        # (replayed over two cost sets and four noise settings, tests/lab/kcontroller.py:
        # 1.02 came to -0.4..+0.9% against none; 1.04 to -2.3..+1.0%, locking in a k
        # 2% short of the best where costs are steady)
        cur = self.k_best
        if (cur != best and cur in self.round_steps and best in self.round_steps and cur in self.candidates()
                and self.rate(best) < self.HYSTERESIS * self.rate(cur)):
            best = cur
        self.k_best = best
        if self.rate(0) > self.SWITCH_OFF * self.rate(best):
            return 0
        if best in self.t_verify:
            close = [k for k in self.candidates()
                     if k not in self.t_verify and self.rate(k) >= self.EXPLORE * self.rate(best)]
            if close:
                return max(close, key=self.rate)
        if self.rounds % self.REFRESH_EVERY == self.REFRESH_EVERY - 1:
            cands = self.candidates()
            i = cands.index(best)
            stale = [k for k in cands[max(0, i - 1):i + 2] if k != best and k in self.t_verify
                     and self.rounds - self.last_used.get(k, 0) >= self.STALE
                     and self.rate(k) >= self.REFRESH * self.rate(best)]
            if stale:
                return min(stale, key=lambda k: self.last_used.get(k, 0))
        return best


# ---- stats -------------------------------------------------------------------------------
@dataclass
class SpecStats:
    drafted: int = 0              # draft tokens proposed
    accepted: int = 0             # draft tokens the target accepted
    verify_forwards: int = 0      # target steps that checked drafts
    plain_forwards: int = 0       # target steps without drafts (probes and fallback)
    emitted: int = 0              # tokens produced by those target steps
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    plain_seconds: float = 0.0
    k_rounds: dict = field(default_factory=dict)   # k -> rounds drafted with it
    fallback: str = ""            # why speculation was last switched off
    fallbacks: int = 0            # times it was switched off
    active: bool = True           # drafting at the end of the run
    # the Drafter's cost model: the plain-step time and step costs are read from it
    # when asked (the app asks mid-generation), not copied into the stats each round
    controller: KController | None = field(default=None, repr=False, compare=False)

    @property
    def t_plain(self) -> float | None:
        """Seconds of one plain target step (the controller's current estimate)."""
        return self.controller.t_plain if self.controller is not None else None

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_target_forward(self) -> float:
        n = self.verify_forwards + self.plain_forwards
        return self.emitted / n if n else 0.0

    @property
    def speedup(self) -> float:
        """Tokens/s achieved over the tokens/s of plain decoding, from the measured
        time of plain target steps taken in the same run."""
        spent = self.draft_seconds + self.verify_seconds + self.plain_seconds
        if not self.t_plain or not spent or not self.emitted:
            return 0.0
        return self.emitted / spent * self.t_plain

    def as_dict(self) -> dict:
        return {"drafted": self.drafted, "accepted": self.accepted,
                "acceptance_rate": round(self.acceptance_rate, 4),
                "tokens_per_target_forward": round(self.tokens_per_target_forward, 3),
                "speedup": round(self.speedup, 3),
                "verify_forwards": self.verify_forwards, "plain_forwards": self.plain_forwards,
                "draft_seconds": round(self.draft_seconds, 4), "verify_seconds": round(self.verify_seconds, 4),
                "plain_seconds": round(self.plain_seconds, 4),
                "k_rounds": {str(k): v for k, v in sorted(self.k_rounds.items())},
                "fallbacks": self.fallbacks,
                "step_ms": self.controller.costs_ms() if self.controller is not None else {},
                "speculation": ("on" if self.active else "off") + (f" ({self.fallback})" if self.fallback else "")}


# ---- the drafter -------------------------------------------------------------------------
class Drafter:
    """A draft engine paired with a target engine.  `Generation(..., drafter=d)`
    decodes through `d.tokens(...)`; one Drafter serves one generation at a time.

    k: the draft length (adaptive: the most it may grow to; fixed otherwise).
    draft_vocab: keep only this many output ids in the draft (0: all).
    """

    # rounds in a row where plain decoding looks faster before giving up on drafting
    FALLBACK_AFTER = 4
    # with speculation off, plain tokens before drafting is tried again; doubled
    # after each fallback up to RETRY_MAX (a few unlucky early rounds must not
    # switch drafting off for the rest of a short answer)
    RETRY_AFTER = 16
    RETRY_MAX = 256
    # one plain step every this many rounds keeps the plain-step time current.  A probe
    # emits one token at plain speed; since the plain step is carried as a multiple of
    # the draft step (KController.t_plain), 64 keeps it current enough (replayed on the
    # Qwen pair's data with drifting costs: 32 -> 64 +0.5%)
    PROBE_EVERY = 64

    @classmethod
    def probe_due(cls, ctl: KController, rounds: int, adaptive: bool) -> bool:
        """Whether round number `rounds` is a plain step timed for the cost model: while no
        plain step is known (the first rounds), then every PROBE_EVERY adaptive rounds."""
        return (ctl.t_plain is None and rounds <= 2
                or adaptive and rounds % cls.PROBE_EVERY == cls.PROBE_EVERY - 1)

    def __init__(self, draft: Engine, target: Engine, k: int = 4, adaptive: bool = True,
                 draft_vocab: int = 0):
        check_same_vocab(draft.loaded, target.loaded)
        if k < 1:
            raise ValueError("--draft-n must be at least 1")
        self.draft, self.target = draft, target
        # k + 1 rows within what the target's backend verifies bit-exactly (CPU 16 rows,
        # GPU 8: its integer matvec's range)
        self.k = min(k, getattr(target.backend, "exact_rows", 16) - 1)
        self.adaptive = adaptive
        tok = target.tokenizer      # None for weights-only models (GPU test files)
        stops = set(tok.stop_ids) | {tok.eos_id or 0} if tok is not None else set()
        self.vocab_ids = restrict_draft_vocab(draft, draft_vocab, stops)
        self.dseq: Sequence | None = None
        self.stats = SpecStats()
        # kept from one generation to the next: each new message of a chat would
        # otherwise pay again for timing a plain step and for exploring k
        self.controller: KController | None = None

    @classmethod
    def load(cls, draft_model: str, target: Engine, k: int = 4, adaptive: bool = True,
             draft_vocab: int = DEFAULT_DRAFT_VOCAB, draft_quant: str | None = DEFAULT_DRAFT_QUANT,
             announce=None) -> "Drafter":
        from .loader import load_model
        lm = load_model(draft_model)
        check_same_vocab(lm, target.loaded)   # before building an engine for nothing
        t0 = time.perf_counter()
        n, before, after = requantize_draft(lm, draft_quant)
        if n and announce:
            announce(f"draft: {n} matrices re-encoded as {draft_quant.upper()} "
                     f"({before / 2**20:.0f} -> {after / 2**20:.0f} MiB, {time.perf_counter() - t0:.1f} s)")
        eng = Engine(lm, device=target.backend.name, n_ctx=target.n_ctx, announce=announce)
        d = cls(eng, target, k=k, adaptive=adaptive, draft_vocab=draft_vocab)
        if d.k < k and announce:
            announce(f"draft: --draft-n {k} capped at {d.k} (the {target.backend.name} backend verifies "
                     f"at most {d.k + 1} tokens a step exactly)")
        t = _draft_type(draft_quant)
        if t is not None and d.vocab_ids is not None:
            # the output layer's kept rows too (its full table stays for embeddings)
            R = _reencoded(eng.model.output, t)
            if R is not None:
                eng.model.output = R
                _weights_changed(eng)
        return d

    def release(self) -> None:
        if self.dseq is not None:
            self.draft.release(self.dseq)
            self.dseq = None

    # ---- draft side ---------------------------------------------------------------------
    def _draft_logits(self, history: list[int]) -> np.ndarray:
        """Bring the draft's cache up to `history` (keeping the common prefix) and
        return its logits for the next token."""
        seq = self.dseq
        if seq is None:
            seq = self.dseq = self.draft.new_sequence()
        n = 0
        lim = min(len(seq.tokens), len(history) - 1)
        while n < lim and seq.tokens[n] == history[n]:
            n += 1
        if n < len(seq.tokens):
            self.draft.cache.truncate(seq, n)
        return self.draft.prefill(seq, history)

    def _draft_pick(self, logits: np.ndarray, sampler: Sampler, history: list[int], rng, matcher=None):
        """(token, q) where q = (ids, probs) is the distribution it was drawn from
        (None for greedy).  matcher: a constraint's state, which the token must satisfy."""
        ids = self.vocab_ids
        p = sampler.p
        if matcher is not None:
            try:
                logits = matcher.mask_logits(logits, ids)
            except ConstraintDead:      # nothing allowed among the draft's ids: propose one that is
                t = matcher.first_allowed()
                if t < 0:
                    raise
                return t, (None if p.greedy else (np.array([t]), np.array([1.0])))
        hist = history[-p.repeat_last_n:] if p.repeat_penalty != 1.0 else ()
        if ids is not None and len(hist):
            # penalties index the draft's own (restricted) logits
            pos = np.searchsorted(ids, hist)
            ok = (pos < ids.size) & (ids[np.minimum(pos, ids.size - 1)] == np.asarray(hist))
            hist = [int(i) for i in pos[ok]]
        if p.greedy:
            j = sampler.sample(logits, hist)
            return (int(ids[j]) if ids is not None else j), None
        q_ids, q_pr = sampler.probs(logits, hist)
        j = int(q_ids[rng.choice(q_ids.size, p=q_pr)])
        if ids is not None:
            q_ids = ids[q_ids]
            j = int(ids[j])
        return j, (q_ids, q_pr)

    def _propose(self, history, k, sampler, rng, matcher=None):
        """k draft tokens, their distributions, the seconds per single-token draft
        forward (None for k = 1) and of the first forward (None when its catch-up
        fed the draft many tokens, e.g. the prompt).  Under a constraint (matcher) the
        drafts satisfy it, and there are fewer where an EOS or the grammar's end comes
        first; the matcher ends where it began."""
        t0 = time.perf_counter()
        behind = len(history) - (len(self.dseq) if self.dseq is not None else 0)
        logits = self._draft_logits(history)
        t1 = time.perf_counter()
        toks, qs = [], []
        hist = list(history)
        n0 = matcher.n_consumed if matcher is not None else 0
        pick = None
        argmax = sampler.p.argmax_only and matcher is None
        try:
            for i in range(k):
                try:
                    t, q = self._draft_pick(logits, sampler, hist, rng, matcher) if pick is None else (pick, None)
                except ConstraintDead:      # the verify step's first row says so
                    break
                toks.append(t); qs.append(q); hist.append(t)
                if matcher is not None and (not matcher.consume(t) or matcher.done
                                            or t in self.target.tokenizer.stop_ids):
                    break
                if i + 1 < k:
                    if argmax:     # greedy, no penalty: the draft's argmax alone
                        j = int(self.draft.step([self.dseq], [[t]], argmax=True)[0])
                        pick = int(self.vocab_ids[j]) if self.vocab_ids is not None else j
                    else:
                        logits = self.draft.step([self.dseq], [[t]])[0]
        finally:
            if matcher is not None:
                matcher.rollback(matcher.n_consumed - n0)
        t2 = time.perf_counter()
        n = len(toks)
        per = (t2 - t1) / (n - 1) if n > 1 else None      # single-token forwards (and picks)
        first = t1 - t0 if behind <= 2 else None            # the usual catch-up: 1-2 tokens
        return toks, qs, per, first

    # ---- the decode loop ------------------------------------------------------------------
    def tokens(self, seq: Sequence, logits: np.ndarray, history: list[int], sampler: Sampler,
               matcher=None):
        """Yield the target's tokens after a prefill that gave `logits`.  The caller
        appends each yielded token to `history` before asking for the next, and may
        stop at any time (then call `finish`).  Between rounds the target cache
        holds every token of history but the last.  matcher (constrain.Matcher): the
        tokens satisfy its constraint; the caller consumes each yielded token into it."""
        eng = self.target
        k_fixed = self.k if not self.adaptive else min(self.k, 3)
        ctl = self.controller
        if ctl is None:
            ctl = self.controller = KController(k_max=self.k, adaptive=self.adaptive, k_fixed=k_fixed)
        else:
            ctl.new_generation(self.k, self.adaptive, k_fixed)
        st = self.stats = SpecStats(controller=ctl)
        rng = np.random.default_rng(sampler.p.seed)
        tok = sampler.sample(logits if matcher is None else matcher.mask_logits(logits), history)
        yield tok
        pending = tok
        off_until = -1          # speculation is off until history reaches this length
        retry = self.RETRY_AFTER
        losing = 0              # consecutive decisions for plain decoding
        rounds = 0
        while True:
            if self.probe_due(ctl, rounds, self.adaptive):
                k = 0           # time a plain step: the cost model and the speedup need it
            elif off_until > len(history):
                k = 0
            elif off_until >= 0:
                off_until = -1  # retry: one forced round re-measures the acceptance
                ctl.forget()
                k = ctl.choose()
            else:
                k = ctl.choose()
                losing = losing + 1 if k == 0 else 0
                if losing >= self.FALLBACK_AFTER:
                    # a retry re-feeds the draft everything it missed, so only retry
                    # when better acceptance alone could make drafting pay
                    hopeless = not ctl.could_pay()
                    off_until = (1 << 62) if hopeless else len(history) + retry
                    retry = min(2 * retry, self.RETRY_MAX)
                    st.fallbacks += 1
                    st.fallback = (f"drafting stopped paying{' even at full acceptance' if hopeless else ''} "
                                   f"(acceptance {ctl.alpha:.0%}, draft step {1e3 * (ctl.t_draft or ctl.t_catch or 0):.0f} ms, "
                                   f"verify +{1e3 * (ctl.t_row or 0):.0f} ms per draft, plain target step "
                                   f"{1e3 * ctl.t_plain:.0f} ms)")
                    losing = 0
            st.active = off_until < 0
            k = max(0, min(k, eng.n_ctx - len(seq) - 1))
            rounds += 1
            if k == 0:
                ev = eng.setup_events
                t0 = time.perf_counter()
                if sampler.p.argmax_only and matcher is None:     # greedy, no penalty: the argmax alone
                    nxt, logits = int(eng.step([seq], [[pending]], argmax=True)[0]), None
                else:
                    logits = eng.step([seq], [[pending]])[0]
                dt = time.perf_counter() - t0
                if eng.setup_events == ev:    # not a step that recorded a plan or captured a graph
                    ctl.observe_plain(dt)
                st.plain_forwards += 1; st.plain_seconds += dt; st.emitted += 1
                if logits is not None and matcher is not None:
                    matcher.mask_logits(logits)
                out = [nxt if logits is None else sampler.sample(logits, history)]
            else:
                try:
                    out = self._round(seq, pending, history, k, sampler, rng, ctl, matcher)
                except ContextOverflow:     # the draft's context is full: the target goes on alone
                    off_until = 1 << 62
                    st.fallbacks += 1
                    st.fallback = "the draft model's context is full"
                    continue
            for t in out:
                yield t
            pending = out[-1]

    def round(self, seq: Sequence, history: list[int], sampler: Sampler) -> list[int] | None:
        """One speculative round for a caller with a loop of its own (the scheduler, while a
        request decodes alone): the tokens to emit, or None when a plain target step is due
        (the controller times one now and then, or drafting does not pay now; report its
        time with observe_plain).  Before and after, the target cache holds every token of
        history but the last, as between the rounds of `tokens`."""
        ctl = self.controller
        if ctl is None:
            k_fixed = self.k if not self.adaptive else min(self.k, 3)
            ctl = self.controller = KController(k_max=self.k, adaptive=self.adaptive, k_fixed=k_fixed)
            self.stats = SpecStats(controller=ctl)
            self._rounds = 0
        self._rounds += 1
        if self.probe_due(ctl, self._rounds, self.adaptive):
            return None
        k = max(0, min(ctl.choose(), self.target.n_ctx - len(seq) - 1))
        if k == 0:
            return None
        try:
            return self._round(seq, history[-1], history, k, sampler, sampler.rng, ctl)
        except ContextOverflow:         # the draft's context is full: a plain step
            return None

    def observe_plain(self, seconds: float) -> None:
        """A plain target step of one token took `seconds` (for the controller's cost model)."""
        if self.controller is not None:
            self.controller.observe_plain(seconds)
            self.stats.plain_forwards += 1
            self.stats.plain_seconds += seconds
            self.stats.emitted += 1

    def _round(self, seq, pending, history, k, sampler, rng, ctl, matcher=None):
        """Draft k tokens, verify them in one target step, roll back; return the
        tokens to emit (accepted drafts plus the target's own next token).  Under a
        constraint each verify row is masked by the matcher's state after the drafts
        before it (which is the emitted prefix wherever that row is reached)."""
        st = self.stats
        eng = self.target
        ev = eng.setup_events + self.draft.setup_events
        t0 = time.perf_counter()
        drafts, qs, per_draft, first = self._propose(history, k, sampler, rng, matcher)
        k = len(drafts)         # fewer under a constraint that ends first
        t1 = time.perf_counter()
        base = len(seq)
        # greedy without penalties: the target's argmax per row is all the check needs
        best = sampler.p.argmax_only and matcher is None
        logits = eng.step([seq], [[pending] + drafts], all_logits=True, argmax=best)
        live = None
        if matcher is not None:
            masks = np.empty((k + 1, matcher.n_words), np.uint32)
            matcher.fill_masks(masks, drafts)
            apply_mask(logits, masks)
            live = masks.any(axis=1)
            if not live[0]:
                raise ConstraintDead(matcher.error or "the grammar allows no further token")
        t2 = time.perf_counter()
        out = []
        hist = list(history)
        for i, d in enumerate(drafts):
            if live is not None and not live[i]:
                break           # nothing may follow: the next round's mask says so
            if best:
                t = int(logits[i])
                ok = t == d
            elif sampler.p.greedy:
                t = sampler.sample(logits[i], hist)
                ok = t == d
            else:
                ok, t = accept_or_resample(sampler.probs(logits[i], hist), qs[i], d, rng)
            out.append(t)
            hist.append(t)
            if not ok:
                break
        else:
            if live is None or live[k]:
                out.append(int(logits[k]) if best else sampler.sample(logits[k], hist))
        n_acc = len(out) - 1
        eng.cache.truncate(seq, base + 1 + n_acc)
        # the draft holds history + drafts[:k-1]; keep what the target accepted
        self.draft.cache.truncate(self.dseq, min(len(self.dseq), len(history) + n_acc))
        ctl.observe_round(k, n_acc, per_draft, t2 - t1, catch_s=first,
                          round_s=t2 - t0 if first is not None else None,
                          timed=eng.setup_events + self.draft.setup_events == ev)
        st.drafted += k; st.accepted += n_acc
        st.verify_forwards += 1; st.emitted += len(out)
        st.draft_seconds += t1 - t0; st.verify_seconds += t2 - t1
        st.k_rounds[k] = st.k_rounds.get(k, 0) + 1
        return out

    def finish(self, seq: Sequence, n_fed: int) -> None:
        """After the caller stopped: roll the target back so that at most n_fed ids
        (prompt + emitted) have been fed (tokens accepted but never emitted must
        not stay in a reused sequence).  Counted in seq.history, which a context
        shift does not shorten."""
        extra = len(getattr(seq, "history", seq.tokens)) - n_fed
        if extra > 0:
            self.target.cache.truncate(seq, len(seq) - extra)
