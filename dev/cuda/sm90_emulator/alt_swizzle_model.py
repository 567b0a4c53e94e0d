"""Sensitivity: under a hypothetical start-relative swizzle (XOR computed on addr - desc.start), the +32 B k-step
advance used by the kernel (and by CUTLASS's DescriptorIterator / FA3 / the notes' CuTe printout 0,2,4,6) would read
wrong bytes. Under the absolute-address model (PTX: base_offset is 0 when the *pattern* starts on a 1024-B boundary)
it is exact. Prints the mismatch fraction per kk for both models."""
import numpy as np
import kernel_emu as ke
import ptx_model as pm

sQ = 1024
tags = {}
mem = {}
for r in range(64):
    for c in range(8):
        o = sQ + ke.swizzled_chunk_offset(r, c, 64)
        for e in range(8):
            mem[o + 2 * e] = r * 256 + c * 8 + e
for kk in range(4):
    desc = ke.k_major_descriptor(sQ, 64, kk)
    d = pm.decode_descriptor(desc)
    r = np.arange(64)[:, None]; k = np.arange(16)[None, :]
    lin = d["start"] + 2 * ((r % 8) * 64 + k) + (r // 8) * d["sbo"]
    absolute = pm.swizzle128(lin)
    relative = d["start"] + pm.swizzle128(lin - d["start"])
    want = r * 256 + 16 * kk + k
    f = lambda a: np.mean(np.vectorize(lambda x: mem.get(int(x), -1))(a) != want)
    print("kk=%d start=sQ+%3d  mismatch absolute-model %.3f  relative-model %.3f" % (kk, d["start"] - sQ, f(absolute), f(relative)))
