"""One micro-batch's decision, free of HTTP: batching, the online feature read, the
model and its executor, the decision policy, the store's health and the challenger."""
