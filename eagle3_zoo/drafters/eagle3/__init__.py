"""EAGLE-3 (and its EAGLE-3.1 options) as a drafter kind: the kind object (`kind`), its TTT loss (`ttt`), the training
objective around it (`objective`), its step metrics (`metrics`) and its draft model for decoding (`decode`). The model
and its config are in `eagle3_zoo.modeling`."""
