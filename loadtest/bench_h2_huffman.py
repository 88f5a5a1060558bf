"""HPACK Huffman decoding: ``h2_huffman`` against ``hpack``'s decoder, in one run.

Not a test: it prints figures. Three costs:

* ns per coded byte on random octet strings (hostile input: every octet value,
  long codes), up to 2000 octets each;
* us per ``:path``-like short string (``/api/v1/namespaces/default``, 18 coded
  bytes, as nghttp2 sends it on every request): ``hpack``, ours, and ours
  through the short memo (a hit: a fresh ``bytes`` object each time, as a
  header block slice is);
* the one-off table build (ms, rebuilt each round) and the memory the tables hold (tracemalloc).

Each figure is the best of the rounds (``time.perf_counter``), less sensitive to a busy machine.
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

from gatekeeper.proxy.listen import h2_huffman

PATH = b"/api/v1/namespaces/default"


def best(rounds: int, fn: Callable[[], object]) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
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

    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print(f"load average {load}; best of {args.rounds} rounds")
    print(f"tables: built in {build_ms:.0f} ms, {table_mb:.1f} MB")
    print(f"random strings ({args.strings}, {total} coded bytes): hpack {theirs_ns:.0f} ns/byte, "
          f"ours {ours_ns:.0f} ns/byte (x{theirs_ns / ours_ns:.2f} faster)")
    print(f":path {PATH.decode()} ({len(path)} coded bytes), us per string:")
    for name, us in figures.items():
        print(f"  {name:15} {us:6.3f} us  (x{figures['hpack'] / us:.1f} vs hpack)")


if __name__ == "__main__":
    main()
