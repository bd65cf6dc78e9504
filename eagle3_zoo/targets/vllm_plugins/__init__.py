"""Modules loaded *inside the vLLM server process* (its own venv): they import vllm (or only safetensors), never
eagle3_zoo.

The server gets this folder on its ``PYTHONPATH`` and names a module here with ``kv_connector_module_path``.
"""
