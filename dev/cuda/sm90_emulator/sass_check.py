"""For every WARPGROUP.ARRIVE .. WARPGROUP.DEPBAR window in the SASS: list HGMMAs, their register ranges,
and any non-HGMMA instruction in the window that writes an HGMMA accumulator or A-operand register."""
import re, sys
for path in sys.argv[1:]:
    lines = [l for l in open(path) if re.search(r"/\*[0-9a-f]{4,6}\*/", l)]
    ins = [re.sub(r"\s*/\*.*?\*/\s*", " ", l.split(";")[0]).strip() for l in lines]
    kernels = 0
    i = 0
    print("==", path)
    while i < len(ins):
        if ins[i].startswith("WARPGROUP.ARRIVE"):
            j = i + 1
            window = []
            while j < len(ins) and not ins[j].startswith("WARPGROUP.DEPBAR"):
                window.append(ins[j]); j += 1
            hg = [w for w in window if w.startswith("HGMMA")]
            regs = set()
            for h in hg:
                m = re.match(r"HGMMA\.64x(\d+)x16\.F32\S* R(\d+), (R(\d+)|gdesc)", h)
                n, d0 = int(m.group(1)), int(m.group(2))
                regs |= set(range(d0, d0 + n // 2))
                if m.group(4):
                    regs |= set(range(int(m.group(4)), int(m.group(4)) + 4))
            bad = []
            for w in window:
                if w.startswith("HGMMA"): continue
                used = [int(x) for x in re.findall(r"\bR(\d+)\b", w)]
                wide = [int(x) for x in re.findall(r"\bR(\d+)\.64", w)]
                used += [x + 1 for x in wide]
                if any(u in regs for u in used):
                    bad.append(w)
            print("  window: %d HGMMA (%s), non-HGMMA instrs %d, any access to wgmma regs inside window: %s" %
                  (len(hg), hg[0].split()[0] + " ... " + hg[-1][-12:], len(window) - len(hg), bad or "none"))
            i = j
        i += 1
