"""The engine, importable without ROS: frames in, a bounded memory out, questions answered.

Frame gate (`frames`), chunks and their prompt (`chunks`, `prompt`, `rope`), the model door
(`backend`, `loader`, `maker`), the drift signal (`drift`), the retention policies (`policy`),
the memory and its slot table (`memory`, `slots`, `config`, `results`), asking (`asking`),
persistence (`persistence`, `state_check`), poses and the memory plan (`plan`). It imports
nothing else of this package.
"""
