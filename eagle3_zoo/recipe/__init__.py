"""The training recipe: the typed `Recipe` with its sections, loading and validation (`sections`), the `engine:`
section (`engine`), and the decisions a run takes once from the recipe (`decisions`: processes, what each rank loads,
the FSDP layout, dtypes, where each phase runs), which `plan`, the data stage, the targets and training read.
"""
