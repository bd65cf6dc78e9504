"""DSpark block drafters (arXiv 2607.05147): the DFlash backbone with every slot a prediction, a low-rank Markov head
and a confidence head: the config (torch-free, `config`), the model (`model`) and the training objective (`loss`).
Decoding: `eagle3_zoo.speculative.dspark_decode`; the drafter kind (`drafter.kind: dspark`): `kind`."""
