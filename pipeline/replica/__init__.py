"""Model replicas on Ray: the actors (one process, or a tensor-parallel group), the worker inside them
that turns rows into generations, and the scheduler that feeds them and survives their deaths."""
