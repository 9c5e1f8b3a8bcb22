"""The engine: the vLLM command line from the configuration and the plan, the supervisor that starts,
watches and relaunches it, the guard that keeps it from outliving the daemon, and the watch on its metrics."""
