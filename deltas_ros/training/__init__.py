"""Training the scene model: the synthetic scene streams, their questions and the training
loop. It imports the core only."""
