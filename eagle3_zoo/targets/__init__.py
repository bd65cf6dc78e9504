"""The target model as a backend: where the frozen target runs for the operations a run needs from it.

Below `data/` and `training/` in the data flow: both import from here, never the reverse (tests/test_layering.py).

- `loading`: load a recipe's target in process (Hugging Face, the `hf` backend) and choose its aux layers.
- `engine`: find the inference engine's virtual environment (`EAGLE3_ZOO_VLLM_PYTHON`), ask it which vLLM build it
  holds, and the hidden-states connector's settings.
- `server`: start and stop a vLLM OpenAI-compatible server for a model folder, or attach to one by URL.
- `openai_client`: a small stdlib HTTP client for OpenAI-compatible servers (retries, timeouts, metrics).
- `engine_eval`: EAGLE-3 speculative decoding inside vLLM, judged by the engine's own counters.

Heavy imports stay inside the modules, so importing this package is cheap.
"""
