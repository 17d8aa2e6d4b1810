"""quickstart-mocha: MOCHA on Flower with fmtl-flower."""
