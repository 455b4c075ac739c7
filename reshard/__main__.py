"""The `reshard` command (`python -m reshard`, and the console script pyproject.toml names)."""
import os
import sys


def main() -> int:
    # reshard does no linear algebra, but numpy starts OpenBLAS's pool of threads on import, which costs each
    # process about 0.06 CPU-seconds (measured: `import numpy` 0.13-0.21 user-s, 0.08-0.12 with one thread); set
    # before anything imports numpy, and only where the user has not chosen
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    from reshard.cli import main as run
    return run()


if __name__ == "__main__":
    sys.exit(main())
