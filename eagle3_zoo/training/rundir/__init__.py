"""The run directory of `fit`: the run lock and its folder names (`lock`), resuming (`resume`), reading a
checkpoint (`checkpoint_io`), the training record kept across restarts (`record`) and what a finished run leaves
behind (`outputs`).
"""
