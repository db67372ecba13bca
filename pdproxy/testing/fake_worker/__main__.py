"""`python -m pdproxy.testing.fake_worker ...` is the same as `pdproxy fake-worker ...`."""

import sys

from pdproxy.testing.fake_worker.cli import main

sys.exit(main())
