"""A CPU emulation of tests/lab/mma4k.cu's Q4_K kernels (and of mma4k_w, the CTA-wide one in
tests/lab/pending/mma-decode.diff's qmma.cuh), thread by thread (each MMA assembled
from the 32 threads' fragment registers as the PTX ISA lays them out), set against an
emulation of the product's mvk4k (quant/cuda/qmvk.cuh, LPB 4): lane classes, dp4a / dp2a
integers, its float FMAs and the warp's butterfly.  Both use one correctly rounded fmaf, so
equal results mean the kernels take mvk4k's operations in mvk4k's order; a float64 dot of the
dequantized weights says both compute the product at all.  It checks the kernels' indexing
and order before a GPU runs them (their first GPU run is lab.mma4k).

    PYTHONPATH=tests python -m lab.mma4k_emul
"""
from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

f32 = np.float32


def fmaf(a, b, c) -> np.float32:
    """a * b + c rounded once to float32 (round half to even), as the GPU's fmaf."""
    a, b, c = float(a), float(b), float(c)
    exact = Fraction(a) * Fraction(b) + Fraction(c)
    if exact == 0:
        # IEEE: x*y + z with an exact zero sum is +0 unless both terms are -0 / negative zero
        return f32(a * b + c)
    m, e = math.frexp(float(exact))                 # |exact| ~ 2^e (float64 guess, maybe off by one)
    e = max(e, -125)                                # float32 subnormals: a fixed quantum below
    q = Fraction(2) ** (e - 24)                     # the float32 quantum at that exponent
    n = exact / q
    r = math.floor(n)
    frac = n - r
    if frac > Fraction(1, 2) or (frac == Fraction(1, 2) and r % 2 == 1):
        r += 1
    v = r * q
    if abs(r) >= 1 << 24 and e > -125:              # the guess was one too low: round again
        q2 = q * 2
        n2 = exact / q2
        r2 = math.floor(n2)
        fr2 = n2 - r2
        if fr2 > Fraction(1, 2) or (fr2 == Fraction(1, 2) and r2 % 2 == 1):
            r2 += 1
        v = r2 * q2
    return f32(float(v))


def fmul(a, b):
    return f32(f32(a) * f32(b))


def fadd(a, b):
    return f32(f32(a) + f32(b))


def half(u16) -> np.float32:
    return f32(np.array([u16], np.uint16).view(np.float16)[0])


def s8(v):
    v &= 0xFF
    return v - 256 if v >= 128 else v


def s16(v):
    v &= 0xFFFF
    return v - 65536 if v >= 32768 else v


def dp4a(a: int, b: int, c: int, a_unsigned=False) -> int:
    s = c
    for i in range(4):
        x = (a >> (8 * i)) & 0xFF
        s += (x if a_unsigned else s8(x)) * s8(b >> (8 * i))
    return s


def u32_at(buf: np.ndarray, off: int) -> int:
    return int(buf[off:off + 4].view(np.uint32)[0])


def k4_scale(Y, Z, W, s, mn):
    lo = (Z & 0x3F3F3F3F) if mn else (Y & 0x3F3F3F3F)
    hi = ((((W >> 4) & 0x0F0F0F0F) | ((Z >> 2) & 0x30303030)) if mn
          else ((W & 0x0F0F0F0F) | ((Y >> 2) & 0x30303030)))
    return ((lo if s < 4 else hi) >> (8 * (s & 3))) & 0xFF


def butterfly(vals):
    v = list(vals)
    o = 16
    while o:
        v = [fadd(v[L], v[L ^ o]) for L in range(32)]
        o >>= 1
    return v[0]


# ---------------------------------------------------------------- mvk4k (the reference)
def mvk4k(Wb, xq, xd, xi, m, n, K):
    """Output m, row n of mvk4k (LPB 4): Wb uint8 [M, row_bytes], xq int8 [N, K], xd float32
    [N, K/256], xi int16 [N, K/16] (q8_act's layout)."""
    nb = K // 256
    nst = (nb + 7) // 8
    accs = []
    for L in range(32):
        q, j = L // 4, L % 4
        sh = 16 * (j >> 1)
        acc = f32(0)
        for it in range(nst):
            blk0 = it * 8 + q
            blk = min(blk0, nb - 1)
            b = Wb[m, blk * 144:(blk + 1) * 144]
            hx, Y, Z, Wd = (u32_at(b, 4 * i) for i in range(4))
            Y, Z, Wd = Y >> sh, Z >> sh, Wd >> sh
            s_lo, m_lo = Y & 0x3F3F3F3F, Z & 0x3F3F3F3F
            s_hi = (Wd & 0x0F0F0F0F) | ((Y >> 2) & 0x30303030)
            m_hi = ((Wd >> 4) & 0x0F0F0F0F) | ((Z >> 2) & 0x30303030)
            d, dm = half(hx & 0xFFFF), half(hx >> 16)
            xdv = xd[n, blk] if blk0 < nb else f32(0)
            I = M_ = 0
            for i in range(2):
                k = j + 4 * i
                e = blk * 256 + 64 * (k >> 1) + 16 * (k & 1)
                xw0 = [u32_at(xq[n].view(np.uint8), e + 4 * kk) for kk in range(4)]
                xw1 = [u32_at(xq[n].view(np.uint8), e + 32 + 4 * kk) for kk in range(4)]
                sl = sh4 = 0
                for kk in range(4):
                    qw = u32_at(b, 16 + 16 * k + 4 * kk)
                    sl = dp4a(qw & 0x0F0F0F0F, xw0[kk], sl)
                    sh4 = dp4a(qw & 0xF0F0F0F0, xw1[kk], sh4, a_unsigned=True)
                lo16, hi16 = s16(sl), s16(sh4 >> 4)
                sw, mw = (s_hi, m_hi) if i == 1 else (s_lo, m_lo)
                I += lo16 * s8(sw) + hi16 * s8(sw >> 8)
                bs = xi[n, blk * 16 + 4 * j + 2 * i: blk * 16 + 4 * j + 2 * i + 2]
                M_ += int(bs[0]) * s8(mw) + int(bs[1]) * s8(mw >> 8)
            acc = fmaf(fmul(d, xdv), f32(I), acc)
            acc = fmaf(-fmul(dm, xdv), f32(M_), acc)
        accs.append(acc)
    return butterfly(accs)


# ---------------------------------------------------------------- MMA fragments (PTX ISA)
def mma_s8_m16n8k16(regs_a, regs_b, regs_c):
    """regs_a[lane] = (a0, a1) u32 of 4 s8 each, regs_b[lane] = b0, regs_c[lane] = [c0..c3];
    returns the new c of every lane."""
    A = np.zeros((16, 16), np.int64)
    B = np.zeros((16, 8), np.int64)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        a0, a1 = regs_a[lane]
        for i in range(4):
            A[g, 4 * t + i] = s8(a0 >> (8 * i))
            A[g + 8, 4 * t + i] = s8(a1 >> (8 * i))
            B[4 * t + i, g] = s8(regs_b[lane] >> (8 * i))
    D = A @ B
    out = []
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        c = regs_c[lane]
        out.append([c[0] + int(D[g, 2 * t]), c[1] + int(D[g, 2 * t + 1]),
                    c[2] + int(D[g + 8, 2 * t]), c[3] + int(D[g + 8, 2 * t + 1])])
    return out


def h2(u32):
    """A half2 register as two exact values (low, high)."""
    a = np.array([u32 & 0xFFFF, u32 >> 16], np.uint16).view(np.float16)
    return Fraction(float(a[0])), Fraction(float(a[1]))


def mma_f16_m16n8k16(regs_a, regs_b, regs_c):
    """f16 operands, fp32 accumulators, computed exactly (the question lab.mma_exact asks the
    hardware): regs_a[lane] = (a0, a1, a2, a3) half2, regs_b[lane] = (b0, b1) half2."""
    A = [[Fraction(0)] * 16 for _ in range(16)]
    B = [[Fraction(0)] * 8 for _ in range(16)]
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        a0, a1, a2, a3 = regs_a[lane]
        b0, b1 = regs_b[lane]
        A[g][2 * t], A[g][2 * t + 1] = h2(a0)
        A[g + 8][2 * t], A[g + 8][2 * t + 1] = h2(a1)
        A[g][2 * t + 8], A[g][2 * t + 9] = h2(a2)
        A[g + 8][2 * t + 8], A[g + 8][2 * t + 9] = h2(a3)
        B[2 * t][g], B[2 * t + 1][g] = h2(b0)
        B[2 * t + 8][g], B[2 * t + 9][g] = h2(b1)
    out = []
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        c = regs_c[lane]
        res = []
        for e, (r, col) in enumerate(((g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1))):
            s = Fraction(float(c[e])) + sum(A[r][k] * B[k][col] for k in range(16))
            assert s.denominator == 1 and abs(s) < 1 << 24, "an integer fp32 holds"
            res.append(f32(float(s)))
        out.append(res)
    return out


QORD = (0, 4, 2, 6, 1, 5, 3, 7)


def _fold(stk, qi, a):
    """mma4k's butterfly stack for one C element: stk = [level 0, 1, 2]."""
    if qi % 2 == 0:
        stk[0] = a
    else:
        p = fadd(stk[0], a)
        if qi % 4 == 1:
            stk[1] = p
        else:
            c = fadd(stk[1], p)
            stk[2] = c if qi == 3 else fadd(stk[2], c)


def _fold4(st, si, a):
    """_fold for a walk of 4 slots (0, 2, 1, 3): st = [the pending slot, the sum]."""
    if si in (0, 2):
        st[0] = a
    elif si == 1:
        st[1] = fadd(st[0], a)
    else:
        st[1] = fadd(st[1], fadd(st[0], a))


def _hdr(Wb, row, blk):
    b = Wb[row, blk * 144:(blk + 1) * 144]
    return b, [u32_at(b, 4 * i) for i in range(4)]


def _lanes(M, n, o0, r0):
    """A warp's lanes with each one's (g, t), the output it holds B for and its two A rows
    (clamped as the kernels clamp them: read, never stored)."""
    L = range(32)
    g = [l >> 2 for l in L]
    t = [l & 3 for l in L]
    wrow = [min(o0 + g[l], M - 1) for l in L]
    ra = [min(r0 + g[l], n - 1) for l in L]
    rb = [min(r0 + g[l] + 8, n - 1) for l in L]
    return L, g, t, wrow, ra, rb


def _pieces_out(stk, g, t, M, n, o0, r0):
    """pieces_sum and store4: each lane's 4 C elements from its per-piece stacks [j][e][level]."""
    out = {}
    for l in range(32):
        for e in range(4):
            r = fadd(fadd(stk[l][0][e][2], stk[l][2][e][2]), fadd(stk[l][1][e][2], stk[l][3][e][2]))
            row, col = r0 + g[l] + 8 * (e >> 1), o0 + 2 * t[l] + (e & 1)
            if row < n and col < M:
                out[(row, col)] = r
    return out


def _block_fmas(hx, xda, xdb, I, Mn, acc):
    """mvk4k's two FMAs a block and piece, for a lane's 4 C elements: hx the first header words
    of outputs 2t and 2t + 1 (d, dmin), xda / xdb rows g's and g + 8's scales, I / Mn float32."""
    d = (half(hx[0] & 0xFFFF), half(hx[1] & 0xFFFF))
    m = (half(hx[0] >> 16), half(hx[1] >> 16))
    for e in range(4):
        xv = xda if e < 2 else xdb
        acc[e] = fmaf(fmul(d[e & 1], xv), I[e], acc[e])
        acc[e] = fmaf(-fmul(m[e & 1], xv), Mn[e], acc[e])


# ---------------------------------------------------------------- mma4k_i8, one warp
def _slot_acc(Wb, xq, xd, xi, M, K, n, o0, r0, q):
    """A warp's class sums of block slot q (blocks q, q + 8, ...), as mma4k's walk makes them
    for that slot: [lane][piece j][C element e]."""
    nb, nst = K // 256, (K // 256 + 7) // 8
    xb8 = xq.view(np.uint8)
    L, g, t, wrow, ra, rb = _lanes(M, n, o0, r0)
    acc = [[[f32(0)] * 4 for _ in range(4)] for _ in L]
    for it in range(nst):
        blk0 = it * 8 + q
        blk, ok = min(blk0, nb - 1), blk0 < nb
        hs = [_hdr(Wb, wrow[l], blk) for l in L]
        hh = [[hs[8 * t[l] + 4 * u][1] for u in range(2)] for l in L]        # the shuffles
        for j in range(4):
            I = [[0] * 4 for _ in L]
            Mn = [[0] * 4 for _ in L]
            for w in range(2):
                k = j + 4 * w
                gg, hf = k >> 1, k & 1
                for f in range(2):
                    s = 2 * gg + f
                    ra_regs, rb_regs = [], []
                    for l in L:
                        e0 = blk * 256 + 64 * gg + 16 * hf + 4 * t[l]
                        qv = u32_at(hs[l][0], 16 + 16 * k + 4 * t[l])
                        ra_regs.append((u32_at(xb8[ra[l]], e0 + 32 * f), u32_at(xb8[rb[l]], e0 + 32 * f)))
                        rb_regs.append(((qv >> 4) if f else qv) & 0x0F0F0F0F)
                    S = mma_s8_m16n8k16(ra_regs, rb_regs, [[0] * 4 for _ in L])
                    for l in L:
                        sc = [k4_scale(*hh[l][u][1:], s, False) for u in range(2)]
                        mn = [k4_scale(*hh[l][u][1:], s, True) for u in range(2)]
                        ba = int(xi[ra[l], blk * 16 + 4 * j + 2 * w + f])
                        bb = int(xi[rb[l], blk * 16 + 4 * j + 2 * w + f])
                        for e in range(4):
                            I[l][e] += sc[e & 1] * S[l][e]
                            Mn[l][e] += mn[e & 1] * (ba if e < 2 else bb)
            for l in L:
                _block_fmas((hh[l][0][0], hh[l][1][0]), xd[ra[l], blk] if ok else f32(0),
                            xd[rb[l], blk] if ok else f32(0), [f32(v) for v in I[l]], [f32(v) for v in Mn[l]],
                            acc[l][j])
    return acc


def mma4k_i8(Wb, xq, xd, xi, M, K, n, o0, r0):
    L, g, t, *_ = _lanes(M, n, o0, r0)
    stk = [[[[None] * 3 for _ in range(4)] for _ in range(4)] for _ in L]     # [lane][j][e][level]
    for qi, q in enumerate(QORD):
        acc = _slot_acc(Wb, xq, xd, xi, M, K, n, o0, r0, q)
        for l in L:
            for j in range(4):
                for e in range(4):
                    _fold(stk[l][j][e], qi, acc[l][j][e])
    return _pieces_out(stk, g, t, M, n, o0, r0)


# ---------------------------------------------------------------- the CTA kernels (_w)
def _cta(slot_acc, n_slots, M, n, o0, r0, total):
    """One CTA of a _w kernel: warp q of n_slots takes slot q for two 8-output tiles (o0, o0 + 8;
    slot_acc(o0, q) -> [lane][chain][C element]); shared memory part[q][chain][output * 16 + row]
    (C element e of tile c: row g + 8 (e >> 1), output 8c + 2t + (e & 1)); thread i adds its
    element's sums, total(P) with P[q][chain]."""
    part = [None] * n_slots
    for q in range(n_slots):
        for c in range(2):
            acc = slot_acc(o0 + 8 * c, q)
            if part[q] is None:
                part[q] = [[None] * 256 for _ in acc[0]]
            for l in range(32):
                g, t = l >> 2, l & 3
                for j, chain in enumerate(acc[l]):
                    for e in range(4):
                        part[q][j][(8 * c + 2 * t + (e & 1)) * 16 + g + 8 * (e >> 1)] = chain[e]
    out = {}
    for i in range(256):
        col, row = o0 + (i >> 4), r0 + (i & 15)
        if row < n and col < M:
            out[(row, col)] = total([[ch[i] for ch in sl] for sl in part])
    return out


def mma4k_w(Wb, xq, xd, xi, M, K, n, o0, r0):
    """mma4k_w (qmma.cuh, tests/lab/pending/mma-decode.diff): 8 slots, 4 pieces; over q as
    _fold adds them, then the pieces."""
    def total(P):
        S = [fadd(fadd(fadd(P[0][j], P[4][j]), fadd(P[2][j], P[6][j])),
                  fadd(fadd(P[1][j], P[5][j]), fadd(P[3][j], P[7][j]))) for j in range(4)]
        return fadd(fadd(S[0], S[2]), fadd(S[1], S[3]))
    return _cta(lambda o, q: _slot_acc(Wb, xq, xd, xi, M, K, n, o, r0, q), 8, M, n, o0, r0, total)


# ---------------------------------------------------------------- mma4k_t<NT>, one warp
def _nib_h2(v, sc):
    """nib_h2: 4 nibbles (bit 0 of each byte) times sc as two half2 registers (exact)."""
    q = [(v >> (8 * i)) & 0xF for i in range(4)]
    return _h2pack(q[0] * sc, q[1] * sc), _h2pack(q[2] * sc, q[3] * sc)


def _h2pack(a, b):
    return int(np.array([a, b], np.float16).view(np.uint32)[0])


def mma4k_t(Wb, x16, xd, bs16, M, K, n, o0, r0, NT):
    nb, nst = K // 256, (K // 256 + 7) // 8
    L, g, t, _, ra, rb = _lanes(M, n, o0, r0)
    wrow = [[min(o0 + 8 * nt + g[l], M - 1) for nt in range(NT)] for l in L]
    x16u = x16.view(np.uint16)
    bsu = bs16.view(np.uint16)
    u32h = lambda arr, row, off: int(arr[row, off:off + 2].view(np.uint32)[0])   # 2 halves
    res = [[[[None, None] for _ in range(4)] for _ in range(NT)] for _ in L]
    for ji, j in enumerate((0, 2, 1, 3)):
        stk = [[[[None] * 3 for _ in range(4)] for _ in range(NT)] for _ in L]
        for qi, q in enumerate(QORD):
            acc = [[[f32(0)] * 4 for _ in range(NT)] for _ in L]
            for it in range(nst):
                blk0 = it * 8 + q
                blk, ok = min(blk0, nb - 1), blk0 < nb
                A = [[None] * 4 for _ in L]
                for l in L:
                    for w in range(2):
                        for f in range(2):
                            k = j + 4 * w
                            e0 = blk * 256 + 64 * (k >> 1) + 16 * (k & 1) + 32 * f + 4 * t[l]
                            A[l][2 * w + f] = (u32h(x16u, ra[l], e0), u32h(x16u, rb[l], e0),
                                               u32h(x16u, ra[l], e0 + 2), u32h(x16u, rb[l], e0 + 2))
                am = []
                for l in L:
                    if t[l] == 0:
                        o = blk * 16 + 4 * j
                        am.append((u32h(bsu, ra[l], o), u32h(bsu, rb[l], o), u32h(bsu, ra[l], o + 2),
                                   u32h(bsu, rb[l], o + 2)))
                    else:
                        am.append((0, 0, 0, 0))
                for nt in range(NT):
                    hs = [_hdr(Wb, wrow[l][nt], blk) for l in L]
                    cI = [[f32(0)] * 4 for _ in L]
                    for w in range(2):
                        k = j + 4 * w
                        gg = k >> 1
                        for f in range(2):
                            bregs = []
                            for l in L:
                                h = hs[l][1]
                                qv = u32_at(hs[l][0], 16 + 16 * k + 4 * t[l])
                                sc = k4_scale(h[1], h[2], h[3], 2 * gg + f, False)
                                bregs.append(_nib_h2((qv >> 4) if f else qv, sc))
                            cI = mma_f16_m16n8k16([A[l][2 * w + f] for l in L], bregs, cI)
                    bm = []
                    for l in L:
                        h = hs[l][1]
                        if t[l] == 0:
                            s0 = 2 * (j >> 1)
                            mn = [k4_scale(h[1], h[2], h[3], s, True) for s in (s0, s0 + 1, s0 + 4, s0 + 5)]
                            bm.append((_h2pack(mn[0], mn[1]), _h2pack(mn[2], mn[3])))
                        else:
                            bm.append((0, 0))
                    cM = mma_f16_m16n8k16(am, bm, [[f32(0)] * 4 for _ in L])
                    for l in L:
                        _block_fmas((hs[8 * t[l]][1][0], hs[8 * t[l] + 4][1][0]), xd[ra[l], blk] if ok else f32(0),
                                    xd[rb[l], blk] if ok else f32(0), cI[l], cM[l], acc[l][nt])
            for l in L:
                for nt in range(NT):
                    for e in range(4):
                        _fold(stk[l][nt][e], qi, acc[l][nt][e])
        for l in L:
            for nt in range(NT):
                for e in range(4):
                    _fold4(res[l][nt][e], ji, stk[l][nt][e][2])
    out = {}
    for l in L:
        for nt in range(NT):
            for e in range(4):
                row, col = r0 + g[l] + 8 * (e >> 1), o0 + 8 * nt + 2 * t[l] + (e & 1)
                if row < n and col < M:
                    out[(row, col)] = res[l][nt][e][1]
    return out


# ---------------------------------------------------------------- Q6_K: mvs's order
def _vsub4_32(v):
    """__vsub4(v, 0x20202020): each byte less 32, modulo 256."""
    return sum(((((v >> (8 * i)) & 0xFF) - 32) & 0xFF) << (8 * i) for i in range(4))


def _q6_run(b, part, u):
    """The 8 codes (q - 32) of run u of a Q6_K part (IQ6_K::decode_i8's), and its scale index."""
    h, l0 = part >> 2, 8 * (part & 3)
    ql = b[64 * h + 32 * (u & 1) + l0: 64 * h + 32 * (u & 1) + l0 + 8].astype(np.int64)
    qh = b[128 + 32 * h + l0: 128 + 32 * h + l0 + 8].astype(np.int64)
    q = ((ql >> (4 if u >= 2 else 0)) & 0xF) | (((qh >> (2 * u)) & 3) << 4)
    return q - 32, 8 * h + (l0 >> 4) + 2 * u


def mvs6k(Wb, xq, xd, m, n, K):
    """Output m, row n of mvs<IQ6_K>: lane l adds parts 32 c + l (chunks c in order), each
    part t = fmaf(d * scale_u, si_u, t) over its 4 runs then acc = fmaf(t, xd, acc); butterfly."""
    nb = K // 256
    nparts = nb * 8
    accs = []
    for l in range(32):
        acc = f32(0)
        for c in range((K + 1023) // 1024):
            gp = 32 * c + l
            if gp >= nparts:
                continue
            blk, part = gp // 8, gp % 8
            b = Wb[m, blk * 210:(blk + 1) * 210]
            d = half(int(b[208]) | (int(b[209]) << 8))
            tt = f32(0)
            for u in range(4):
                q, si_ = _q6_run(b, part, u)
                e0 = blk * 256 + 128 * (part >> 2) + 32 * u + 8 * (part & 3)
                sv = int((q * xq[n, e0:e0 + 8].astype(np.int64)).sum())
                tt = fmaf(fmul(d, f32(s8(int(b[192 + si_])))), f32(sv), tt)
            acc = fmaf(tt, xd[n, blk], acc)
        accs.append(acc)
    return butterfly(accs)


SORD = (0, 2, 1, 3)


def _slot_acc6(Wb, xq, xd, M, K, n, o0, r0, s):
    """A warp's part sums of block slot s (blocks s, s + 4, ...), as mma6k_s makes them for
    that slot: [lane][part p][C element e]."""
    nb = K // 256
    L, g, t, wrow, ra, rb = _lanes(M, n, o0, r0)
    crow = [[min(o0 + 2 * t[l] + u, M - 1) for u in range(2)] for l in L]
    xb8 = xq.view(np.uint8)
    blkb = lambda row, blk: Wb[row, blk * 210:(blk + 1) * 210]
    acc = [[[f32(0)] * 4 for _ in range(8)] for _ in L]
    for c in range((nb + 3) // 4):
        blk = 4 * c + s
        if blk >= nb:
            break
        for p in range(8):
            h, l0 = p >> 2, 8 * (p & 3)
            tt = [[f32(0)] * 4 for _ in L]
            for u in range(4):
                ar, br = [], []
                for l in L:
                    if t[l] < 2:
                        e0 = blk * 256 + 128 * h + 32 * u + l0 + 4 * t[l]
                        ar.append((u32_at(xb8[ra[l]], e0), u32_at(xb8[rb[l]], e0)))
                        b = blkb(wrow[l], blk)
                        ql = u32_at(b, 64 * h + 32 * (u & 1) + l0 + 4 * t[l])
                        qh = u32_at(b, 128 + 32 * h + l0 + 4 * t[l])
                        q6 = ((ql >> (4 if u >= 2 else 0)) & 0x0F0F0F0F) | (((qh >> (2 * u)) & 0x03030303) << 4)
                        br.append(_vsub4_32(q6))
                    else:
                        ar.append((0, 0))
                        br.append(0)
                S = mma_s8_m16n8k16(ar, br, [[0] * 4 for _ in L])
                si_ = 8 * h + (l0 >> 4) + 2 * u
                for l in L:
                    for e in range(4):
                        cb = blkb(crow[l][e & 1], blk)
                        d = half(int(cb[208]) | (int(cb[209]) << 8))
                        sc = fmul(d, f32(s8(int(cb[192 + si_]))))
                        tt[l][e] = fmaf(sc, f32(S[l][e]), tt[l][e])
            for l in L:
                for e in range(4):
                    xv = xd[ra[l], blk] if e < 2 else xd[rb[l], blk]
                    acc[l][p][e] = fmaf(tt[l][e], xv, acc[l][p][e])
    return acc


def _parts_tree(v):
    """mvs's butterfly over the 8 parts (lane xor 4, 2, 1)."""
    return fadd(fadd(fadd(v[0], v[4]), fadd(v[2], v[6])), fadd(fadd(v[1], v[5]), fadd(v[3], v[7])))


def mma6k_s(Wb, xq, xd, M, K, n, o0, r0):
    """One warp of mma6k_s (tests/lab/mma4k.cu), thread by thread."""
    L, g, t, *_ = _lanes(M, n, o0, r0)
    v2 = [[[[None, None] for _ in range(4)] for _ in range(8)] for _ in L]
    for si, s in enumerate(SORD):
        acc = _slot_acc6(Wb, xq, xd, M, K, n, o0, r0, s)
        for l in L:
            for p in range(8):
                for e in range(4):
                    _fold4(v2[l][p][e], si, acc[l][p][e])
    out = {}
    for l in L:
        for e in range(4):
            r = _parts_tree([v2[l][p][e][1] for p in range(8)])
            row, col = r0 + g[l] + 8 * (e >> 1), o0 + 2 * t[l] + (e & 1)
            if row < n and col < M:
                out[(row, col)] = r
    return out


def mma6k_s_w(Wb, xq, xd, M, K, n, o0, r0):
    """mma6k_s_w (qmma.cuh, tests/lab/pending/mma-decode.diff): 4 slots, 8 parts; over s as
    _fold4 adds them, then the parts' tree."""
    def total(P):
        return _parts_tree([fadd(fadd(P[0][p], P[2][p]), fadd(P[1][p], P[3][p])) for p in range(8)])
    return _cta(lambda o, s: _slot_acc6(Wb, xq, xd, M, K, n, o, r0, s), 4, M, n, o0, r0, total)


def check6(M=8, K=1280, n=9, seed=0, order="mvs"):
    """Outputs of mma6k_s (order "mvs"), mma6k_s_w ("mvs_w") or mma6k_k ("mvkt") differing from the product
    kernel of that order, and its distance from float64."""
    from quant import GGMLType, QTensor
    from quant.dequant import dequantize
    from quant.encode import quantize
    rng = np.random.default_rng(seed)
    Wb = np.ascontiguousarray(quantize(rng.standard_normal((M, K)).astype(np.float32) * 0.05, GGMLType.Q6_K))
    Wb = Wb.reshape(M, -1).view(np.uint8)
    xq = rng.integers(-127, 128, (n, K)).astype(np.int8)
    xd = (rng.random((n, K // 256)) * 0.02 + 1e-3).astype(np.float32)
    refk, kern = {"mvs": (mvs6k, mma6k_s), "mvs_w": (mvs6k, mma6k_s_w), "mvkt": (mvkt6, mma6k_k)}[order]
    ref = {(r, m): refk(Wb, xq, xd, m, r, K) for r in range(n) for m in range(M)}
    Wf = dequantize(QTensor("w", GGMLType.Q6_K, (M, K), Wb)).astype(np.float64)
    f64 = (xq.astype(np.float64) * np.repeat(xd.astype(np.float64), 256, axis=1)) @ Wf.T
    dist = max(abs(float(ref[k]) - f64[k]) for k in ref) / np.abs(f64).max()
    got = {}
    for r0 in range(0, n, 16):
        for o0 in range(0, M, 16 if order == "mvs_w" else 8):
            got.update(kern(Wb, xq, xd, M, K, n, o0, r0))
    assert set(got) == set(ref)
    bad = sum(1 for k in ref if np.float32(got[k]).view(np.uint32) != np.float32(ref[k]).view(np.uint32))
    return bad, dist


# ---------------------------------------------------------------- Q6_K: mvkt's order
def _q6k_piece_run(b, j, r):
    """mvkt's MQ6_K: the 16 codes (q - 32) of run r of piece j, and its scale byte's offset."""
    h, l0 = j >> 1, 16 * (j & 1)
    ql = b[64 * h + 32 * (r & 1) + l0: 64 * h + 32 * (r & 1) + l0 + 16].astype(np.int64)
    qe = b[128 + 32 * h + l0: 128 + 32 * h + l0 + 16].astype(np.int64)
    q = ((ql >> (4 * (r >> 1))) & 0xF) | (((qe >> (2 * r)) & 3) << 4)
    return q - 32, 192 + 8 * h + (j & 1) + 2 * r


def mvkt6(Wb, xq, xd, m, n, K):
    """Output m, row n of mvkt<MQ6_K>: mvk4k's lane classes, Y = sum_t sc_t sum (q - 32) x per
    block and piece, acc = fmaf(d * xd, Y, acc), the butterfly."""
    nb = K // 256
    nst = (nb + 7) // 8
    accs = []
    for L in range(32):
        q, j = L // 4, L % 4
        h, l0 = j >> 1, 16 * (j & 1)
        acc = f32(0)
        for it in range(nst):
            blk0 = it * 8 + q
            blk = min(blk0, nb - 1)
            b = Wb[m, blk * 210:(blk + 1) * 210]
            d = half(int(b[208]) | (int(b[209]) << 8))
            xdv = xd[n, blk] if blk0 < nb else f32(0)
            Y = 0
            for r in range(4):
                qq, so = _q6k_piece_run(b, j, r)
                e0 = blk * 256 + 128 * h + l0 + 32 * r
                Y += s8(int(b[so])) * int((qq * xq[n, e0:e0 + 16].astype(np.int64)).sum())
            acc = fmaf(fmul(d, xdv), f32(Y), acc)
        accs.append(acc)
    return butterfly(accs)


def mma6k_k(Wb, xq, xd, M, K, n, o0, r0):
    """One warp of mma6k_k (tests/lab/mma4k.cu), thread by thread."""
    nb, nst = K // 256, (K // 256 + 7) // 8
    L, g, t, wrow, ra, rb = _lanes(M, n, o0, r0)
    crow = [[min(o0 + 2 * t[l] + u, M - 1) for u in range(2)] for l in L]
    xb8 = xq.view(np.uint8)
    blkb = lambda row, blk: Wb[row, blk * 210:(blk + 1) * 210]
    stk = [[[[None] * 3 for _ in range(4)] for _ in range(4)] for _ in L]
    for qi, q in enumerate(QORD):
        acc = [[[f32(0)] * 4 for _ in range(4)] for _ in L]
        for it in range(nst):
            blk0 = it * 8 + q
            blk, ok = min(blk0, nb - 1), blk0 < nb
            for j in range(4):
                h, l0 = j >> 1, 16 * (j & 1)
                Y = [[0] * 4 for _ in L]
                for r in range(4):
                    ar, br = [], []
                    for l in L:
                        b = blkb(wrow[l], blk)
                        Q = u32_at(b, 64 * h + 32 * (r & 1) + l0 + 4 * t[l])
                        qe = u32_at(b, 128 + 32 * h + l0 + 4 * t[l])
                        q6 = ((Q >> (4 * (r >> 1))) & 0x0F0F0F0F) | (((qe >> (2 * r)) & 0x03030303) << 4)
                        e0 = blk * 256 + 128 * h + l0 + 32 * r + 4 * t[l]
                        ar.append((u32_at(xb8[ra[l]], e0), u32_at(xb8[rb[l]], e0)))
                        br.append(_vsub4_32(q6))
                    S = mma_s8_m16n8k16(ar, br, [[0] * 4 for _ in L])
                    so = 192 + 8 * h + (j & 1) + 2 * r
                    for l in L:
                        for e in range(4):
                            Y[l][e] += s8(int(blkb(crow[l][e & 1], blk)[so])) * S[l][e]
                for l in L:
                    for e in range(4):
                        cb = blkb(crow[l][e & 1], blk)
                        d = half(int(cb[208]) | (int(cb[209]) << 8))
                        xv = (xd[ra[l], blk] if e < 2 else xd[rb[l], blk]) if ok else f32(0)
                        acc[l][j][e] = fmaf(fmul(d, xv), f32(Y[l][e]), acc[l][j][e])
        for l in L:
            for j in range(4):
                for e in range(4):
                    _fold(stk[l][j][e], qi, acc[l][j][e])
    return _pieces_out(stk, g, t, M, n, o0, r0)


# ---------------------------------------------------------------- inputs and the check
def random_inputs(M, K, n, seed=0):
    """Q4_K weights (quant's encoder on random floats), and activations as q8_act leaves them:
    int8 codes, float32 steps, and the int16 run sums in mvk's order."""
    from quant import GGMLType
    from quant.encode import quantize
    rng = np.random.default_rng(seed)
    Wb = quantize(rng.standard_normal((M, K)).astype(np.float32) * 0.05, GGMLType.Q4_K)
    Wb = np.ascontiguousarray(Wb).reshape(M, -1).view(np.uint8)
    xq = rng.integers(-127, 128, (n, K)).astype(np.int8)
    xd = (rng.random((n, K // 256)) * 0.02 + 1e-3).astype(np.float32)
    xi = np.zeros((n, K // 16), np.int16)
    for b in range(K // 256):
        for i in range(16):                       # run i = 8t + 4g + 2f + h at (2(2g + h) + t) * 2 + f
            tt, gq, f, hq = i >> 3, (i >> 2) & 1, (i >> 1) & 1, i & 1
            xi[:, b * 16 + (2 * (2 * gq + hq) + tt) * 2 + f] = xq[:, b * 256 + 16 * i: b * 256 + 16 * i + 16].sum(1)
    return Wb, xq, xd, xi


def dequant_ref(Wb, xq, xd, M, K):
    from quant import GGMLType, QTensor
    from quant.dequant import dequantize
    W = dequantize(QTensor("w", GGMLType.Q4_K, (M, K), Wb)).astype(np.float64)
    X = xq.astype(np.float64) * np.repeat(xd.astype(np.float64), 256, axis=1)
    return X @ W.T


def check(M=16, K=2304, n=16, kernels=("i8", "w", "t2"), seed=0):
    """{kernel: outputs differing from mvk4k}, and the largest relative distance of mvk4k from
    the float64 product (a sanity bound on both)."""
    Wb, xq, xd, xi = random_inputs(M, K, n, seed)
    ref = {(r, m): mvk4k(Wb, xq, xd, xi, m, r, K) for r in range(n) for m in range(M)}
    f64 = dequant_ref(Wb, xq, xd, M, K)
    scale = np.abs(f64).max()
    dist = max(abs(float(ref[k]) - f64[k]) for k in ref) / scale
    x16 = xq.astype(np.float16)
    bs16 = xi.astype(np.float16)
    bad = {}
    for kern in kernels:
        got = {}
        for r0 in range(0, n, 16):
            if kern == "i8":
                for o0 in range(0, M, 8):
                    got.update(mma4k_i8(Wb, xq, xd, xi, M, K, n, o0, r0))
            elif kern == "w":
                for o0 in range(0, M, 16):
                    got.update(mma4k_w(Wb, xq, xd, xi, M, K, n, o0, r0))
            else:
                NT = int(kern[1:])
                for o0 in range(0, M, 8 * NT):
                    got.update(mma4k_t(Wb, x16, xd, bs16, M, K, n, o0, r0, NT))
        assert set(got) == set(ref), kern
        bad[kern] = sum(1 for k in ref if np.float32(got[k]).view(np.uint32) != np.float32(ref[k]).view(np.uint32))
    return bad, dist


def main() -> int:
    bad, dist = check()
    print(f"mvk4k against the float64 product: largest distance {dist:.2e} of the output scale")
    for k, v in bad.items():
        print(f"{k}: {v} outputs differ from mvk4k")
    bad6, dist6 = check6()
    print(f"mvs<IQ6_K> against the float64 product: {dist6:.2e}; mma6k_s: {bad6} outputs differ from it")
    badk, distk = check6(order="mvkt", K=2304)
    print(f"mvkt<MQ6_K> against the float64 product: {distk:.2e}; mma6k_k: {badk} outputs differ from it")
    return 0 if not any(bad.values()) and not bad6 and not badk else 1


if __name__ == "__main__":
    raise SystemExit(main())
