"""`eagle3-zoo plan`: what one GPU holds in every phase of a recipe's run (`plan`), the phases before training
(`phases`) and the report's lines and verdicts (`report`).
"""
