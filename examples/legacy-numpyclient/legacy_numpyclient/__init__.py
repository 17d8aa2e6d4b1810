"""legacy-numpyclient: MOCHA in a NumPyClient + client_fn Flower project."""
