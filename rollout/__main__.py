"""`python -m rollout ...` (the form used with `ray job submit`)."""

import sys

from rollout.cli import main

sys.exit(main())
