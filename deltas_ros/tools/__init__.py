"""The `deltas-ros` command line and its offline tools: runs over bags and videos, and plots.
It imports the core and training; it reaches the ROS side only through `replay` and
`ask_client`, imported where their commands run."""
