"""The iterator and its feeds: threads in this process, worker processes, the Ray service; timing and metrics."""
