"""quickstart-fedem: FedEM on Flower with fmtl-flower and Flower Datasets."""
