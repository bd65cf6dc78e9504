"""DFlash block drafters (arXiv 2602.06036): the config (torch-free, `config`), the model and its training forward
(`model`), and the training objective (`loss`). Not yet wired into `fit`, decoding or the checkpoint commands."""
