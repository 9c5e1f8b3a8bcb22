"""The running daemon: its start and stop order, signals, systemd notify and watchdog, logs, and the watch
on its own event loop."""
