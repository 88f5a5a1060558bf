"""Why the webhook does not refuse a review by counting its braces before decoding it (README, worst case).

    .venv/bin/python loadtest/bench_webhook_decode_shapes.py

Decodes bodies of ``maxBodyBytes`` (6 MiB) shaped four ways, each in a fresh process, and prints the body's count
of ``{`` and the decode's growth of peak RSS (VmHWM over VmRSS before). A count cheap enough to run on every review
(``bytes.count``, C speed) does not know which braces are inside JSON strings: a ConfigMap value (or a Pod's env
value, args, annotation) of 6 MiB of braces counts 3x the braces of ``[{},{},...]`` and decodes to a few MiB, so no
threshold on the count refuses the hostile shape without refusing it. Not counting inside strings needs a scan of
the strings (a regex pass and a copy of the body on every review), and even then the legitimate shapes
(a Secret with many keys, an object's managedFields) decode to 84-106 MiB against the hostile 182: the most such a
bound could save is about a third of the decoding term.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

SIZE = 6 * 1024 * 1024
SHAPES = {
    "hostile [{},{},...]": "b'[' + b'{},' * ((N - 2) // 3) + b'{}]'",
    "Secret data, distinct short keys": "b'{' + b','.join(b'\"%x\":\"\"' % i for i in range(N // 11)) + b'}'",
    "managedFields-like {\"f:k\":{},...}": "b'{' + b','.join(b'\"f:%x\":{}' % i for i in range(N // 13)) + b'}'",
    "ConfigMap value of braces": "b'{\"d\":\"' + b'{' * (N - 10) + b'\"}'",
}
CODE = r'''
import orjson
N = %d
body = %s
def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))
before = status("VmRSS:")
tree = orjson.loads(body)
print(f"{len(body) / 2**20:5.1f} MiB {body.count(b'{'):9d} {(status('VmHWM:') - before) / 2**20:6.0f} MiB")
'''


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                            epilog="--help: this text; no other options (each shape is about 6 MiB)").parse_args()
    print(f"{'shape':36} {'body':>9} {'count {':>9} {'decode':>10}")
    for name, expr in SHAPES.items():
        out = subprocess.run([sys.executable, "-c", CODE % (SIZE, expr)], capture_output=True, text=True, check=True)
        print(f"{name:36} {out.stdout.strip()}", flush=True)


if __name__ == "__main__":
    main()
