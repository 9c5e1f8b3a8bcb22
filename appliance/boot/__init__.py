"""Start-up: the configuration, what must hold before the engine starts (pins, host checks), the plan, and
the composition root that builds the daemon's parts from them."""
