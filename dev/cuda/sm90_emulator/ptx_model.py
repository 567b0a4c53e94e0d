"""Hardware model of wgmma.mma_async (sm_90a), written from the PTX ISA text, independent of the
kernel under test.

Sources (read for this model):
  PTX ISA 9.7.15.5.1.2.2 "Matrix Descriptor Format": bits 13-0 start addr, 29-16 LBO, 45-32 SBO,
      51-49 base offset, 63-62 swizzle (0 none, 1 128B, 2 64B, 3 32B); encode(x) = (x & 0x3FFFF) >> 4;
      base offset 0 when the repeating pattern starts on a 1024-B boundary (128B swizzle).
  PTX ISA 9.7.15.5.1.2.1.3 "Canonical Layouts" (CuTe notation, T = 128 / bits(elem) = 8 for 16-bit):
      K-major  128B: Swizzle<3,4,3> o ((8,m),(T,2k)) : ((8T,SBO),(1,T))
      MN-major 128B: Swizzle<3,4,3> o ((T,8,m),(8,k)) : ((1,T,LBO),(8T,SBO))
  PTX ISA 9.7.15.5.1.2.1.1/.2 LBO/SBO definitions (K-major swizzled: LBO unused, SBO = next 8 rows;
      MN-major swizzled: LBO = next (swizzle-bytes/16) 128-bit rows i.e. next 64 fp16 along MN,
      SBO = next 8 columns along K).
  PTX ISA 9.7.15.5.1.2: imm-trans-a/b = 0 -> K-major, 1 -> M-/N-major.
  PTX ISA 9.7.15.5.1.1.1 "Matrix Fragments for wgmma .m64nNk16": A in four .f16x2 registers holding
      a0..a7 low to high; D f32 in N/2 registers d0..; the per-thread placement is in figures 148/149
      (images). Their text equivalent used here is CUTLASS cute/atom/mma_traits_sm90_gmma.hpp:
      CLayout_64xN = ((4,8,4),(2,2,N/8)) : ((128,1,16),(64,8,512)), ALayout_64x16 = CLayout_64x16,
      i.e. a CuTe (thread, value) -> column-major (M x N) index map, evaluated generically below.
  Swizzle<3,4,3> on byte addresses: bits [6:4] ^= bits [9:7] (absolute address; base offset 0).
"""
import numpy as np


# ----------------------------------------------------------------------------- descriptor
def decode_descriptor(desc):
    desc = int(desc)
    return dict(
        start=(desc & 0x3FFF) << 4,
        lbo=((desc >> 16) & 0x3FFF) << 4,
        sbo=((desc >> 32) & 0x3FFF) << 4,
        base_offset=(desc >> 49) & 0x7,
        layout=(desc >> 62) & 0x3,
        reserved_bits=desc & ~((0x3FFF) | (0x3FFF << 16) | (0x3FFF << 32) | (0x7 << 49) | (0x3 << 62)),
    )


def swizzle128(addr):
    """Swizzle<3,4,3> on byte addresses (absolute, base_offset = 0)."""
    addr = np.asarray(addr, dtype=np.int64)
    return addr ^ (((addr >> 7) & 0x7) << 4)


# ----------------------------------------------------------------------------- smem operand maps
ELEM = 2      # bytes per f16/bf16
T = 8         # 128 / 16: elements per 128-bit unit


def kmajor_addresses(desc, rows):
    """Byte address read for element (r, k), r < rows (M for A, N for B), k < 16, K-major operand.
    Canonical 128B K-major: ((8,m),(T,2k)) : ((8T,SBO),(1,T)) in elements; SBO given in bytes."""
    d = decode_descriptor(desc)
    assert d["layout"] == 1, "model only covers 128B swizzle"
    assert d["base_offset"] == 0
    r = np.arange(rows)[:, None]
    k = np.arange(16)[None, :]
    r0, r1 = r % 8, r // 8
    k0, k1 = k % T, k // T
    lin = d["start"] + ELEM * (r0 * 8 * T + k0 * 1 + k1 * T) + r1 * d["sbo"]
    return swizzle128(lin), d


def mnmajor_addresses(desc, ncols):
    """Byte address read for element (k, n), k < 16, n < ncols, MN-major operand.
    Canonical 128B MN-major: ((T,8,m),(8,k)) : ((1,T,LBO),(8T,SBO)); LBO/SBO in bytes."""
    d = decode_descriptor(desc)
    assert d["layout"] == 1, "model only covers 128B swizzle"
    assert d["base_offset"] == 0
    k = np.arange(16)[:, None]
    n = np.arange(ncols)[None, :]
    n0, n1, n2 = n % T, (n // T) % 8, n // (8 * T)
    k0, k1 = k % 8, k // 8
    lin = d["start"] + ELEM * (n0 + n1 * T + k0 * 8 * T) + n2 * d["lbo"] + k1 * d["sbo"]
    return swizzle128(lin), d


# ----------------------------------------------------------------------------- register fragments
def cute_eval(shape, stride, idx):
    """Evaluate a flat CuTe mode (shape tuple, stride tuple) at a linear index (colexicographic)."""
    off = 0
    for s, d in zip(shape, stride):
        off += (idx % s) * d
        idx //= s
    return off


def clayout_64xN(N):
    """(thread, value) -> (row m, col n) of D for wgmma m64nNk16, from CUTLASS CLayout_64xN."""
    tshape, tstride = (4, 8, 4), (128, 1, 16)
    vshape, vstride = (2, 2, N // 8), (64, 8, 512)
    m = np.zeros((128, N // 2), dtype=np.int64)
    n = np.zeros((128, N // 2), dtype=np.int64)
    for tid in range(128):
        for v in range(N // 2):
            off = cute_eval(tshape, tstride, tid) + cute_eval(vshape, vstride, v)
            m[tid, v], n[tid, v] = off % 64, off // 64
    # must be a bijection onto 64 x N
    assert len(set(zip(m.ravel(), n.ravel()))) == 64 * N
    return m, n


def alayout_64x16():
    """(thread, element a0..a7) -> (row m, col k) of the register A operand (ALayout_64x16 = CLayout_64x16)."""
    return clayout_64xN(16)


# ----------------------------------------------------------------------------- number formats
def f32_to_f16_bits(x):
    return np.asarray(x, dtype=np.float32).astype(np.float16).view(np.uint16)


def f16_bits_to_f32(b):
    return np.asarray(b, dtype=np.uint16).view(np.float16).astype(np.float32)


def f32_to_bf16_bits(x):
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    nan = np.isnan(np.asarray(x, dtype=np.float32))
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16  # round to nearest even
    out = rounded.astype(np.uint16)
    out = np.where(nan, np.uint16(0x7FC0), out)
    return out


def bf16_bits_to_f32(b):
    return (np.asarray(b, dtype=np.uint32) << 16).astype(np.uint32).view(np.float32)


class Fmt:
    def __init__(self, name):
        self.name = name
        if name == "f16":
            self.enc, self.dec = f32_to_f16_bits, f16_bits_to_f32
        else:
            self.enc, self.dec = f32_to_bf16_bits, bf16_bits_to_f32

    def round(self, x):
        return self.dec(self.enc(x))


# ----------------------------------------------------------------------------- wgmma
class SmemHazard(Exception):
    pass


def check_shape_f16(N, d_regs=None):
    """PTX ISA 9.7.15.5.1 (wgmma.mma_async, "Matrix shape"): with .f16/.bf16 A and B (dense) the shape is
    .m64nNk16, N = 8, 16, 24, ..., 256, and an f32 D takes N/2 registers per thread (N = 176: 88). Nothing else
    in this model depends on N: clayout_64xN is CUTLASS's CLayout_64xN for any such N (PTX ISA figure "WGMMA
    .m64nNk16 register fragment layout for accumulator matrix D": the 8-column pattern repeated N/8 times), and
    kmajor_addresses / mnmajor_addresses walk N rows / columns through the canonical layouts."""
    assert N % 8 == 0 and 8 <= N <= 256, "wgmma .m64nNk16 with N = %d does not exist" % N
    if d_regs is not None:
        assert np.size(d_regs) == 128 * (N // 2), "D of m64n%dk16 is %d f32 registers per thread" % (N, N // 2)


class Wgmma:
    """Executes wgmma.mma_async on a byte-array shared memory and per-thread register files."""

    def __init__(self, smem, fmt, log=None):
        self.smem = smem          # Smem object
        self.fmt = fmt
        self.log = log if log is not None else []

    def _read_elems(self, addrs):
        addrs = np.asarray(addrs)
        assert (addrs % 2 == 0).all()
        self.smem.check_async_read(addrs)
        lo = self.smem.mem[addrs].astype(np.uint16)
        hi = self.smem.mem[addrs + 1].astype(np.uint16)
        return self.fmt.dec(lo | (hi << 8))

    @staticmethod
    def regs_to_matrix(regs, N):
        m, n = clayout_64xN(N)
        D = np.zeros((64, N), dtype=np.float32)
        D[m, n] = regs
        return D

    @staticmethod
    def matrix_to_regs(D, N):
        m, n = clayout_64xN(N)
        return D[m, n].astype(np.float32)

    def a_regs_to_matrix(self, a_regs):
        """a_regs: (128, 4) uint32 -> A (64 x 16) float32, element 2j in the low half of register j."""
        m, k = alayout_64x16()  # (128, 8)
        elems = np.zeros((128, 8), dtype=np.uint16)
        for j in range(4):
            elems[:, 2 * j] = (a_regs[:, j] & 0xFFFF).astype(np.uint16)
            elems[:, 2 * j + 1] = (a_regs[:, j] >> 16).astype(np.uint16)
        A = np.zeros((64, 16), dtype=np.float32)
        A[m, k] = self.fmt.dec(elems)
        return A

    def _accumulate(self, d_regs, A, B, N, scale_d):
        prod = (A.astype(np.float64) @ B.astype(np.float64)).astype(np.float32)
        if scale_d:
            prod = prod + self.regs_to_matrix(d_regs, N)
        return self.matrix_to_regs(prod, N)

    def ss(self, d_regs, desc_a, desc_b, N, scale_d, scale_a, scale_b, trans_a, trans_b):
        assert scale_a == 1 and scale_b == 1
        check_shape_f16(N, d_regs)
        if trans_a == 0:
            aaddr, da = kmajor_addresses(desc_a, 64)          # (64, 16): [m][k]
            A = self._read_elems(aaddr)
        else:
            aaddr, da = mnmajor_addresses(desc_a, 64)         # (16, 64): [k][m]
            A = self._read_elems(aaddr).T
        if trans_b == 0:
            baddr, db = kmajor_addresses(desc_b, N)           # (N, 16): [n][k]
            B = self._read_elems(baddr).T                     # -> [k][n]
        else:
            baddr, db = mnmajor_addresses(desc_b, N)          # (16, N): [k][n]
            B = self._read_elems(baddr)
        self.log.append(("ss", da, db, aaddr, baddr))
        return self._accumulate(d_regs, A, B, N, scale_d)

    def rs(self, d_regs, a_regs, desc_b, N, scale_d, scale_a, scale_b, trans_b):
        assert scale_a == 1 and scale_b == 1
        check_shape_f16(N, d_regs)
        A = self.a_regs_to_matrix(a_regs)
        if trans_b == 0:
            baddr, db = kmajor_addresses(desc_b, N)
            B = self._read_elems(baddr).T
        else:
            baddr, db = mnmajor_addresses(desc_b, N)
            B = self._read_elems(baddr)
        self.log.append(("rs", None, db, None, baddr))
        return self._accumulate(d_regs, A, B, N, scale_d), A, B


# ----------------------------------------------------------------------------- shared memory
class Smem:
    """Byte-addressed shared memory with a tiny cp.async / barrier / proxy-fence state machine.

    Per byte: 0 = stable and visible to the async proxy, 1 = cp.async issued (pending),
    2 = landed (writer waited) but no barrier yet, 3 = visible to the generic proxy of all threads
    (barrier passed) but no fence.proxy.async since, 4 = landed and fenced by its writer, no
    barrier yet (the barrier then makes it visible to every thread's async proxy). A wgmma read of a byte not in state 0 is a hazard.
    A cp.async write into bytes that an un-waited wgmma reads is a WAR hazard.
    """

    def __init__(self, size=232448):
        self.mem = np.zeros(size, dtype=np.uint8)
        self.state = np.zeros(size, dtype=np.int8)
        self.inflight_reads = np.zeros(size, dtype=np.int8)  # 1 issued, 2 waited (no barrier yet)
        self.hazards = []

    def cp_async(self, dst, data16):
        dst = int(dst)
        assert dst % 16 == 0, "cp.async 16-byte destination must be 16-byte aligned"
        if (self.inflight_reads[dst:dst + 16] != 0).any():
            self.hazards.append(("WAR: cp.async into bytes an in-flight wgmma reads", dst))
        self.mem[dst:dst + 16] = data16
        self.state[dst:dst + 16] = 1

    def cp_async_wait_all(self):
        self.state[self.state == 1] = 2

    def syncthreads(self):
        self.state[self.state == 2] = 3
        self.state[self.state == 4] = 0
        self.inflight_reads[self.inflight_reads == 2] = 0

    def fence_proxy_async(self):
        self.state[self.state == 3] = 0
        self.state[self.state == 2] = 4

    def check_async_read(self, addrs):
        st = self.state[addrs]
        if (st != 0).any():
            self.hazards.append(("RAW: wgmma reads bytes in state %s" % sorted(set(st[st != 0].tolist())),
                                 int(np.asarray(addrs).ravel()[0])))
        self.inflight_reads[np.asarray(addrs).ravel()] = 1
        self.inflight_reads[np.asarray(addrs).ravel() + 1] = 1

    def wgmma_wait_all(self):
        self.inflight_reads[self.inflight_reads == 1] = 2
