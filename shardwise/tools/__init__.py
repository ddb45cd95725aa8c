"""Tools built on the library: the main job (`shardwise train`), the planner (`shardwise
estimate`), the launcher (`shardwise run`), checkpoint conversion (`shardwise convert`),
the command line, data, profiling and the multi-rank test harness."""
