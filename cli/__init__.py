"""The entry point on top of the app folders: the ``fraud-scoring`` command (``main``),
the end-to-end demo and the simulated live feed (``emit``). Nothing imports this package.
"""

import fraud_scoring  # noqa: F401  (first: Feast imports fast, fraud_scoring/feast_import.py)
