"""The node's state without ROS: the session (one stream's memory, its worker thread and its
bookkeeping), the parameter table, the memory files' path rules and the memory image. It
imports the core only."""
