"""`python -m pdproxy ...` is the same as the `pdproxy` command."""

import sys

from pdproxy.cli import main

if __name__ == "__main__":  # not when multiprocessing's spawn imports it in a child
    sys.exit(main())
