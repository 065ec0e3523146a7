"""`python -m bench`: `shardserve bench` without the server's packages."""

import sys

from bench.cli import main

sys.exit(main())
