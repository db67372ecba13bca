"""`python -m pdproxy ...` is the same as the `pdproxy` command."""

import sys

from pdproxy.cli import main

sys.exit(main())
