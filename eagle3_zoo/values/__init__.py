"""Small torch-free value types and tables every layer reads: draft shapes (`draft_shapes`), dtype names
(`dtypes`), the drafter-folder layouts' names (`layout_names`), what a location names (`locations`) and the packaged
zoo registry (`zoo_registry`).
"""
