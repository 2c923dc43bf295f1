"""Symbolize the frames scripts/segv_backtrace.c printed into a log ('lib.so(+0xOFF)[0x...]'), with
addr2line on this machine (the one that ran it, so the libraries are the same files):
    python scripts/symbolize_backtrace.py LOG > LOG.symbols
Not part of the library."""

import re
import subprocess
import sys

FRAME = re.compile(r"^(/[^\s()]+)\((?:([^+)]*)\+)?(0x[0-9a-f]+)\)\[(0x[0-9a-f]+)\]", re.M)


def main(path: str) -> int:
    text = open(path, errors="replace").read()
    for block in text.split("=== segv_backtrace:")[1:]:
        print("=== segv_backtrace:" + block.splitlines()[0])
        for lib, symbol, offset, _ in FRAME.findall(block):
            try:
                out = subprocess.run(["addr2line", "-f", "-C", "-e", lib, offset], capture_output=True, text=True,
                                     timeout=30).stdout.split("\n")
            except (OSError, subprocess.SubprocessError) as error:
                out = [f"(addr2line: {error})", ""]
            print(f"  {lib.rsplit('/', 1)[-1]}+{offset} {symbol or ''} -> {out[0]} {out[1] if len(out) > 1 else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
