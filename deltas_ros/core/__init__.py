"""The engine, importable without ROS: frames in, a bounded memory out, questions answered.

Frame gate (`frames`), chunks and their prompt (`chunks`, `prompt`, `rope`), the model door
(`backend`, `loader`, `model_maker`), the drift signal (`drift`), the retention policies
(`policy`), the memory and its slot table (`memory`, `slot_table`, `config`, `results`), asking
(`asking`, `evidence_forward`), the second tier (`tiers`, `recall`), persistence
(`persistence`, `state_check`), poses and the memory plan (`plan`). It imports nothing else of
this package.
"""
