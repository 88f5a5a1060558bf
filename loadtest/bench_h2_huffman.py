"""HPACK Huffman decoding: ``proxy/h2wire/huffman.py`` against ``hpack``'s decoder, in one run.

Not a test: it prints figures. Three costs:

* ns per coded byte on random octet strings (hostile input: every octet value,
  long codes), up to 2000 octets each;
* us per ``:path``-like short string (``/api/v1/namespaces/default``, 18 coded
  bytes, as nghttp2 sends it on every request): ``hpack``, ours, and ours
  through the short memo (a hit: a fresh ``bytes`` object each time, as a
  header block slice is);
* by coded length, the short memo against decoding: a hit, and a miss (distinct
  strings, so every call decodes, inserts and evicts), which is how
  ``SHORT_MEMO_MIN_BYTES`` was chosen;
* the one-off table build (ms, rebuilt each round) and the memory the tables hold (tracemalloc).

Each figure is the best of the rounds in process CPU time (``time.process_time``): a busy machine delays
the bench but charges it little.
Run: ``nice .venv/bin/python loadtest/bench_h2_huffman.py [--rounds 5]``.
"""

from __future__ import annotations

import argparse
import random
import time
import tracemalloc
from collections.abc import Callable

from hpack.huffman import HuffmanEncoder
from hpack.huffman_constants import REQUEST_CODES, REQUEST_CODES_LENGTH
from hpack.huffman_table import decode_huffman as hpack_decode

from gatekeeper.proxy.h2wire import huffman as h2_huffman

PATH = b"/api/v1/namespaces/default"


def best(rounds: int, fn: Callable[[], object]) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return min(times)


def each(fn: Callable[[bytes], bytes], items: list[bytes]) -> Callable[[], object]:
    return lambda: [fn(x) for x in items]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--strings", type=int, default=300, help="random strings of 0..2000 octets")
    ap.add_argument("--paths", type=int, default=20000)
    args = ap.parse_args()
    encode = HuffmanEncoder(REQUEST_CODES, REQUEST_CODES_LENGTH).encode

    build_ms = best(args.rounds, h2_huffman._build) * 1e3
    tracemalloc.start()
    h2_huffman._build()
    table_mb = tracemalloc.get_traced_memory()[0] / 1e6
    tracemalloc.stop()

    rng = random.Random(1)
    coded = [encode(bytes(rng.randrange(256) for _ in range(rng.randrange(2001)))) for _ in range(args.strings)]
    total = sum(map(len, coded))
    ours_ns = best(args.rounds, each(h2_huffman.decode, coded)) / total * 1e9
    theirs_ns = best(args.rounds, each(hpack_decode, coded)) / total * 1e9

    path = encode(PATH)
    paths = [path[:1] + path[1:] for _ in range(args.paths)]  # distinct objects: the hash is computed each time
    h2_huffman.decode_memo_short(path)
    figures: dict[str, float] = {}
    decoders: list[tuple[str, Callable[[bytes], bytes]]] = [
        ("hpack", hpack_decode), ("ours", h2_huffman.decode), ("ours, memo hit", h2_huffman.decode_memo_short)]
    for name, fn in decoders:
        figures[name] = best(args.rounds, each(fn, paths)) / len(paths) * 1e6

    lengths: list[tuple[int, list[float]]] = []
    five_bit = b"012aceiost"  # RFC 7541 Appendix B: 5-bit codes, so m of them code to ceil(5m/8) bytes
    for target in (4, 8, 16, 32, 63):
        m = target * 8 // 5
        # More distinct strings than the memo holds, cycled in order: with LRU eviction every lookup misses.
        distinct = [encode(bytes(five_bit[int(d)] for d in f"{k:0{m}d}"))
                    for k in range(2 * h2_huffman.SHORT_MEMO_ENTRIES)]
        distinct *= max(1, args.paths // len(distinct))
        same = distinct[0]
        fresh = [same[:1] + same[1:] for _ in range(args.paths)]
        h2_huffman.decode_memo_short(same)
        row = [best(args.rounds, each(fn, items)) / len(items) * 1e6
               for fn, items in ((h2_huffman.decode, fresh), (h2_huffman._short_memo, fresh),
                                 (h2_huffman._short_memo, distinct))]
        lengths.append((len(same), row))

    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print(f"load average {load}; best of {args.rounds} rounds")
    print(f"tables: built in {build_ms:.0f} ms, {table_mb:.1f} MB")
    print(f"random strings ({args.strings}, {total} coded bytes): hpack {theirs_ns:.0f} ns/byte, "
          f"ours {ours_ns:.0f} ns/byte (x{theirs_ns / ours_ns:.2f} faster)")
    print(f":path {PATH.decode()} ({len(path)} coded bytes), us per string:")
    for name, us in figures.items():
        print(f"  {name:15} {us:6.3f} us  (x{figures['hpack'] / us:.1f} vs hpack)")
    print("short memo by coded length, us per string: decode / memo hit / memo miss (distinct strings)")
    for size, (dec, hit, miss) in lengths:
        print(f"  {size:3} bytes: {dec:.3f} / {hit:.3f} / {miss:.3f}")


if __name__ == "__main__":
    main()
