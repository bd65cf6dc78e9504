"""eagle3-zoo: train, evaluate and publish EAGLE-3 speculative-decoding drafters."""

__version__ = "0.1.0"
