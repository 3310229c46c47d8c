"""`python -m fusesearch` and the `fusesearch` script: the CLI, with Ctrl-C (SIGINT) an exit of
130 and one line on stderr whenever it comes: while the (slow) imports run, in a command
(`cli.main`), or once the command is done and the interpreter shuts down (ignored then: the
command's exit code stands; a library's threads or destructors must not turn it into a death
by signal)."""

import signal
import sys

INTERRUPTED = 130  # 128 + SIGINT, as shells report it


def interrupted() -> int:
    print("fusesearch: interrupted", file=sys.stderr)
    return INTERRUPTED


def entry() -> None:
    try:
        from fusesearch.cli import main

        code = main()
    except KeyboardInterrupt:
        code = interrupted()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(code)


if __name__ == "__main__":
    entry()
