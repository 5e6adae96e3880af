"""What every app folder shares. Importing it first makes Feast import in ~2 s instead of
~7 s: :func:`fraud_scoring.feast_import.skip_typechecks` (each app folder's
``__init__`` imports this package, so it runs before any of them imports Feast)."""

from fraud_scoring.feast_import import skip_typechecks

skip_typechecks()
