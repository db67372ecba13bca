"""`python -m pdproxy.fake_vllm ...` is the same as `pdproxy fake-worker ...`."""

import sys

from pdproxy.fake_vllm.cli import main

sys.exit(main())
