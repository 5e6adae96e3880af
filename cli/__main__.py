"""``python -m cli``: the ``fraud-scoring`` command."""

import sys

from cli.main import main

sys.exit(main())
