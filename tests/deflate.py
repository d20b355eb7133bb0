"""The symbols of a gzip member's deflate stream: what the compressor chose, which inflating hides.
Enough of RFC 1951 for tests: stored, fixed and dynamic blocks."""

from __future__ import annotations

LEN_BASE = [3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 15, 17, 19, 23, 27, 31, 35, 43, 51, 59, 67, 83, 99, 115, 131, 163, 195, 227, 258]
LEN_EXTRA = [0] * 8 + [1] * 4 + [2] * 4 + [3] * 4 + [4] * 4 + [5] * 4 + [0]
DIST_BASE = [1, 2, 3, 4, 5, 7, 9, 13, 17, 25, 33, 49, 65, 97, 129, 193, 257, 385, 513, 769, 1025, 1537, 2049, 3073, 4097, 6145, 8193, 12289, 16385, 24577]
DIST_EXTRA = [0, 0, 0, 0] + [n // 2 for n in range(2, 28)]
CODE_LENGTH_ORDER = [16, 17, 18, 0, 8, 7, 9, 6, 10, 5, 11, 4, 12, 3, 13, 2, 14, 1, 15]


class _Bits:
    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def take(self, n: int) -> int:
        value = 0
        for i in range(n):
            value |= ((self.data[self.pos >> 3] >> (self.pos & 7)) & 1) << i
            self.pos += 1
        return value

    def decode(self, codes: dict) -> int:
        code = length = 0
        while (length, code) not in codes:
            code, length = (code << 1) | self.take(1), length + 1
        return codes[(length, code)]


def _canonical(lengths: list[int]) -> dict:
    codes, code, next_code = {}, 0, {}
    for bits in range(1, max(lengths) + 1):
        code = (code + lengths.count(bits - 1) * (bits > 1)) << 1
        next_code[bits] = code
    for symbol, bits in enumerate(lengths):
        if bits:
            codes[(bits, next_code[bits])] = symbol
            next_code[bits] += 1
    return codes


def symbols(member: bytes) -> list[tuple]:
    """("lit", byte, at) and ("match", length, distance, at), `at` being the offset in the output."""
    if member[3]:
        raise ValueError("gzip header flags are not read here")
    bits, out, at = _Bits(member[10:]), [], 0
    while True:
        final, kind = bits.take(1), bits.take(2)
        if kind == 0:
            bits.pos = (bits.pos + 7) & ~7
            n = bits.take(16)
            bits.take(16)
            out += [("lit", b, at + i) for i, b in enumerate(bits.data[bits.pos >> 3 : (bits.pos >> 3) + n])]
            bits.pos += 8 * n
            at += n
        else:
            if kind == 1:
                lit, dist = _canonical([8] * 144 + [9] * 112 + [7] * 24 + [8] * 8), _canonical([5] * 30)
            else:
                hlit, hdist, hclen = bits.take(5) + 257, bits.take(5) + 1, bits.take(4) + 4
                code_lengths = [0] * 19
                for i in range(hclen):
                    code_lengths[CODE_LENGTH_ORDER[i]] = bits.take(3)
                meta, lengths = _canonical(code_lengths), []
                while len(lengths) < hlit + hdist:
                    s = bits.decode(meta)
                    if s < 16:
                        lengths.append(s)
                    elif s == 16:
                        lengths += [lengths[-1]] * (3 + bits.take(2))
                    else:
                        lengths += [0] * ((3 + bits.take(3)) if s == 17 else (11 + bits.take(7)))
                lit, dist = _canonical(lengths[:hlit]), _canonical(lengths[hlit:])
            while (s := bits.decode(lit)) != 256:
                if s < 256:
                    out.append(("lit", s, at))
                    at += 1
                    continue
                length = LEN_BASE[s - 257] + bits.take(LEN_EXTRA[s - 257])
                d = bits.decode(dist)
                out.append(("match", length, DIST_BASE[d] + bits.take(DIST_EXTRA[d]), at))
                at += length
        if final:
            return out
