"""`python -m flowrec ...` and the `flowrec` command (torchrun launches it this way).

`run` imports the command line (torch, pyarrow, dask: about a second) itself, so a Ctrl-C in that
time ends in one line with exit status 130, as one later does, not a traceback through the imports.
"""
import sys


def run() -> None:
    """Import the command line and run it; interrupted while importing: one line, exit 130."""
    try:
        from flowrec.cli import main
    except KeyboardInterrupt:
        sys.stderr.write("error: interrupted (Ctrl-C) while flowrec was starting; nothing was done\n")
        raise SystemExit(130) from None
    main()


if __name__ == "__main__":
    run()
