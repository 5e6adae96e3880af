"""What a decision feeds after it is answered: the decision log, the drift monitor and
the analysts' review queue."""
