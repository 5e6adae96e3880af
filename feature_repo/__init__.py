import fraud_scoring  # noqa: F401  (first: Feast imports fast, fraud_scoring/feast_import.py)
