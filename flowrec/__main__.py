"""`python -m flowrec ...`: the same as the `flowrec` command (torchrun launches it this way)."""
from flowrec.cli import main

if __name__ == "__main__":
    main()
