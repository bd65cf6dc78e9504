"""The data stage's side of a served target: hidden-state requests to the recipe's engine (`feed`), training
batches streamed from it (`stream`), and regeneration through an engine or an OpenAI-compatible server
(`regenerate_server`).
"""
